"""Degenerate text must not count: loops in a continuation, and accept lengths with the loops set apart.

A loop is the easiest text a draft will ever see (the draft has just watched the verifier write
the same tokens), so an accept length measured on looping continuations says little about the
draft on real text. Everything here works on the generated token ids, never on decoded text, so
a count does not depend on how the text is detokenised or normalised.

The rule (`detect_loop`). Over the n generated token ids of one continuation, form its n - 5
6-grams (6 consecutive ids, each start position 0..n-6). A 6-gram *repeats* when the same six
ids occurred at an earlier start position of the same continuation. share = repeats / (n - 5);
the continuation is *degenerate* when share >= 0.3. Fewer than 6 tokens: no 6-gram, never
degenerate. (In real code only about 2% of 128-token windows reach 0.3, issue 41.)

Where the loop starts (`Degeneracy.loop_start`, only for a degenerate continuation): the
smallest start i whose 6-gram repeats and from which at least half of the 6-grams (i included)
repeat: from there on, the text is mostly a copy of itself. The token at i is the first token of
the first repetition, so a reader sees the original once and the copies from i on. When no such i
exists (the continuation repeated itself in the middle and then moved on), it is the start of the
longest run of consecutive repeated 6-grams (the first one on a tie).

Accept lengths (`accept_split`), the traps issue 41 lists:
- *pooled*: 1 + accepted / drafts over every verify step of every request (vLLM's figure);
- *clean*: pooled over the non-degenerate continuations only (None when every one loops);
- *per request*: the unweighted mean of each request's own accept length (SpecForge's figure,
  which ranks drafts differently from the pooled one), over requests with at least one draft;
- *by position*: pooled over the steps whose first emitted token falls in each decode-position
  bucket (0 = the first generated token), because acceptance rises along a continuation and a
  short run reads low.
Per-position acceptance *rates* fall as k grows by arithmetic alone (position i needs i earlier
acceptances), so nothing here ranks k by them; rank by speedup, or by accept length.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from workbench.decoding.stats import compute_stats
from workbench.decoding.events import StepEvent

NGRAM = 6  # the n of the n-grams compared
THRESHOLD = 0.3  # share of repeated 6-grams from which a continuation is a loop
LOOP_TAIL_SHARE = 0.5  # "mostly repeats" for the loop start: at least this share of the rest repeats
POSITION_EDGES = (0, 32, 64, 128)  # decode-position buckets: 0-31, 32-63, 64-127, 128+
DEAD_DRAFT = 1.2  # an accept length below this: the draft is barely ever accepted (dead or mis-wired)
MOSTLY_LOOPS = 0.5  # evidence "rests on looping text" when more than this share of continuations loop
RANDOM_CHARS_PER_TOKEN = 1.6  # a prompt tokenised finer than this looks random (see `looks_random`)
RANDOM_MIN_TOKENS = 16  # ... judged only from this many tokens on: a short prompt says too little


@dataclass(frozen=True)
class Degeneracy:
    """What `detect_loop` found in one continuation."""

    num_tokens: int
    num_ngrams: int  # max(num_tokens - 5, 0)
    repeated: int  # 6-grams that occurred at an earlier start position
    share: float  # repeated / num_ngrams (0 with no 6-gram)
    degenerate: bool  # share >= THRESHOLD
    loop_start: int | None  # token index where the loop starts (degenerate only), see the module docstring

    def to_dict(self) -> dict:
        return asdict(self)


def repeated_ngrams(tokens: Sequence[int], n: int = NGRAM) -> list[bool]:
    """For each n-gram start 0..len-n: does the same n-gram start at an earlier position?"""
    seen: set[tuple[int, ...]] = set()
    flags = []
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        flags.append(gram in seen)
        seen.add(gram)
    return flags


def loop_start(flags: Sequence[bool], tail_share: float = LOOP_TAIL_SHARE) -> int | None:
    """The first repeated start from which at least `tail_share` of the rest repeats; else the start of
    the longest run of repeats; None without any repeat."""
    repeats_from = [0] * (len(flags) + 1)  # repeats_from[i]: repeated n-grams at starts i..end
    for i in range(len(flags) - 1, -1, -1):
        repeats_from[i] = repeats_from[i + 1] + flags[i]
    for i, f in enumerate(flags):
        if f and repeats_from[i] >= tail_share * (len(flags) - i):
            return i
    best, best_len, run_start = None, 0, 0
    for i, f in enumerate(flags):
        if not f:
            continue
        run_start = i if i == 0 or not flags[i - 1] else run_start
        if i - run_start + 1 > best_len:
            best, best_len = run_start, i - run_start + 1
    return best


def detect_loop(tokens: Sequence[int], n: int = NGRAM, threshold: float = THRESHOLD) -> Degeneracy:
    """The rule of the module docstring over one continuation's generated token ids."""
    flags = repeated_ngrams(tokens, n)
    repeated = sum(flags)
    share = repeated / len(flags) if flags else 0.0
    degenerate = bool(flags) and share >= threshold
    return Degeneracy(len(tokens), len(flags), repeated, share, degenerate,
                      loop_start(flags) if degenerate else None)


def is_degenerate(tokens: Sequence[int]) -> bool:
    return detect_loop(tokens).degenerate


# ---- accept lengths with the loops set apart ----------------------------------------------------


def bucket_labels(edges: Sequence[int] = POSITION_EDGES) -> list[str]:
    """"0-31", "32-63", ..., "128+" for edges (0, 32, 64, 128)."""
    return [f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])] + [f"{edges[-1]}+"]


