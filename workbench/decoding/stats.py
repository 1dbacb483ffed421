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
from collections.abc import Sequence
from dataclasses import dataclass

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
    prefill = [e for e in events if e.kind == "prefill"]
    stats = _counted(drafts, draft_tokens, accepted, per_pos, drafts_at, reached, hist,
                     draft_time=sum(e.draft_time for e in spec),
                     verify_time=sum(e.verify_time for e in events if e.kind != "prefill"),
                     prefill_time=sum(e.draft_time + e.verify_time for e in prefill))
    if num_tokens is None:
        num_tokens = sum(len(e.emitted) for e in events)
    return _with_throughput(stats, elapsed, num_tokens)


def _counted(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int], drafts_at: list[int],
             reached: list[int], hist: list[int], **times: float) -> GenerationStats:
    """Stats from counted steps: vLLM's counters, each position's rates over the steps that proposed
    it (`drafts_at`) and that reached it (`reached`), and the times (draft, verify, prefill)."""
    uncond, cond = position_rates(per_pos, drafts_at, reached)
    return GenerationStats(num_drafts=drafts, num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
                           accepted_per_pos=per_pos, accept_length=1.0 + _ratio(accepted, drafts),
                           per_position_acceptance=uncond, conditional_acceptance=cond,
                           accepted_length_histogram=hist, **times)


def _with_throughput(stats: GenerationStats, elapsed: float | None, num_tokens: int) -> GenerationStats:
    if elapsed is None:
        elapsed = stats.draft_time + stats.verify_time + stats.prefill_time
    if not math.isfinite(elapsed) or elapsed < 0:
        raise ValueError(f"compute_stats: argument 'elapsed' = {elapsed!r}; expected seconds >= 0")
    if num_tokens < 0:
        raise ValueError(f"compute_stats: argument 'num_tokens' = {num_tokens!r}; expected >= 0")
    stats.elapsed = float(elapsed)
    stats.num_tokens = int(num_tokens)
    stats.tokens_per_s = _ratio(num_tokens, elapsed)
    return stats


def _denominators(s: GenerationStats, index: int) -> tuple[list[int | None], list[int | None]]:
    """Per-position (drafts, reached) counts behind one stats record's rates.

    One k for every step (num_draft_tokens == num_drafts * K, which no mix of k <= K can
    fake) gives them exactly. With mixed k they are recovered from rate = count / den where
    the count is positive; elsewhere they are unknown (None).
    """
    per_pos = s.accepted_per_pos
    if s.num_draft_tokens == s.num_drafts * len(per_pos):
        return [s.num_drafts] * len(per_pos), [s.num_drafts] + per_pos[:-1]
    if len(s.per_position_acceptance) != len(per_pos) or len(s.conditional_acceptance) != len(per_pos):
        raise ValueError(f"merge_stats: stats[{index}] has {len(per_pos)} positions but rates of another length")

    def recover(rates: list[float]) -> list[int | None]:
        return [round(n / r) if n > 0 and r > 0 else None for n, r in zip(per_pos, rates)]

    return recover(s.per_position_acceptance), recover(s.conditional_acceptance)


def merge_stats(stats: list[GenerationStats]) -> GenerationStats:
    """Sum the counters of several generations (a conversation, a prompt set); recompute rates.

    Exact whenever each input used one k throughout (any k per input). For inputs that mixed
    k, prefer `compute_stats(all_events)`, which is always exact; here a mixed input whose
    denominator at a position cannot be recovered raises when it matters.
    """
    k_max = max((len(s.accepted_per_pos) for s in stats), default=0)
    per_pos, drafts_at, reached = [0] * k_max, [0] * k_max, [0] * k_max
    hist = [0] * (k_max + 1)
    unknown: set[tuple[int, int]] = set()
    for n, s in enumerate(stats):
        if len(s.accepted_length_histogram) > len(s.accepted_per_pos) + 1:
            raise ValueError(f"merge_stats: stats[{n}].accepted_length_histogram is longer than k + 1")
        d_at, r_at = _denominators(s, n)
        for i, count in enumerate(s.accepted_per_pos):
            per_pos[i] += count
            for den, total in ((d_at, drafts_at), (r_at, reached)):
                if den[i] is None:
                    unknown.add((n, i))
                else:
                    total[i] += den[i]
        for a, count in enumerate(s.accepted_length_histogram):
            hist[a] += count
    for n, i in sorted(unknown):
        if per_pos[i] > 0:
            raise ValueError(
                f"merge_stats: stats[{n}] mixed k and accepted nothing at position {i}, so how many of its steps "
                f"proposed position {i} is unknown; merge the events with compute_stats(events) instead"
            )
    merged = _counted(sum(s.num_drafts for s in stats), sum(s.num_draft_tokens for s in stats),
                      sum(s.num_accepted_tokens for s in stats), per_pos, drafts_at, reached, hist,
                      **{t: sum(getattr(s, t) for s in stats) for t in ("draft_time", "verify_time", "prefill_time")})
    return _with_throughput(merged, sum(s.elapsed for s in stats), sum(s.num_tokens for s in stats))


def stats_table(stats: GenerationStats) -> dict:
    """One flat row (scalars, then `<list>_<i>` columns) for JSON lines and CSV."""
    row: dict = {}
    for name, value in stats.to_dict().items():
        if isinstance(value, list):
            for i, v in enumerate(value):
                row[f"{name}_{i}"] = v
        else:
            row[name] = value
    return row


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


@dataclass(frozen=True)
class Line:
    """y = a + b * x, least squares; b = 0 where fewer than two x were measured."""

    a: float
    b: float

    @classmethod
    def fit(cls, xs: Sequence[float], ys: Sequence[float]) -> "Line":
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
        return cls(my - b * mx, b)

    def __call__(self, x: float) -> float:
        return self.a + self.b * x
