"""Fast paths and probes work on weight-sharing copies: the models a caller holds never change, and
importing the library leaves torch's global state alone."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

import workbench as wb
from tests.helpers import REPO
from workbench.analysis.doctor import diagnose
from workbench.analysis.fusion import ablation_study
from workbench.variants import REMOVED, copy_modules, variant

# a held-out prompt the draft is accepted on within 12 tokens, and a short one
PROMPTS = [json.loads((REPO / "assets/prompts/code.jsonl").read_text().splitlines()[0])["prompt"], "import os\n"]


def test_importing_workbench_leaves_torchs_global_hooks_as_they_were():
    code = """
import importlib, pkgutil, torch
import torch.nn.modules.module as m
names = [n for n in dir(m) if n.startswith("_global_") and isinstance(getattr(m, n), dict)]
before = {n: dict(getattr(m, n)) for n in names}
import workbench
for info in pkgutil.walk_packages(workbench.__path__, "workbench."):
    if not info.name.startswith("workbench.integrations"):  # vLLM, where installed, is imported lazily anyway
        importlib.import_module(info.name)
after = {n: dict(getattr(m, n)) for n in names}
print(len(names), sorted(n for n in names if before[n] != after[n]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    count, changed = out.stdout.split(" ", 1)
    assert int(count) >= 4, out.stdout  # forward, backward, parameter and module registration hooks at least
    assert changed.strip() == "[]", out.stdout


def test_copies_share_weights_and_leave_the_original_alone(embedded_pair):
    v = embedded_pair.plain[0]
    copy = copy_modules(v)
    assert copy is not v and copy.lm_head is not v.lm_head and copy.lm_head.weight is v.lm_head.weight
    other = variant(v, {"model.layers.1.self_attn.rotary.interleave": not v.model.layers[1].self_attn.rotary.interleave,
                        "aux_layer_ids": (1, 2, 3)})
    assert other.model.layers[1].self_attn.rotary.interleave != v.model.layers[1].self_attn.rotary.interleave
    assert other.aux_layer_ids == (1, 2, 3) != v.aux_layer_ids
    assert other.model.embed_tokens.weight is v.model.embed_tokens.weight
    d = embedded_pair.plain[1]
    shared = copy_modules(v, memo=(memo := {}))
    draft = copy_modules(d, memo=memo)
    assert draft.part("embed_tokens") is shared.model.embed_tokens  # a draft copied with its verifier borrows its copy
    with pytest.raises(AttributeError, match="no module 'model.nope'"):
        variant(v, {"model.nope.x": 1})
    with pytest.raises(AttributeError, match="no attribute 'interleav'"):
        variant(v, {"model.layers.0.self_attn.rotary.interleav": 1})
    own = torch.nn.Embedding(*d.part("embed_tokens").weight.shape)
    with_own = variant(d, {"embed_tokens": own})
    assert with_own.part("embed_tokens") is own and "embed_tokens" not in d._modules
    assert "embed_tokens" not in variant(with_own, {"embed_tokens": REMOVED})._modules and with_own.embed_tokens is own


def _snapshot(pair) -> tuple:
    v, d = pair.verifier, pair.draft
    settings = (v.aux_layer_ids, d.norm_output, d.config.aux_layer_ids,
                [m.interleave for m in d.modules() if hasattr(m, "interleave")], d.part("embed_tokens"), d.fc,
                type(d.fc), "combine_hidden_states" in d.__dict__)
    return {n: t.clone() for n, t in {**v.state_dict(), **d.state_dict()}.items()}, settings


def test_probes_leave_the_pair_as_it_was(embedded_pair):
    """The doctor's and the fusion ablation's probes: the pair's weights, settings and next greedy
    generation are what they were."""
    pair = embedded_pair
    want = wb.SpecDecoder(pair, 3).generate(PROMPTS[0], 24)
    weights, settings = _snapshot(pair)
    report = diagnose(pair, PROMPTS, k=3, max_new_tokens=12)
    assert sum(p.skipped is None for p in report.probes) >= 4  # aux ids, RoPE, feedback at least ran
    ablation = ablation_study(pair, PROMPTS[:1], k=3, max_new_tokens=12, modes=("zero",))
    assert len(ablation.entries) == 3 and min(e.delta for e in ablation.entries) < 0
    after, after_settings = _snapshot(pair)
    assert after_settings == settings and after.keys() == weights.keys()
    assert all(torch.equal(after[n], weights[n]) for n in weights)
    got = wb.SpecDecoder(pair, 3).generate(PROMPTS[0], 24)
    assert (got.tokens, got.stats.accept_length) == (want.tokens, want.stats.accept_length)


def test_a_generation_beside_a_running_probe_equals_one_alone(embedded_pair):
    """The dashboard runs probes and generations of one shared pair in different threads, unlocked."""
    pair = embedded_pair
    alone = [wb.SpecDecoder(pair, 3).generate(p, 32).tokens for p in PROMPTS]
    errors: list[BaseException] = []

    def probe() -> None:
        try:
            diagnose(pair, PROMPTS, k=2, max_new_tokens=16)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    thread = threading.Thread(target=probe)
    thread.start()
    beside = []
    while thread.is_alive() or not beside:  # generate for as long as the probes run, at least once
        beside.append([wb.SpecDecoder(pair, 3).generate(p, 32).tokens for p in PROMPTS])
    thread.join()
    assert not errors, errors
    assert all(b == alone for b in beside), len(beside)
