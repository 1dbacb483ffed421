"""Probe a draft/verifier pairing for the silent misconfigurations whose only symptom is low acceptance.

Field reports (peers.md §6.5): aux layer ids off by one (vLLM captures the residual *entering*
layer k; some trainers save "output of layer k"), RoPE pairing (DeepSeek/Kimi interleave
the rope dims, Llama-style code rotates halves), feeding back the pre-norm vs the post-norm
state (EAGLE-3 vs EAGLE-3.1 `norm_output`), a draft shipping its own embedding vs using the
verifier's, and a draft whose max_position_embeddings is below the verifier's (NeMo RL PR
#3960: acceptance collapses past that position).

`diagnose` runs static checks on configs and weights, then measures the greedy accept length
of the configured pairing and of each alternative; an alternative that beats the configured
one by a clear margin is flagged, as is a configured accept length below 1.2. Every probe
changes the pair in place and restores it in a `finally`, so hold the app's generation lock.

"Clear" means above a fixed margin and above the sampling noise of a few prompts: greedy runs
are deterministic, but a handful of steps says little about other text (on the trained tiny
pair, 2 prompts x 16 tokens once put a wrong RoPE pairing 0.24 ahead; 8 x 32 put it behind).
The noise is the standard error of the difference of the two mean accepted counts per step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field

import torch

from workbench.analysis.metrics import compute_stats
from workbench.decoding.engine import SpecDecoder
from workbench.models.rope import RotaryEmbedding

MARGIN_ABS = 0.05  # an alternative must beat the configured accept length by more than this ...
MARGIN_REL = 0.02  # ... and by more than this fraction of it, to be flagged (run-to-run noise is 0 at T=0,
# but a few prompts make small differences meaningless)
MIN_ACCEPT = 1.2  # below this the draft is barely ever accepted: likely misconfigured, not just weak
NOISE_Z = 2.0  # ... and by more than this many standard errors of the difference


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail" | "info"
    detail: str


@dataclass
class Probe:
    name: str
    description: str
    accept_length: float | None = None  # None when skipped
    steps: int = 0  # speculative steps measured
    stderr: float | None = None  # standard error of accept_length; None below 2 steps (unknown)
    skipped: str | None = None  # why the probe could not run
    delta: float | None = None  # accept_length - configured
    flagged: bool = False


@dataclass
class DoctorReport:
    k: int
    max_new_tokens: int
    num_prompts: int
    checks: list[Check]
    configured: Probe
    probes: list[Probe]
    flags: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.flags and all(c.status != "fail" for c in self.checks)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def summary(self) -> str:
        lines = [f"doctor: {'OK' if self.ok else 'PROBLEMS FOUND'} (k={self.k}, {self.num_prompts} prompts, "
                 f"max_new_tokens {self.max_new_tokens})", "static checks:"]
        lines += [f"  [{c.status:>4}] {c.name}: {c.detail}" for c in self.checks]
        conf = self.configured.accept_length
        lines.append(f"acceptance probes (greedy accept length; configured = "
                     f"{'n/a' if conf is None else f'{conf:.3f}'}):")
        for p in self.probes:
            if p.skipped:
                lines.append(f"  [skip] {p.name}: {p.skipped}")
            else:
                mark = "FLAG" if p.flagged else "  ok"
                err = "?" if p.stderr is None else f"{p.stderr:.3f}"
                lines.append(f"  [{mark}] {p.name}: {p.accept_length:.3f} ± {err} ({p.delta:+.3f}) - {p.description}")
        lines += [f"! {f}" for f in self.flags]
        return "\n".join(lines)


# ---- static checks --------------------------------------------------------------------------


def static_checks(pair) -> list[Check]:
    """Everything configs and weight shapes can tell, without running the models."""
    v, d = pair.verifier, pair.draft
    vc = v.config
    if d is None:
        return [Check("draft", "fail", "the pair has no draft")]
    dc = d.config
    where = getattr(d, "source", "draft")
    out = [Check("draft", "info", f"{where}: {dc.architecture} ({dc.attention}) for a {vc.num_hidden_layers}-layer "
                                  f"verifier ({getattr(v, 'source', 'verifier')})")]

    def check(name: str, good: bool, ok: str, bad: str, severity: str = "fail") -> None:
        out.append(Check(name, "ok" if good else severity, ok if good else bad))

    check("hidden sizes", dc.target_hidden_size == vc.hidden_size and dc.hidden_size == vc.hidden_size,
          f"draft hidden {dc.hidden_size}, target_hidden_size {dc.target_hidden_size} = verifier hidden {vc.hidden_size}",
          f"draft hidden_size {dc.hidden_size} / target_hidden_size {dc.target_hidden_size}; expected the "
          f"verifier's hidden_size {vc.hidden_size}")
    ids = list(dc.aux_layer_ids)
    if hasattr(d, "fc"):
        want = len(ids) * vc.hidden_size
        check("fc input width", d.fc.in_features == want, f"fc takes {d.fc.in_features} = {len(ids)} x {vc.hidden_size}",
              f"fc takes {d.fc.in_features} inputs; expected {len(ids)} aux states x hidden {vc.hidden_size} = {want}")
    else:
        out.append(Check("fc input width", "warn", "the draft has no fc (use_aux_hidden_state = false): it does not "
                                                   "fuse verifier states, so it is not an EAGLE-3 draft"))
    n = vc.num_hidden_layers
    check("aux layer ids in range", all(0 <= i < n for i in ids), f"{ids} within [0, {n - 1}]",
          f"{ids}: expected ids in [0, {n - 1}] for a {n}-layer verifier")
    check("aux layer ids ascending", all(a < b for a, b in zip(ids, ids[1:])), f"{ids} strictly ascending",
          f"{ids}: the verifier returns aux states in ascending layer order, so fc's blocks would be read in "
          "another order than the draft was trained on (or a layer is repeated)")
    check("aux layers captured", tuple(v.aux_layer_ids) == tuple(sorted(ids)),
          f"the verifier captures {list(v.aux_layer_ids)}",
          f"the verifier captures {list(v.aux_layer_ids)}, the draft config says {ids}")
    out.append(Check("aux convention", "info", f"{ids}: id k = residual entering layer k (vLLM); vLLM's default "
                                               f"for this verifier is {list(vc.default_aux_layer_ids)}"))
    check("vocab", dc.vocab_size == vc.vocab_size and dc.draft_vocab_size <= dc.vocab_size,
          f"vocab {dc.vocab_size}, draft vocab {dc.draft_vocab_size}",
          f"draft vocab_size {dc.vocab_size} / draft_vocab_size {dc.draft_vocab_size}; expected vocab_size = the "
          f"verifier's {vc.vocab_size} and draft_vocab_size <= it")
    out += _d2t_check(d)
    out.append(_tokenizer_check(pair))
    check("max_position_embeddings", dc.max_position_embeddings >= vc.max_position_embeddings,
          f"draft {dc.max_position_embeddings} >= verifier {vc.max_position_embeddings}",
          f"draft {dc.max_position_embeddings} < verifier {vc.max_position_embeddings}: acceptance collapses past "
          f"position {dc.max_position_embeddings} (NeMo RL PR #3960); expected the verifier's length", "warn")
    check("rope pairing", dc.rope_interleave == vc.rope_interleave or dc.attention != "mla",
          f"draft interleave {dc.rope_interleave} = verifier {vc.rope_interleave}",
          f"draft rope_interleave {dc.rope_interleave} differs from the verifier's {vc.rope_interleave}", "warn")
    embed = "its own embed_tokens" if "embed_tokens" in d._modules else "the verifier's embedding"
    head = "its own lm_head" if "lm_head" in d._modules else "the verifier's lm_head"
    out.append(Check("norm and sharing flags", "info",
                     f"norm_before_residual {dc.norm_before_residual}, norm_output {d.norm_output}; uses {embed} "
                     f"and {head}"))
    return out


def _d2t_check(d) -> list[Check]:
    if not hasattr(d, "d2t"):
        return []
    dc = d.config
    target = torch.arange(dc.draft_vocab_size, device=d.d2t.device) + d.d2t
    in_range = bool(((target >= 0) & (target < dc.vocab_size)).all())
    unique = target.unique().numel() == target.numel()
    good = in_range and unique
    return [Check("d2t", "ok" if good else "fail",
                  f"{dc.draft_vocab_size} draft ids map to distinct verifier ids" if good else
                  f"draft id + d2t must be distinct ids in [0, {dc.vocab_size}); in range: {in_range}, "
                  f"distinct: {unique}")]


def _tokenizer_check(pair) -> Check:
    tok = getattr(pair, "tokenizer", None)
    rows = pair.verifier.model.embed_tokens.num_embeddings
    if tok is None:
        return Check("tokenizer", "fail", f"{pair.verifier_dir}: no tokenizer; expected tokenizer.json or tiktoken.model")
    n = tok.vocab_size
    if n > rows:
        return Check("tokenizer", "fail", f"tokenizer has {n} tokens but the embedding has {rows} rows: ids >= {rows} "
                                          "would index past it")
    return Check("tokenizer", "ok", f"{n} tokens <= {rows} embedding rows"
                 + ("" if n == rows else f" ({rows - n} padding rows)"))


# ---- acceptance probes ----------------------------------------------------------------------


@contextmanager
def aux_ids(verifier, ids: Sequence[int]) -> Iterator[None]:
    old = verifier.aux_layer_ids
    verifier.aux_layer_ids = tuple(ids)
    try:
        yield
    finally:
        verifier.aux_layer_ids = old


@contextmanager
def rope_flipped(draft) -> Iterator[None]:
    ropes = [m for m in draft.modules() if isinstance(m, RotaryEmbedding)]
    for m in ropes:
        m.interleave = not m.interleave
    try:
        yield
    finally:
        for m in ropes:
            m.interleave = not m.interleave


@contextmanager
def norm_output_flipped(draft) -> Iterator[None]:
    draft.norm_output = not draft.norm_output
    try:
        yield
    finally:
        draft.norm_output = not draft.norm_output


@contextmanager
def verifier_embedding(draft) -> Iterator[None]:
    """The draft reads the verifier's embedding instead of the one it ships."""
    own = draft._modules["embed_tokens"]
    draft.embed_tokens = draft._shared["embed_tokens"]
    try:
        yield
    finally:
        draft.embed_tokens = own


