"""Acceptance metrics in vLLM's vocabulary, and the tokens a step emits at a given k.

Counters follow `vllm/v1/spec_decode/metrics.py` (peers.md §2.1): one *draft* per spec step,
`num_draft_tokens += k`, `num_accepted_tokens += a` (bonus/correction not counted), and a
step with `a` accepted increments `accepted_per_pos[0..a-1]`. From them:

- accept length = 1 + accepted / drafts (tokens emitted per verifier forward, bonus included);
- unconditional per-position rate = per_pos[i] / drafts (what vLLM logs);
- conditional rate (EAGLE's alpha) = per_pos[i] / per_pos[i-1], per_pos[0] / drafts at i = 0.

Varying k. vLLM divides every position by `num_drafts`. When the steps of one run propose
different k (an engine may shorten k near the end of the budget), that would count a step
that never proposed position i as a rejection there. We count a step only at the positions
it proposed instead: the unconditional denominator at i is the number of steps with k > i,
and the conditional one the number of those that also accepted positions 0..i-1. With one
k for every step both reduce to vLLM's formulas exactly.

E(k) (`expected_accept_length`) is what a step with k proposals emits given the conditional
rates; what a step costs is measured and modelled in `workbench.analysis.costmodel`.
"""
from __future__ import annotations

import math

from workbench.decoding.events import GenerationStats, StepEvent


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def position_rates(
    accepted_per_pos: list[int], drafts_per_pos: list[int], reached_per_pos: list[int]
) -> tuple[list[float], list[float]]:
    """(unconditional, conditional) per-position rates; 0 where a denominator is 0 (no NaN)."""
    uncond = [_ratio(n, d) for n, d in zip(accepted_per_pos, drafts_per_pos)]
    cond = [_ratio(n, d) for n, d in zip(accepted_per_pos, reached_per_pos)]
    return uncond, cond


def counter_rates(
    num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int, accepted_per_pos: list[int]
) -> dict:
    """What vLLM's four counters imply (its own formulas: every position over num_drafts).

    Shared by `compute_stats` (one k per step), the vLLM `/metrics` scraper and
    `LLM.get_metrics()` reader, so a number means the same thing wherever it is shown.
    """
    per_pos = list(accepted_per_pos)
    uncond, cond = position_rates(per_pos, [num_drafts] * len(per_pos), [num_drafts] + per_pos[:-1])
    return {
        "accept_length": 1.0 + _ratio(num_accepted_tokens, num_drafts),
        "draft_acceptance_rate": _ratio(num_accepted_tokens, num_draft_tokens),
        "per_position_acceptance": uncond,
        "conditional_acceptance": cond,
    }


def compute_stats(
    events: list[StepEvent], elapsed: float | None = None, num_tokens: int | None = None
) -> GenerationStats:
    """vLLM's counters and rates for one generation (or any list of steps).

    "spec" steps are drafts; "prefill" steps add tokens and prefill time; "decode" steps
    (the autoregressive baseline's one-token forwards) add tokens and verifier time.

    `num_tokens` defaults to every emitted token (prefill's included) and `elapsed` to the
    summed draft + verify + prefill time; pass wall-clock values to include the overhead.
    """
    spec = [e for e in events if e.kind == "spec"]
    for e in events:
        if e.kind not in ("spec", "prefill", "decode"):
            raise ValueError(
                f"StepEvent step {e.step}: field 'kind' = {e.kind!r}; expected 'spec', 'prefill' or 'decode'"
            )
    for e in spec:
        if not 0 <= e.num_accepted <= e.k:
            raise ValueError(
                f"StepEvent step {e.step}: field 'num_accepted' = {e.num_accepted}; "
                f"expected 0..{e.k} (k = len(proposed))"
            )
    k_max = max((e.k for e in spec), default=0)
    per_pos, drafts_at, reached = [0] * k_max, [0] * k_max, [0] * k_max
    hist = [0] * (k_max + 1)
    drafts = draft_tokens = accepted = 0
    for e in spec:
        if e.k == 0:  # a verify with nothing proposed is not a draft (vLLM counts none)
            continue
        drafts += 1
        draft_tokens += e.k
        accepted += e.num_accepted
        hist[e.num_accepted] += 1
        for i in range(e.k):
            drafts_at[i] += 1
        for i in range(e.num_accepted):
            per_pos[i] += 1
        for i in range(min(e.num_accepted + 1, e.k)):  # positions whose predecessors were all accepted
            reached[i] += 1
    if num_tokens is None:
        num_tokens = sum(len(e.emitted) for e in events)
    times = dict(draft_time=sum(e.draft_time for e in spec),
                 verify_time=sum(e.verify_time for e in events if e.kind != "prefill"),
                 prefill_time=sum(e.draft_time + e.verify_time for e in events if e.kind == "prefill"))
    if elapsed is None:
        elapsed = sum(times.values())
    if not math.isfinite(elapsed) or elapsed < 0:
        raise ValueError(f"compute_stats: argument 'elapsed' = {elapsed!r}; expected seconds >= 0")
    if num_tokens < 0:
        raise ValueError(f"compute_stats: argument 'num_tokens' = {num_tokens!r}; expected >= 0")
    uncond, cond = position_rates(per_pos, drafts_at, reached)
    return GenerationStats(num_drafts=drafts, num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
                           accepted_per_pos=per_pos, accept_length=1.0 + _ratio(accepted, drafts),
                           per_position_acceptance=uncond, conditional_acceptance=cond,
                           accepted_length_histogram=hist, num_tokens=int(num_tokens), elapsed=float(elapsed),
                           tokens_per_s=_ratio(num_tokens, elapsed), **times)


# ---- tokens per step ------------------------------------------------------------------------


def _check_rates(cond_rates: list[float]) -> None:
    if not cond_rates:
        raise ValueError("cond_rates is empty; expected at least one measured conditional acceptance rate")
    for i, a in enumerate(cond_rates):
        if not (isinstance(a, (int, float)) and 0.0 <= a <= 1.0):
            raise ValueError(f"cond_rates[{i}] = {a!r}; expected a probability in [0, 1]")


def expected_accept_length(cond_rates: list[float], k: int) -> float:
    """E(k) = 1 + sum_{i<k} prod_{j<=i} alpha_j: tokens per verifier step with k proposals.

    Positions past the measured ones reuse the last measured alpha. That is the simplest
    guess; measured alphas usually fall with depth, so E(k) beyond them is optimistic.
    """
    if k < 0:
        raise ValueError(f"k = {k}; expected >= 0")
    if k == 0:
        return 1.0
    _check_rates(cond_rates)
    total, survive = 1.0, 1.0
    for i in range(k):
        survive *= cond_rates[min(i, len(cond_rates) - 1)]
        total += survive
    return total
