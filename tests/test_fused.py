"""The fused greedy step (`workbench.decoding.fused`) computes what the unfused step computes.

One call verifies, accepts and drafts the next proposals; the draft's first pass covers every
verified position with the verifier's argmax as its tokens and the chain continues from the
accepted row. Eager checks on the trained embedded pair (every accepted count occurs, so every
row the chain can continue from is exercised); the compiled bf16 check is in test_compiled.py.
"""
from __future__ import annotations

import json

import pytest
import torch
from tests.helpers import EMBEDDED, REPO

import workbench as wb

ALL_PROMPTS = [json.loads(line)["prompt"] for line in (REPO / "assets/prompts/code.jsonl").read_text().splitlines()]
PROMPTS = ALL_PROMPTS[:3]


def _same_events(a: wb.GenerationResult, b: wb.GenerationResult) -> float:
    """Events agree on everything but timing; returns the largest probability difference."""
    assert len(a.events) == len(b.events)
    worst = 0.0
    for x, y in zip(a.events, b.events):
        assert (x.kind, x.proposed, x.proposed_text, x.num_accepted, x.emitted, x.emitted_text, x.emitted_status,
                x.position, x.finish_reason) == (y.kind, y.proposed, y.proposed_text, y.num_accepted, y.emitted,
                                                 y.emitted_text, y.emitted_status, y.position, y.finish_reason)
        for u, v in zip(x.draft_probs + x.verifier_probs + x.emitted_verifier_probs,
                        y.draft_probs + y.verifier_probs + y.emitted_verifier_probs):
            worst = max(worst, abs(u - v))
    return worst


@pytest.fixture(scope="module")
def fp32_pair():
    return wb.load_pair(dtype="float32")


@pytest.mark.parametrize("k", [1, 3, 6])
def test_fused_steps_are_the_unfused_steps(fp32_pair, k):
    pair, accepted = fp32_pair, set()
    for i, prompt in enumerate(ALL_PROMPTS):  # at least 3 prompts, then until every accepted count has occurred
        if i >= 3 and accepted == set(range(k + 1)):
            break
        fused = wb.SpecDecoder(pair, k, fused=True)
        assert fused.fused is not None
        got = fused.generate(prompt, 48)
        want = wb.SpecDecoder(pair, k, fused=False).generate(prompt, 48)
        assert got.tokens == want.tokens == wb.generate_autoregressive(pair, prompt, 48).tokens
        assert _same_events(got, want) < 1e-5  # fp32: the same math over other row counts
        accepted |= {e.num_accepted for e in got.events if e.kind == "spec"}
    assert accepted == set(range(k + 1))  # every row the chain continues from, bonus included


def test_fused_steps_with_the_mha_draft():
    """The MHA twin of the embedded draft continues its chain from the accepted row the same way."""
    pair = wb.load_pair(draft=EMBEDDED / "draft-mha", dtype="float32")
    assert pair.draft.attention_kind == "mha"
    accepted = set()
    for prompt in PROMPTS[:2]:
        got = wb.SpecDecoder(pair, 3, fused=True).generate(prompt, 40)
        want = wb.SpecDecoder(pair, 3, fused=False).generate(prompt, 40)
        assert got.tokens == want.tokens == wb.generate_autoregressive(pair, prompt, 40).tokens
        assert _same_events(got, want) < 1e-5
        accepted |= {e.num_accepted for e in got.events if e.kind == "spec"}
    assert len(accepted) >= 3


def test_near_the_context_end_steps_stay_fused(fp32_pair):
    """The last steps before max_len verify fewer than k proposals (none, at the very end), still
    fused: one call per step, with the same tokens and events as unfused."""
    pair, prompt = fp32_pair, PROMPTS[0]
    n = len(pair.encode(prompt))
    last = []  # proposals in each run's last step
    for max_len in range(n + 9, n + 15):
        dec = wb.SpecDecoder(pair, 4, fused=True)
        before = dec.fused.calls
        got = dec.generate(prompt, 64, max_len=max_len)
        want = wb.SpecDecoder(pair, 4, fused=False).generate(prompt, 64, max_len=max_len)
        assert got.finish_reason == want.finish_reason == "context" and got.tokens == want.tokens
        assert _same_events(got, want) < 1e-5
        spec = [e for e in got.events if e.kind == "spec"]
        assert dec.fused.calls - before == 1 + len(spec)  # the first proposal, then one call per step
        last.append(len(spec[-1].proposed))
    assert min(last) < 4  # where the room ran out before k proposals (which runs do depends on acceptance)


