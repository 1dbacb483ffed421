"""Accept length by context length: whether a draft holds up as the prompt grows (issue 43).

Each long document (default `assets/documents/long.jsonl`: the openings of third-party files from the
packages held out of the chat verifier's corpus, each line naming its package, version, path and
licence) is cut after L of its tokens for each L in `lengths`, and the cut is continued for
`new_tokens` tokens: speculatively (k, at each temperature) and, greedily, by plain decoding, back
to back on the same cut. The default lengths (192, 448, 960 and 1,920 prompt tokens, 64 new) put
every step of a point inside one bucket of context: under 256, 256-512, 512-1,024, 1,024-2,048.

A point reports the accept length over the clean continuations (`degeneracy`'s loop rule), pooled
and per request, with how many looped, so that a loop never inflates it; the draft's and the whole
step's milliseconds and the speedup over plain decoding at that context; and `retained`, the
longest context's clean accept length over the shortest's (issue 43's target: at least 0.9).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

from workbench.analysis.degeneracy import accept_split
from workbench.analysis.kvcache import bytes_per_token
from workbench.analysis.protocol import Timing
from workbench.decoding.engine import SpecDecoder, generate_autoregressive
from workbench.jsonl import read_records

DEFAULT_DOCUMENTS = Path(__file__).resolve().parents[2] / "assets" / "documents" / "long.jsonl"
DEFAULT_LENGTHS = (192, 448, 960, 1920)
BUCKETS = ((0, 256), (256, 512), (512, 1024), (1024, 2048))  # tokens of context a step sees


def load_documents(path: str | Path = DEFAULT_DOCUMENTS) -> list[dict]:
    """The documents of a JSONL file: each line an object with a non-empty "text" (other fields,
    such as package and licence, are kept). A bad line is an error naming the file, line and field."""
    return read_records(path, "text", '{"text": "import os\\n...", "license": "MIT"}', "documents")


def bucket_of(context: int) -> str:
    """The label of the context bucket holding `context` tokens ("0-256", ..., "1024-2048")."""
    for lo, hi in BUCKETS:
        if lo <= context < hi:
            return f"{lo}-{hi}"
    return f">={BUCKETS[-1][1]}"


@dataclass
class ContextPoint:
    prompt_tokens: int  # each request's prompt: the documents cut after this many tokens
    bucket: str  # the context every step of the point sees (prompt + up to new_tokens)
    temperature: float
    requests: int
    loops: int  # continuations the loop rule calls degenerate
    accept_length_clean: float | None  # pooled over the clean continuations (None: every one loops)
    accept_length: float  # pooled over every continuation, loops included
    accept_length_per_request: float | None  # the mean of the clean requests' own figures
    draft_ms_per_step: float  # medians over the requests: the draft's share of a step
    step_ms: float  # a whole step (verify, acceptance, drafting)
    tokens_per_s: float  # decode tokens over decode seconds, pooled
    plain_tokens_per_s: float | None = None  # plain decoding on the same cuts (greedy points only)
    speedup: float | None = None  # tokens_per_s / plain_tokens_per_s
    identical: int | None = None  # greedy requests whose tokens equal plain decoding's

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ContextReport:
    k: int
    new_tokens: int
    documents: int
    points: list[ContextPoint] = field(default_factory=list)
    kv_bytes_per_token: dict = field(default_factory=dict)  # verifier, draft: the caches' bytes per token

    def retained(self, temperature: float) -> float | None:
        """The longest context's clean accept length over the shortest's, at this temperature."""
        pts = sorted((p for p in self.points if p.temperature == temperature), key=lambda p: p.prompt_tokens)
        if len(pts) < 2 or not pts[0].accept_length_clean or pts[-1].accept_length_clean is None:
            return None
        return pts[-1].accept_length_clean / pts[0].accept_length_clean

    def to_dict(self) -> dict:
        temps = sorted({p.temperature for p in self.points})
        return {"k": self.k, "new_tokens": self.new_tokens, "documents": self.documents,
                "kv_bytes_per_token": self.kv_bytes_per_token, "points": [p.to_dict() for p in self.points],
                "retained": {str(t): self.retained(t) for t in temps}}

    def summary(self) -> str:
        kv = ", ".join(f"{k} {v:,} B" for k, v in self.kv_bytes_per_token.items())
        lines = [f"accept length by context, k = {self.k}, {self.new_tokens} new tokens, {self.documents} documents"
                 f" (KV per token: {kv})",
                 f"{'prompt':>6} {'context':>9} {'T':>4} {'clean':>6} {'all':>6} {'loops':>6} {'draft ms':>8} "
                 f"{'step ms':>7} {'tok/s':>7} {'plain':>7} {'speedup':>7} {'same':>5}"]
        for p in self.points:
            clean = "n/a" if p.accept_length_clean is None else f"{p.accept_length_clean:.3f}"
            plain = "" if p.plain_tokens_per_s is None else f"{p.plain_tokens_per_s:7.0f}"
            sp = "" if p.speedup is None else f"{p.speedup:6.2f}x"
            same = "" if p.identical is None else f"{p.identical}/{p.requests}"
            lines.append(f"{p.prompt_tokens:>6} {p.bucket:>9} {p.temperature:>4.1f} {clean:>6} {p.accept_length:>6.3f} "
                         f"{f'{p.loops}/{p.requests}':>6} {p.draft_ms_per_step:>8.3f} {p.step_ms:>7.3f} "
                         f"{p.tokens_per_s:>7.0f} {plain:>7} {sp:>7} {same:>5}")
        for t in sorted({p.temperature for p in self.points}):
            r = self.retained(t)
            lines.append(f"T = {t}: the longest context keeps "
                         f"{'n/a' if r is None else f'{r:.0%}'} of the shortest's clean accept length")
        return "\n".join(lines)


def _decode_rate(results) -> float:
    """Decode tokens over decode seconds, pooled, as the protocol clocks them."""
    t = Timing.total([Timing.of(r) for r in results])
    return t.decode_tokens / t.decode_s if t.decode_s > 0 else 0.0


def context_sweep(pair, documents: Sequence[str], lengths: Sequence[int] = DEFAULT_LENGTHS, k: int = 3,
                  temperatures: Sequence[float] = (0.0, 0.7), new_tokens: int = 64, seed: int = 0,
                  progress: Callable[[str], None] | None = None) -> ContextReport:
    """Accept length, step time and speedup with the prompt cut at each of `lengths` tokens."""
    return context_compare({"draft": pair}, documents, lengths, k, temperatures, new_tokens, seed, progress)["draft"]


def context_compare(pairs: dict, documents: Sequence[str], lengths: Sequence[int] = DEFAULT_LENGTHS, k: int = 3,
                    temperatures: Sequence[float] = (0.0, 0.7), new_tokens: int = 64, seed: int = 0,
                    progress: Callable[[str], None] | None = None) -> dict[str, ContextReport]:
    """`context_sweep` for several drafts of one verifier (`pairs`: name -> pair), side by side: each
    cut's requests run every draft back to back (a busy machine slows them alike), and plain
    decoding, once, on the first pair. A report per name."""
    first = next(iter(pairs.values()), None)
    if first is None:
        raise ValueError("context_compare: no pairs; expected at least one pair with an EAGLE-3 draft")
    for name, p in pairs.items():
        if p.draft is None:
            raise ValueError(f"context_sweep: the pair {name!r} has no draft; expected a pair with an EAGLE-3 draft")
        if p.verifier_dir != first.verifier_dir:
            raise ValueError(f"context_compare: the pair {name!r} has the verifier {p.verifier_dir}, not "
                             f"{first.verifier_dir}; expected drafts of one verifier")
    lengths = sorted({int(n) for n in lengths})
    if not lengths or lengths[0] < 2 or lengths[-1] + new_tokens > first.context_length:
        raise ValueError(f"lengths = {lengths}; expected prompt lengths from 2 with the longest + {new_tokens} new "
                         f"tokens within the pair's context of {first.context_length}")
    ids = [first.encode(text) for text in documents]
    short = [i for i, d in enumerate(ids) if len(d) < lengths[-1]]
    if short:
        raise ValueError(f"documents {short} have fewer than {lengths[-1]} tokens; expected every document to "
                         f"reach the longest length (or pass shorter --lengths)")
    reports = {name: ContextReport(k, new_tokens, len(documents)) for name in pairs}
    for L in lengths:
        cuts = [d[:L] for d in ids]
        for t in temperatures:
            spec: dict[str, list] = {name: [] for name in pairs}
            plain = []
            for n, cut in enumerate(cuts):
                for name, p in pairs.items():
                    spec[name].append(SpecDecoder(p, k, temperature=t, seed=seed + n, fused=False).generate(cut, new_tokens))
                if t == 0:
                    plain.append(generate_autoregressive(first, cut, new_tokens))
            for name in pairs:
                point = _point(L, t, spec[name], plain, new_tokens)
                reports[name].points.append(point)
                if progress:
                    label = f"{name}: " if len(pairs) > 1 else ""
                    progress(f"{label}{L} tokens, T = {t}: clean accept {point.accept_length_clean}")
    for name, p in pairs.items():
        nb = p.verifier.dtype.itemsize
        reports[name].kv_bytes_per_token = {"verifier": bytes_per_token(p.verifier.config, nb),
                                            "draft": bytes_per_token(p.draft.config, nb)}
    return reports


def _point(L: int, t: float, spec: list, plain: list, new_tokens: int) -> ContextPoint:
    """One cut length and temperature: the speculative requests' figures, against plain decoding's."""
    split = accept_split([r.events for r in spec])
    steps = [r for r in spec if r.stats.num_drafts]
    point = ContextPoint(
        prompt_tokens=L, bucket=bucket_of(L + new_tokens - 1), temperature=t, requests=len(spec),
        loops=split.num_degenerate, accept_length_clean=split.clean, accept_length=split.pooled,
        accept_length_per_request=split.per_request,
        draft_ms_per_step=median(1e3 * r.stats.draft_time / r.stats.num_drafts for r in steps) if steps else 0.0,
        step_ms=median(1e3 * (r.stats.elapsed - r.stats.prefill_time) / r.stats.num_drafts for r in steps)
        if steps else 0.0,
        tokens_per_s=_decode_rate(spec))
    if plain:
        point.plain_tokens_per_s = _decode_rate(plain)
        point.speedup = point.tokens_per_s / point.plain_tokens_per_s if point.plain_tokens_per_s else None
        point.identical = sum(s.tokens == p.tokens for s, p in zip(spec, plain))
    return point
