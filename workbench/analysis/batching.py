"""Speculation under load: measured sweeps over the batch size B and k, the crossover batch size,
the schedule to give vLLM, and adaptive k against the best static k.

For each B the prompts go in groups of B, decoded together by `BatchDecoder` (all admitted at
once, the batch shrinking as rows finish). The arms of one `protocol.measure` run are the
autoregressive baseline batched the same way (k = 0) and each k; a cell is (repeat, group), so
every interval pairs arms that ran the same prompts in the same seconds. Aggregate tokens/s is
decode tokens over decode wall seconds (each group's prefills apart); per-request tokens/s is
each request's own decode tokens over the seconds from its first token to its last. The speedup
at B is over the baseline at B, the like-for-like question a scheduler asks.

From the points: the fastest k at each B (0 where no k beats plain decoding), written as vLLM's
`num_speculative_tokens_per_batch_size`; the crossover, the smallest measured B from which on no
k pays; the step costs t_step(B, k) / t_decode(B) that `GoodputEMA` decides with; the cache bytes
each B allocated beside the figure the configs give; and the GPU roofline model beside it all.

Every accept length comes with its clean counterpart and loop count (`analysis.degeneracy`), and
the summary says at which B the best k's evidence is mostly looping text. The best k is chosen by
measured speedup, never by per-position rates.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median

from workbench.analysis.degeneracy import accept_split
from workbench.decoding.stats import compute_stats
from workbench.analysis.protocol import Arm, Interval, Measurements, Progress, Timing, check_protocol, measure
from workbench.analysis.costmodel import StepCosts
from workbench.decoding.adaptive import ConfidenceStop, GoodputEMA, KPolicy
from workbench.decoding.batch import BatchDecoder, BatchStep
from workbench.decoding.engine import MAX_K
from workbench.decoding.events import GenerationResult
from workbench.batch_schedule import BatchSchedule, schedule_from_best_k


@dataclass
class BatchRun:
    """One group of prompts decoded together: every request's result and the steps' clocks."""

    results: list[GenerationResult]
    steps: list[BatchStep]
    wall_s: float

    def timing(self) -> Timing:
        prefill = sum(r.events[0].verify_time for r in self.results if r.events)
        return Timing(decode_tokens=sum(max(len(r.tokens) - 1, 0) for r in self.results),
                      decode_s=max(self.wall_s - prefill, 0.0), prefill_s=prefill, steps=len(self.steps),
                      verify_s=sum(s.verify_s for s in self.steps), draft_s=sum(s.draft_s for s in self.steps),
                      draft_forwards=sum(max(s.ks, default=0) for s in self.steps))

    def request_rates(self) -> list[float]:
        """Each request's decode tokens per second from its first token to its last."""
        out = []
        for r in self.results:
            t = Timing.of(r)
            if t.decode_s > 0:
                out.append(t.decode_tokens / t.decode_s)
        return out


def run_group(dec: BatchDecoder, prompts: Sequence[str], max_new_tokens: int, **settings) -> BatchRun:
    """Decode `prompts` together on `dec` (an idle decoder) and time it."""
    first = len(dec.history)
    t = time.perf_counter()
    results = dec.generate_many(list(prompts), max_new_tokens=max_new_tokens, **settings)
    return BatchRun(results, dec.history[first:], time.perf_counter() - t)


