"""The pairing doctor: static checks, probes that flag a better alternative, and state always restored.

Acceptance needs a draft that is actually accepted. Random pairs accept ~nothing, so these tests
build a *copy pair* whose acceptance is known exactly (see `make_copy_pair`); the trained
embedded pair, once it ships, is checked the same way (skipped while it is still random).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.helpers import EMBEDDED, REPO, make_random_pair
from workbench.analysis import doctor
from workbench.analysis.doctor import (MIN_ACCEPT, Probe, diagnose, first_proposal_hits, generate_run, judge,
                                       paired_z, static_checks)
from workbench.analysis.fusion import greedy_accept_length
from workbench.models.rope import RotaryEmbedding
from workbench.pair import save_model

PROMPTS = ["def f(x):", "import os"]
COPY_AUX = (1, 2, 4)  # 5-layer verifier; the draft reads only the last id (4)


def make_copy_pair(out: Path, prompts: list[str] = PROMPTS, aux: tuple[int, ...] = COPY_AUX) -> tuple[Path, Path]:
    """A 5-layer random pair rewired so that greedy acceptance is exactly k+1 with aux ids `aux`.

    Verifier: attention off (o_proj = 0) and the last layer's MLP off, so its final state at a
    token is the residual entering layer 4 (aux id 4) and depends on that token only; lm_head
    rows are unit vectors, and the rows of the prompts' tokens are the directions of their own
    final states, so the verifier's argmax repeats the last token forever. Layer 3's MLP is
    scaled up so aux 3 and aux 4 point in clearly different directions.
    Draft: fc = [0 | 0 | I] reads only the highest aux state; its attention and MLP are off, so
    it proposes lm_head(norm(aux 4)) = the verifier's own next token at every depth.
    Capture layer 3 instead of 4 (aux ids shifted by -1) and the proposals miss: accept ~1.
    """
    vdir, ddir = make_random_pair(out, layers=5, aux_layer_ids=aux)
    pair = wb.load_pair(vdir, ddir, fast="off")  # the plain models: their weights are edited in place below
    v, d = pair.verifier, pair.draft
    H = v.config.hidden_size
    with torch.no_grad():
        for layer in v.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        for i, scale in ((4, 0.0), (3, 20.0)):
            for name, p in v.model.layers[i].mlp.named_parameters():
                if name.endswith("down_proj.weight"):
                    p.mul_(scale)
        w = v.lm_head.weight
        w.div_(w.norm(dim=-1, keepdim=True))
        toks = sorted({t for p in prompts for t in pair.encode(p)})
        final = v(torch.tensor(toks)[:, None]).hidden_states[:, 0]
        w[toks] = final / final.norm(dim=-1, keepdim=True)
        d.fc.weight.zero_()
        d.fc.weight[:, 2 * H:] = torch.eye(H)
        d.layers[0].self_attn.o_proj.weight.zero_()
        d.layers[0].mlp.down_proj.weight.zero_()
    save_model(v, vdir)
    save_model(d, ddir)
    return vdir, ddir


def with_aux_ids(draft_dir: Path, out: Path, ids: list[int]) -> Path:
    """A copy of a draft checkpoint whose config.json names other aux layer ids (at the top level,
    where vLLM and `load_draft` read them, and in eagle_config, where trainers write them)."""
    shutil.copytree(draft_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    cfg["eagle_aux_hidden_state_layer_ids"] = ids
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def copy_dirs(tmp_path_factory):
    return make_copy_pair(tmp_path_factory.mktemp("copy"))


def state(pair) -> dict:
    d = pair.draft
    return {"aux": pair.verifier.aux_layer_ids, "norm_output": d.norm_output,
            "interleave": [m.interleave for m in d.modules() if isinstance(m, RotaryEmbedding)],
            "modules": dict(d._modules), "overrides": dict(d.__dict__).get("combine_hidden_states")}


def test_judge_margins_and_noise():
    conf = Probe("configured", "", 2.0)
    probes = [Probe("a", "", 2.06, z=3.0), Probe("b", "", 2.04, z=9.0), Probe("c", "", None, skipped="n/a"),
              Probe("d", "", 2.5, z=1.9), Probe("e", "", 2.5, z=None), Probe("f", "", 3.0, z=2.1)]
    flags = judge(conf, probes)
    assert [p.flagged for p in probes] == [True, False, False, False, False, True]
    assert probes[0].delta == pytest.approx(0.06) and probes[2].delta is None
    assert len(flags) == 2 and "'a'" in flags[0]
    # +0.055 on 3.0 clears the absolute margin but not the 2% relative one
    assert not judge(Probe("configured", "", 3.0), [Probe("h", "", 3.055, z=5.0)])
    assert any("the draft is dead" in f for f in judge(Probe("configured", "", MIN_ACCEPT - 0.01), []))
    assert MIN_ACCEPT == 1.2
    assert judge(Probe("configured", "", MIN_ACCEPT), []) == []


def test_paired_z():
    assert paired_z([True], [False]) is None
    assert paired_z([True, False, True], [True, False, True]) == 0.0
    # d = [1, 1, 0, 0]: mean 0.5, sd 0.577, z = 0.5 / (0.577 / 2)
    assert paired_z([False, False, True, False], [True, True, True, False]) == pytest.approx(0.5 / (3 ** -0.5 / 2))
    assert paired_z([True] * 4, [False] * 4) < -1e5  # every position lost: no noise at all


def test_generation_and_first_proposals_match_the_engine(copy_dirs):
    pair = wb.load_pair(*copy_dirs)
    run = generate_run(pair, PROMPTS[:1], k=2, max_new_tokens=7)
    assert (run.accept_length, run.steps) == (3.0, 2)
    assert run.accept_length == greedy_accept_length(pair, PROMPTS[:1], 2, 7)
    n_prompt = len(pair.encode(PROMPTS[0]))
    assert len(run.sequences[0]) == n_prompt + 7
    # prefill token, then per step 2 accepted + 1 bonus
    assert [run.marks[0][p][1] for p in sorted(run.marks[0])] == [False, True, True, False, True, True, False]
    hits = first_proposal_hits(pair, run.sequences)
    assert len(hits) == n_prompt + 6
    assert all(hits[n_prompt - 1:])  # over the output the draft always proposes the repeated token
    wrong = pair.variant(verifier={"aux_layer_ids": (0, 1, 3)})  # the wrong capture: every first proposal misses
    assert not any(first_proposal_hits(wrong, run.sequences)[n_prompt - 1:])
    assert generate_run(wrong, PROMPTS, k=2, max_new_tokens=4).accept_length == 1.0
    assert pair.verifier.aux_layer_ids == (1, 2, 4) and all(first_proposal_hits(pair, run.sequences)[n_prompt - 1:])


def test_static_checks(copy_dirs):
    pair = wb.load_pair(*copy_dirs)
    by_name = {c.name: c for c in static_checks(pair)}
    engines = by_name.pop("engine readings")  # ids (1, 2, 4): no eagle_config list reads alike in every SGLang
    assert engines.status == "warn" and "sglang#25454 fuses the states entering layers [0, 1, 3]" in engines.detail
    assert all(c.status in ("ok", "info") for c in by_name.values()), by_name
    assert by_name["tokenizer"].detail.startswith("8192 tokens")
    cfg = pair.draft.config
    old = (cfg.max_position_embeddings, cfg.aux_layer_ids, cfg.target_hidden_size)
    try:
        cfg.max_position_embeddings, cfg.aux_layer_ids, cfg.target_hidden_size = 256, (4, 2, 1), 32
        by_name = {c.name: c for c in static_checks(pair)}
    finally:
        cfg.max_position_embeddings, cfg.aux_layer_ids, cfg.target_hidden_size = old
    assert by_name["max_position_embeddings"].status == "warn" and "#3960" in by_name["max_position_embeddings"].detail
    assert by_name["aux layer ids ascending"].status == "fail"
    assert by_name["hidden sizes"].status == "fail" and "target_hidden_size 32" in by_name["hidden sizes"].detail
    assert by_name["aux layers captured"].status == "ok"  # same set, other order


def test_correct_pairing_is_not_flagged(copy_dirs):
    pair = wb.load_pair(*copy_dirs)
    before = state(pair)
    report = diagnose(pair, PROMPTS[:1], k=2, max_new_tokens=7)  # 1 + 3 + 3: no shortened step
    assert state(pair) == before
    assert report.ok and not report.flags
    assert report.configured.accept_length == 3.0  # k + 1: every proposal accepted
    # the copy pair's verifier repeats the last token forever: its one continuation is a loop
    assert report.configured.degenerate == 1 and report.configured.accept_length_clean is None
    assert "3.000 (clean n/a, 1 of 1 loop)" in report.summary()
    assert next(c for c in report.checks if c.name == "prompts").status == "ok"
    probes = {p.name.split(" [")[0]: p for p in report.probes}
    # ids (1, 2, 4) -1: what SGLang since #25454 captures from eagle_config [0, 1, 3] (a first id other than 1)
    assert probes["sglang#25454 reading"].accept_length < 1.5 and not probes["sglang#25454 reading"].flagged
    assert probes["aux ids +1"].skipped and "[5]" in probes["aux ids +1"].skipped
    assert probes["verifier embedding"].skipped  # this draft ships no embedding
    json.dumps(report.to_dict())
    assert "OK" in report.summary()


def test_random_prompts_are_warned_about(copy_dirs):
    import random

    pair = wb.load_pair(*copy_dirs)
    rng = random.Random(3)
    noise = "".join(chr(rng.randrange(33, 127)) for _ in range(100))
    report = diagnose(pair, [PROMPTS[0], noise], k=2, max_new_tokens=4)
    check = next(c for c in report.checks if c.name == "prompts")
    assert check.status == "warn" and check.detail.startswith("1 of 2 prompts look random")
    assert "prompt 1" in check.detail
    assert "[warn] prompts: 1 of 2 prompts look random" in report.summary()


def test_shifted_aux_ids_are_flagged(copy_dirs, tmp_path):
    shifted = with_aux_ids(copy_dirs[1], tmp_path / "draft", [0, 1, 3])  # "output of layer k" saved as k
    pair = wb.load_pair(copy_dirs[0], shifted)
    report = diagnose(pair, PROMPTS[:1], k=2, max_new_tokens=7)  # 1 + 3 + 3: no shortened step
    assert not report.ok
    flagged = [p for p in report.probes if p.flagged]
    # the list written in both places: SGLang reads eagle_config's as "output of layer i", which it was
    assert [p.name for p in flagged] == ["sglang reading [1, 2, 4]"] and flagged[0].accept_length == 3.0
    assert flagged[0].test == "first proposals" and flagged[0].z > 2
    assert report.configured.accept_length < MIN_ACCEPT
    assert any("the draft is dead" in f for f in report.flags)
    assert "FLAG" in report.summary() and pair.verifier.aux_layer_ids == (0, 1, 3)


def test_nested_aux_ids_are_read_as_vllm_reads_them_and_each_reading_is_measured(copy_dirs, tmp_path):
    """A SpecForge/TorchSpec-style draft: ids only in eagle_config, written as 'output of layer i'.
    vLLM ignores them and captures its default; the doctor measures every reading (each engine's) and
    flags the one the draft was trained on."""
    out = tmp_path / "nested"
    shutil.copytree(copy_dirs[1], out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 3]  # output of layers 0, 1, 3 = (1, 2, 4)
    (out / "config.json").write_text(json.dumps(cfg))
    pair = wb.load_pair(copy_dirs[0], out)
    assert pair.verifier.aux_layer_ids == (2, 2, 2)  # vLLM's default for 5 layers: (2, L // 2, L - 3)
    report = diagnose(pair, PROMPTS[:1], k=2, max_new_tokens=7)
    probes = {p.name: p for p in report.probes}  # named by the engine that reads the ids so (SGLang: +1)
    assert probes["sglang reading [1, 2, 4]"].accept_length == 3.0
    assert probes["sglang reading [1, 2, 4]"].flagged
    assert probes["sglang#25454 reading [0, 1, 3]"].accept_length < 1.5  # a first id other than 1: as written
    assert report.configured.accept_length < MIN_ACCEPT and not report.ok
    checks = {c.name: c for c in report.checks}
    assert checks["nested aux ids"].status == "warn"


def test_own_embedding_probe_and_restore_on_error(copy_dirs, monkeypatch):
    plain = wb.load_pair(*copy_dirs, fast="off")
    own = torch.nn.Embedding(*plain.verifier.model.embed_tokens.weight.shape)
    with torch.no_grad():
        own.weight.copy_(plain.verifier.model.embed_tokens.weight)
    plain.draft.embed_tokens = own  # a draft that ships its own (here identical) embedding
    pair = plain.with_path("auto")  # the default path, built from the edited plain draft
    before = state(pair)
    report = diagnose(pair, PROMPTS[:1], k=2, max_new_tokens=6)
    emb = next(p for p in report.probes if p.name == "verifier embedding")
    assert emb.skipped is None and emb.delta == 0.0 and not emb.flagged
    assert state(pair) == before and pair.plain[1].part("embed_tokens") is own

    calls = []

    def failing(*args, **kwargs):  # the third run (rope flipped) fails mid-probe
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return generate_run(*args, **kwargs)

    monkeypatch.setattr(doctor, "generate_run", failing)
    with pytest.raises(RuntimeError, match="boom"):
        diagnose(pair, PROMPTS[:1], k=2, max_new_tokens=4)
    assert state(pair) == before


def test_bad_prompts():
    with pytest.raises(ValueError, match="prompts"):
        diagnose(None, "def f():")


def test_trained_embedded_pair_flags_shifted_ids(embedded_pair, tmp_path):
    from workbench.cli import read_prompts

    prompts = read_prompts(REPO / "assets" / "prompts" / "code.jsonl", limit=4)
    report = diagnose(embedded_pair, prompts, k=3, max_new_tokens=16)
    if report.configured.accept_length <= 1.5:
        pytest.skip(f"the embedded pair accepts {report.configured.accept_length:.2f} <= 1.5 tokens per step at k=3 "
                    "(random weights): too little to tell a shifted pairing from the right one")
    assert report.ok, report.summary()
    # the draft saved with its aux ids one layer low (the trainer's "output of layer k" read as "input of k")
    ids = [i - 1 for i in embedded_pair.draft.config.aux_layer_ids]
    pair = wb.load_pair(EMBEDDED / "verifier", with_aux_ids(EMBEDDED / "draft", tmp_path / "draft", ids))
    shifted = diagnose(pair, prompts, k=3, max_new_tokens=16)
    assert not shifted.ok
    back = [p for p in shifted.probes if p.flagged]
    # one list in both places: SGLang reads eagle_config's as "output of layer i" (+1), the trained ids
    assert [p.name for p in back] == [f"sglang reading {list(embedded_pair.draft.config.aux_layer_ids)}"], \
        shifted.summary()
