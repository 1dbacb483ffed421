"""Acceptance metrics from StepEvents, and the tokens a step emits at a given k."""
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.analysis.sweep import stats_table
from workbench.decoding.stats import compute_stats, counter_rates, expected_accept_length
from workbench.decoding.events import StepEvent


def spec(step: int, k: int, a: int, draft_time: float = 0.01, verify_time: float = 0.1) -> StepEvent:
    emitted = list(range(100, 100 + a + 1))
    status = ["accepted"] * a + ["bonus" if a == k else "corrected"]
    return StepEvent(step=step, kind="spec", proposed=list(range(k)), num_accepted=a, emitted=emitted,
                     emitted_status=status, draft_time=draft_time, verify_time=verify_time)


def prefill() -> StepEvent:
    return StepEvent(step=0, kind="prefill", emitted=[7], emitted_status=["bonus"], verify_time=0.5, draft_time=0.2)


def run(pairs: list[tuple[int, int]]) -> list[StepEvent]:
    return [prefill()] + [spec(i + 1, k, a) for i, (k, a) in enumerate(pairs)]


def brute_rates(pairs: list[tuple[int, int]], i: int) -> tuple[float, float]:
    """Position i straight from the definitions: among steps that proposed i, how many
    accepted it; among those that also accepted 0..i-1, how many accepted it."""
    proposed = [(k, a) for k, a in pairs if k > i]
    reached = [(k, a) for k, a in proposed if a >= i]
    hit = [(k, a) for k, a in proposed if a > i]
    uncond = len(hit) / len(proposed) if proposed else 0.0
    cond = len(hit) / len(reached) if reached else 0.0
    return uncond, cond


def test_hand_computed_uniform_k():
    s = compute_stats(run([(3, 0), (3, 1), (3, 3), (3, 2), (3, 3)]))
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (5, 15, 9)
    assert s.accepted_per_pos == [4, 3, 2]
    assert s.accept_length == pytest.approx(1 + 9 / 5)
    assert s.per_position_acceptance == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert s.conditional_acceptance == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert s.accepted_length_histogram == [1, 1, 1, 2]
    assert s.num_tokens == 1 + (1 + 2 + 4 + 3 + 4)
    assert s.draft_time == pytest.approx(5 * 0.01)
    assert s.verify_time == pytest.approx(5 * 0.1)
    assert s.prefill_time == pytest.approx(0.7)
    assert s.elapsed == pytest.approx(0.05 + 0.5 + 0.7)
    assert s.tokens_per_s == pytest.approx(15 / 1.25)


def test_wall_clock_overrides():
    s = compute_stats(run([(2, 1)]), elapsed=4.0, num_tokens=10)
    assert (s.elapsed, s.num_tokens, s.tokens_per_s) == (4.0, 10, 2.5)


def test_mixed_k_counts_each_step_at_its_own_positions():
    pairs = [(3, 3), (3, 1), (1, 1), (2, 2)]
    s = compute_stats(run(pairs))
    assert s.accepted_per_pos == [4, 2, 1]
    assert s.accepted_length_histogram == [0, 2, 1, 1]
    for i in range(3):
        u, c = brute_rates(pairs, i)
        assert s.per_position_acceptance[i] == pytest.approx(u)
        assert s.conditional_acceptance[i] == pytest.approx(c)
    assert s.per_position_acceptance == pytest.approx([1.0, 2 / 3, 1 / 2])
    assert s.conditional_acceptance == pytest.approx([1.0, 2 / 3, 1.0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)).map(lambda t: (max(t), min(t))), max_size=30))
def test_rates_match_definitions(pairs):
    s = compute_stats(run(pairs))
    for i in range(len(s.accepted_per_pos)):
        u, c = brute_rates(pairs, i)
        assert s.per_position_acceptance[i] == pytest.approx(u)
        assert s.conditional_acceptance[i] == pytest.approx(c)
    drafted = [(k, a) for k, a in pairs if k > 0]
    assert s.num_drafts == len(drafted)
    assert s.accept_length == pytest.approx(1 + sum(a for _, a in drafted) / len(drafted) if drafted else 1.0)
    assert sum(s.accepted_length_histogram) == len(drafted)
    assert all(math.isfinite(x) for x in s.per_position_acceptance + s.conditional_acceptance)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 6), min_size=1, max_size=30))
def test_uniform_k_equals_vllm_formulas(k, accepted):
    pairs = [(k, min(a, k)) for a in accepted]
    s = compute_stats(run(pairs))
    vllm = counter_rates(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos)
    assert s.accept_length == pytest.approx(vllm["accept_length"])
    assert s.per_position_acceptance == pytest.approx(vllm["per_position_acceptance"])
    assert s.conditional_acceptance == pytest.approx(vllm["conditional_acceptance"])
    # vLLM's identity: AL = 1 + sum of unconditional rates; and the chain rule through E(k).
    assert s.accept_length == pytest.approx(1 + sum(s.per_position_acceptance))
    assert expected_accept_length(s.conditional_acceptance, k) == pytest.approx(s.accept_length)


def test_no_drafts_is_nan_free():
    s = compute_stats([prefill()], elapsed=0.0)
    assert (s.num_drafts, s.accept_length, s.tokens_per_s) == (0, 1.0, 0.0)
    assert s.per_position_acceptance == [] and s.accepted_length_histogram == [0]
    s = compute_stats(run([(2, 0), (2, 0)]))
    assert s.conditional_acceptance == [0.0, 0.0]


def test_autoregressive_baseline_events():
    decode = [StepEvent(step=i, kind="decode", emitted=[5], emitted_status=["bonus"], verify_time=0.25) for i in (1, 2, 3)]
    s = compute_stats([prefill()] + decode)
    assert (s.num_drafts, s.accept_length, s.num_tokens) == (0, 1.0, 4)
    assert s.verify_time == pytest.approx(0.75) and s.prefill_time == pytest.approx(0.7)
    assert s.tokens_per_s == pytest.approx(4 / 1.45)


def test_bad_events_are_named():
    with pytest.raises(ValueError, match="step 1: field 'num_accepted' = 4; expected 0..3"):
        compute_stats([spec(1, 3, 4)])
    with pytest.raises(ValueError, match="field 'kind' = 'verify'"):
        compute_stats([StepEvent(step=2, kind="verify")])
    with pytest.raises(ValueError, match="elapsed"):
        compute_stats(run([(1, 1)]), elapsed=-1.0)


def test_stats_table_is_flat_json():
    s = compute_stats(run([(2, 1), (2, 2)]))
    row = stats_table(s)
    assert row["accept_length"] == s.accept_length
    assert [row[f"per_position_acceptance_{i}"] for i in range(2)] == s.per_position_acceptance
    assert [row[f"accepted_length_histogram_{i}"] for i in range(3)] == [0, 1, 1]
    assert not any(isinstance(v, (list, dict)) for v in row.values())
    assert json.loads(json.dumps(row)) == row


def test_expected_accept_length():
    assert expected_accept_length([0.8, 0.5], 0) == 1.0
    assert expected_accept_length([0.8, 0.5], 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_accept_length([0.8, 0.5], 4) == pytest.approx(1 + 0.8 + 0.4 + 0.2 + 0.1)  # 0.5 extrapolated
    alpha = 0.8
    for k in range(6):  # constant alpha: a geometric series
        assert expected_accept_length([alpha], k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    for bad in ([], [1.2], [-0.1]):
        with pytest.raises(ValueError, match="cond_rates"):
            expected_accept_length(bad, 2)
