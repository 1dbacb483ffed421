"""Probe a draft/verifier pairing for the silent misconfigurations whose only symptom is low acceptance.

Field reports (peers.md §6.5): aux layer ids off by one (vLLM captures the residual *entering*
layer k; some trainers save "output of layer k"), RoPE pairing (DeepSeek/Kimi interleave
the rope dims, Llama-style code rotates halves), feeding back the pre-norm vs the post-norm
state (EAGLE-3 vs EAGLE-3.1 `norm_output`), a draft shipping its own embedding vs using the
verifier's, and a draft whose max_position_embeddings is below the verifier's (NeMo RL PR
#3960: acceptance collapses past that position).

`diagnose` runs static checks on configs and weights, then measures the greedy accept length
of the configured pairing and of each alternative; an alternative that beats the configured
one by a clear margin is flagged, and a configured accept length below 1.2 calls the draft dead.
Every accept length comes with the one over the continuations that do not loop and the loop
count (`workbench.analysis.degeneracy`), and prompts that look random are warned about. Every probe runs
on a weight-sharing variant of the pair (`ModelPair.variant`): the caller's pair never changes.

"Clear" means above a fixed margin *and* beyond the noise of a few prompts. Greedy runs are
deterministic, but a handful of steps says little about other text: on the trained tiny pair,
2 prompts x 16 tokens once put a wrong RoPE pairing 0.24 ahead, 8 x 32 put it behind. So each
alternative is also tested where the comparison is paired and cheap: the *first proposal* at
every position of the prompts and of the configured run's output (greedy speculation is
lossless, so that text is the same for every probe). One verifier forward and one draft pass
over a sequence give, at each position, whether the draft's first proposal there would be
accepted (it equals the verifier's argmax); d = hit(alternative) - hit(configured) per
position and z = mean(d) / (sd(d) / sqrt(n)) must exceed 2. The feedback probe changes only
later proposals (depth >= 1), so it is paired on generation instead: per emitted position,
whether it was an accepted proposal (positions whose token differs, a verifier near-tie, are
left out).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from workbench.analysis.degeneracy import DEAD_DRAFT, AcceptSplit, accept_split, dead_draft_note, random_prompt_warning
from workbench.analysis.field_checks import Check, aux_id_readings, field_checks
from workbench.decoding.stats import compute_stats
from workbench.decoding.engine import SpecDecoder
from workbench.models.rope import RotaryEmbedding
from workbench.variants import REMOVED

MARGIN_ABS = 0.05  # an alternative must beat the configured accept length by more than this ...
MARGIN_REL = 0.02  # ... and by more than this fraction of it, to be flagged (run-to-run noise is 0 at T=0,
# but a few prompts make small differences meaningless)
MIN_ACCEPT = DEAD_DRAFT  # below this the draft is barely ever accepted: dead (misconfigured or untrained)
NOISE_Z = 2.0  # ... and its paired per-position z-score must exceed this


@dataclass
class Probe:
    name: str
    description: str
    accept_length: float | None = None  # None when skipped
    steps: int = 0  # speculative steps measured
    first_proposal_rate: float | None = None  # teacher-forced: share of positions whose first proposal is accepted
    positions: int = 0  # positions behind first_proposal_rate
    z: float | None = None  # paired z-score against the configured run (None: fewer than 2 positions)
    test: str = ""  # what z pairs: "first proposals" or "accepted positions"
    skipped: str | None = None  # why the probe could not run
    delta: float | None = None  # accept_length - configured
    flagged: bool = False
    accept_length_clean: float | None = None  # over the continuations that do not loop (None: all loop, or skipped)
    degenerate: int = 0  # continuations that loop

    def loops_text(self, num_prompts: int) -> str:
        clean = "n/a" if self.accept_length_clean is None else f"{self.accept_length_clean:.3f}"
        return f"clean {clean}, {self.degenerate} of {num_prompts} loop"


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
        c = self.configured
        head = "n/a" if c.accept_length is None else (f"{c.accept_length:.3f} ({c.loops_text(self.num_prompts)}), "
                                                         f"first proposals {c.first_proposal_rate:.3f} over "
                                                         f"{c.positions} positions")
        lines.append(f"acceptance probes (greedy accept length; configured = {head}):")
        for p in self.probes:
            if p.skipped:
                lines.append(f"  [skip] {p.name}: {p.skipped}")
            else:
                mark = "FLAG" if p.flagged else "  ok"
                z = "?" if p.z is None else f"{p.z:+.1f}"
                lines.append(f"  [{mark}] {p.name}: {p.accept_length:.3f} ({p.delta:+.3f}; "
                             f"{p.loops_text(self.num_prompts)}; first proposals "
                             f"{p.first_proposal_rate:.3f}; z {z} on {p.test}) - {p.description}")
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
          f"draft hidden {dc.hidden_size}, target_hidden_size {dc.target_hidden_size} = verifier hidden "
          f"{vc.hidden_size}",
          f"draft hidden_size {dc.hidden_size} / target_hidden_size {dc.target_hidden_size}; expected the "
          f"verifier's hidden_size {vc.hidden_size}")
    ids = list(dc.aux_layer_ids)
    if hasattr(d, "fc"):
        want = len(ids) * vc.hidden_size
        check("fc input width", d.fc.in_features == want,
              f"fc takes {d.fc.in_features} = {len(ids)} x {vc.hidden_size}",
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
    out += field_checks(pair)
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
        return Check("tokenizer", "fail",
                     f"{pair.verifier_dir}: no tokenizer; expected tokenizer.json or tiktoken.model")
    n = tok.vocab_size
    if n > rows:
        return Check("tokenizer", "fail", f"tokenizer has {n} tokens but the embedding has {rows} rows: ids >= {rows} "
                                          "would index past it")
    return Check("tokenizer", "ok", f"{n} tokens <= {rows} embedding rows"
                 + ("" if n == rows else f" ({rows - n} padding rows)"))


# ---- acceptance probes ----------------------------------------------------------------------


@dataclass
class Alternative:
    name: str
    description: str
    make: Callable[[], object] | None  # the probe's pair (a weight-sharing variant); None when skipped
    skipped: str | None = None
    first_proposal: bool = True  # changes the first proposal of a step (else only later ones)
    ids: tuple[int, ...] = ()  # the layers it captures, when it moves the aux layers


def engine_alternatives(pair) -> list[Alternative]:
    """How the draft runs under each engine's reading of its config, where that differs from the
    configured run (vLLM's ids, with the draft's own fc_norm and norm_output): SGLang's ids, and
    vLLM dropping EAGLE-3.1's flags. These are the accept lengths each engine would see."""
    from workbench.engine_readings import config_view, engine_readings

    v, d = pair.plain
    n, ids = v.config.num_hidden_layers, tuple(v.aux_layer_ids)
    out = []
    for r in engine_readings(config_view(d.config), n).values():
        changes = {}
        if r.fc_norm != d.config.fc_norm and "fc_norm" in d._modules:
            changes["fc_norm"] = REMOVED
        if r.norm_output != d.norm_output:
            changes["norm_output"] = r.norm_output
        if r.ids == ids and not changes:
            continue
        what = [f"capture layers {list(r.ids)} ({r.source})"] if r.ids != ids else []
        what += ["no fc_norm"] * ("fc_norm" in changes) + [f"feed back {'post' if r.norm_output else 'pre'}-norm"] * (
            "norm_output" in changes)
        bad = [i for i in r.ids if not 0 <= i < n]
        make = None if bad else (lambda r=r, changes=changes: pair.variant(
            verifier={"aux_layer_ids": r.ids} if r.ids != ids else None, draft=changes or None))
        out.append(Alternative(f"{r.engine} reading {list(r.ids)}", f"as {r.engine} would run it: " + ", ".join(what),
                               make, f"{bad} outside the verifier's layers [0, {n - 1}]: {r.engine} cannot run it"
                               if bad else None, first_proposal=r.norm_output == d.norm_output,
                               ids=r.ids if r.ids != ids else ()))
    return out