def alternatives(pair) -> list[tuple[str, str, Callable[[], AbstractContextManager] | None, str | None]]:
    """(name, what it tests, context manager factory or None, why skipped) for each probe."""
    v, d = pair.verifier, pair.draft
    n = v.config.num_hidden_layers
    ids = tuple(v.aux_layer_ids)
    probes = []
    for shift in (-1, +1):
        moved = tuple(i + shift for i in ids)
        name = f"aux ids {shift:+d} {list(moved)}"
        what = f"capture layers shifted by {shift} (the 'input of' vs 'output of' layer k off-by-one)"
        bad = [i for i in moved if not 0 <= i < n]
        probes.append((name, what, None if bad else (lambda m=moved: aux_ids(v, m)),
                       f"{bad} outside the verifier's layers [0, {n - 1}]" if bad else None))
    ropes = [m for m in d.modules() if isinstance(m, RotaryEmbedding)]
    current = "interleaved" if ropes and ropes[0].interleave else "half-split"
    other = "half-split" if current == "interleaved" else "interleaved"
    probes.append((f"rope {other}", f"the draft's RoPE pairs dims {other} instead of {current}",
                   (lambda: rope_flipped(d)) if ropes else None, None if ropes else "the draft has no rotary embedding"))
    fed = "post-norm" if not d.norm_output else "pre-norm"
    probes.append((f"feed back {fed}", f"feed the {fed} state back between draft steps (norm_output = {not d.norm_output})",
                   lambda: norm_output_flipped(d), None))
    shared = d._shared.get("embed_tokens")
    own = d._modules.get("embed_tokens")
    if own is None:
        probes.append(("verifier embedding", "use the verifier's embedding instead of the draft's own", None,
                       "the draft ships no embedding of its own (it already uses the verifier's)"))
    elif shared is None or shared.weight.shape != own.weight.shape:
        probes.append(("verifier embedding", "use the verifier's embedding instead of the draft's own", None,
                       "the verifier's embedding has another shape"))
    else:
        probes.append(("verifier embedding", "use the verifier's embedding instead of the draft's own",
                       lambda: verifier_embedding(d), None))
    return probes


