"""The timing protocol, the step-cost model, synthetic acceptance and the vLLM outputs.

The protocol and the model are checked on measurements whose values are set by hand, so every
figure has a closed form; the sweep itself is checked on real pairs in tests/test_sweep.py.
"""
from __future__ import annotations

import json
import math

import pytest

import workbench as wb
from tests.test_engine import ID_PROMPTS, random_pair
from workbench.analysis.costmodel import Line, fit_cost_model, model_curve
from workbench.analysis.protocol import Arm, Interval, Measurements, Timing, bootstrap, cells_to_separate, measure, rotation
from workbench.decoding.events import GenerationResult, GenerationStats, StepEvent
from workbench.analysis.synthetic import SyntheticAcceptor, conditional_rates
from workbench.decoding.sampling import SamplingError
from workbench.integrations.vllm import spec_decode_metrics, synthetic_acceptance_config

# ---- the protocol -------------------------------------------------------------------------


def _result(k: int, accepted: list[int], prefill_s: float, verify_s: float, draft_s: float, host_s: float) -> GenerationResult:
    """A generation whose steps have the given costs: a prefill, then one step per entry of `accepted`."""
    events = [StepEvent(0, "prefill", emitted=[1], emitted_status=["bonus"], verify_time=prefill_s)]
    for i, a in enumerate(accepted, 1):
        if k:
            events.append(StepEvent(i, "spec", proposed=[5] * k, num_accepted=a, emitted=[5] * (a + 1),
                                    emitted_status=["accepted"] * a + ["corrected"], verify_time=verify_s,
                                    draft_time=draft_s))
        else:
            events.append(StepEvent(i, "decode", emitted=[5], emitted_status=["bonus"], verify_time=verify_s))
    elapsed = prefill_s + len(accepted) * (verify_s + draft_s + host_s)
    tokens = 1 + sum(len(e.emitted) for e in events[1:])
    return GenerationResult([5] * tokens, "", events, GenerationStats(elapsed=elapsed, num_tokens=tokens), k=k)


def test_rotation_puts_each_arm_first_equally_often_and_measure_warms_every_arm():
    calls = []
    arms = [Arm(n, k, lambda p, n=n, k=k: calls.append((n, p)) or _result(k, [0], 0.1, 0.01, 0.0, 0.0))
            for n, k in (("autoregressive", 0), ("k=1", 1), ("k=2", 2))]
    firsts = [rotation(arms, r, p)[0].name for r in range(3) for p in range(2)]
    assert firsts == ["autoregressive", "k=1", "k=1", "k=2", "k=2", "autoregressive"]
    m = measure(arms, ["a", "b"], repeats=3)
    assert calls[:3] == [("autoregressive", "a"), ("k=1", "a"), ("k=2", "a")]  # the untimed warm-up
    assert len(calls) == 3 + 3 * 2 * 3 and set(m.warmup_s) == {"autoregressive", "k=1", "k=2"}
    assert [o[0] for o in m.orders] == firsts and all(sorted(o) == sorted(a.name for a in arms) for o in m.orders)
    assert [c["order"] for c in m.cells_dict()] == m.orders
    with pytest.raises(ValueError, match="repeats = 0"):
        measure(arms, ["a"], repeats=0)
    with pytest.raises(ValueError, match="empty prompt set"):
        measure(arms, [], repeats=1)
    with pytest.raises(ValueError, match="each arm once"):
        measure(arms + arms[:1], ["a"])


def test_timing_splits_the_prefill_from_the_decode():
    t = Timing.of(_result(2, [2, 0, 1], prefill_s=0.5, verify_s=0.03, draft_s=0.01, host_s=0.002))
    assert (t.decode_tokens, t.steps, t.draft_forwards) == (3 + 1 + 2, 3, 6)
    assert t.prefill_s == 0.5 and t.decode_s == pytest.approx(3 * 0.042)
    assert t.verify_s == pytest.approx(0.09) and t.draft_s == pytest.approx(0.03)