def alternatives(pair) -> list[Alternative]:
    """The probes that apply to this pair, and the ones that do not (with the reason). Each probe
    is a `ModelPair.variant`: the pair the caller holds is never changed."""
    v, d = pair.plain
    n = v.config.num_hidden_layers
    ids = tuple(v.aux_layer_ids)
    capture = lambda m: (lambda: pair.variant(verifier={"aux_layer_ids": m}))  # noqa: E731
    out = engine_alternatives(pair)
    # the other readings of the draft's config (eagle_config's ids as written, or as "output of layer i"),
    # where no engine's reading above already captures those layers
    engines = {alt.ids for alt in out}
    readings = {} if d.config.nested_aux_layer_ids is None else {
        r: m for r, m in aux_id_readings(d.config, v.config).items() if r != "vllm" and m != ids and m not in engines}
    out += [Alternative(f"{r} reading {list(m)}", f"capture the layers a reading of the config's {r.split('+')[0]} "
                        f"ids names ({'as output of layer i' if r.endswith('+1') else 'as written'}), not vLLM's",
                        capture(m)) for r, m in readings.items()]
    readings = {**readings, **{alt.name: alt.ids for alt in out if alt.ids}}
    for shift in (-1, +1):
        moved = tuple(i + shift for i in ids)
        if moved in readings.values():
            continue  # already a reading above
        bad = [i for i in moved if not 0 <= i < n]
        out.append(Alternative(
            f"aux ids {shift:+d} {list(moved)}",
            f"capture layers shifted by {shift} (the 'input of' vs 'output of' layer k off-by-one)",
            None if bad else capture(moved), f"{bad} outside the verifier's layers [0, {n - 1}]" if bad else None))
    ropes = {f"{name}.interleave": not m.interleave for name, m in d.named_modules() if isinstance(m, RotaryEmbedding)}
    current = "interleaved" if ropes and not next(iter(ropes.values())) else "half-split"
    other = "half-split" if current == "interleaved" else "interleaved"
    out.append(Alternative(f"rope {other}", f"the draft's RoPE pairs dims {other} instead of {current}",
                           (lambda: pair.variant(draft=ropes)) if ropes else None,
                           None if ropes else "the draft has no rotary embedding"))
    fed = "post-norm" if not d.norm_output else "pre-norm"
    out.append(Alternative(f"feed back {fed}",
                           f"feed the {fed} state back between draft steps (norm_output = {not d.norm_output})",
                           lambda: pair.variant(draft={"norm_output": not d.norm_output}), first_proposal=False))
    what = "use the verifier's embedding instead of the draft's own"
    own, shared = d._modules.get("embed_tokens"), d._shared.get("embed_tokens")
    if own is None:
        out.append(Alternative("verifier embedding", what, None,
                               "the draft ships no embedding of its own (it already uses the verifier's)"))
    elif shared is None or shared.weight.shape != own.weight.shape:
        out.append(Alternative("verifier embedding", what, None, "the verifier's embedding has another shape"))
    else:
        out.append(Alternative("verifier embedding", what, lambda: pair.variant(draft={"embed_tokens": REMOVED})))
    return out


