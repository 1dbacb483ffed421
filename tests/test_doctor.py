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
from conftest import EMBEDDED, make_random_pair
from workbench.analysis import doctor
from workbench.analysis.doctor import MIN_ACCEPT, Probe, diagnose, judge, measure, static_checks
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
    pair = wb.load_pair(vdir, ddir)
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
    """A copy of a draft checkpoint whose config.json names other aux layer ids."""
    shutil.copytree(draft_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Two intra-op threads on a 2-core machine shared with other jobs run these tiny matmuls
    many times slower (OpenMP threads wait on each other), so these tests use one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def copy_dirs(tmp_path_factory):
    return make_copy_pair(tmp_path_factory.mktemp("copy"))


def state(pair) -> dict:
    d = pair.draft
    return {"aux": pair.verifier.aux_layer_ids, "norm_output": d.norm_output,
            "interleave": [m.interleave for m in d.modules() if isinstance(m, RotaryEmbedding)],
            "modules": dict(d._modules), "overrides": dict(d.__dict__).get("combine_hidden_states")}


def test_judge_margins_and_noise():
    conf = Probe("configured", "", 2.0, steps=50, stderr=0.0)
    probes = [Probe("a", "", 2.06, stderr=0.0), Probe("b", "", 2.04, stderr=0.0), Probe("c", "", None, skipped="n/a"),
              Probe("d", "", 2.5, stderr=0.2), Probe("e", "", 2.5, stderr=0.1), Probe("f", "", 3.0, stderr=None)]
    flags = judge(conf, probes)
    # d: +0.5 is within 2 standard errors (0.4 < 0.5? no: 2 x 0.2 = 0.4 < 0.5 -> flagged); e: 2 x 0.1 -> flagged
    assert [p.flagged for p in probes] == [True, False, False, True, True, False]
    assert probes[0].delta == pytest.approx(0.06) and probes[2].delta is None
    assert len(flags) == 3 and "'a'" in flags[0]
    noisy = Probe("configured", "", 2.0, stderr=0.2)
    assert not judge(noisy, [Probe("g", "", 2.5, stderr=0.2)])  # 0.5 < 2 x hypot(0.2, 0.2) = 0.566
    # +0.055 on 3.0 clears the absolute margin but not the 2% relative one
    assert not judge(Probe("configured", "", 3.0, stderr=0.0), [Probe("h", "", 3.055, stderr=0.0)])
    assert any("misconfigured" in f for f in judge(Probe("configured", "", MIN_ACCEPT - 0.01, stderr=0.0), []))
    assert judge(Probe("configured", "", MIN_ACCEPT, stderr=0.0), []) == []


def test_measure_matches_the_engine(copy_dirs):
    pair = wb.load_pair(*copy_dirs)
    with doctor.aux_ids(pair.verifier, (0, 1, 3)):  # the wrong capture: every step rejects its first proposal
        m = measure(pair, PROMPTS, k=2, max_new_tokens=4)
    assert (m.accept_length, m.steps, m.stderr) == (1.0, 6, 0.0)  # 3 steps per prompt, 0 accepted each
    m = measure(pair, PROMPTS[:1], k=2, max_new_tokens=7)
    assert (m.accept_length, m.steps, m.stderr) == (3.0, 2, 0.0)
    assert m.accept_length == greedy_accept_length(pair, PROMPTS[:1], 2, 7)


def test_static_checks(copy_dirs):
    pair = wb.load_pair(*copy_dirs)
    by_name = {c.name: c for c in static_checks(pair)}
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
    probes = {p.name.split(" [")[0]: p for p in report.probes}
    assert probes["aux ids -1"].accept_length < 1.5 and not probes["aux ids -1"].flagged
    assert probes["aux ids +1"].skipped and "[5]" in probes["aux ids +1"].skipped
    assert probes["verifier embedding"].skipped  # this draft ships no embedding
    json.dumps(report.to_dict())
    assert "OK" in report.summary()


def test_shifted_aux_ids_are_flagged(copy_dirs, tmp_path):
    shifted = with_aux_ids(copy_dirs[1], tmp_path / "draft", [0, 1, 3])  # "output of layer k" saved as k
    pair = wb.load_pair(copy_dirs[0], shifted)
    report = diagnose(pair, PROMPTS[:1], k=2, max_new_tokens=7)  # 1 + 3 + 3: no shortened step
    assert not report.ok
    flagged = [p for p in report.probes if p.flagged]
    assert [p.name for p in flagged] == ["aux ids +1 [1, 2, 4]"] and flagged[0].accept_length == 3.0
    assert report.configured.accept_length < MIN_ACCEPT
    assert any("misconfigured" in f for f in report.flags)
    assert "FLAG" in report.summary() and pair.verifier.aux_layer_ids == (0, 1, 3)


def test_own_embedding_probe_and_restore_on_error(copy_dirs, monkeypatch):
    pair = wb.load_pair(*copy_dirs)
    own = torch.nn.Embedding(*pair.verifier.model.embed_tokens.weight.shape)
    with torch.no_grad():
        own.weight.copy_(pair.verifier.model.embed_tokens.weight)
    pair.draft.embed_tokens = own  # a draft that ships its own (here identical) embedding
    before = state(pair)
    report = diagnose(pair, PROMPTS[:1], k=2, max_new_tokens=6)
    emb = next(p for p in report.probes if p.name == "verifier embedding")
    assert emb.skipped is None and emb.delta == 0.0 and not emb.flagged
    assert state(pair) == before and pair.draft.part("embed_tokens") is own

    calls = []

    def failing(*args, **kwargs):  # the third run (rope flipped) fails mid-probe
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return measure(*args, **kwargs)

    monkeypatch.setattr(doctor, "measure", failing)
    with pytest.raises(RuntimeError, match="boom"):
        diagnose(pair, PROMPTS[:1], k=2, max_new_tokens=4)
    assert state(pair) == before


def test_bad_prompts():
    with pytest.raises(ValueError, match="prompts"):
        diagnose(None, "def f():")


def test_trained_embedded_pair_flags_shifted_ids(embedded_pair, tmp_path):
    configured = greedy_accept_length(embedded_pair, PROMPTS, k=3, max_new_tokens=16)
    if configured <= 1.5:
        pytest.skip(f"the embedded pair accepts {configured:.2f} <= 1.5 tokens per step at k=3 (random weights): "
                    "too little to tell a shifted pairing from the right one")
    report = diagnose(embedded_pair, PROMPTS, k=3, max_new_tokens=16)
    assert report.configured.accept_length == configured
    assert not any(p.flagged for p in report.probes), report.summary()
    ids = [i + 1 for i in embedded_pair.draft.config.aux_layer_ids]
    pair = wb.load_pair(EMBEDDED / "verifier", with_aux_ids(EMBEDDED / "draft", tmp_path / "draft", ids))
    shifted = diagnose(pair, PROMPTS, k=3, max_new_tokens=16)
    assert not shifted.ok
    assert any(p.flagged and p.name.startswith("aux ids -1") for p in shifted.probes), shifted.summary()
