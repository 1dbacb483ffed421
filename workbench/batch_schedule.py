"""vLLM's Dynamic SD schedule, `num_speculative_tokens_per_batch_size` (vLLM PR #32374).

The field makes vLLM choose the number of speculative tokens k from the current batch size.
It is written in two syntaxes, both of inclusive batch-size ranges:

- list, vLLM's config type `list[tuple[int, int, int]]`: `[[1, 16, 3], [64, 128, 2], [256, 4096, 0]]`;
- map, as in PR #32374's description and some deployments: `{"1-16": 3, "64-128": 2, "256-4096": 0}`.

`read_schedule` reads either, or a JSON string of either; `BatchSchedule.to_map` / `to_list`
write them. vLLM's lookup (`build_dynamic_sd_schedule_lookup`, `vllm/v1/spec_decode/dynamic/utils.py`):
the first range must start at 1; a batch size inside a range takes its k; one in a gap between
ranges, or past the last range up to max_num_seqs, inherits the k of the range before it; every
k is clamped to `num_speculative_tokens`; k = 0 means "do not speculate".

We are stricter where vLLM is silently lenient: it `int()`s 3.7 to 3 and clamps a k above
`num_speculative_tokens`; we refuse both and name the entry. A schedule that differs from the one
meant switches k at the wrong batch size, and throughput collapses at that threshold (vLLM #49548).
"""
from __future__ import annotations

import json
import re
from bisect import bisect_right
from dataclasses import dataclass
from numbers import Integral

FIELD = "num_speculative_tokens_per_batch_size"
_KEY = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")
_FORMS = 'a map {"lo-hi": k}, a list of [lo, hi, k], or a JSON string of either'
_Entry = tuple[str, object, object, object]  # (the entry as the user wrote it, start, end, k)


class ScheduleError(ValueError):
    """A schedule, or an input to one, that vLLM would refuse or silently reinterpret."""


def _fail(source: str, what: str, expected: str) -> ScheduleError:
    return ScheduleError(f"{source}: {what}; expected {expected}")


def _is_int(x: object) -> bool:
    # Integral admits numpy integers from measurements; bool is an int to Python but never a count
    return isinstance(x, Integral) and not isinstance(x, bool)


def _int(x: object, source: str, label: str, name: str) -> int:
    if not _is_int(x):
        raise _fail(source, f"entry {label}: {name} = {x!r} ({type(x).__name__})",
                    "an integer (vLLM would int() it silently; we refuse it)")
    return int(x)


