"""vLLM's Dynamic SD schedule (`num_speculative_tokens_per_batch_size`): reading, lookup, writing."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.batch_schedule import (
    BatchSchedule,
    ScheduleError,
    read_schedule,
    schedule_from_best_k,
)

ASCEND = [(1, 16, 3), (32, 128, 2), (256, 256, 0)]  # vllm-ascend's regression schedule


def vllm_lookup(schedule: list[tuple[int, int, int]], max_batch_size: int, n: int) -> list[int]:
    """Oracle: vLLM's `build_dynamic_sd_schedule_lookup`, rewritten from its rules (gap, range, tail, clamp)."""
    dense = [0] * (max_batch_size + 1)
    next_b, last_k = 1, None
    for start, end, k in sorted(schedule):
        if start > next_b and last_k is not None:
            for b in range(next_b, min(start, max_batch_size + 1)):
                dense[b] = min(n, last_k)
        for b in range(max(start, next_b), min(end, max_batch_size) + 1):
            dense[b] = min(n, k)
        next_b, last_k = max(next_b, end + 1), k
        if next_b > max_batch_size:
            break
    for b in range(next_b, max_batch_size + 1):
        dense[b] = min(n, last_k)
    return dense


def test_vllm_ascend_expectations():
    s = read_schedule(ASCEND, 3)
    dense = s.dense(256)
    assert len(dense) == 257
    expected = {0: 0, 1: 3, 16: 3, 17: 3, 31: 3, 32: 2, 128: 2, 129: 2, 255: 2, 256: 0}
    assert {b: dense[b] for b in expected} == expected
    assert all(s.k_for(b) == k for b, k in expected.items() if b)
    assert dense == vllm_lookup(ASCEND, 256, 3)


def test_both_syntaxes_and_json_read_the_same():
    as_list = read_schedule([[1, 16, 3], [64, 128, 2], [256, 4096, 0]], 3)
    as_map = read_schedule({"1-16": 3, "64-128": 2, "256-4096": 0}, 3)
    assert as_list == as_map == read_schedule('{"256-4096": 0, "1-16": 3, "64-128": 2}', 3)
    assert as_map == read_schedule(json.dumps(as_list.to_list()), 3)
    assert as_map.to_map() == {"1-16": 3, "64-128": 2, "256-4096": 0}
    assert as_map.to_list() == [[1, 16, 3], [64, 128, 2], [256, 4096, 0]]
    assert read_schedule({"1-7": 2, "8": 1, 9: 0}, 2).ranges == ((1, 7, 2), (8, 8, 1), (9, 9, 0))
    assert as_map.k_for(10_000) == 0  # tail inherits the last k


def test_hand_built_schedule_is_checked_and_normalised():
    s = BatchSchedule(((32, 64, 1), (1, 31, 2)), 2)
    assert s.ranges == ((1, 31, 2), (32, 64, 1))
    with pytest.raises(ScheduleError, match=r"BatchSchedule: entry \(1, 4, 9\): k = 9 is above"):
        BatchSchedule(((1, 4, 9),), 3)


@st.composite
def schedules(draw):
    n = draw(st.integers(1, 8))
    ranges, start = [], 1
    for _ in range(draw(st.integers(1, 6))):
        end = start + draw(st.integers(0, 40))
        ranges.append((start, end, draw(st.integers(0, n))))
        start = end + 1 + draw(st.integers(0, 30))  # random gap, possibly none
    return ranges, n


@settings(max_examples=200, deadline=None)
@given(schedules(), st.integers(1, 400), st.randoms(use_true_random=False))
def test_lookup_matches_vllm_and_forms_round_trip(schedule_n, max_batch_size, rnd):
    ranges, n = schedule_n
    shuffled = ranges[:]
    rnd.shuffle(shuffled)  # vLLM sorts by start; so do we
    s = read_schedule(shuffled, n)
    dense = s.dense(max_batch_size)
    assert dense == vllm_lookup(ranges, max_batch_size, n)
    assert all(s.k_for(b) == dense[b] for b in range(1, max_batch_size + 1))
    assert read_schedule(s.to_map(), n) == s
    assert read_schedule(s.to_list(), n) == s
    assert read_schedule(json.dumps(s.to_map()), n) == s
    assert read_schedule(json.dumps(s.to_list()), n) == s


SRC = "num_speculative_tokens_per_batch_size"


