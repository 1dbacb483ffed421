"""What a speculative step costs on this machine, from the terms measured in the same run.

In units of one autoregressive decode (`t_decode`: the baseline's decode wall seconds per token),
a step with k proposals costs

    step_cost(k) = t_verify(k+1 tokens) / t_decode + k * c_draft + overhead(k)

where t_verify is the verifier's forward over k+1 tokens (acceptance included), c_draft one draft
forward, and overhead the step's host work (emitting tokens, events). The verify term is fitted
as a line in the tokens it verifies and the overhead as a line in k, so the model extrapolates
past the measured ks. With E(k) the tokens a step emits (from the pooled conditional rates),

    speedup(k) = E(k) / step_cost(k).

Error bars are a bootstrap over the measurement's cells: the whole fit is redone on each
resample.
"""
from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from workbench.analysis.protocol import BOOTSTRAP, Measurements, Timing, percentile_interval, resample
from workbench.decoding.events import StepEvent
from workbench.decoding.stats import compute_stats, expected_accept_length

MODEL_RESAMPLES = BOOTSTRAP // 4  # each resample refits the model: fewer, still a stable 95% interval


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


@dataclass
class StepCosts:
    """What a step with k proposals costs at batch size B, in plain decodes at that batch size
    (t_step(B, k) / t_decode(B)), from measured points {(B, k): cost}. Between measured batch sizes
    the cost is interpolated in log2(B) and held beyond them; past the largest measured k it grows
    by the last measured step in k (a line, as `costmodel` fits one)."""

    points: Mapping[tuple[int, int], float]
    source: str = "measured"
    _by_b: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        by_b: dict[int, dict[int, float]] = {}
        for (b, k), c in self.points.items():
            if not (isinstance(b, int) and b >= 1 and isinstance(k, int) and k >= 0 and c > 0 and math.isfinite(c)):
                raise ValueError(f"StepCosts: point ({b!r}, {k!r}) -> {c!r}; expected batch size >= 1, k >= 0 "
                                 "and a finite cost > 0")
            by_b.setdefault(b, {})[k] = float(c)
        if not by_b:
            raise ValueError("StepCosts: no points; expected measured {(batch_size, k): cost}")
        self._by_b = dict(sorted(by_b.items()))

    def _at(self, b: int, k: int) -> float:
        ks = {0: 1.0, **self._by_b[b]}  # a step with nothing proposed is a plain decode
        known = sorted(ks)
        if k in ks:
            return ks[k]
        lo = max((x for x in known if x < k), default=known[0])
        hi = min((x for x in known if x > k), default=None)
        if hi is None:  # past the largest measured k: the last measured step in k, continued
            lo, hi = (known[-2], known[-1]) if len(known) > 1 else (known[-1], known[-1])
            if lo == hi:
                return ks[hi]
        return ks[lo] + (ks[hi] - ks[lo]) * (k - lo) / (hi - lo)

    @classmethod
    def lines(cls, points: Mapping[tuple[int, int], float], source: str = "measured, a line in k per B") -> "StepCosts":
        """The measured costs smoothed to a least-squares line in k at each batch size (a step costs
        a verify that grows with k + 1 tokens and k draft forwards: `costmodel` fits the same), so the
        noise of one short measurement does not make k + 1 look cheaper than k."""
        by_b: dict[int, list[tuple[int, float]]] = {}
        for (b, k), c in points.items():
            if k > 0:
                by_b.setdefault(b, []).append((k, c))
        fitted = {}
        for b, pts in by_b.items():
            line = Line.fit([k for k, _ in pts], [c for _, c in pts])
            fitted.update({(b, k): line(k) for k, _ in pts})
        return cls(fitted, source)

    def __call__(self, batch_size: int, k: int) -> float:
        bs = list(self._by_b)
        if batch_size <= bs[0] or batch_size >= bs[-1]:
            return self._at(bs[0] if batch_size <= bs[0] else bs[-1], k)
        hi = next(b for b in bs if b >= batch_size)
        lo = max(b for b in bs if b <= batch_size)
        if lo == hi:
            return self._at(lo, k)
        w = (math.log2(batch_size) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return (1 - w) * self._at(lo, k) + w * self._at(hi, k)


@dataclass
class CostModel:
    t_decode: float  # seconds per autoregressive decode token
    verify: Line  # t_verify / t_decode against the tokens verified (k + 1)
    c_draft: float  # one draft forward / t_decode
    overhead: Line  # host work per step / t_decode against k
    rates: list[float]  # pooled conditional acceptance rates per position
    measured_ks: list[int]

    def step_cost(self, k: int) -> float:
        return self.verify(k + 1) + k * self.c_draft + self.overhead(k)

    def accept_length(self, k: int) -> float:
        return expected_accept_length(self.rates, k) if self.rates else 1.0

    def speedup(self, k: int) -> float:
        return self.accept_length(k) / self.step_cost(k) if k else 1.0

    def to_dict(self) -> dict:
        return {"t_decode_s": self.t_decode, "verify_decodes": {"a": self.verify.a, "per_token": self.verify.b},
                "c_draft": self.c_draft, "overhead_decodes": {"a": self.overhead.a, "per_k": self.overhead.b},
                "conditional_rates": self.rates, "measured_ks": self.measured_ks}


def fit_cost_model(m: Measurements, base: str, spec: dict[int, str], cells: Sequence[int] | None = None) -> CostModel:
    """The model from the baseline arm `base` and the speculative arms `spec` ({k: arm name}),
    over `cells` (indices into `m.cells`; all by default)."""
    idx = list(range(len(m.cells))) if cells is None else list(cells)

    def timings(arm: str) -> list[Timing]:
        ts = m.cell_timings(arm)
        return [ts[i] for i in idx]

    b = Timing.total(timings(base))
    t_dec = b.decode_s / b.decode_tokens if b.decode_tokens else 0.0
    if t_dec <= 0:
        raise ValueError("the baseline decoded no token after its prefill; expected max_new_tokens >= 2")
    ks, verify, over, draft_s, forwards = [], [], [], 0.0, 0
    events: list[StepEvent] = []
    for k, arm in sorted(spec.items()):
        s = Timing.total(timings(arm))
        if not s.steps:
            continue
        ks.append(k)
        verify.append(s.verify_s / s.steps / t_dec)
        over.append((s.decode_s - s.verify_s - s.draft_s) / s.steps / t_dec)
        draft_s, forwards = draft_s + s.draft_s, forwards + s.draft_forwards
        events += [e for r, p in (m.cells[i] for i in idx) for e in m.results[arm][r][p].events]
    if not ks:
        raise ValueError("no speculative step was measured; expected max_new_tokens >= 2")
    rates = compute_stats(events).conditional_acceptance  # pooled over every k: each position's own denominator
    return CostModel(t_dec, Line.fit([k + 1 for k in ks], verify), draft_s / forwards / t_dec if forwards else 0.0,
                     Line.fit(ks, over), rates, ks)


@dataclass
class ModelCurve:
    """The model's speedup for k = 0..k_max, with a bootstrap interval per k."""

    model: CostModel
    ks: list[int]
    speedup: dict[int, float]
    lo: dict[int, float]
    hi: dict[int, float]
    best: int
    runner_up: int
    margin: tuple[float, float, float]  # best minus runner-up: on every cell, and its interval over resamples

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "speedup": self.speedup, "lo": self.lo, "hi": self.hi,
                "best_k": self.best, "runner_up_k": self.runner_up,
                "margin": dict(zip(("point", "lo", "hi"), self.margin))}


def model_curve(m: Measurements, base: str, spec: dict[int, str], k_max: int,
                resamples: int = MODEL_RESAMPLES) -> ModelCurve:
    """Fit on every cell, then on `resamples` bootstrap resamples of the cells for the error bars."""
    model = fit_cost_model(m, base, spec)
    ks = list(range(0, k_max + 1))
    point = {k: model.speedup(k) for k in ks}
    order = sorted(ks, key=lambda k: (-point[k], k))
    best, runner = order[0], order[1]
    rng, n = random.Random(1), len(m.cells)
    curves, margins = {k: [] for k in ks}, []
    for _ in range(resamples):
        fit = fit_cost_model(m, base, spec, resample(n, rng))
        for k in ks:
            curves[k].append(fit.speedup(k))
        margins.append(fit.speedup(best) - fit.speedup(runner))
    bands = {k: percentile_interval(curves[k]) for k in ks}
    margin = (point[best] - point[runner], *percentile_interval(margins))
    return ModelCurve(model, ks, point, {k: bands[k][0] for k in ks}, {k: bands[k][1] for k in ks}, best, runner,
                      margin)
