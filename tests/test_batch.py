"""The batched engine is lossless per row, isolates rows, and joins and drops them cleanly.

Each row of a batch must emit exactly what it would emit alone: its own batch-1 plain decoding
under greedy settings (bit for bit with the CPU kernels in bf16, and in fp32 on torch's
operations), and plain sampling's distribution under sampling. Rows are ragged (different prompt
lengths, budgets, k, stop reasons), join while others decode and leave when they finish.
"""
from __future__ import annotations

import json

import pytest
import torch
from tests.helpers import REPO
from tests.test_sampling import (END, PROMPT, VOCAB, empirical, exact_first_two, null_tv_max, peaked_pair,  # noqa: F401
                                 resample_bug, tv)

import workbench as wb
from workbench.analysis.costmodel import StepCosts
from workbench.decoding.adaptive import ConfidenceStop, GoodputEMA, ScheduleK
from workbench.decoding.batch import BatchDecoder
from workbench.decoding.drafters import Proposal
from workbench.batch_schedule import read_schedule

PROMPTS = [json.loads(line)["prompt"] for line in (REPO / "assets/prompts/code.jsonl").read_text().splitlines()[:8]]
BUDGETS = [24, 9, 31, 17, 5, 28, 13, 20]  # rows finish at different steps


@pytest.fixture(scope="module")
def bf16_pair():
    return wb.load_pair(dtype="bfloat16")  # the CPU kernels where they build


@pytest.fixture(scope="module")
def fp32_plain():
    return wb.load_pair(dtype="float32", fast="off")  # torch's own operations


def alone(pair, prompts=PROMPTS, budgets=BUDGETS, **kw) -> list[list[int]]:
    return [wb.generate_autoregressive(pair, p, n, **kw).tokens for p, n in zip(prompts, budgets)]


def batched(dec: BatchDecoder, prompts=PROMPTS, budgets=BUDGETS, ks=None, **kw) -> list[wb.GenerationResult]:
    ids = [dec.submit(p, max_new_tokens=n, k=None if ks is None else ks[i], **kw)
           for i, (p, n) in enumerate(zip(prompts, budgets))]
    while not dec.idle:
        dec.step()
    return [dec.result(i) for i in ids]


@pytest.mark.parametrize("B", [2, 4, 8])
@pytest.mark.parametrize("k", [1, 3])
def test_batched_greedy_is_each_rows_plain_decoding_bf16_kernels(bf16_pair, B, k):
    """8 ragged requests through a batch of B (the rest join as rows finish): each row's tokens
    equal its batch-1 autoregressive tokens bit for bit (the CPU kernels compute every row alone)."""
    want = alone(bf16_pair)
    dec = BatchDecoder(bf16_pair, k, max_batch_size=B)
    got = batched(dec)
    assert [r.tokens for r in got] == want
    assert [r.finish_reason for r in got] == ["length"] * 8
    sizes = [h.batch_size for h in dec.history]
    assert max(sizes) == B and min(sizes) < B  # full batches, then a shrinking tail
    assert all(ev.batch_size == h.batch_size for h in dec.history[:1] for r in got for ev in r.events[1:2])
    if k:  # the draft really drafted: rows accepted proposals, at the speed batch-1 decoding would
        one = [wb.SpecDecoder(bf16_pair, k).generate(p, n).stats.accept_length for p, n in zip(PROMPTS, BUDGETS)]
        assert [r.stats.accept_length for r in got] == pytest.approx(one)
        assert all(r.stats.accept_length > 1.2 for r in got[:1])


@pytest.mark.parametrize("k", [1, 3])
def test_batched_greedy_is_each_rows_plain_decoding_fp32_torch(fp32_plain, k):
    """The plain models (torch's operations, a padded batch with per-row lengths): fp32 rounding
    differences between a batch and one row never flip a greedy choice."""
    prompts, budgets = PROMPTS[:6], BUDGETS[:6]
    got = batched(BatchDecoder(fp32_plain, k, max_batch_size=4), prompts, budgets)
    assert [r.tokens for r in got] == alone(fp32_plain, prompts, budgets)


def test_rows_with_different_k_share_a_step(bf16_pair):
    """Per-row k: each row verifies its own k + 1 tokens in the padded forward."""
    ks = [0, 1, 2, 3, 4, 5, 6, 3]
    dec = BatchDecoder(bf16_pair, 6, max_batch_size=8)
    got = batched(dec, ks=ks)
    assert [r.tokens for r in got] == alone(bf16_pair)
    for r, k in zip(got, ks):
        spec = [e for e in r.events if e.kind != "prefill"]
        assert max(e.k for e in spec) == k and all(e.kind == ("spec" if k else "decode") for e in spec)
    assert any(len(set(h.ks)) > 2 for h in dec.history)  # several ks in one forward