def _entries(value: object, source: str) -> list[_Entry]:
    """The entries of the map, the list, or a JSON string of either, not yet checked."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _fail(source, f"{value!r} is not valid JSON ({e.msg})", _FORMS) from None
    if isinstance(value, dict):
        entries: list[_Entry] = []
        for key, k in value.items():
            label = f"{{{key!r}: {k!r}}}"
            text = str(key) if _is_int(key) else key  # a Python {8: 2} means "8-8", as JSON's {"8": 2}
            match = _KEY.fullmatch(text) if isinstance(text, str) else None
            if match is None:
                raise _fail(source, f"entry {label}: key {key!r} is not a batch-size range",
                            'a key "lo-hi" or "n" of integers, such as "1-16" or "8"')
            entries.append((label, int(match[1]), int(match[2] or match[1]), k))
        return entries
    if isinstance(value, (list, tuple)):
        for entry in value:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise _fail(source, f"entry {entry!r} is not a 3-item list",
                            "[range_start, range_end, k] (vLLM refuses it too)")
        return [(repr(entry), *entry) for entry in value]
    raise _fail(source, f"got {type(value).__name__} {value!r}", _FORMS)


def _checked(entries: list[_Entry], n: object, source: str,
             names: tuple[str, str] = ("range_start", "range_end")) -> list[tuple[int, int, int, str]]:
    """Integer, in-bounds, non-overlapping entries as (start, end, k, label), sorted by start.

    `names` are the bounds' names in messages: best_k's entries are single batch sizes.
    """
    if not _is_int(n) or n < 1:
        raise _fail(source, f"num_speculative_tokens = {n!r}", "an integer >= 1")
    if not entries:
        raise _fail(source, "empty schedule", "at least one range, the first starting at 1")
    checked = []
    for label, *raw in entries:
        lo, hi, k = (_int(x, source, label, name) for x, name in zip(raw, (*names, "k")))
        if lo < 1:
            raise _fail(source, f"entry {label}: {names[0]} = {lo}", f"{names[0]} >= 1")
        if lo > hi:
            raise _fail(source, f"entry {label}: range_start {lo} > range_end {hi}", "range_start <= range_end")
        if k < 0:
            raise _fail(source, f"entry {label}: k = {k}", "k >= 0 (0 = do not speculate)")
        if k > n:
            raise _fail(source, f"entry {label}: k = {k} is above num_speculative_tokens = {n}",
                        f"k <= {n} (vLLM would silently clamp it to {n}; we refuse it)")
        checked.append((lo, hi, k, label))
    checked.sort()
    for (_, prev_hi, _, prev), (lo, _, _, label) in zip(checked, checked[1:]):
        if lo <= prev_hi:
            raise _fail(source, f"ranges {prev} and {label} overlap", "non-overlapping ranges (vLLM refuses it too)")
    return checked


def _ranges(entries: list[_Entry], n: object, source: str) -> tuple[tuple[int, int, int], ...]:
    checked = _checked(entries, n, source)
    lo, _, _, label = checked[0]
    if lo != 1:
        raise _fail(source, f"first range {label} starts at {lo}",
                    "the first range to start at 1, so every batch size has a k (vLLM refuses it too)")
    return tuple((lo, hi, k) for lo, hi, k, _ in checked)


@dataclass(frozen=True)
class BatchSchedule:
    """A checked schedule: sorted, non-overlapping inclusive (start, end, k) ranges, the first at 1."""

    ranges: tuple[tuple[int, int, int], ...]
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        # a hand-built instance gets the checks (and the normal form) of one read from a config
        object.__setattr__(self, "ranges", _ranges(_entries(self.ranges, "BatchSchedule.ranges"),
                                                   self.num_speculative_tokens, "BatchSchedule"))
        object.__setattr__(self, "num_speculative_tokens", int(self.num_speculative_tokens))

    def k_for(self, batch_size: int) -> int:
        """vLLM's k for one batch size: its range's k, in a gap or past the end the k before it."""
        if not _is_int(batch_size) or batch_size < 1:
            raise ScheduleError(f"batch_size = {batch_size!r}; expected an integer >= 1")
        # the last range starting at or before it rules; k <= num_speculative_tokens was checked,
        # so vLLM's clamp changes nothing here
        return self.ranges[bisect_right(self.ranges, batch_size, key=lambda r: r[0]) - 1][2]

    def dense(self, max_batch_size: int) -> list[int]:
        """vLLM's `build_dynamic_sd_schedule_lookup`: `[0, k(1), ..., k(max_batch_size)]`."""
        if not _is_int(max_batch_size) or max_batch_size < 1:
            raise ScheduleError(f"max_batch_size = {max_batch_size!r}; expected an integer >= 1")
        out = [0] * (max_batch_size + 1)  # index 0 unused, as in vLLM
        stops = [lo for lo, _, _ in self.ranges[1:]] + [max_batch_size + 1]
        for (lo, _, k), stop in zip(self.ranges, stops):
            for b in range(lo, min(stop, max_batch_size + 1)):
                out[b] = k
        return out

    def to_map(self) -> dict[str, int]:
        """The map syntax, `{"lo-hi": k}`."""
        return {f"{lo}-{hi}": k for lo, hi, k in self.ranges}

    def to_list(self) -> list[list[int]]:
        """The list syntax (vLLM's config type), `[[lo, hi, k], ...]`."""
        return [list(r) for r in self.ranges]


def read_schedule(value: object, num_speculative_tokens: int, source: str = FIELD) -> BatchSchedule:
    """Read the map, the list, or a JSON string of either; a ScheduleError names `source` and the entry."""
    return BatchSchedule(_ranges(_entries(value, source), num_speculative_tokens, source), num_speculative_tokens)


def schedule_from_best_k(best_k: dict[int, int], num_speculative_tokens: int,
                         max_batch_size: int | None = None) -> BatchSchedule:
    """The schedule playing each measured batch size's best k until the next measured size.

    The first range starts at 1 with the smallest measured size's k; neighbours with equal k
    merge; the last range ends at `max_batch_size`, else at the largest measured size.
    """
    source = "best_k"
    if not isinstance(best_k, dict):
        raise _fail(source, f"got {type(best_k).__name__} {best_k!r}", "a {batch_size: k} dict")
    points = _checked([(f"{{{b!r}: {k!r}}}", b, b, k) for b, k in best_k.items()],
                      num_speculative_tokens, source, names=("batch_size", "batch_size"))
    last = points[-1][0]
    if max_batch_size is not None and (not _is_int(max_batch_size) or max_batch_size < last):
        raise _fail(source, f"max_batch_size = {max_batch_size!r}",
                    f"an integer >= {last}, the largest measured batch size")
    ranges: list[list[int]] = []
    for i, (b, _, k, _) in enumerate(points):
        hi = points[i + 1][0] - 1 if i + 1 < len(points) else (last if max_batch_size is None else int(max_batch_size))
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = hi  # equal neighbours: one range, the same lookup, a shorter config
        else:
            ranges.append([1 if i == 0 else b, hi, k])
    return BatchSchedule(tuple(tuple(r) for r in ranges), num_speculative_tokens)
