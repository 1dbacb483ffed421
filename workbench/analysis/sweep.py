"""Measured sweeps over k (and temperature): acceptance, throughput, and the k to serve with.

For each temperature the autoregressive baseline runs once per prompt, then `SpecDecoder`
once per prompt for every k, all on the same pair, cache and sampling code, so tokens/s and
speedup compare like with like. Each k's statistics are `compute_stats` over the events of
every prompt together (exact pooled counts, not an average of per-prompt rates).

Timing terms (all from the engine's events, prefill excluded):
- draft forward time  = draft time of the spec steps / draft forwards. A step with k
  proposals runs k draft forwards (the first over the newly verified tokens, then k-1
  single-token ones); a step that proposes nothing near the end of the budget still ran one.
- verify forward time = verify time of the spec steps / spec steps (one verifier forward
  over k+1 tokens each, acceptance included); for the baseline, per one-token decode step.
- c = draft forward time / verify forward time: the cost of one draft forward in units of
  one verifier forward, the `c` of the goodput model E(k) / (1 + k*c).
tokens/s is generated tokens over wall time per generation (prefill included, for the
baseline alike), and speedup is that over the baseline's tokens/s at the same temperature.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from workbench.analysis.metrics import Recommendation, compute_stats, recommend_k, stats_table
from workbench.decoding.engine import MAX_K, RequestError, SpecDecoder, generate_autoregressive
from workbench.decoding.events import GenerationResult, GenerationStats, StepEvent

Progress = Callable[[int, int, str], None]


@dataclass
class SweepPoint:
    """One (temperature, k) cell of a sweep; k = 0 is the autoregressive baseline."""

    temperature: float
    k: int
    stats: GenerationStats  # compute_stats over the events of every prompt
    tokens_per_s: float  # generated tokens / wall seconds, summed over prompts
    speedup: float  # tokens_per_s / the baseline's at this temperature (1.0 for k = 0)
    draft_forward_time: float  # seconds per draft forward (0 for the baseline)
    verify_forward_time: float  # seconds per verifier forward (k+1 tokens; 1 for the baseline)
    c: float  # draft_forward_time / verify_forward_time (0 for the baseline)
    draft_forwards: int = 0
    verify_forwards: int = 0  # spec steps, or the baseline's one-token decode steps
    per_prompt_accept_length: list[float] = field(default_factory=list)
    matches_baseline: int | None = None  # temperature 0: prompts whose tokens equal the baseline's

    @property
    def accept_length(self) -> float:
        return self.stats.accept_length

    def row(self) -> dict:
        """One flat dict: the point's scalars, then the stats' `<list>_<i>` columns."""
        head = {"temperature": self.temperature, "k": self.k, "accept_length": self.accept_length,
                "tokens_per_s": self.tokens_per_s, "speedup": self.speedup,
                "draft_forward_time": self.draft_forward_time, "verify_forward_time": self.verify_forward_time,
                "c": self.c, "draft_forwards": self.draft_forwards, "verify_forwards": self.verify_forwards,
                "matches_baseline": self.matches_baseline}
        rest = {f"stats_{n}": v for n, v in stats_table(self.stats).items()
                if n not in ("accept_length", "tokens_per_s")}
        return {**head, **rest}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accept_length"] = self.accept_length
        return d


@dataclass
class SweepResult:
    ks: list[int]
    temperatures: list[float]
    num_prompts: int
    max_new_tokens: int
    seed: int
    attention: str
    points: list[SweepPoint]  # per temperature: the baseline (k = 0), then each k in order
    pooled: dict[float, GenerationStats]  # per temperature: compute_stats over every k's spec steps

    def point(self, temperature: float, k: int) -> SweepPoint:
        for p in self.points:
            if p.temperature == temperature and p.k == k:
                return p
        raise KeyError(f"no sweep point at temperature {temperature} and k = {k}; "
                       f"measured temperatures {self.temperatures}, ks {[0, *self.ks]}")

    def c(self, temperature: float) -> float:
        """c pooled over every k at this temperature (total draft time per draft forward over
        total verify time per verifier forward), which is what the recommendation uses."""
        spec = [p for p in self.points if p.temperature == temperature and p.k > 0]
        forwards, steps = sum(p.draft_forwards for p in spec), sum(p.verify_forwards for p in spec)
        draft = sum(p.stats.draft_time for p in spec) / forwards if forwards else 0.0
        verify = sum(p.stats.verify_time for p in spec) / steps if steps else 0.0
        return draft / verify if verify else 0.0

    def recommendation(self, temperature: float) -> Recommendation:
        """`recommend_k` from the pooled conditional rates and c, checked against measured tokens/s
        (k = 0 is the baseline, so "do not speculate" is a measured option too)."""
        self.point(temperature, 0)  # raises for a temperature that was not swept
        rates = self.pooled[temperature].conditional_acceptance
        if not rates:
            raise ValueError(f"temperature {temperature}: no speculative step was measured (max_new_tokens = "
                             f"{self.max_new_tokens}); expected at least one to estimate acceptance rates")
        measured = {p.k: p.tokens_per_s for p in self.points if p.temperature == temperature}
        return recommend_k(rates, self.c(temperature), k_max=max(self.ks), measured=measured)

    def rows(self) -> list[dict]:
        """Flat dicts, one per (temperature, k), for a DataFrame or CSV."""
        return [p.row() for p in self.points]

    def to_dict(self) -> dict:
        recs = {}
        for t in self.temperatures:
            try:
                recs[str(t)] = asdict(self.recommendation(t))
            except ValueError as e:
                recs[str(t)] = {"error": str(e)}
        return {
            "ks": self.ks, "temperatures": self.temperatures, "num_prompts": self.num_prompts,
            "max_new_tokens": self.max_new_tokens, "seed": self.seed, "attention": self.attention,
            "points": [p.to_dict() for p in self.points],
            "pooled": {str(t): s.to_dict() for t, s in self.pooled.items()},
            "c": {str(t): self.c(t) for t in self.temperatures},
            "recommendations": recs,
        }

    def summary(self) -> str:
        lines = [f"sweep: {self.num_prompts} prompts, max_new_tokens {self.max_new_tokens}, "
                 f"ks {self.ks}, attention {self.attention}"]
        for t in self.temperatures:
            base = self.point(t, 0)
            lines.append(f"\ntemperature {t}: autoregressive {base.tokens_per_s:.1f} tok/s "
                         f"({base.verify_forward_time * 1e3:.1f} ms per step)")
            lines.append(f"{'k':>3} {'accept':>7} {'tok/s':>8} {'speedup':>8} {'c':>6}  per-position "
                         f"(unconditional / conditional)")
            for p in self.points:
                if p.temperature != t or p.k == 0:
                    continue
                s = p.stats
                pos = " ".join(f"{u:.2f}/{c:.2f}" for u, c in zip(s.per_position_acceptance, s.conditional_acceptance))
                lines.append(f"{p.k:>3} {p.accept_length:>7.3f} {p.tokens_per_s:>8.1f} {p.speedup:>7.2f}x "
                             f"{p.c:>6.3f}  {pos}")
            try:
                rec = self.recommendation(t)
                lines.append(f"recommended k = {rec.k}: {rec.reason}")
            except ValueError as e:
                lines.append(f"no recommendation: {e}")
        return "\n".join(lines)


def _check_inputs(pair, prompts, ks, temperatures, max_new_tokens) -> tuple[list[int], list[float]]:
    if getattr(pair, "draft", None) is None:
        raise RequestError("run_sweep: the pair has no draft; expected a verifier + EAGLE-3 draft pair")
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError("run_sweep: argument 'prompts'; expected a non-empty list of non-empty strings")
    ks = list(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K for k in ks):
        raise ValueError(f"run_sweep: argument 'ks' = {ks!r}; expected integers in [1, {MAX_K}]")
    if len(set(ks)) != len(ks):
        raise ValueError(f"run_sweep: argument 'ks' = {ks!r}; expected each k once")
    temps = [float(t) for t in temperatures]
    if not temps or any(not math.isfinite(t) or t < 0 for t in temps) or len(set(temps)) != len(temps):
        raise ValueError(f"run_sweep: argument 'temperatures' = {list(temperatures)!r}; "
                         "expected distinct numbers >= 0")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"run_sweep: argument 'max_new_tokens' = {max_new_tokens!r}; expected an integer >= 1")
    return sorted(ks), temps


def _point(temperature: float, k: int, results: list[GenerationResult], base_tps: float | None,
           baseline: list[GenerationResult] | None) -> SweepPoint:
    events: list[StepEvent] = [e for r in results for e in r.events]
    elapsed = sum(r.stats.elapsed for r in results)
    stats = compute_stats(events, elapsed=elapsed, num_tokens=sum(len(r.tokens) for r in results))
    if k == 0:
        steps = [e for e in events if e.kind == "decode"]
        verify = sum(e.verify_time for e in steps) / len(steps) if steps else 0.0
        return SweepPoint(temperature, 0, stats, stats.tokens_per_s, 1.0, 0.0, verify, 0.0, 0, len(steps))
    spec = [e for e in events if e.kind == "spec"]
    forwards = sum(max(e.k, 1) for e in spec)  # k = 0 near the budget's end still ran one draft forward
    draft = sum(e.draft_time for e in spec) / forwards if forwards else 0.0
    verify = sum(e.verify_time for e in spec) / len(spec) if spec else 0.0
    matches = None
    if temperature == 0 and baseline is not None:
        matches = sum(r.tokens == b.tokens for r, b in zip(results, baseline))
    return SweepPoint(
        temperature, k, stats, stats.tokens_per_s, stats.tokens_per_s / base_tps if base_tps else 0.0,
        draft, verify, draft / verify if verify else 0.0, forwards, len(spec),
        per_prompt_accept_length=[r.stats.accept_length for r in results], matches_baseline=matches)


def run_sweep(pair, prompts: Sequence[str], ks: Sequence[int], temperatures: Sequence[float] = (0.0,),
              max_new_tokens: int = 64, attention: str = "auto", seed: int = 0,
              progress: Progress | None = None) -> SweepResult:
    """Measure the baseline and every k at every temperature on the same prompts.

    `progress(i, n, label)` is called before each of the n generations (i = 0..n-1) and once
    more with i = n at the end, for a progress bar.
    """
    ks, temps = _check_inputs(pair, prompts, ks, temperatures, max_new_tokens)
    prompts = list(prompts)
    n = len(temps) * len(prompts) * (len(ks) + 1)
    done = 0

    def tick(label: str) -> None:
        if progress is not None:
            progress(done, n, label)

    points: list[SweepPoint] = []
    pooled: dict[float, GenerationStats] = {}
    for t in temps:
        baseline = []
        for i, prompt in enumerate(prompts):
            tick(f"T={t} autoregressive, prompt {i + 1}/{len(prompts)}")
            baseline.append(generate_autoregressive(pair, prompt, max_new_tokens, temperature=t, seed=seed,
                                                    attention=attention))
            done += 1
        base = _point(t, 0, baseline, None, None)
        points.append(base)
        spec_events: list[StepEvent] = []
        for k in ks:
            # Unfused: the goodput model needs the draft's cost apart from the verify's (a fused step times both as one).
            dec = SpecDecoder(pair, num_speculative_tokens=k, temperature=t, seed=seed, attention=attention, fused=False)
            results = []
            for i, prompt in enumerate(prompts):
                tick(f"T={t} k={k}, prompt {i + 1}/{len(prompts)}")
                results.append(dec.generate(prompt, max_new_tokens))
                done += 1
            points.append(_point(t, k, results, base.tokens_per_s, baseline))
            spec_events += [e for r in results for e in r.events if e.kind == "spec"]
        pooled[t] = compute_stats(spec_events)
    tick("done")
    return SweepResult(ks, temps, len(prompts), max_new_tokens, seed, pair.with_attention(attention).attention, points,
                       pooled)