@dataclass
class BatchPoint:
    batch_size: int
    k: int  # 0: the autoregressive baseline at this batch size
    tokens_per_s: Interval  # aggregate decode tokens / decode seconds
    per_request_tokens_per_s: float  # median over requests
    speedup: Interval  # over the baseline at this batch size, paired per cell
    accept_length: float
    occupancy: float  # mean rows per step: the batch the verifier really saw
    step_ms: float  # median wall per step
    cost: float  # t_step / t_decode at this batch size: what GoodputEMA reads
    cache_bytes: dict[str, int]  # what the decoder allocated for its B slots
    cache_bytes_hand: dict[str, int]  # B x rows per slot x bytes per token, from the configs
    matches_baseline: int | None  # greedy: requests whose tokens equal the baseline's
    error: str | None = None  # the speedup beat the accept length beyond its interval: not physics
    accept_length_clean: float | None = None  # over the continuations that do not loop (None: all loop)
    degenerate: int = 0  # continuations (first repeat) that loop
    num_requests: int = 0  # continuations judged

    @property
    def mostly_loops(self) -> bool:
        return self.num_requests > 0 and 2 * self.degenerate > self.num_requests

    def row(self) -> dict:
        return {"batch_size": self.batch_size, "k": self.k, "tokens_per_s": self.tokens_per_s.median,
                "tokens_per_s_lo": self.tokens_per_s.lo, "tokens_per_s_hi": self.tokens_per_s.hi,
                "per_request_tokens_per_s": self.per_request_tokens_per_s, "speedup": self.speedup.median,
                "speedup_lo": self.speedup.lo, "speedup_hi": self.speedup.hi, "speedup_pooled": self.speedup.pooled,
                "accept_length": self.accept_length, "accept_length_clean": self.accept_length_clean,
                "degenerate": self.degenerate, "num_requests": self.num_requests,
                "occupancy": self.occupancy, "step_ms": self.step_ms,
                "cost": self.cost, "cache_bytes": sum(self.cache_bytes.values()),
                "cache_bytes_hand": sum(self.cache_bytes_hand.values()), "matches_baseline": self.matches_baseline,
                "error": self.error}

    def to_dict(self) -> dict:
        return {**self.row(), "tokens_per_s": self.tokens_per_s.to_dict(), "speedup": self.speedup.to_dict(),
                "cache_bytes": self.cache_bytes, "cache_bytes_hand": self.cache_bytes_hand}