Marks = list[dict[int, tuple[int, bool]]]  # per prompt: position -> (token, was an accepted proposal)


@dataclass
class Run:
    """What one greedy generation over the prompts leaves to compare."""

    accept_length: float
    steps: int
    marks: Marks
    sequences: list[list[int]]  # prompt + output tokens, per prompt
    split: AcceptSplit  # the accept lengths with the looping continuations set apart


def generate_run(pair, prompts: Sequence[str], k: int, max_new_tokens: int, attention: str = "auto") -> Run:
    """Greedy speculative decoding over the prompts: pooled accept length and per-position marks."""
    dec = SpecDecoder(pair, num_speculative_tokens=k, temperature=0.0, attention=attention)
    events, marks, sequences, requests = [], [], [], []
    for prompt in prompts:
        res = dec.generate(prompt, max_new_tokens)
        events += res.events
        requests.append(res.events)
        marks.append({e.position + i: (tok, status == "accepted") for e in res.events
                      for i, (tok, status) in enumerate(zip(e.emitted, e.emitted_status))})
        sequences.append(res.prompt_tokens + res.tokens)
    steps = sum(1 for e in events if e.kind == "spec" and e.k > 0)
    return Run(compute_stats(events).accept_length, steps, marks, sequences, accept_split(requests))


@torch.inference_mode()
def first_proposal_hits(pair, sequences: list[list[int]], attention: str = "auto") -> list[bool]:
    """At every position of each sequence: would greedy verification accept the draft's first proposal?

    As in the engine's first draft pass, row j takes token j+1 and the fused verifier state of
    position j and proposes the token after j+1; it is accepted iff it is the verifier's argmax
    at position j+1. One verifier forward and one draft pass per sequence, no generation loop.
    """
    pair = pair.with_attention(attention)
    d = pair.draft
    hits: list[bool] = []
    for ids in sequences:
        x = torch.tensor([ids], device=pair.device)
        out = pair.verifier(x)
        target = out.logits[0].argmax(-1)
        post, _ = d(x[:, 1:], d.combine_hidden_states(out.aux_hidden_states)[:, :-1])
        hits += (d.compute_logits(post)[0].argmax(-1) == target[1:]).tolist()
    return hits