def test_when_a_step_is_fused(fp32_pair):
    pair = fp32_pair
    assert wb.SpecDecoder(pair, 3).fused is None  # an eager pair: unfused unless asked
    for kw in (dict(temperature=0.7), dict(proposer="ngram"), dict(draft_sampling="sample", temperature=0.5)):
        assert wb.SpecDecoder(pair, 3, **kw).fused is None
        with pytest.raises(wb.RequestError, match="fused = True needs greedy decoding"):
            wb.SpecDecoder(pair, 3, fused=True, **kw)
    with pytest.raises(wb.RequestError, match="fused = 'yes'"):
        wb.SpecDecoder(pair, 3, fused="yes")
    a, b = wb.SpecDecoder(pair, 3, fused=True), wb.SpecDecoder(pair, 3, fused=True)
    assert a.fused is not b.fused and a.fused.fn is b.fused.fn  # each decoder's own state, one function per pair
    assert a.proposer is a.fused and wb.SpecDecoder(pair, 4, fused=True).fused.k == 4
    assert a.engine.settings()["fused"] and a.engine_report()["drafter"] == "eagle3-mla (fused)"
    with pytest.raises(wb.RequestError, match="fused = True needs k >= 1"):
        wb.BatchDecoder(pair, 0, max_batch_size=2, fused=True)


def _steps(res: wb.GenerationResult) -> list[tuple]:
    return [(e.kind, e.proposed, e.num_accepted, e.emitted, e.emitted_status, e.position) for e in res.events]


def test_fused_batch_steps_are_each_rows_own(fp32_pair):
    """Many rows in one fused step: rows of different lengths and budgets (so some verify fewer
    proposals than others, padded, and leave early while others join), each with its own accepted
    count, give every row's batch-of-one steps and plain decoding's tokens."""
    pair = fp32_pair
    prompts = PROMPTS + [PROMPTS[0][:40], PROMPTS[2] + "\n"]
    budgets = [40, 12, 33, 7, 25]
    dec = wb.BatchDecoder(pair, 3, max_batch_size=3, fused=True)
    assert dec.settings()["fused"] and dec.drafter.name.endswith("(fused)")
    rids = [dec.submit(p, n) for p, n in zip(prompts, budgets)]
    widths, accepted = set(), set()
    while not dec.idle:
        dec.step()
        if dec.history:
            widths.add(tuple(dec.history[-1].ks))
    assert any(len(set(ks)) > 1 for ks in widths) and max(s.batch_size for s in dec.history) == 3
    for rid, p, n in zip(rids, prompts, budgets):
        got = dec.result(rid)
        alone = wb.SpecDecoder(pair, 3, fused=False).generate(p, n)
        assert got.tokens == alone.tokens == wb.generate_autoregressive(pair, p, n).tokens
        assert _steps(got) == _steps(alone)
        accepted |= {e.num_accepted for e in got.events if e.kind == "spec"}
    assert accepted == {0, 1, 2, 3}


def test_nan_logits_in_a_fused_step_raise_and_the_decoder_recovers():
    """A token whose embedding is NaN (a corrupt checkpoint) poisons the verify that first reads it."""
    pair = wb.load_pair(dtype="float32")
    prompt = PROMPTS[1]
    truth = wb.generate_autoregressive(pair, prompt, 24).tokens
    bad = next(t for t in truth[4:] if t not in truth[:4] and t not in pair.encode(prompt))
    dec = wb.SpecDecoder(pair, 3, fused=True)
    weight = pair.verifier.model.embed_tokens.weight
    saved = weight[bad].clone()
    with torch.no_grad():
        weight[bad] = float("nan")
    with pytest.raises(wb.SamplingError, match=r"verifier logits at step \d+: the logits contain NaN"):
        dec.generate(prompt, 24)
    with torch.no_grad():
        weight[bad] = saved
    assert dec.generate(prompt, 24).tokens == truth


def test_cli_fused_flag(capsys):
    """`workbench generate --fused on|off` (fp32, eager): the same tokens and steps; a fused
    request that cannot be fused is an error naming the flag's value, exit status 2."""
    from workbench.cli import main

    common = ["generate", "--prompt", PROMPTS[1], "--k", "3", "--max-new-tokens", "32", "--json"]
    outs = []
    for flag in ("on", "off"):
        assert main(common + ["--fused", flag]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    shape = lambda out: [(e["kind"], e["proposed"], e["num_accepted"], e["emitted"], e["emitted_status"])  # noqa: E731
                         for e in out["steps"]]
    assert outs[0]["tokens"] == outs[1]["tokens"] and shape(outs[0]) == shape(outs[1])
    assert any(e["num_accepted"] > 0 for e in outs[0]["steps"])
    assert main(common + ["--fused", "on", "--temperature", "0.5"]) == 2
    assert "fused = True needs greedy decoding" in capsys.readouterr().err