@dataclass
class BatchSweepResult:
    batch_sizes: list[int]
    ks: list[int]  # the speculative ks (the baseline k = 0 is always measured)
    num_prompts: int
    repeats: int
    max_new_tokens: int
    points: list[BatchPoint]
    gpu: dict | None = None  # the roofline model's figures (`workbench.analysis.roofline`)
    measurements: dict[int, Measurements] = field(default_factory=dict, repr=False)

    def point(self, batch_size: int, k: int) -> BatchPoint:
        for p in self.points:
            if p.batch_size == batch_size and p.k == k:
                return p
        raise KeyError(f"no point at batch size {batch_size}, k = {k}; measured {self.batch_sizes} x {[0, *self.ks]}")

    def best_k(self) -> dict[int, int]:
        """The fastest arm at each batch size by pooled speedup (0: plain decoding was fastest)."""
        out = {}
        for b in self.batch_sizes:
            cands = [p for p in self.points if p.batch_size == b and not p.error]
            out[b] = max(cands, key=lambda p: (p.speedup.pooled, -p.k)).k
        return out

    def rests_on_loops(self) -> list[int]:
        """The batch sizes whose best k (speculative) was measured on mostly looping continuations."""
        best = self.best_k()
        return [b for b in self.batch_sizes if best[b] and self.point(b, best[b]).mostly_loops]

    def crossover(self) -> dict:
        """The smallest measured B from which on (it and every larger measured B) no k pays, overall
        and per k; None: speculation still pays at the largest B measured."""
        def first_never(pays: dict[int, bool]) -> int | None:
            last = max((b for b, ok in pays.items() if ok), default=0)
            return min((b for b in pays if b > last), default=None)

        per_k = {k: first_never({b: self.point(b, k).speedup.pooled > 1 for b in self.batch_sizes}) for k in self.ks}
        overall = first_never({b: k > 0 for b, k in self.best_k().items()})
        return {"overall": overall, "per_k": per_k}

    def schedule(self, num_speculative_tokens: int | None = None) -> BatchSchedule:
        """The best k per measured B as vLLM's `num_speculative_tokens_per_batch_size`."""
        return schedule_from_best_k(self.best_k(), num_speculative_tokens or max(self.ks))

    def step_costs(self) -> StepCosts:
        """Each measured (B, k)'s t_step / t_decode, a line in k per B (`StepCosts.lines`; a B whose
        baseline decoded nothing has none)."""
        return StepCosts.lines({(p.batch_size, p.k): p.cost for p in self.points if p.k and math.isfinite(p.cost)},
                               "this sweep, a line in k per B")

    def rows(self) -> list[dict]:
        """Flat dicts, one per (B, k), for a DataFrame or CSV."""
        return [p.row() for p in self.points]

    def speculative_config(self, draft: str = "draft") -> dict:
        """What a vLLM user pastes: k = the largest swept, k by batch size as measured here."""
        from workbench.analysis.vllm_keys import speculative_config

        return speculative_config(draft, max(self.ks), schedule=self.schedule())

    def to_dict(self) -> dict:
        sched = self.schedule()
        return {"batch_sizes": self.batch_sizes, "ks": self.ks, "num_prompts": self.num_prompts,
                "repeats": self.repeats, "max_new_tokens": self.max_new_tokens,
                "points": [p.to_dict() for p in self.points], "best_k": self.best_k(), "crossover": self.crossover(),
                "num_speculative_tokens_per_batch_size": sched.to_map(), "schedule_list": sched.to_list(),
                "best_k_rests_on_loops": self.rests_on_loops(),
                "speculative_config": self.speculative_config(),
                "gpu_model": self.gpu,
                "cells": {str(b): m.cells_dict() for b, m in self.measurements.items()}}

    def summary(self) -> str:
        lines = [f"batch sweep: {self.num_prompts} prompts x {self.repeats} repeats, max_new_tokens "
                 f"{self.max_new_tokens}, aggregate decode tokens/s (median [95%]) and speedup over plain "
                 "decoding at the same batch size"]
        lines.append(f"{'B':>4} {'k':>3} {'tok/s':>8} {'[95%]':>18} {'speedup':>8} {'[95%]':>16} {'accept':>7} "
                     f"{'clean':>6} {'loops':>6} {'per-req':>8} {'rows':>5} {'cache MiB':>10}")
        for p in self.points:
            t, s = p.tokens_per_s, p.speedup
            lines.append(f"{p.batch_size:>4} {p.k:>3} {t.median:>8.0f} {f'[{t.lo:.0f}, {t.hi:.0f}]':>18} "
                         f"{s.median:>8.3f} {f'[{s.lo:.2f}, {s.hi:.2f}]':>16} {p.accept_length:>7.3f} "
                         f"{'n/a' if p.accept_length_clean is None else f'{p.accept_length_clean:.3f}':>6} "
                         f"{f'{p.degenerate}/{p.num_requests}':>6} "
                         f"{p.per_request_tokens_per_s:>8.0f} {p.occupancy:>5.2f} "
                         f"{sum(p.cache_bytes.values()) / 2**20:>10.2f}" + (f"  ERROR: {p.error}" if p.error else ""))
        cross = self.crossover()
        lines.append(f"best k per B: {self.best_k()}; crossover: "
                     + (f"speculation stops paying from B = {cross['overall']}" if cross["overall"]
                        else f"speculation still pays at B = {max(self.batch_sizes)}, the largest measured")
                     + f" (per k: {cross['per_k']})")
        lines.append(f"vLLM: \"num_speculative_tokens_per_batch_size\": {self.schedule().to_map()}")
        if looping := self.rests_on_loops():
            lines.append(f"CAUTION: at B = {looping} the best k was measured on mostly looping continuations "
                         "(more than half loop): its evidence is looping text; measure on prompts that do not loop")
        if self.gpu:
            lines.append(f"GPU (a roofline MODEL, not measured): {self.gpu['summary']}")
        return "\n".join(lines)


def _check(pair, prompts, batch_sizes, ks, max_new_tokens) -> tuple[list[int], list[int]]:
    bs = list(batch_sizes)
    if not bs or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bs) or len(set(bs)) != len(bs):
        raise ValueError(f"batch sizes = {bs!r}; expected distinct integers >= 1")
    ks = sorted(set(ks) - {0})
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K for k in ks):
        raise ValueError(f"ks = {ks!r}; expected integers in [1, {MAX_K}] (k = 0, the baseline, is always measured)")
    if len(prompts) < max(bs):
        raise ValueError(f"{len(prompts)} prompts for batch size {max(bs)}; expected at least one full batch "
                         "of prompts for the largest batch size")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens = {max_new_tokens!r}; expected an integer >= 2")
    if pair.draft is None:
        raise ValueError("the pair has no draft; expected a verifier + EAGLE-3 draft pair")
    return sorted(bs), ks


