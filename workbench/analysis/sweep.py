"""Measured sweeps over k: acceptance, decode speed with its spread, a fitted step-cost model, and
the k to serve with, written as vLLM takes it.

Per temperature, the autoregressive baseline and every k are arms of one `protocol.measure` run
(warmed up, interleaved per prompt, R repeats). Each point's acceptance statistics are
`compute_stats` over the first repeat's events (the same seed replays the same tokens); its
tokens/s and speedup are decode-only medians with a bootstrap interval. A point whose speedup
exceeds what physics allows (`bound`) is marked as a measurement error and left out of the
recommendation. The step-cost model (`costmodel`) is fitted on the same run and extrapolated to
`k_max`.

Each point's continuations are judged by the loop rule (`workbench.analysis.degeneracy`): the
point carries its loop count and its accept length over the clean continuations beside the
pooled one, and the recommendation says when the evidence for its k is mostly looping text. The
recommendation ranks arms by measured speedup only; per-position acceptance rates fall with k by
arithmetic alone and never rank k.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from workbench.analysis.costmodel import ModelCurve, model_curve
from workbench.analysis.degeneracy import AcceptSplit, accept_split
from workbench.decoding.stats import compute_stats
from workbench.analysis.protocol import (Arm, Interval, Measurements, Progress, Timing, cells_to_separate,
                                         check_protocol, measure)
from workbench.decoding.engine import MAX_K, RequestError, SpecDecoder, generate_autoregressive
from workbench.decoding.events import GenerationStats
from workbench.analysis.synthetic import SyntheticAcceptor, check_synthetic_rates
from workbench.analysis.vllm_keys import spec_decode_metrics, speculative_config, synthetic_acceptance_config


@dataclass
class SweepPoint:
    """One (temperature, k) arm; k = 0 is the autoregressive baseline."""

    temperature: float
    k: int
    stats: GenerationStats  # compute_stats over the first repeat's events, every prompt pooled
    tokens_per_s: Interval  # decode tokens / decode seconds
    speedup: Interval  # over the baseline's, paired per cell (1 for k = 0)
    prefill_ms: float  # median prefill per prompt
    verify_decodes: float  # a verify forward of k+1 tokens / t_decode (the baseline's decode wall per token)
    draft_decodes: float  # a draft forward / t_decode
    overhead_decodes: float  # a step's host work / t_decode
    bound: float  # the most speedup physics allows: accept_length * t_decode / t_verify
    error: str | None = None  # set when the measured speedup exceeds `bound` beyond its spread
    model_speedup: float | None = None
    per_prompt_accept_length: list[float] = field(default_factory=list)
    matches_baseline: int | None = None  # temperature 0: prompts whose tokens equal the baseline's
    split: AcceptSplit | None = None  # the first repeat's continuations: loops, clean and per-request figures

    @property
    def accept_length(self) -> float:
        return self.stats.accept_length

    @property
    def accept_length_clean(self) -> float | None:
        return self.split.clean if self.split else None

    @property
    def degenerate(self) -> int:
        """Continuations (first repeat) that loop."""
        return self.split.num_degenerate if self.split else 0

    def row(self) -> dict:
        """One flat dict: the point's scalars, then the stats' `<list>_<i>` columns."""
        head = {"temperature": self.temperature, "k": self.k, "accept_length": self.accept_length,
                "accept_length_clean": self.accept_length_clean, "degenerate": self.degenerate,
                "accept_length_per_request": self.split.per_request if self.split else None,
                "tokens_per_s": self.tokens_per_s.median, "tokens_per_s_lo": self.tokens_per_s.lo,
                "tokens_per_s_hi": self.tokens_per_s.hi, "speedup": self.speedup.median,
                "speedup_lo": self.speedup.lo, "speedup_hi": self.speedup.hi, "model_speedup": self.model_speedup,
                "bound": self.bound, "error": self.error, "prefill_ms": self.prefill_ms,
                "verify_decodes": self.verify_decodes, "draft_decodes": self.draft_decodes,
                "overhead_decodes": self.overhead_decodes, "matches_baseline": self.matches_baseline}
        rest = {f"stats_{n}": v for n, v in stats_table(self.stats).items()
                if n not in ("accept_length", "tokens_per_s")}
        return {**head, **rest}

    def to_dict(self) -> dict:
        return {**self.row(), "tokens_per_s": self.tokens_per_s.to_dict(), "speedup": self.speedup.to_dict(),
                "stats": self.stats.to_dict(), "per_prompt_accept_length": self.per_prompt_accept_length,
                "per_prompt_degenerate": self.split.degenerate if self.split else [],
                "accept_length_by_position": self.split.by_position if self.split else {}}


def stats_table(stats: GenerationStats) -> dict:
    """One flat row (scalars, then `<list>_<i>` columns) for JSON lines and CSV."""
    row: dict = {}
    for name, value in stats.to_dict().items():
        if isinstance(value, list):
            row.update({f"{name}_{i}": v for i, v in enumerate(value)})
        else:
            row[name] = value
    return row


@dataclass
class Recommendation:
    """The k to serve with, as the measurement decides it, and what the model says."""

    k: int  # the fastest measured arm (0: do not speculate)
    decided: bool  # every other candidate is slower beyond the interval
    tied: list[int]  # candidates that cannot be told apart from k at this sample size
    runner_up: int | None
    margin: Interval | None  # k's speedup minus the runner-up's, paired per cell
    prompts_to_separate: int | None  # prompts (at these repeats) that would separate k from the runner-up
    model_k: int
    model_margin: tuple[float, float, float]  # the model's best minus its runner-up: point, lo, hi
    agrees: bool  # the model's best is k or one of the candidates tied with it
    set_aside: list[int]  # ks whose measurement broke physics
    reason: str
    outputs: dict  # vLLM: speculative_config, synthetic acceptance, per-request metrics
    mostly_loops: bool = False  # more than half the continuations behind k loop: the evidence is looping text


@dataclass
class SweepResult:
    ks: list[int]
    temperatures: list[float]
    num_prompts: int
    repeats: int
    max_new_tokens: int
    seed: int
    attention: str
    acceptance: str  # "draft", or the synthetic rates the arms accepted with (timing only)
    acceptance_rules: dict[float, str]  # per temperature: the rule's name, as SpecDecoder says it
    points: list[SweepPoint]  # per temperature: the baseline (k = 0), then each k in order
    models: dict[float, ModelCurve]
    draft: str = "draft"  # what speculative_config names as the model
    measurements: dict[float, Measurements] = field(default_factory=dict, repr=False)
    engine: dict = field(default_factory=dict)  # what ran the speculative arms (`SpecDecoder.engine_report`)

    def point(self, temperature: float, k: int) -> SweepPoint:
        for p in self.points:
            if p.temperature == temperature and p.k == k:
                return p
        raise KeyError(f"no sweep point at temperature {temperature} and k = {k}; "
                       f"measured temperatures {self.temperatures}, ks {[0, *self.ks]}")

    def recommendation(self, temperature: float) -> Recommendation:
        return _recommend(self, temperature)

    def rows(self) -> list[dict]:
        """Flat dicts, one per (temperature, k), for a DataFrame or CSV."""
        return [p.row() for p in self.points]

    def to_dict(self) -> dict:
        recs = {}
        for t in self.temperatures:
            r = self.recommendation(t)
            recs[str(t)] = {**{f: getattr(r, f) for f in ("k", "decided", "tied", "runner_up", "prompts_to_separate",
                                                          "model_k", "agrees", "set_aside", "reason", "outputs",
                                                          "mostly_loops")},
                            "margin": r.margin.to_dict() if r.margin else None,
                            "model_margin": dict(zip(("point", "lo", "hi"), r.model_margin))}
        return {
            "ks": self.ks, "temperatures": self.temperatures, "num_prompts": self.num_prompts,
            "repeats": self.repeats, "max_new_tokens": self.max_new_tokens, "seed": self.seed,
            "attention": self.attention, "acceptance": self.acceptance, "engine": self.engine,
            "acceptance_rules": {str(t): r for t, r in self.acceptance_rules.items()},
            "points": [p.to_dict() for p in self.points],
            "models": {str(t): m.to_dict() for t, m in self.models.items()},
            "recommendations": recs,
            "cells": {str(t): m.cells_dict() for t, m in self.measurements.items()},
            "warmup_s": {str(t): m.warmup_s for t, m in self.measurements.items()},  # untimed, per arm
        }

    def summary(self) -> str:
        lines = [f"sweep: {self.num_prompts} prompts x {self.repeats} repeats, max_new_tokens {self.max_new_tokens}, "
                 f"ks {self.ks}, attention {self.attention}, acceptance {self.acceptance}"]
        for t in self.temperatures:
            base = self.point(t, 0)
            lines.append(f"\ntemperature {t} ({self.acceptance_rules[t]}): autoregressive {base.tokens_per_s} tok/s "
                         f"(decode), prefill {base.prefill_ms:.1f} ms")
            lines.append(f"{'k':>3} {'accept':>7} {'clean':>6} {'loops':>6} {'tok/s [95%]':>22} {'speedup [95%]':>22} "
                         f"{'model':>6} {'verify':>6} {'draft':>6} {'host':>6}  (costs in decodes)")
            for p in self.points:
                if p.temperature != t or p.k == 0:
                    continue
                clean = "n/a" if p.accept_length_clean is None else f"{p.accept_length_clean:.3f}"
                lines.append(f"{p.k:>3} {p.accept_length:>7.3f} {clean:>6} {f'{p.degenerate}/{self.num_prompts}':>6} "
                             f"{str(p.tokens_per_s):>22} {str(p.speedup):>22} "
                             f"{p.model_speedup:>6.2f} {p.verify_decodes:>6.2f} {p.draft_decodes:>6.3f} "
                             f"{p.overhead_decodes:>6.3f}" + (f"  MEASUREMENT ERROR: {p.error}" if p.error else ""))
            lines.append(self.recommendation(t).reason)
        return "\n".join(lines)


def _check_inputs(pair, ks, temperatures, max_new_tokens, synthetic_rates) -> tuple[list[int], list[float]]:
    if getattr(pair, "draft", None) is None:
        raise RequestError("run_sweep: the pair has no draft; expected a verifier + EAGLE-3 draft pair")
    ks = list(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K for k in ks):
        raise ValueError(f"run_sweep: argument 'ks' = {ks!r}; expected integers in [1, {MAX_K}]")
    if len(set(ks)) != len(ks):
        raise ValueError(f"run_sweep: argument 'ks' = {ks!r}; expected each k once")
    temps = [float(t) for t in temperatures]
    if not temps or any(not math.isfinite(t) or t < 0 for t in temps) or len(set(temps)) != len(temps):
        raise ValueError(f"run_sweep: argument 'temperatures' = {list(temperatures)!r}; "
                         "expected distinct numbers >= 0")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"run_sweep: argument 'max_new_tokens' = {max_new_tokens!r}; expected an integer >= 2 "
                         "(the first token comes from the prefill)")
    if synthetic_rates is not None:
        check_synthetic_rates(synthetic_rates, max(ks))
    return sorted(ks), temps


def arm_name(k: int) -> str:
    """The name of the arm that decodes with k proposals (0: the autoregressive baseline)."""
    return "autoregressive" if k == 0 else f"k={k}"


def _arms(pair, ks, t, max_new_tokens, attention, seed, synthetic_rates, acceptor, draft_sampling):
    def decoder(k: int, rates) -> SpecDecoder:
        # Unfused: the cost model needs the draft's time apart from the verify's (a fused step times both as one).
        return SpecDecoder(pair, num_speculative_tokens=k, temperature=t, seed=seed, attention=attention,
                           acceptor=SyntheticAcceptor(rates, k) if rates is not None else acceptor,
                           draft_sampling=draft_sampling, fused=False)

    def spec_arm(k: int) -> Arm:
        dec = decoder(k, synthetic_rates[:k] if synthetic_rates is not None else None)
        return Arm(arm_name(k), k, lambda prompt: dec.generate(prompt, max_new_tokens))

    base = Arm(arm_name(0), 0, lambda prompt: generate_autoregressive(pair, prompt, max_new_tokens, temperature=t,
                                                                           seed=seed, attention=attention))
    largest = decoder(max(ks), synthetic_rates)
    return [base, *(spec_arm(k) for k in ks)], largest.acceptance_rule, largest.engine_report()


def _points(m: Measurements, t: float, curve: ModelCurve) -> list[SweepPoint]:
    base = arm_name(0)
    first = {a.name: m.results[a.name][0] for a in m.arms}  # repeat 0: [prompt] -> result
    bt = Timing.total(m.cell_timings(base))
    dec_fwd, t_dec = bt.verify_s / max(bt.steps, 1), curve.model.t_decode  # a decode's forward alone; its wall
    points = []
    for a in m.arms:
        s = Timing.total(m.cell_timings(a.name))
        steps = s.steps or 1
        verify, host = s.verify_s / steps, (s.decode_s - s.verify_s - s.draft_s) / steps
        stats = compute_stats([e for r in first[a.name] for e in r.events],
                              num_tokens=sum(len(r.tokens) for r in first[a.name]))
        speedup = m.ratio(a.name, base) if a.k else Interval(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
        bound = stats.accept_length * min(1.0, dec_fwd / verify) if a.k and verify > 0 else 1.0
        error = None
        if a.k and speedup.lo > bound:
            error = (f"speedup {speedup} exceeds accept_length x t_decode / t_verify = {bound:.3f} beyond its spread "
                     "(a verify costs at least a decode): the arms did not run under the same conditions")
        matches = None
        if t == 0 and a.k:
            matches = sum(r.tokens == b.tokens for r, b in zip(first[a.name], first[base]))
        points.append(SweepPoint(
            t, a.k, stats, m.rate(a.name), speedup, m.prefill_s(a.name) * 1e3, verify / t_dec if a.k else 1.0,
            s.draft_s / s.draft_forwards / t_dec if s.draft_forwards else 0.0, host / t_dec if a.k else 0.0, bound,
            error, curve.speedup.get(a.k), [r.stats.accept_length for r in first[a.name]], matches,
            accept_split([r.events for r in first[a.name]])))
    return points


def run_sweep(pair, prompts: Sequence[str], ks: Sequence[int], temperatures: Sequence[float] = (0.0,),
              max_new_tokens: int = 64, attention: str = "auto", seed: int = 0, progress: Progress | None = None,
              repeats: int = 3, warmup: bool = True, synthetic_rates: Sequence[float] | None = None,
              k_max: int | None = None, draft_name: str | None = None, acceptor: str | None = None,
              draft_sampling: str = "greedy") -> SweepResult:
    """Measure the baseline and every k at every temperature under `protocol.measure`.

    `synthetic_rates` (vLLM's unconditional per-position rates) replaces the draft's acceptance by
    `SyntheticAcceptor`: the machine's cost curve for a draft of that quality, outputs not lossless.
    `k_max` (default: the largest k, at least 8) is how far the cost model extrapolates. `acceptor`
    ("greedy", "rejection", "block"; default by temperature) and `draft_sampling` ("greedy", "sample")
    choose the acceptance rule, as `SpecDecoder` takes them.
    `progress(i, n, label)` as `protocol.measure` calls it, over every temperature's generations.
    """
    ks, temps = _check_inputs(pair, ks, temperatures, max_new_tokens, synthetic_rates)
    check_protocol(prompts, repeats)
    if synthetic_rates is not None and acceptor is not None:
        raise ValueError(f"run_sweep: acceptor = {acceptor!r} and synthetic_rates given; expected one of them "
                         "(synthetic rates replace the acceptance rule)")
    k_max = max(max(ks), 8) if k_max is None else k_max
    if isinstance(k_max, bool) or not isinstance(k_max, int) or not max(ks) <= k_max <= MAX_K:
        raise ValueError(f"run_sweep: argument 'k_max' = {k_max!r}; expected an integer in [{max(ks)}, {MAX_K}]")
    points, models, rules, ms = [], {}, {}, {}
    per_t = len(prompts) * repeats * (len(ks) + 1)
    for i, t in enumerate(temps):
        arms, rules[t], engine = _arms(pair, ks, t, max_new_tokens, attention, seed, synthetic_rates, acceptor, draft_sampling)
        tick = None if progress is None else (lambda j, n, s, i=i, t=t: progress(i * per_t + j, per_t * len(temps),
                                                                                 f"T={t} {s}"))
        m = ms[t] = measure(arms, prompts, repeats, warmup, tick)
        models[t] = model_curve(m, arms[0].name, {a.k: a.name for a in arms[1:]}, k_max)
        points += _points(m, t, models[t])
    acceptance = "draft" if synthetic_rates is None else f"synthetic {list(synthetic_rates)}"
    return SweepResult(ks, temps, len(prompts), repeats, max_new_tokens, seed, pair.with_attention(attention).attention,
                       acceptance, rules, points, models, draft_name or pair.draft_dir or "draft", ms,
                       {**engine, "k": list(ks)})


def _recommend(res: SweepResult, t: float) -> Recommendation:
    res.point(t, 0)  # raises for a temperature that was not swept
    m, curve = res.measurements[t], res.models[t]
    pts = [p for p in res.points if p.temperature == t]
    set_aside = [p.k for p in pts if p.error]
    cands = [p for p in pts if not p.error]
    # by measured speedup only (pooled: consistent with the pooled differences); never by per-position rates
    best = max(cands, key=lambda p: (p.speedup.pooled, -p.k))
    diffs = {p.k: m.difference(arm_name(best.k), arm_name(p.k), arm_name(0)) for p in cands if p.k != best.k}
    tied = sorted(k for k, d in diffs.items() if d.lo <= 0)
    # the runner-up: the closest candidate (among those tied with the best, if any)
    runner = min(tied or diffs, key=lambda k: (diffs[k].pooled, k)) if diffs else None
    margin = diffs.get(runner)
    needed = [cells_to_separate(diffs[k], len(m.cells)) for k in tied]
    prompts = None if not tied or None in needed else math.ceil(max(needed) / res.repeats)
    agrees = curve.best in [best.k, *tied]
    reason = _reason(res, t, best, tied, runner, margin, prompts, curve, agrees, set_aside) + _loop_note(best)
    return Recommendation(best.k, not tied, tied, runner, margin, prompts, curve.best, curve.margin, agrees,
                          set_aside, reason, _outputs(res, t, best.k), bool(best.split and best.split.mostly_loops))


def _loop_note(best: SweepPoint) -> str:
    """What the recommended k's accept length rests on: a warning when most of its continuations loop."""
    s = best.split
    if s is None or not s.num_requests:
        return ""
    if s.mostly_loops:
        return (f" CAUTION: the evidence for k={best.k} rests mostly on looping text: {s.num_degenerate} of "
                f"{s.num_requests} continuations loop ({s.describe()}); measure on prompts that do not loop.")
    return f" Its {s.describe()}."


def _reason(res, t, best, tied, runner, margin, prompts, curve, agrees, set_aside) -> str:
    size = f"{res.num_prompts} prompts x {res.repeats} repeats"
    if tied:
        others = " and ".join(f"k={k}" for k in tied)
        out = (f"Too few samples to decide: k={best.k} cannot be told apart from {others} at {size} "
               f"(k={best.k} minus k={runner}: {_diff(margin)})")
        if prompts is None or prompts > 10_000:
            out += "; no practical sample size separates them: for serving they are equal"
        else:
            out += f"; about {prompts} prompts (x {res.repeats} repeats) would separate them"
        out += f". Fastest measured: k={best.k} ({best.speedup}x)."
    elif runner is None:
        out = f"Recommended k = {best.k}: the only arm left standing ({size})"
    else:
        out = (f"Recommended k = {best.k}: {best.speedup}x, ahead of k={runner} by {_diff(margin)} "
               f"(speedup difference, 95% interval, {size})")
    lo, hi = curve.lo[curve.best], curve.hi[curve.best]
    out += (f" The step-cost model's best is k={curve.best} ({curve.speedup[curve.best]:.2f}x [{lo:.2f}, {hi:.2f}], "
            f"ahead of k={curve.runner_up} by {curve.margin[0]:.3f} [{curve.margin[1]:.3f}, {curve.margin[2]:.3f}])"
            + ("; the measurement agrees." if agrees else "; the measurement does not agree."))
    if curve.best > max(res.ks):
        out += f" k={curve.best} is past the measured ks: an extrapolation."
    if set_aside:
        out += f" Set aside as measurement errors: k={set_aside}."
    return out


def _diff(d: Interval) -> str:
    return f"{d.pooled:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}]"


def _outputs(res: SweepResult, t: float, k: int) -> dict:
    """What a vLLM user pastes for k: the speculative_config, its acceptance replayed as synthetic, and the
    per-request spec-decode metrics (vLLM's `metrics.speculative_decoding`) of each prompt and pooled.
    For k = 0 they are the fastest speculative k's, with a note that serving without a draft was faster."""
    note = None
    if k == 0:
        k = max((p for p in res.points if p.temperature == t and p.k), key=lambda p: (p.speedup.pooled, -p.k)).k
        note = f"speculation did not pay here (autoregressive was fastest); with the draft, k = {k} was fastest"
    p = res.point(t, k)
    rates = list(p.stats.per_position_acceptance)
    for i in range(1, len(rates)):  # vLLM asks for non-increasing rates; a short last step can break that by a hair
        rates[i] = min(rates[i], rates[i - 1])
    first = res.measurements[t].results[arm_name(k)][0]
    return {
        "k": k, "note": note,
        "speculative_config": speculative_config(res.draft, k),
        "synthetic_acceptance": synthetic_acceptance_config(res.draft, k, rates=[round(r, 4) for r in rates]),
        "synthetic_acceptance_length": synthetic_acceptance_config(res.draft, k, length=round(p.accept_length, 4)),
        "spec_decode_metrics": spec_decode_metrics(p.stats, k),
        "per_request_spec_decode_metrics": [spec_decode_metrics(r.stats, k) for r in first],
    }
