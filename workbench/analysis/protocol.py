"""How the workbench times decoding on a noisy machine: warmed-up arms, interleaved per prompt.

An *arm* is one way to decode a prompt (autoregressive, or speculative with some k). `measure`
runs every arm once untimed (the first calls of a process pay for page faults, packed weights and
caches), then R repeats over the prompts; for each (repeat, prompt) *cell* it runs every arm
back to back, the order rotating with the prompt and the repeat, so no arm always runs first or
last (on any prompt) and a slow minute of the machine falls on every arm alike.

Each generation is split into its prefill (the prompt's forward and first token) and its
decode (everything after, wall clock); tokens/s is decode tokens over decode seconds. Spreads
come from the cells: a ratio's interval is a paired bootstrap over cells (both arms of a cell ran
in the same seconds), and `min`/`max` are over the repeats' pooled figures.
"""
from __future__ import annotations

import atexit
import gc
import math
import random
import time
from collections.abc import Callable, Sequence
from statistics import median
from dataclasses import dataclass, field

from workbench.decoding.events import GenerationResult

Progress = Callable[[int, int, str], None]
atexit.register(gc.unfreeze)  # what `measure` froze is collected at exit (native extensions check for leaks)
BOOTSTRAP = 1000  # resamples: the 2.5/97.5% quantiles settle to ~1% of the interval's width
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Arm:
    """One way to decode a prompt (or a group of prompts decoded together): `k` = 0 is the
    autoregressive baseline. `clock` reads a run's `Timing` (default: one generation's)."""

    name: str
    k: int
    run: Callable[[str], GenerationResult] | None  # None in a finished measurement's record
    clock: Callable[[object], "Timing"] | None = None


@dataclass
class Timing:
    """One generation's clock: its prefill apart from its decode."""

    decode_tokens: int  # tokens after the prefill's one
    decode_s: float  # wall seconds after the prefill
    prefill_s: float
    steps: int  # verifier forwards after the prefill
    verify_s: float  # their forward time (acceptance included)
    draft_s: float
    draft_forwards: int

    @classmethod
    def of(cls, result: GenerationResult) -> "Timing":
        pre = [e for e in result.events if e.kind == "prefill"]
        rest = [e for e in result.events if e.kind != "prefill"]
        prefill = sum(e.verify_time + e.draft_time for e in pre)
        return cls(decode_tokens=sum(len(e.emitted) for e in rest), decode_s=max(result.stats.elapsed - prefill, 0.0),
                   prefill_s=prefill, steps=len(rest), verify_s=sum(e.verify_time for e in rest),
                   draft_s=sum(e.draft_time for e in rest),
                   draft_forwards=sum(max(e.k, 1) for e in rest if e.kind == "spec"))

    @classmethod
    def total(cls, timings: Sequence["Timing"]) -> "Timing":
        """Every field summed over `timings` (several generations' clocks as one)."""
        return cls(*(sum(getattr(t, f) for t in timings) for f in cls.__dataclass_fields__))


@dataclass
class Interval:
    """A figure with its spread: the median over repeats, their min and max, the figure pooled over every
    cell (what decisions compare: pooled differences are differences of pooled figures), and its
    bootstrap interval over cells."""

    median: float
    lo: float  # bootstrap interval over cells
    hi: float
    min: float  # over repeats
    max: float
    pooled: float

    def to_dict(self) -> dict:
        return {"median": self.median, "lo": self.lo, "hi": self.hi, "min": self.min, "max": self.max,
                "pooled": self.pooled}

    def __str__(self) -> str:
        return f"{self.median:.3g} [{self.lo:.3g}, {self.hi:.3g}]"


@dataclass
class Measurements:
    """Every arm's timing per (repeat, prompt) cell, and its results."""

    arms: list[Arm]
    num_prompts: int
    repeats: int
    timings: dict[str, list[list[Timing]]] = field(default_factory=dict)  # arm -> [repeat][prompt]
    results: dict[str, list[list[GenerationResult]]] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)  # the arms' order in each cell
    warmup_s: dict[str, float] = field(default_factory=dict)

    @property
    def cells(self) -> list[tuple[int, int]]:
        return [(r, p) for r in range(self.repeats) for p in range(self.num_prompts)]

    def cell_timings(self, arm: str) -> list[Timing]:
        return [self.timings[arm][r][p] for r, p in self.cells]

    def decode_rate(self, arm: str, cells: Sequence[int] | None = None) -> float:
        """Decode tokens per decode second, pooled over `cells` (indices into `self.cells`; all by default)."""
        ts = self.cell_timings(arm)
        ts = ts if cells is None else [ts[i] for i in cells]
        seconds = sum(t.decode_s for t in ts)
        return sum(t.decode_tokens for t in ts) / seconds if seconds > 0 else 0.0

    def _per_repeat(self, arm: str) -> list[float]:
        n = self.num_prompts
        return [self.decode_rate(arm, range(r * n, (r + 1) * n)) for r in range(self.repeats)]

    def rate(self, arm: str) -> Interval:
        per = self._per_repeat(arm)
        lo, hi = bootstrap(len(self.cells), lambda idx: self.decode_rate(arm, idx))
        return Interval(median(per), lo, hi, min(per), max(per), self.decode_rate(arm))

    def ratio(self, arm: str, base: str) -> Interval:
        """`arm`'s decode tokens/s over `base`'s (a speedup), paired cell by cell."""
        per = [a / b if b else 0.0 for a, b in zip(self._per_repeat(arm), self._per_repeat(base))]

        def stat(idx):
            b = self.decode_rate(base, idx)
            return self.decode_rate(arm, idx) / b if b else 0.0

        lo, hi = bootstrap(len(self.cells), stat)
        return Interval(median(per), lo, hi, min(per), max(per), stat(range(len(self.cells))))

    def difference(self, a: str, b: str, base: str) -> Interval:
        """`a`'s speedup over `base` minus `b`'s, paired cell by cell (b = base: a's speedup - 1)."""
        def stat(idx):
            d = self.decode_rate(base, idx)
            return (self.decode_rate(a, idx) - self.decode_rate(b, idx)) / d if d else 0.0

        n = self.num_prompts
        per = [stat(range(r * n, (r + 1) * n)) for r in range(self.repeats)]
        lo, hi = bootstrap(len(self.cells), stat)
        return Interval(median(per), lo, hi, min(per), max(per), stat(range(len(self.cells))))

    def cells_dict(self) -> list[dict]:
        """Each cell's arm order and each arm's decode tokens/s there: the raw material of every interval."""
        out = []
        for i, (r, p) in enumerate(self.cells):
            t = {a.name: self.timings[a.name][r][p] for a in self.arms}
            out.append({"repeat": r, "prompt": p, "order": self.orders[i],
                        "decode_tokens_per_s": {n: x.decode_tokens / x.decode_s if x.decode_s else 0.0
                                                for n, x in t.items()},
                        "prefill_s": {n: x.prefill_s for n, x in t.items()}})
        return out

    def prefill_s(self, arm: str) -> float:
        """Median prefill seconds over cells."""
        return median([t.prefill_s for t in self.cell_timings(arm)])