def _measurements(costs: dict[int, float], accepted: dict[int, list[int]], prompts: int = 4, repeats: int = 2,
                  jitter: float = 0.0) -> Measurements:
    """Arms whose per-step verify costs are `costs[k]` seconds (k = 0: the decode), draft 0.001 s a
    forward and host work 0.0005 s a step; `jitter` scales cell (r, p) by 1 + jitter * (p - 1.5)."""
    names = {k: "autoregressive" if k == 0 else f"k={k}" for k in costs}
    m = Measurements([Arm(names[k], k, None) for k in costs], prompts, repeats)
    for k, cost in costs.items():
        m.timings[names[k]], m.results[names[k]] = [], []
        for r in range(repeats):
            row = []
            for p in range(prompts):
                scale = 1 + jitter * (p - 1.5)
                row.append(_result(k, accepted[k], 0.01, cost * scale, 0.001 * k * scale, 0.0005 * scale))
            m.results[names[k]].append(row)
            m.timings[names[k]].append([Timing.of(x) for x in row])
    m.orders = [[a.name for a in rotation(m.arms, r, p)] for r, p in m.cells]
    return m


def test_rates_ratios_and_intervals_on_exact_timings():
    m = _measurements({0: 0.010, 2: 0.012}, {0: [0] * 10, 2: [2, 1] * 5})
    ar = 1 / (0.010 + 0.0005)
    spec = 2.5 / (0.012 + 0.002 + 0.0005)  # 2.5 tokens a step
    r = m.rate("autoregressive")
    assert r.median == pytest.approx(ar) and r.lo == pytest.approx(ar) and r.hi == pytest.approx(ar)
    s = m.ratio("k=2", "autoregressive")
    assert s.median == pytest.approx(spec / ar) and (s.min, s.max) == pytest.approx((spec / ar, spec / ar))
    d = m.difference("k=2", "autoregressive", "autoregressive")
    assert d.median == pytest.approx(spec / ar - 1) and d.pooled == pytest.approx(s.pooled - 1)
    noisy = _measurements({0: 0.010, 2: 0.012}, {0: [0] * 10, 2: [2, 1] * 5}, jitter=0.2)
    s = noisy.ratio("k=2", "autoregressive")
    assert s.lo - 1e-9 <= s.median <= s.hi + 1e-9 and noisy.rate("k=2").lo < noisy.rate("k=2").hi
    assert bootstrap(8, lambda idx: sum(idx)) == bootstrap(8, lambda idx: sum(idx))  # seeded: reproducible


def test_cells_to_separate_scales_with_the_interval():
    # half-width 0.1 around 0.05 at 16 cells: the width must halve, which takes 4x the cells
    assert cells_to_separate(Interval(0.05, -0.05, 0.15, 0, 0, pooled=0.05), 16) == 64
    assert cells_to_separate(Interval(0.0, -0.1, 0.1, 0, 0, pooled=0.0), 16) is None


# ---- the step-cost model --------------------------------------------------------------------


def test_the_model_recovers_every_measured_term_and_extrapolates():
    t_dec = 0.010 + 0.0005  # the baseline's decode wall per token
    costs = {0: 0.010, **{k: 0.010 + 0.001 * (k + 1) for k in (1, 2, 3)}}  # verify: 10 ms + 1 ms a token
    accepted = {0: [0] * 12, 1: [1, 0, 1, 1] * 3, 2: [2, 1, 0, 2] * 3, 3: [3, 2, 1, 0] * 3}
    m = _measurements(costs, accepted)
    model = fit_cost_model(m, "autoregressive", {k: f"k={k}" for k in (1, 2, 3)})
    assert model.t_decode == pytest.approx(t_dec)
    assert model.verify.a == pytest.approx(0.010 / t_dec) and model.verify.b == pytest.approx(0.001 / t_dec)
    assert model.c_draft == pytest.approx(0.001 / t_dec)
    assert model.overhead.a == pytest.approx(0.0005 / t_dec) and model.overhead.b == pytest.approx(0.0, abs=1e-12)
    # pooled conditional rates: position 0 accepted in 27 of 36 steps, position 1 in 12 of 18 reached (k >= 2), ...
    assert model.rates == pytest.approx([27 / 36, 12 / 18, 3 / 6])
    k = 6
    cost = (0.010 + 0.001 * 7 + 0.001 * k + 0.0005) / t_dec
    assert model.step_cost(k) == pytest.approx(cost)
    assert model.speedup(k) == pytest.approx(model.accept_length(k) / cost)
    curve = model_curve(m, "autoregressive", {k: f"k={k}" for k in (1, 2, 3)}, k_max=8, resamples=20)
    assert curve.ks == list(range(9)) and curve.speedup[0] == 1.0
    assert curve.best == max(range(9), key=lambda k: (model.speedup(k), -k))
    assert all(curve.lo[k] <= curve.speedup[k] + 1e-9 and curve.speedup[k] <= curve.hi[k] + 1e-9 for k in range(9))
    assert Line.fit([4], [2.0]) == Line(2.0, 0.0)  # one measured k: no slope to fit