def measure(pair, prompts: Sequence[str], k: int, max_new_tokens: int, attention: str = "auto") -> Probe:
    """Greedy accept length over the prompts (every prompt's steps pooled) and its standard error."""
    dec = SpecDecoder(pair, num_speculative_tokens=k, temperature=0.0, attention=attention)
    events = [e for p in prompts for e in dec.generate(p, max_new_tokens).events]
    counts = [e.num_accepted for e in events if e.kind == "spec" and e.k > 0]
    n = len(counts)
    mean = sum(counts) / n if n else 0.0
    stderr = math.sqrt(sum((c - mean) ** 2 for c in counts) / (n - 1) / n) if n > 1 else None
    return Probe("", "", compute_stats(events).accept_length, steps=n, stderr=stderr)


def judge(configured: Probe, probes: list[Probe]) -> list[str]:
    """Flag alternatives that clearly beat the configured pairing, and a configured accept length < 1.2."""
    flags = []
    base = configured.accept_length
    for p in probes:
        if p.accept_length is None:
            continue
        p.delta = p.accept_length - base
        unknown = configured.stderr is None or p.stderr is None  # too few steps to tell anything apart
        noise = math.inf if unknown else NOISE_Z * math.hypot(configured.stderr, p.stderr)
        p.flagged = p.delta > MARGIN_ABS and p.delta > MARGIN_REL * base and p.delta > noise
        if p.flagged:
            flags.append(f"'{p.name}' accepts {p.accept_length:.3f} vs the configured {base:.3f} "
                         f"(noise {noise:.3f}): {p.description}")
    if base < MIN_ACCEPT:
        flags.append(f"configured accept length {base:.3f} < {MIN_ACCEPT}: the draft is likely misconfigured "
                     "(wrong aux layers, norm, RoPE or checkpoint), or untrained")
    return flags