def paired_z(configured: list[bool], alternative: list[bool]) -> float | None:
    """z-score of the mean of d = alternative - configured over paired 0/1 outcomes."""
    d = [int(b) - int(a) for a, b in zip(configured, alternative)]
    n = len(d)
    if n < 2:
        return None
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean / math.sqrt(max(var, 1e-12) / n)  # var = 0 only when every d is 0 (mean 0)


def _paired_marks(configured: Marks, alternative: Marks) -> tuple[list[bool], list[bool]]:
    pairs = [(conf[p][1], alt[p][1]) for conf, alt in zip(configured, alternative)
             for p in sorted(conf.keys() & alt.keys()) if conf[p][0] == alt[p][0]]
    return [a for a, _ in pairs], [b for _, b in pairs]


def judge(configured: Probe, probes: list[Probe]) -> list[str]:
    """Flag alternatives that clearly beat the configured pairing, and a configured accept length < 1.2.

    Each probe's `z` must already hold its paired z-score against the configured run."""
    flags = []
    base = configured.accept_length
    for p in probes:
        if p.accept_length is None:
            continue
        p.delta = p.accept_length - base
        p.flagged = (p.delta > MARGIN_ABS and p.delta > MARGIN_REL * base and p.z is not None and p.z > NOISE_Z)
        if p.flagged:
            flags.append(f"'{p.name}' accepts {p.accept_length:.3f} vs the configured {base:.3f} (paired z = "
                         f"{p.z:.1f} on {p.test}): {p.description}")
    if dead := dead_draft_note(base):
        flags.append(f"configured: {dead}")
    return flags


def prompt_check(pair, prompts: Sequence[str]) -> Check:
    """Prompts that look random make every acceptance figure meaningless: warn before any is shown."""
    warning = random_prompt_warning(prompts, pair.encode)
    return Check("prompts", "warn", warning) if warning else \
        Check("prompts", "ok", f"none of the {len(prompts)} prompts looks random")


def path_check(pair) -> Check:
    """Which path runs the models (the CPU kernels' library and threads, torch.compile, plain)."""
    return Check("fast path", "info", pair.status())


def diagnose(pair, prompts: Sequence[str], k: int = 3, max_new_tokens: int = 32, attention: str = "auto",
             progress=None) -> DoctorReport:
    """Static checks plus greedy accept length of the configured pairing and each alternative."""
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError("diagnose: argument 'prompts'; expected a non-empty list of non-empty strings")
    checks = static_checks(pair) + [prompt_check(pair, prompts), path_check(pair)]
    configured = Probe("configured", "the pairing as loaded")
    if pair.draft is None or any(c.status == "fail" and c.name in ("fc input width", "hidden sizes", "vocab")
                                 for c in checks):
        configured.skipped = "static checks failed; the draft cannot run against this verifier"
        return DoctorReport(k, max_new_tokens, len(prompts), checks, configured, [],
                            ["static checks failed: " + "; ".join(c.name for c in checks if c.status == "fail")])
    plan = alternatives(pair)
    total = 1 + sum(alt.make is not None for alt in plan)
    if progress:
        progress(0, total, "configured")
    base = generate_run(pair, prompts, k, max_new_tokens, attention)
    base_hits = first_proposal_hits(pair, base.sequences, attention)
    configured.accept_length, configured.steps, configured.delta = base.accept_length, base.steps, 0.0
    configured.accept_length_clean, configured.degenerate = base.split.clean, base.split.num_degenerate
    configured.first_proposal_rate, configured.positions = sum(base_hits) / len(base_hits), len(base_hits)
    probes = []
    for alt in plan:
        probe = Probe(alt.name, alt.description, skipped=alt.skipped)
        probes.append(probe)
        if alt.make is None:
            continue
        if progress:
            progress(len([p for p in probes if p.skipped is None]), total, alt.name)
        probe_pair = alt.make()
        run = generate_run(probe_pair, prompts, k, max_new_tokens, attention)
        hits = first_proposal_hits(probe_pair, base.sequences, attention)
        probe.accept_length, probe.steps = run.accept_length, run.steps
        probe.accept_length_clean, probe.degenerate = run.split.clean, run.split.num_degenerate
        probe.first_proposal_rate, probe.positions = sum(hits) / len(hits), len(hits)
        if alt.first_proposal:
            probe.z, probe.test = paired_z(base_hits, hits), "first proposals"
        else:
            probe.z, probe.test = paired_z(*_paired_marks(base.marks, run.marks)), "accepted positions"
    if progress:
        progress(total, total, "done")
    return DoctorReport(k, max_new_tokens, len(prompts), checks, configured, probes, judge(configured, probes))