def test_a_request_that_joins_mid_flight_gets_its_own_tokens(bf16_pair):
    dec = BatchDecoder(bf16_pair, 3, max_batch_size=4)
    first = [dec.submit(p, max_new_tokens=30) for p in PROMPTS[:3]]
    for _ in range(4):
        dec.step()
    late = dec.submit(PROMPTS[5], max_new_tokens=25)
    dec.step()  # it joins the three that are mid-flight
    assert dec.history[-1].batch_size == 4
    while not dec.idle:
        dec.step()
    assert dec.result(late).tokens == wb.generate_autoregressive(bf16_pair, PROMPTS[5], 25).tokens
    assert [dec.result(i).tokens for i in first] == alone(bf16_pair, PROMPTS[:3], [30] * 3)
    alone_dec = BatchDecoder(bf16_pair, 3, max_batch_size=1)
    solo = alone_dec.generate_many([PROMPTS[5]], max_new_tokens=25)[0]
    assert [e.emitted for e in solo.events] == [e.emitted for e in dec.result(late).events]  # the same steps too


def test_rows_end_for_their_own_reasons_and_the_others_keep_decoding(bf16_pair):
    """A stop string, a context limit and a cancellation each end one row; the rest are untouched."""
    dec = BatchDecoder(bf16_pair, 3, max_batch_size=4, max_len=120)
    long_prompt = PROMPTS[1] * 4  # about 110 tokens: it reaches the 120-token context first
    assert 90 < len(bf16_pair.encode(long_prompt)) < 119
    ids = [dec.submit(PROMPTS[0], max_new_tokens=40, stop="\n"), dec.submit(long_prompt, max_new_tokens=60),
           dec.submit(PROMPTS[2], max_new_tokens=40), dec.submit(PROMPTS[3], max_new_tokens=40)]
    for _ in range(3):
        dec.step()
    assert dec.cancel(ids[3]) and not dec.cancel(ids[3])
    while not dec.idle:
        dec.step()
    res = [dec.result(i) for i in ids]
    assert [r.finish_reason for r in res] == ["stop", "context", "length", "cancelled"]
    assert res[0].text == wb.generate_autoregressive(bf16_pair, PROMPTS[0], 40, stop="\n").text
    assert res[1].tokens == wb.generate_autoregressive(bf16_pair, long_prompt, 60, max_len=120).tokens
    assert res[2].tokens == wb.generate_autoregressive(bf16_pair, PROMPTS[2], 40).tokens