def _bucket(position: int, edges: Sequence[int]) -> int:
    """The index of the last edge at or below `position` (the first bucket for anything below it)."""
    return max((i for i, e in enumerate(edges) if position >= e), default=0)


def accept_length_by_position(requests: Sequence[Sequence[StepEvent]],
                              edges: Sequence[int] = POSITION_EDGES) -> dict[str, dict]:
    """Per decode-position bucket: the pooled accept length of the verify steps whose first emitted
    token falls in it, and how many steps that is (accept length None without a step).

    A request's decode position 0 is its first generated token (the prefill's), so a step's bucket
    is its event's `position` minus the request's first event's."""
    steps: list[list[StepEvent]] = [[] for _ in edges]
    for events in requests:
        if not events:
            continue
        origin = events[0].position
        for e in events:
            if e.kind == "spec" and e.k > 0:
                steps[_bucket(e.position - origin, edges)].append(e)
    return {label: {"accept_length": compute_stats(s).accept_length if s else None, "steps": len(s)}
            for label, s in zip(bucket_labels(edges), steps)}


@dataclass
class AcceptSplit:
    """Accept lengths of a set of requests, with the looping ones set apart (module docstring)."""

    pooled: float
    clean: float | None  # pooled over the non-degenerate continuations; None when all loop
    per_request: float | None  # unweighted mean over requests with a draft; None without one
    by_position: dict[str, dict]
    num_requests: int
    degenerate: list[bool] = field(default_factory=list)  # per request, in order
    loops: list[Degeneracy] = field(default_factory=list)

    @property
    def num_degenerate(self) -> int:
        return sum(self.degenerate)

    @property
    def mostly_loops(self) -> bool:
        """More than half the continuations loop: a figure from them rests on looping text."""
        return self.num_requests > 0 and self.num_degenerate > MOSTLY_LOOPS * self.num_requests

    def describe(self) -> str:
        """"accept length 3.07 (clean 2.54, 55 of 64 loop)": the raw figure never without the clean one."""
        return f"accept length {self.pooled:.2f} ({self.clean_text()})"

    def clean_text(self) -> str:
        clean = "n/a, every continuation loops" if self.clean is None else f"{self.clean:.2f}"
        return f"clean {clean}, {self.num_degenerate} of {self.num_requests} loop"

    def to_dict(self) -> dict:
        """The bench's JSON names for these figures."""
        return {"accept_length": self.pooled, "accept_length_clean": self.clean,
                "accept_length_per_request": self.per_request, "accept_length_by_position": self.by_position,
                "degenerate_prompts": self.num_degenerate, "num_requests": self.num_requests,
                "mostly_loops": self.mostly_loops}


def emitted_tokens(events: Sequence[StepEvent]) -> list[int]:
    """A request's generated token ids, read from its steps (the prefill's token first)."""
    return [t for e in events for t in e.emitted]


def accept_split(requests: Sequence[Sequence[StepEvent]], edges: Sequence[int] = POSITION_EDGES) -> AcceptSplit:
    """Pooled, clean, per-request and by-position accept lengths of requests given as their steps
    (`GenerationResult.events` each, or a chat answer's steps)."""
    loops = [detect_loop(emitted_tokens(events)) for events in requests]
    clean_events = [e for events, d in zip(requests, loops) if not d.degenerate for e in events]
    has_clean = any(not d.degenerate for d in loops)
    own = [compute_stats(list(events)) for events in requests]
    drafted = [s.accept_length for s in own if s.num_drafts]  # a request that never drafted has no accept length
    return AcceptSplit(
        pooled=compute_stats([e for events in requests for e in events]).accept_length,
        clean=compute_stats(clean_events).accept_length if has_clean else None,
        per_request=sum(drafted) / len(drafted) if drafted else None,
        by_position=accept_length_by_position(requests, edges),
        num_requests=len(requests), degenerate=[d.degenerate for d in loops], loops=loops)


# ---- hygiene ----------------------------------------------------------------------------------


def is_dead(accept_length: float | None) -> bool:
    """A draft whose accept length is below 1.2 is dead: barely ever accepted (untrained or mis-wired)."""
    return accept_length is not None and accept_length < DEAD_DRAFT


def dead_draft_note(accept_length: float | None) -> str | None:
    if not is_dead(accept_length):
        return None
    return (f"the draft is dead: accept length {accept_length:.3f} < {DEAD_DRAFT} (barely ever accepted; "
            "wrong aux layers, norm, RoPE or checkpoint, or untrained)")


def looks_random(text: str, token_ids: Sequence[int]) -> bool:
    """A prompt looks random when its tokenizer cuts it finer than 1.6 characters a token (from 16 tokens).

    A BPE tokenizer merges what it saw in training: code and prose run at 2.7 to 5.2 characters
    a token on this project's tokenizers (every prompt of assets/prompts), random bytes at 0.5 to
    1.0 and random printable characters at 1.1 to 1.2; random letters at 1.1 to 1.2 on the first
    pair's and 2.0 on the chat pair's, which passes. A draft's acceptance on such a prompt says
    nothing about serving."""
    return len(token_ids) >= RANDOM_MIN_TOKENS and len(text) / len(token_ids) < RANDOM_CHARS_PER_TOKEN


def random_prompt_warning(prompts: Sequence[str], encode) -> str | None:
    """A warning naming the prompts (by index) that look random, or None; `encode(text) -> ids`."""
    bad = [i for i, p in enumerate(prompts) if looks_random(p, encode(p))]
    if not bad:
        return None
    shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
    return (f"{len(bad)} of {len(prompts)} prompts look random (fewer than {RANDOM_CHARS_PER_TOKEN} characters a "
            f"token: prompt {shown}): acceptance on them says nothing about real traffic")