@pytest.mark.parametrize("value, n, needles", [
    # not integers: vLLM would int() these; we refuse them
    ([[1, 16, 3.0]], 3, ["[1, 16, 3.0]", "k = 3.0 (float)", "we refuse it"]),
    ([[1, 16.5, 3]], 3, ["[1, 16.5, 3]", "range_end = 16.5"]),
    ([[1, 16, True]], 3, ["[1, 16, True]", "k = True (bool)"]),
    ([[1, "16", 3]], 3, ["[1, '16', 3]", "range_end = '16' (str)"]),
    ({"1-16": 3.7}, 3, ["{'1-16': 3.7}", "k = 3.7 (float)", "int() it"]),
    ({"1-16": "3"}, 3, ["{'1-16': '3'}", "k = '3' (str)"]),
    ({"1-16.5": 3}, 3, ["{'1-16.5': 3}", "key '1-16.5' is not a batch-size range", '"lo-hi"']),
    ({"a-b": 3}, 3, ["{'a-b': 3}", "key 'a-b'"]),
    ({"-1-4": 3}, 3, ["{'-1-4': 3}", "key '-1-4'"]),
    ({True: 3}, 3, ["{True: 3}", "key True"]),
    ('{"1-16": 3.0}', 3, ["{'1-16': 3.0}", "k = 3.0 (float)"]),
    # out of bounds
    ({"16-1": 3}, 3, ["{'16-1': 3}", "range_start 16 > range_end 1", "range_start <= range_end"]),
    ([[0, 4, 3]], 3, ["[0, 4, 3]", "range_start = 0", "range_start >= 1"]),
    ({"0-4": 3}, 3, ["{'0-4': 3}", "range_start = 0"]),
    ([[1, 4, -1]], 3, ["[1, 4, -1]", "k = -1", "k >= 0"]),
    ({"1-16": 4}, 3, ["{'1-16': 4}", "k = 4 is above num_speculative_tokens = 3", "k <= 3",
                      "silently clamp it to 3"]),
    # shape of the schedule
    ({"1-16": 3, "8-32": 2}, 3, ["ranges {'1-16': 3} and {'8-32': 2} overlap", "non-overlapping"]),
    ([[8, 32, 2], [1, 8, 3]], 3, ["ranges [1, 8, 3] and [8, 32, 2] overlap"]),
    ({"2-16": 3, "32-64": 1}, 3, ["first range {'2-16': 3} starts at 2", "start at 1"]),
    ({}, 3, ["empty schedule"]),
    ([], 3, ["empty schedule"]),
    ("[]", 3, ["empty schedule"]),
    # containers
    (5, 3, ["got int 5", '{"lo-hi": k}', "[lo, hi, k]", "JSON string"]),
    (None, 3, ["got NoneType None"]),
    ("{1-16: 3}", 3, ["'{1-16: 3}' is not valid JSON"]),
    ('"1-16"', 3, ["got str '1-16'"]),
    ([[1, 16]], 3, ["entry [1, 16] is not a 3-item list", "[range_start, range_end, k]"]),
    ([[1, 16, 3, 0]], 3, ["entry [1, 16, 3, 0]"]),
    ([5], 3, ["entry 5 is not a 3-item list"]),
    # num_speculative_tokens itself
    ({"1-16": 0}, 0, ["num_speculative_tokens = 0", "an integer >= 1"]),
    ({"1-16": 0}, 3.0, ["num_speculative_tokens = 3.0"]),
    ({"1-16": 0}, True, ["num_speculative_tokens = True"]),
])
def test_read_errors_name_source_and_entry(value, n, needles):
    with pytest.raises(ScheduleError) as info:
        read_schedule(value, n)
    message = str(info.value)
    assert message.startswith(SRC + ": ") and "; expected " in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_source_names_where_the_schedule_came_from():
    with pytest.raises(ScheduleError, match=r"^serve\.yaml: entry \{'1-16': 9\}"):
        read_schedule({"1-16": 9}, 3, source="serve.yaml")


def test_lookup_arguments_are_checked():
    s = read_schedule(ASCEND, 3)
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ScheduleError, match="batch_size"):
            s.k_for(bad)
        with pytest.raises(ScheduleError, match="max_batch_size"):
            s.dense(bad)
    assert s.dense(1) == [0, 3]


def test_schedule_from_best_k():
    best = {1: 3, 2: 3, 4: 2, 8: 2, 16: 0}
    s = schedule_from_best_k(best, 3)
    assert s.to_map() == {"1-3": 3, "4-15": 2, "16-16": 0}
    assert all(s.k_for(b) == k for b, k in best.items())
    assert schedule_from_best_k(best, 3, max_batch_size=256).to_map() == {"1-3": 3, "4-15": 2, "16-256": 0}
    assert s.dense(256) == schedule_from_best_k(best, 3, 256).dense(256)  # vLLM's tail inherits it anyway

    s = schedule_from_best_k({8: 1, 4: 2}, 2)
    assert s.to_map() == {"1-7": 2, "8-8": 1}
    assert [s.k_for(b) for b in (1, 4, 7, 8, 100)] == [2, 2, 2, 1, 1]
    assert schedule_from_best_k({32: 0}, 4).to_map() == {"1-32": 0}


@pytest.mark.parametrize("best, n, max_bs, needles", [
    ({1: 3, 16: 4}, 3, None, ["best_k: entry {16: 4}: k = 4 is above num_speculative_tokens = 3"]),
    ({1: 3, 16: -1}, 3, None, ["entry {16: -1}: k = -1"]),
    ({1: 3, 16: 1.0}, 3, None, ["entry {16: 1.0}", "(float)"]),
    ({0: 3}, 3, None, ["entry {0: 3}: batch_size = 0", "batch_size >= 1"]),
    ({1: 3, 4.0: 2}, 3, None, ["entry {4.0: 2}: batch_size = 4.0 (float)"]),
    ({}, 3, None, ["best_k: empty"]),
    ([(1, 3)], 3, None, ["best_k: got list"]),
    ({1: 1}, 0, None, ["num_speculative_tokens = 0"]),
    ({1: 3, 16: 0}, 3, 8, ["max_batch_size = 8", ">= 16, the largest measured batch size"]),
    ({1: 3, 16: 0}, 3, 16.0, ["max_batch_size = 16.0"]),
])
def test_schedule_from_best_k_errors(best, n, max_bs, needles):
    with pytest.raises(ScheduleError) as info:
        schedule_from_best_k(best, n, max_bs)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