def test_a_failing_row_fails_alone(bf16_pair, monkeypatch):
    """A row whose acceptance raises (here: its acceptor, made to fail at its third step) ends with
    finish_reason "error" and the message; every other row finishes as it would alone."""
    dec = BatchDecoder(bf16_pair, 3, max_batch_size=4)
    ids = [dec.submit(p, max_new_tokens=30, temperature=0.0 if i != 1 else 0.7, seed=i)
           for i, p in enumerate(PROMPTS[:4])]
    dec.step()
    broken = next(r for r in dec.rows if r.rid == ids[1])
    calls = {"n": 0}
    real = broken.acceptor.verify

    def verify(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise wb.SamplingError("injected: this row's logits are unusable")
        return real(*args, **kw)

    monkeypatch.setattr(broken.acceptor, "verify", verify)
    while not dec.idle:
        dec.step()
    res = [dec.result(i) for i in ids]
    assert res[1].finish_reason == "error" and "injected" in res[1].error and len(res[1].tokens) > 1
    others = [0, 2, 3]
    assert [res[i].tokens for i in others] == alone(bf16_pair, [PROMPTS[i] for i in others], [30] * 3)


def test_a_row_whose_logits_break_fails_alone(bf16_pair, monkeypatch):
    """NaN logits in one row of a step (here put there by a wrapped verifier) end that row with the
    reason; the rows beside it in the same forward finish as they would alone."""
    dec = BatchDecoder(bf16_pair, 3, max_batch_size=3)
    ids = [dec.submit(p, max_new_tokens=20) for p in PROMPTS[:3]]
    real, calls = dec.pair.verifier.forward, {"n": 0}

    def forward(x, cache, **kw):
        out = real(x, cache, **kw)
        calls["n"] += 1
        if x.shape[0] == 3 and calls["n"] == 6:  # a batched step, not a prefill
            out.logits[1] = float("nan")
        return out

    monkeypatch.setattr(dec.pair.verifier, "forward", forward)
    while not dec.idle:
        dec.step()
    res = [dec.result(i) for i in ids]
    assert res[1].finish_reason == "error" and "NaN" in res[1].error
    assert [res[0].tokens, res[2].tokens] == alone(bf16_pair, [PROMPTS[0], PROMPTS[2]], [20, 20])


def test_bad_input_is_refused_with_the_field_named(bf16_pair):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(wb.RequestError, match="max_batch_size"):
            BatchDecoder(bf16_pair, 3, max_batch_size=bad)
    with pytest.raises(wb.RequestError, match="num_speculative_tokens"):
        BatchDecoder(bf16_pair, wb.MAX_K + 1)
    dec = BatchDecoder(bf16_pair, 3, max_batch_size=2, max_len=64)
    with pytest.raises(wb.RequestError, match=r"k = 4; expected an integer in \[0, 3\]"):
        dec.submit(PROMPTS[0], k=4)
    too_long = " ".join(["x = 1"] * 60)
    with pytest.raises(wb.RequestError, match="context is 64 tokens"):
        dec.submit(too_long)
    rid = dec.submit(PROMPTS[0], max_new_tokens=5)  # the refused requests left nothing behind
    while not dec.idle:
        dec.step()
    assert dec.result(rid).tokens == wb.generate_autoregressive(bf16_pair, PROMPTS[0], 5).tokens
    many = dec.generate_many([PROMPTS[1], too_long, PROMPTS[2]], max_new_tokens=5)  # the long one fails alone
    assert [r.finish_reason for r in many] == ["length", "error", "length"] and "context is 64" in many[1].error
    assert [many[0].tokens, many[2].tokens] == alone(bf16_pair, [PROMPTS[1], PROMPTS[2]], [5, 5])


def test_cache_bytes_are_the_hand_figure(bf16_pair):
    """B slots of (context + k + 1) verifier rows and (context + 2k + 1) draft rows, from the configs."""
    from workbench.analysis.kvcache import bytes_per_token

    B, k, ctx = 6, 3, 100
    dec = BatchDecoder(bf16_pair, k, max_batch_size=B, max_len=ctx)
    v, d = bf16_pair.verifier.config, bf16_pair.draft.config
    assert dec.cache_bytes() == {"verifier": B * (ctx + k + 1) * bytes_per_token(v, 2),
                                 "draft": B * (ctx + 2 * k + 1) * bytes_per_token(d, 2)}


# ---- adaptive k ----------------------------------------------------------------------------------


def test_policies_keep_the_output_and_change_k(bf16_pair):
    want = alone(bf16_pair)
    schedule = read_schedule({"1-2": 5, "3-4": 2, "5-8": 0}, 5)
    costs = StepCosts({(1, 1): 1.2, (1, 5): 1.8, (8, 1): 1.5, (8, 5): 3.5})
    for policy in (ConfidenceStop(0.5, per_row=True), ConfidenceStop(0.3), GoodputEMA(costs, k_max=5),
                   GoodputEMA(costs, k_max=5, per_row=True), ScheduleK(schedule)):
        chosen, choose = [], policy.choose
        policy.choose = lambda rids, caps, b, choose=choose, chosen=chosen: chosen.append(choose(rids, caps, b)) \
            or chosen[-1]
        dec = BatchDecoder(bf16_pair, 5, max_batch_size=4, policy=policy)
        got = batched(dec)
        assert [r.tokens for r in got] == want, policy.name
        ks = {k for h in dec.history for k in h.ks}
        assert len(ks) > 1, policy.name
        if isinstance(policy, ScheduleK):
            assert all(max(h.ks) <= schedule.k_for(h.batch_size) for h in dec.history)
        if isinstance(policy, ConfidenceStop) and policy.per_row:  # every verified proposal but the first was sure
            assert all(q >= 0.5 for r in got for e in r.events[1:] for q in e.draft_probs[1:])
        if isinstance(policy, GoodputEMA):  # one k for the batch (rows pad to the longest anyway), or each its own
            assert any(len(set(c)) > 1 for c in chosen) == policy.per_row
    assert ConfidenceStop(0.3).trim(0, [0.9, 0.1, 0.8]) == 3 and ConfidenceStop(0.3, per_row=True).trim(0, [0.9, 0.1]) == 1


def test_goodput_rule_picks_k_from_acceptance_and_cost():
    costs = StepCosts({(1, 1): 1.1, (1, 4): 1.4, (16, 1): 1.6, (16, 4): 3.4})
    assert costs(1, 0) == 1.0 and costs(1, 2) == pytest.approx(1.2) and costs(1, 6) == pytest.approx(1.6)
    assert costs(4, 1) == pytest.approx(1.1 + 0.5 * 0.5)  # halfway from B=1 to 16 in log2
    p = GoodputEMA(costs, k_max=6, alpha=0.5, prior=0.9)
    assert p.choose([0], [6], 1)[0] >= 4  # a good draft on a cheap machine: long chains
    for _ in range(6):
        p.observe(0, 4, 0)  # every first proposal rejected
    assert p.choose([0], [6], 1) == [0] and p.choose([0], [6], 16) == [0]
    for _ in range(30):
        k = p.choose([0], [6], 1)[0]
        if k:
            break
    assert k > 0  # with nothing observed the estimates drift back: it probes again
    batch = GoodputEMA(costs, k_max=6, alpha=0.5, prior=0.9)
    for _ in range(6):
        batch.observe(1, 4, 4)  # request 1: every proposal accepted; request 2 as the prior
    assert batch.choose([1, 2], [6, 2], 1) == [k := batch.choose([1, 2], [6, 6], 1)[0], min(k, 2)]  # one k, capped
    with pytest.raises(ValueError, match="alpha"):
        GoodputEMA(costs, alpha=0.0)
    with pytest.raises(ValueError, match="threshold"):
        ConfidenceStop(1.5)
    with pytest.raises(ValueError, match=r"point \(0, 1\)"):
        StepCosts({(0, 1): 1.0})
    noisy = StepCosts.lines({(1, 1): 1.5, (1, 2): 1.71, (1, 3): 1.67, (1, 4): 1.81, (8, 1): 1.4, (8, 2): 1.6})
    assert noisy(1, 3) > noisy(1, 2) and noisy(1, 6) == pytest.approx(noisy(1, 4) + 2 * (noisy(1, 4) - noisy(1, 3)))
    assert noisy(8, 2) == pytest.approx(1.6) and noisy(8, 0) == 1.0  # two points: the line through them


# ---- sampling -------------------------------------------------------------------------------------


class OracleDrafter:
    """A batch drafter proposing each row's verifier argmax (a good greedy draft, q one-hot): about
    half its proposals are accepted at temperature 1 on the peaked pair, so the residual path runs."""

    name, needs_aux = "oracle", False

    def __init__(self, pair) -> None:
        self.pair = pair

    def admit(self, slot, row, prefill) -> None:
        pass

    def move(self, src, dst) -> None:
        pass

    def reserve(self, max_len) -> None:
        pass

    def propose(self, rows, ks, stop_below):
        out = []
        for r, k in zip(rows, ks):
            ids = list(r.verified)
            for _ in range(k):
                ids.append(int(self.pair.verifier(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(Proposal(ids[len(r.verified):], None, [1.0] * k))
        return out


def test_batched_rejection_sampling_gives_each_row_plain_sampling(peaked_pair):  # noqa: F811
    """(t1, t2) of 800 requests (two prompts interleaved, 8 rows at a time) against the exact law of
    plain sampling, by TV under the bound of 20k correct experiments; and a request's draws are its
    own: the same seed gives the same tokens alone and in a batch."""
    other = [7, 1, 14, 3, 3]
    laws = {tuple(p): exact_first_two(peaked_pair, p) for p in (PROMPT, other)}
    n = 400
    assert tv(exact_first_two(peaked_pair, PROMPT, resample_bug)[1], laws[tuple(PROMPT)][1]) > 1.5 * null_tv_max(
        laws[tuple(PROMPT)][1], n)  # the bug this test targets would show
    dec = BatchDecoder(peaked_pair, 1, max_batch_size=8, proposer=OracleDrafter(peaked_pair))
    ids = [(p, dec.submit(p, max_new_tokens=2, temperature=1.0, seed=s)) for s in range(n) for p in (PROMPT, other)]
    while not dec.idle:
        dec.step()
    assert max(h.batch_size for h in dec.history) == 8
    accepted = sum(e.num_accepted for _, i in ids for e in dec.result(i).events)
    assert 0.25 < accepted / len(ids) < 0.85  # both branches of the rejection test ran often
    for prompt in (PROMPT, other):
        pairs = [tuple((dec.result(i).tokens + [END])[:2]) for p, i in ids if p is prompt]
        p1, p2 = laws[tuple(prompt)]
        assert tv(empirical([a for a, _ in pairs], VOCAB), p1) < null_tv_max(p1, n)
        assert tv(empirical([b for _, b in pairs], VOCAB + 1), p2) < null_tv_max(p2, n)
    solo = BatchDecoder(peaked_pair, 1, max_batch_size=1, proposer=OracleDrafter(peaked_pair))
    for s in (3, 11, 42):
        r = solo.generate_many([other], max_new_tokens=2, temperature=1.0, seed=s)[0]
        assert r.tokens == dec.result(ids[2 * s + 1][1]).tokens


def test_the_triton_kernel_serves_a_ragged_batch(fp32_plain):
    """The Triton MLA kernel (under its interpreter here) reads each row's own sequence length."""
    pytest.importorskip("triton")
    dec = BatchDecoder(fp32_plain, 2, max_batch_size=3, attention="triton")
    assert dec.pair.attention == "triton"
    budgets = [5, 3, 4]
    assert [r.tokens for r in batched(dec, PROMPTS[:3], budgets)] == alone(fp32_plain, PROMPTS[:3], budgets)
