"""Loops in a continuation and accept lengths with the loops set apart, on constructed inputs."""
from __future__ import annotations

import pytest

from workbench.analysis.degeneracy import (accept_split, bucket_labels, dead_draft_note, detect_loop, is_dead,
                                           looks_random, random_prompt_warning)
from workbench.decoding.events import StepEvent
from workbench.tokenizer import Tokenizer
from tests.helpers import EMBEDDED

PREFIX = list(range(100, 110))  # ten distinct tokens
LOOP = PREFIX + [20, 21, 22, 23] * 10  # then a period-4 loop of 40 tokens
CLEAN = list(range(200, 300))


def test_a_known_loop_is_flagged_where_its_second_copy_starts():
    d = detect_loop(LOOP)
    # 45 6-grams; those starting at 14..44 repeat the one four tokens earlier: 31 repeats
    assert (d.num_tokens, d.num_ngrams, d.repeated) == (50, 45, 31)
    assert d.share == pytest.approx(31 / 45) and d.degenerate
    assert d.loop_start == 14 and LOOP[14:18] == LOOP[10:14]  # the reader saw the cycle once at 10


def test_a_known_clean_continuation_is_not():
    d = detect_loop(CLEAN)
    assert (d.repeated, d.share, d.degenerate, d.loop_start) == (0, 0.0, False, None)


def test_the_threshold_is_inclusive_at_three_tenths():
    at = [7, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1]  # 10 6-grams, starts 7, 8, 9 repeat: 0.3
    below = [7, 8, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0]  # starts 8, 9 repeat: 0.2
    assert detect_loop(at).share == pytest.approx(0.3) and detect_loop(at).degenerate
    assert detect_loop(below).share == pytest.approx(0.2) and not detect_loop(below).degenerate
    assert detect_loop(at).loop_start == 7


def test_short_continuations_never_loop():
    for tokens in ([], [5], [5] * 5):
        d = detect_loop(tokens)
        assert (d.num_ngrams, d.degenerate, d.loop_start) == (0, False, None)
    assert detect_loop([5] * 6).num_ngrams == 1 and not detect_loop([5] * 6).degenerate  # nothing earlier
    assert detect_loop([5] * 12).degenerate and detect_loop([5] * 12).loop_start == 1


def test_a_loop_that_ends_starts_at_its_longest_run():
    # the cycle 0..9 three more times, then 40 new tokens: 25 of 75 repeat, but never half of a tail
    tokens = list(range(10)) * 4 + list(range(100, 140))
    d = detect_loop(tokens)
    assert d.repeated == 25 and d.degenerate and d.loop_start == 10


def test_the_loop_start_is_where_the_repetition_takes_over_not_the_first_repeat():
    # one early repeated 6-gram (start 8), clean text, then a loop: the start is the loop's, not 8
    tokens = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5] + list(range(300, 330)) + [9, 8] * 20
    d = detect_loop(tokens)
    assert d.degenerate and tokens[d.loop_start:d.loop_start + 6] == [9, 8] * 3
    assert d.loop_start == 14 + 30 + 2  # the second copy of (9, 8)


# ---- accept lengths ---------------------------------------------------------------------------------


def request(tokens: list[int], accepted: list[int], k: int = 3, origin: int = 7) -> list[StepEvent]:
    """A prefill and spec steps that accept `accepted[i]` of k and emit them plus one token, over `tokens`."""
    events = [StepEvent(0, "prefill", emitted=tokens[:1], position=origin)]
    at = 1
    for i, a in enumerate(accepted):
        emitted = tokens[at:at + a + 1]
        events.append(StepEvent(i + 1, "spec", proposed=[0] * k, num_accepted=a, emitted=emitted,
                                position=origin + at))
        at += len(emitted)
    assert at == len(tokens), "the steps must cover the tokens"
    return events