def diagnose(pair, prompts: Sequence[str], k: int = 3, max_new_tokens: int = 32, attention: str = "auto",
             progress=None) -> DoctorReport:
    """Static checks plus greedy accept length of the configured pairing and each alternative."""
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError("diagnose: argument 'prompts'; expected a non-empty list of non-empty strings")
    checks = static_checks(pair)
    configured = Probe("configured", "the pairing as loaded")
    if pair.draft is None or any(c.status == "fail" and c.name in ("fc input width", "hidden sizes", "vocab")
                                 for c in checks):
        configured.skipped = "static checks failed; the draft cannot run against this verifier"
        return DoctorReport(k, max_new_tokens, len(prompts), checks, configured, [],
                            ["static checks failed: " + "; ".join(c.name for c in checks if c.status == "fail")])
    plan = alternatives(pair)
    total = 1 + sum(f is not None for _, _, f, _ in plan)
    if progress:
        progress(0, total, "configured")
    configured = _run(configured, pair, prompts, k, max_new_tokens, attention)
    configured.delta = 0.0
    probes, done = [], 1
    for name, what, factory, skipped in plan:
        probe = Probe(name, what, skipped=skipped)
        if factory is not None:
            if progress:
                progress(done, total, name)
            with factory():
                probe = _run(probe, pair, prompts, k, max_new_tokens, attention)
            done += 1
        probes.append(probe)
    if progress:
        progress(total, total, "done")
    flags = judge(configured, probes)
    return DoctorReport(k, max_new_tokens, len(prompts), checks, configured, probes, flags)


def _run(probe: Probe, pair, prompts, k: int, max_new_tokens: int, attention: str) -> Probe:
    m = measure(pair, prompts, k, max_new_tokens, attention)
    probe.accept_length, probe.steps, probe.stderr = m.accept_length, m.steps, m.stderr
    return probe