# ---- synthetic acceptance ---------------------------------------------------------------------


def test_synthetic_acceptor_accepts_at_the_given_rates():
    pair = random_pair(seed=3)
    full = wb.SpecDecoder(pair, 3, acceptor=SyntheticAcceptor([1.0, 1.0, 1.0])).generate(ID_PROMPTS[0], 40)
    assert full.stats.per_position_acceptance == [1.0, 1.0, 1.0] and "not lossless" in full.acceptance_rule
    none = wb.SpecDecoder(pair, 3, acceptor=SyntheticAcceptor([0.0])).generate(ID_PROMPTS[0], 20)
    assert none.stats.accept_length == 1.0
    rates = [0.9, 0.72, 0.504]
    res = wb.SpecDecoder(pair, 3, acceptor=SyntheticAcceptor(rates), seed=1).generate(ID_PROMPTS[0], 400)
    n = res.stats.num_drafts
    assert n >= 60, f"only {n} steps: the run ended early"
    for got, want in zip(res.stats.per_position_acceptance, rates):
        assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / n)  # binomial, 4 sigma
    assert conditional_rates(rates, 5) == pytest.approx([0.9, 0.8, 0.7, 0.7, 0.7])


@pytest.mark.parametrize("rates, match", [([1.2], r"\[0\] = 1.2; expected a rate in \[0, 1\]"),
                                          ([-0.1], r"expected a rate in \[0, 1\]"),
                                          ([0.5, 0.7], "non-increasing"), ([], "non-empty"),
                                          ([0.9, 0.8, 0.7, 0.6], "has 4 entries; expected at most")])
def test_synthetic_rates_are_checked(rates, match):
    with pytest.raises(SamplingError, match=match):
        SyntheticAcceptor(rates, k=3)


# ---- vLLM's key names and rules -------------------------------------------------------------------


def test_synthetic_config_follows_vllms_rules():
    """`SpeculativeConfig` (vllm/config/speculative.py): rejection_sample_method 'synthetic' with exactly one
    of synthetic_acceptance_rates (length num_speculative_tokens, each in [0, 1], non-increasing) or
    synthetic_acceptance_length (in [1, k + 1])."""
    cfg = synthetic_acceptance_config("d", 3, rates=[0.9, 0.5, 0.2])
    assert cfg == {"model": "d", "method": "eagle3", "num_speculative_tokens": 3,
                   "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.5, 0.2]}
    assert synthetic_acceptance_config("d", 3, length=2.6)["synthetic_acceptance_length"] == 2.6
    for kw in (dict(rates=[0.9, 0.5]), dict(rates=[0.5, 0.9, 0.1]), dict(rates=[1.1, 0.5, 0.1]), dict(length=4.5),
               dict(length=0.5), dict(), dict(rates=[0.9, 0.5, 0.2], length=2.0)):
        with pytest.raises(ValueError, match="synthetic"):
            synthetic_acceptance_config("d", 3, **kw)
    json.dumps(cfg)


def test_spec_decode_metrics_are_vllms_per_request_block():
    """vLLM #48915: `metrics.speculative_decoding` = these seven keys; acceptance_histogram[j] counts the
    verify steps that accepted exactly j draft tokens."""
    res = wb.SpecDecoder(random_pair(seed=3), 3).generate(ID_PROMPTS[0], 30)
    block = spec_decode_metrics(res.stats, 3)
    assert list(block) == ["mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram",
                           "num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens"]
    h = block["acceptance_histogram"]
    assert len(h) == 4 and all(isinstance(x, int) for x in h) and sum(h) == block["num_spec_steps"]
    assert sum(j * n for j, n in enumerate(h)) == block["num_accepted_draft_tokens"]
    assert block["mean_acceptance_length"] == pytest.approx(1 + block["num_accepted_draft_tokens"] / sum(h))
    assert isinstance(block["draft_acceptance_rate"], float) and block["num_spec_tokens"] == 3