def percentile_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The central `confidence` interval of `values` (their empirical quantiles, outward-rounded)."""
    s, tail = sorted(values), (1 - confidence) / 2
    return s[int(tail * (len(s) - 1))], s[int(math.ceil((1 - tail) * (len(s) - 1)))]


def resample(n: int, rng: random.Random) -> list[int]:
    """n cell indices drawn with replacement."""
    return [rng.randrange(n) for _ in range(n)]


def bootstrap(n: int, stat: Callable[[list[int]], float], resamples: int = BOOTSTRAP,
              confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """The percentile interval of `stat` over resamples of n cell indices; seeded, so the same
    measurements always give the same interval."""
    rng = random.Random(seed)
    return percentile_interval([stat(resample(n, rng)) for _ in range(resamples)], confidence)


def rotation(arms: Sequence[Arm], repeat: int, prompt: int) -> list[Arm]:
    """The arms' order in cell (repeat, prompt): shifted by one per prompt and per repeat, so each arm
    runs first equally often overall and, across repeats, on each prompt."""
    i = (repeat + prompt) % len(arms)
    return list(arms[i:]) + list(arms[:i])


def check_protocol(prompts: Sequence, repeats: int) -> None:
    """Prompts are non-empty strings, or groups of them (tuples: the requests of one batch)."""
    def ok(p) -> bool:
        return (isinstance(p, str) and bool(p)) or (isinstance(p, tuple) and bool(p) and all(ok(q) for q in p))

    if isinstance(prompts, str) or not prompts or not all(ok(p) for p in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty strings (an empty prompt set "
                         "measures nothing)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats = {repeats!r}; expected an integer >= 1")


def measure(arms: Sequence[Arm], prompts: Sequence, repeats: int = 1, warmup: bool = True,
            progress: Progress | None = None) -> Measurements:
    """Time every arm on every prompt, `repeats` times, interleaved and rotating (module docstring).

    `progress(i, n, label)` is called before each of the n timed generations and once more with
    i = n at the end.
    """
    check_protocol(prompts, repeats)
    arms = list(arms)
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arms: names {names}; expected each arm once")
    m = Measurements([Arm(a.name, a.k, None) for a in arms], len(prompts), repeats)  # no callables: picklable
    clocks = {a.name: a.clock or Timing.of for a in arms}
    for a in arms:
        m.timings[a.name] = [[None] * len(prompts) for _ in range(repeats)]  # type: ignore[list-item]
        m.results[a.name] = [[None] * len(prompts) for _ in range(repeats)]  # type: ignore[list-item]
        if warmup:
            t = time.perf_counter()
            a.run(prompts[0])
            m.warmup_s[a.name] = time.perf_counter() - t
    n, done = repeats * len(prompts) * len(arms), 0
    for r, p in m.cells:
        order = rotation(arms, r, p)
        m.orders.append([a.name for a in order])
        for a in order:
            if progress is not None:
                progress(done, n, f"repeat {r + 1}/{repeats}, prompt {p + 1}/{len(prompts)}: {a.name}")
            # What earlier runs left alive (their results, kept here) is not walked again by a full
            # collection during this run: one over a sweep's events stalled a run 5x (2026-12-05).
            # Frozen objects are still freed by reference counting; compiled pairs freeze the same way.
            gc.freeze()
            res = a.run(prompts[p])
            m.results[a.name][r][p], m.timings[a.name][r][p] = res, clocks[a.name](res)
            done += 1
    if progress is not None:
        progress(n, n, "done")
    return m


def cells_to_separate(diff: Interval, cells: int) -> int | None:
    """Cells (prompts x repeats) at which an interval of this width would exclude 0: the width shrinks
    as 1/sqrt(cells). None where the pooled difference is 0 (no size separates them)."""
    half = (diff.hi - diff.lo) / 2
    if diff.pooled == 0:
        return None
    return max(cells + 1, math.ceil(cells * (half / abs(diff.pooled)) ** 2))
