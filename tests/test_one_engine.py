"""One engine: a request gives the same tokens and the same steps whichever face of the loop runs it.

`SpecDecoder` is the engine with one row, `BatchDecoder` the same engine with many, and plain
decoding (`generate_autoregressive`, `BatchDecoder(k=0)`) is k = 0 of it. Through the public API,
in fp32: identical token ids, and for the speculative runs identical steps (proposals and accepted
counts), with the fused greedy step too.
"""
from __future__ import annotations

import json

import pytest
from tests.helpers import REPO

import workbench as wb

PROMPTS = [json.loads(line)["prompt"] for line in (REPO / "assets/prompts/code.jsonl").read_text().splitlines()[:8]]
BUDGETS = [24, 9, 31, 17, 5, 28, 13, 20]  # rows finish at different steps, so rows join and leave


@pytest.fixture(scope="module")
def pair():
    return wb.load_pair(dtype="float32")


def batched(dec: wb.BatchDecoder) -> list[wb.GenerationResult]:
    ids = [dec.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, BUDGETS)]
    while not dec.idle:
        dec.step()
    return [dec.result(i) for i in ids]


def steps(res: wb.GenerationResult) -> list[tuple]:
    return [(e.kind, e.position, e.proposed, e.num_accepted, e.emitted, e.emitted_status) for e in res.events]


@pytest.mark.parametrize("k", [2, 4])
def test_batch_of_one_many_rows_and_the_fused_step_take_the_same_steps(pair, k):
    one = [wb.SpecDecoder(pair, k).generate(p, n) for p, n in zip(PROMPTS, BUDGETS)]
    fused = [wb.SpecDecoder(pair, k, fused=True).generate(p, n) for p, n in zip(PROMPTS, BUDGETS)]
    plain = [wb.generate_autoregressive(pair, p, n).tokens for p, n in zip(PROMPTS, BUDGETS)]
    assert [r.tokens for r in one] == [r.tokens for r in fused] == plain
    assert [steps(r) for r in one] == [steps(r) for r in fused]
    for B in (4, 8):
        dec = wb.BatchDecoder(pair, k, max_batch_size=B)
        many = batched(dec)
        assert max(h.batch_size for h in dec.history) == B
        assert [r.tokens for r in many] == plain
        assert [steps(r) for r in many] == [steps(r) for r in one]
        assert [r.acceptance_rule for r in many] == [r.acceptance_rule for r in one] == ["greedy"] * len(PROMPTS)
    assert sum(e.num_accepted for r in one for e in r.events) > 0  # the draft really drafted


def test_plain_decoding_is_k_0_of_the_same_loop(pair):
    alone = [wb.generate_autoregressive(pair, p, n) for p, n in zip(PROMPTS, BUDGETS)]
    dec = wb.BatchDecoder(pair, 0, max_batch_size=4)
    many = batched(dec)
    assert max(h.batch_size for h in dec.history) == 4
    assert [r.tokens for r in many] == [r.tokens for r in alone]
    assert [steps(r) for r in many] == [steps(r) for r in alone]
    assert {r.acceptance_rule for r in many} == {r.acceptance_rule for r in alone} == {"none (autoregressive)"}


def test_sampled_drafts_in_a_batch_are_each_rows_own(pair):
    """Sampled drafts (with their real q) and rejection sampling: a row's draws are its own generator's,
    so a request takes the same steps alone and among others."""
    settings = dict(temperature=0.8, draft_sampling="sample", seed=3)
    alone = [wb.SpecDecoder(pair, 3, **settings).generate(p, n) for p, n in zip(PROMPTS[:4], BUDGETS[:4])]
    dec = wb.BatchDecoder(pair, 3, max_batch_size=4)
    ids = [dec.submit(p, max_new_tokens=n, **settings) for p, n in zip(PROMPTS[:4], BUDGETS[:4])]
    while not dec.idle:
        dec.step()
    many = [dec.result(i) for i in ids]
    assert [r.tokens for r in many] == [r.tokens for r in alone]
    assert [steps(r) for r in many] == [steps(r) for r in alone]
    assert many[0].acceptance_rule == alone[0].acceptance_rule == "rejection (sampled draft, its real q)"
    assert all(0 < q <= 1 for r in many for e in r.events for q in e.draft_probs)


def test_a_decoder_serves_one_request_at_a_time(pair):
    """A stream left unfinished is cancelled by the decoder's next request, which decodes as if alone."""
    dec = wb.SpecDecoder(pair, 3)
    want = dec.generate(PROMPTS[1], 12)
    left = dec.stream(PROMPTS[0], 30)
    assert next(left).kind == "prefill"
    got = dec.generate(PROMPTS[1], 12)
    assert got.tokens == want.tokens and steps(got) == steps(want) and dec.engine.idle


def test_a_batch_of_one_takes_a_k_policy(pair):
    """Adaptive k is the engine's, so a SpecDecoder takes a policy too (here: stop drafting when unsure)."""
    plain = wb.generate_autoregressive(pair, PROMPTS[0], 24).tokens
    res = wb.SpecDecoder(pair, 4, policy=wb.ConfidenceStop(0.5, per_row=True)).generate(PROMPTS[0], 24)
    assert res.tokens == plain
    assert any(0 < e.k < 4 for e in res.events if e.kind == "spec") and res.stats.accept_length > 1