def test_a_batch_of_a_loop_and_a_clean_continuation():
    # the loop: 50 tokens = 1 + 7 steps accepting 3 (28) + 7 steps accepting 2 (21); the clean one:
    # 100 tokens = 1 + 33 steps accepting 2 (99)
    loop = request(LOOP, [3] * 7 + [2] * 7)
    clean = request(CLEAN, [2] * 33, origin=0)
    s = accept_split([loop, clean])
    assert s.degenerate == [True, False] and s.num_degenerate == 1 and s.num_requests == 2
    assert s.pooled == pytest.approx(1 + (7 * 3 + 7 * 2 + 33 * 2) / (14 + 33))
    assert s.clean == pytest.approx(3.0)
    assert s.per_request == pytest.approx(((1 + 35 / 14) + 3.0) / 2)  # unweighted: each request once
    assert s.pooled != pytest.approx(s.per_request)
    assert not s.mostly_loops and s.loops[0].loop_start == 14
    assert s.describe() == f"accept length {s.pooled:.2f} (clean 3.00, 1 of 2 loop)"
    assert s.to_dict()["degenerate_prompts"] == 1 and s.to_dict()["accept_length_clean"] == s.clean


def test_accept_length_by_decode_position():
    # steps of the loop: the first emitted token of step i sits at decode position 1, 5, 9, ... (4 a step
    # while accepting 3), then 29, 32, 35, ... (3 a step); the origin is the request's prefill position
    s = accept_split([request(LOOP, [3] * 7 + [2] * 7, origin=40)])
    starts = [1 + 4 * i for i in range(7)] + [29 + 3 * i for i in range(7)]
    expect = {"0-31": [a for p, a in zip(starts, [3] * 7 + [2] * 7) if p < 32],
              "32-63": [a for p, a in zip(starts, [3] * 7 + [2] * 7) if 32 <= p < 64]}
    assert list(s.by_position) == bucket_labels() == ["0-31", "32-63", "64-127", "128+"]
    for label, acc in expect.items():
        assert s.by_position[label] == {"accept_length": pytest.approx(1 + sum(acc) / len(acc)), "steps": len(acc)}
    assert s.by_position["64-127"] == {"accept_length": None, "steps": 0}


def test_every_continuation_looping_has_no_clean_figure():
    s = accept_split([request(LOOP, [3] * 7 + [2] * 7), request(LOOP, [3] * 7 + [2] * 7)])
    assert s.clean is None and s.mostly_loops and "n/a, every continuation loops" in s.describe()
    s = accept_split([])
    assert (s.pooled, s.clean, s.per_request, s.num_degenerate) == (1.0, None, None, 0)


def test_a_request_that_never_drafted_has_no_per_request_figure():
    only_prefill = [StepEvent(0, "prefill", emitted=[1], position=3)]
    s = accept_split([only_prefill, request(CLEAN, [2] * 33)])
    assert s.per_request == pytest.approx(3.0) and s.pooled == pytest.approx(3.0)


# ---- hygiene ----------------------------------------------------------------------------------------


def test_dead_draft():
    assert is_dead(1.19) and not is_dead(1.2) and not is_dead(None)
    assert "dead" in dead_draft_note(1.05) and dead_draft_note(2.0) is None


def test_random_prompts_are_told_from_code():
    import random
    import string

    tok = Tokenizer.from_dir(EMBEDDED / "verifier")
    rng = random.Random(0)
    code = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
    noise = bytes(rng.randrange(256) for _ in range(200)).decode("latin-1")
    letters = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(200))
    assert not looks_random(code, tok.encode(code))
    assert looks_random(noise, tok.encode(noise)) and looks_random(letters, tok.encode(letters))
    assert not looks_random("x=1", tok.encode("x=1"))  # too short to judge
    warning = random_prompt_warning([code, noise], tok.encode)
    assert warning.startswith("1 of 2 prompts look random") and "prompt 1" in warning
    assert random_prompt_warning([code], tok.encode) is None