def hand_cache_bytes(pair, batch_size: int, rows: dict[str, int]) -> dict[str, int]:
    """B slots x rows per slot x the bytes one token takes (`kvcache.bytes_per_token`, from the configs)."""
    from workbench.analysis.kvcache import bytes_per_token

    size = pair.verifier.dtype.itemsize
    out = {"verifier": batch_size * rows["verifier"] * bytes_per_token(pair.verifier.config, size)}
    out["draft"] = batch_size * rows["draft"] * bytes_per_token(pair.draft.config, size) if rows["draft"] else 0
    return out


def run_batch_sweep(pair, prompts: Sequence[str], batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
                    ks: Sequence[int] = (1, 2, 3, 4), max_new_tokens: int = 64, repeats: int = 3,
                    warmup: bool = True, progress: Progress | None = None, gpu: bool = True) -> BatchSweepResult:
    """Measure the batched baseline and every k at every batch size (module docstring)."""
    bs, ks = _check(pair, prompts, batch_sizes, ks, max_new_tokens)
    check_protocol(list(prompts), repeats)
    context = min(pair.context_length, max(len(pair.encode(p)) for p in prompts) + max_new_tokens + 1)
    points, ms = [], {}
    per_b = repeats * (len(prompts) // bs[0]) * (len(ks) + 1)
    for i, b in enumerate(bs):
        groups = [tuple(prompts[j:j + b]) for j in range(0, len(prompts) - b + 1, b)]
        decoders = {k: BatchDecoder(pair, k, max_batch_size=b, max_len=context) for k in [0, *ks]}
        arms = [Arm(f"B={b} k={k}", k, (lambda g, d=d: run_group(d, g, max_new_tokens)), BatchRun.timing)
                for k, d in decoders.items()]
        tick = None if progress is None else (lambda j, n, s, i=i: progress(i * per_b + j, per_b * len(bs), s))
        m = ms[b] = measure(arms, groups, repeats, warmup, tick)
        points += _points(pair, m, b, decoders)
    result = BatchSweepResult(bs, ks, len(prompts), repeats, max_new_tokens, points, None, ms)
    if gpu:
        from workbench.analysis.roofline import gpu_model

        model = gpu_model(batch_sizes=range(1, 257), ks=range(0, max(ks) + 1))
        shown = set(range(1, model.max_batch + 1)) | {2 ** i for i in range(9)}  # every feasible B, and beyond
        result.gpu = {"summary": model.summary(), "best_k": model.best_k, "crossover": model.crossover,
                      "crossover_per_k": model.crossover_per_k, "max_batch": model.max_batch,
                      "weight_bytes_per_gpu": model.weight_bytes_per_gpu,
                      "table": [r for r in model.table if r["B"] in shown]}
    return result


def _points(pair, m: Measurements, b: int, decoders: dict[int, BatchDecoder]) -> list[BatchPoint]:
    base = f"B={b} k=0"
    bt = Timing.total(m.cell_timings(base))
    t_decode = bt.decode_s / max(bt.steps, 1)  # the baseline's wall per step at this batch size
    first = {a.name: m.results[a.name][0] for a in m.arms}  # repeat 0: [group] -> BatchRun
    points = []
    for a in m.arms:
        runs = [run for r in range(m.repeats) for run in m.results[a.name][r]]
        s = Timing.total(m.cell_timings(a.name))
        results = [res for run in first[a.name] for res in run.results]
        stats = compute_stats([e for r in results for e in r.events])
        split = accept_split([r.events for r in results])
        steps = [st for run in runs for st in run.steps]
        speedup = m.ratio(a.name, base) if a.k else Interval(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
        error = None
        if a.k and speedup.lo > stats.accept_length:
            error = (f"speedup {speedup} beats the accept length {stats.accept_length:.3f} beyond its spread: a step "
                     "cannot emit more than it accepts, so the arms did not run under the same conditions")
        matches = None
        if a.k:
            base_tokens = [res.tokens for run in first[base] for res in run.results]
            matches = sum(r.tokens == t for r, t in zip(results, base_tokens))
        dec = decoders[a.k]
        points.append(BatchPoint(
            b, a.k, m.rate(a.name), median([x for run in runs for x in run.request_rates()] or [0.0]), speedup,
            stats.accept_length, sum(st.batch_size for st in steps) / max(len(steps), 1),
            median([st.wall_s for st in steps] or [0.0]) * 1e3,
            (s.decode_s / max(s.steps, 1)) / t_decode if t_decode > 0 else math.nan,
            dec.cache_bytes(), hand_cache_bytes(pair, b, dec.cache_rows()), matches, error, split.clean,
            split.num_degenerate, split.num_requests))
    return points


# ---- adaptive k against static k ------------------------------------------------------------------


@dataclass
class PolicyResult:
    name: str
    tokens_per_s: Interval
    accept_length: float
    mean_k: float  # proposals verified per speculative step
    speedup: Interval  # over plain decoding
    vs_best_static: Interval | None  # its speedup minus the best static k's, paired per cell
    matches_baseline: int
    accept_length_clean: float | None = None  # over the continuations that do not loop (None: all loop)
    degenerate: int = 0  # continuations (first repeat) that loop


def compare_policies(pair, prompts: Sequence[str], policies: dict[str, KPolicy], static_ks: Sequence[int],
                     batch_size: int = 1, max_new_tokens: int = 64, repeats: int = 2,
                     progress: Progress | None = None) -> dict:
    """Every adaptive policy and every static k on the same prompts, as arms of one measurement (groups
    of `batch_size`), with the plain baseline: tokens/s, accept length, the k each really used, and
    each policy's speedup against the best static k's, paired per cell."""
    check_protocol(list(prompts), repeats)
    if len(prompts) < batch_size:
        raise ValueError(f"{len(prompts)} prompts for batch size {batch_size}; expected at least one full batch")
    k_max = max(static_ks)
    context = min(pair.context_length, max(len(pair.encode(p)) for p in prompts) + max_new_tokens + 1)
    groups = [tuple(prompts[j:j + batch_size]) for j in range(0, len(prompts) - batch_size + 1, batch_size)]
    arms = {"autoregressive": BatchDecoder(pair, 0, batch_size, context)}
    arms.update({f"k={k}": BatchDecoder(pair, k, batch_size, context) for k in static_ks})
    arms.update({name: BatchDecoder(pair, k_max, batch_size, context, policy=p) for name, p in policies.items()})
    m = measure([Arm(n, d.k_max, (lambda g, d=d: run_group(d, g, max_new_tokens)), BatchRun.timing)
                 for n, d in arms.items()], groups, repeats, True, progress)

    def summary(name: str) -> tuple[float, float, int, float | None, int]:
        results = [res for run in m.results[name][0] for res in run.results]
        events = [e for r in results for e in r.events if e.kind == "spec"]
        base = [res.tokens for run in m.results["autoregressive"][0] for res in run.results]
        split = accept_split([r.events for r in results])
        return (compute_stats(events).accept_length, sum(e.k for e in events) / max(len(events), 1),
                sum(r.tokens == t for r, t in zip(results, base)), split.clean, split.num_degenerate)

    best = max((f"k={k}" for k in static_ks), key=lambda n: m.ratio(n, "autoregressive").pooled)
    out = {}
    for name in arms:
        al, mean_k, same, clean, loops = summary(name)
        out[name] = PolicyResult(name, m.rate(name), al, mean_k, m.ratio(name, "autoregressive"),
                                 m.difference(name, best, "autoregressive") if name != "autoregressive" else None, same,
                                 clean, loops)
    return {"batch_size": batch_size, "num_prompts": len(prompts), "repeats": repeats, "best_static": best,
            "policies": {n: p.name for n, p in policies.items()}, "results": out, "measurements": m}


def default_policies(costs: StepCosts, k_max: int) -> dict[str, KPolicy]:
    """The two adaptive rules the issue names, at their defaults."""
    return {"confidence 0.5": ConfidenceStop(0.5), "goodput EMA": GoodputEMA(costs, k_max=k_max)}


__all__ = ["BatchPoint", "BatchRun", "BatchSweepResult", "PolicyResult", "compare_policies", "default_policies",
           "hand_cache_bytes", "run_batch_sweep", "run_group"]
