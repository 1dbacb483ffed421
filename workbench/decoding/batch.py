"""The engine: speculative decoding of many requests at once, each on its own. It is the one loop:
`SpecDecoder` is a batch of one, plain decoding (`generate_autoregressive`) is k = 0.

    rid = dec.submit(prompt, ...)      checked at once, then queued
    dec.step():
        admit queued requests into free slots, each prefilled alone into its slot of the caches
        ks = each row's k this step: its request's k, the k policy, the room left in its context
        proposals = the drafter, for every row at once (each continues from its own newly verified positions)
        out = verifier([last token] + proposals of every row, padded to the longest)   # one forward
        each row accepts with its own acceptor, settings and generator; its caches roll back alone
        rows that finish leave; the rows still decoding keep slots 0..n-1 (continuous batching)

Rows never see each other. A row's attention reads only its own slot of each cache, up to its own
length; its padded positions lie past that length, where none of its queries look, and the next
step overwrites them. Every CPU kernel computes each token's row alone, so with them a row's
tokens equal its batch-1 decoding bit for bit, in bf16 too; on torch's operations a batch can
round differently in the last bit, so greedy output is exact in fp32 (where a flip needs an exact
tie) and follows the tie rule in bf16. Rows with different k share a step this way, by padding:
each verifies its own k + 1 tokens (per-row k, not a group per k).

The fused step (`fused=True`: `workbench.decoding.fused`) is the same step with the
acceptance and the next drafting in one call after the verify (`FusedDrafter.accept`).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from workbench.decoding.adaptive import KPolicy, StaticK
from workbench.decoding.drafters import Drafter, EagleDrafter, NgramDrafter, Proposal
from workbench.decoding.events import GenerationResult, StepEvent
from workbench.decoding.fused import FusedDrafter, fits
from workbench.decoding.logits import Context
from workbench.decoding.request import (MAX_K, RequestError, _Emitter, _Request, _validate_common, acceptance_rule,
                                        result_of, sampling_params)
from workbench.decoding.sampling import (Acceptor, GreedyAcceptor, SamplingParams, Verdict,
                                         acceptor_for, check_finite, greedy_verdicts,
                                         next_token, nonfinite_error, shown_prob)
from workbench.decoding.stats import compute_stats


@dataclass
class _Row:
    """A request while it decodes (or waits to)."""

    rid: int
    req: _Request
    k: int  # the request's most proposals a step
    params: SamplingParams
    acceptor: Acceptor
    seed: int
    sampled_draft: bool = False  # its EAGLE drafts are samples with their real q (else argmaxes, q one-hot)
    generator: torch.Generator = field(default_factory=torch.Generator)
    emitter: _Emitter | None = None
    verified: list[int] = field(default_factory=list)
    # What the drafter knows of the row (on the row, so that `BatchDecoder.mark` can put it back):
    aux: tuple[torch.Tensor, ...] = ()  # verifier states [1, n, H] of the positions the draft has not seen
    seen: int = 0  # positions whose draft cache rows are final
    base: int = 0  # positions before it have no draft row (a cold start): draft row i is position base + i
    upcoming: Proposal | None = None  # the fused step's proposals for the next step
    events: list[StepEvent] = field(default_factory=list)
    t_start: float = 0.0  # when its prefill began
    t_first: float = 0.0  # when its prefill ended
    t_end: float = 0.0
    finish: str | None = None  # why it ended: the emitter's reason, "cancelled" or "error"
    error: str | None = None
    exc: Exception | None = None  # what made it fail (a batch of one raises it)

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)


@dataclass
class BatchStep:
    """One batched step: its rows, their ks, and its clock (every row's event carries the same times)."""

    batch_size: int
    ks: list[int]
    draft_s: float
    verify_s: float
    wall_s: float  # the whole step: drafting, the verify, acceptance and events


class BatchDecoder:
    """Speculative decoding (or, with k = 0, plain decoding) of up to `max_batch_size` requests at once.

    `num_speculative_tokens` is the most any request drafts (the caches are sized for it, as vLLM's
    is); each request may ask for fewer, and `policy` (`workbench.decoding.adaptive`) sets each
    row's k every step. `proposer` is "eagle" (the pair's draft), "ngram" or a `Drafter`.
    `max_len` caps every request's context (default: the verifier's). `fused=True` runs the fused
    greedy step (greedy EAGLE requests, attention 'torch'). `preallocate=False` sizes the
    caches for each request as it arrives (a batch of one) rather than for the whole context.
    """

    def __init__(self, pair, num_speculative_tokens: int = 3, max_batch_size: int = 8, max_len: int | None = None,
                 policy: KPolicy | None = None, proposer: str | Drafter = "eagle", attention: str = "auto",
                 fused: bool = False, preallocate: bool = True) -> None:
        k, B = num_speculative_tokens, max_batch_size
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_K:
            raise RequestError(f"num_speculative_tokens = {k!r}; expected an integer in [0, {MAX_K}] (0: autoregressive)")
        if isinstance(B, bool) or not isinstance(B, int) or B < 1:
            raise RequestError(f"max_batch_size = {B!r}; expected an integer >= 1")
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2):
            raise RequestError(f"max_len = {max_len!r}; expected an integer >= 2 (a prompt token and a new one)")
        self.pair = pair = pair.with_attention(attention)
        self.k_max, self.max_batch_size, self.fused, self.preallocate = k, B, bool(fused), preallocate
        self.proposer = proposer if isinstance(proposer, str) else "custom"
        self.context = min(max_len or pair.context_length, pair.context_length)
        if fused and (not k or proposer != "eagle" or pair.attention != "torch"):
            raise RequestError("fused = True needs k >= 1, the pair's EAGLE draft and attention "
                               "'torch'")
        self.drafter = self._drafter(proposer) if k else None
        self.vcache = None
        if preallocate:  # a step writes up to k + 1 rows per sequence, padding included, past a length below the context
            self._reserve(self.context + k + 1)
        self.policy = policy or StaticK()
        self.rows: list[_Row] = []  # decoding, in slot order
        self.queue: deque[_Row] = deque()
        self.finished: dict[int, _Row] = {}
        self.history: list[BatchStep] = []
        self._next_id = 0

    def _drafter(self, proposer) -> Drafter:
        if not isinstance(proposer, str):
            return proposer
        if proposer == "ngram":
            return NgramDrafter()
        if proposer != "eagle":
            raise RequestError(f"proposer = {proposer!r}; expected 'eagle', 'ngram' or a Drafter object")
        if self.pair.draft is None:
            raise RequestError("proposer 'eagle' needs a draft; this pair has none (use proposer='ngram')")
        if self.fused:
            return FusedDrafter(self.pair.draft, self.k_max, self.pair.compiled, self.max_batch_size)
        return EagleDrafter(self.pair.draft, self.max_batch_size)

    def _reserve(self, rows: int) -> None:
        """Caches with room for `rows` positions a slot (called while no row decodes: nothing is kept)."""
        if self.vcache is None or self.vcache.max_len < rows:
            self.vcache = self.pair.verifier.new_cache(rows, batch=self.max_batch_size)
        if self.drafter is not None:
            self.drafter.reserve(rows + self.k_max)  # + a chain's k - 1 provisional rows

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, prompt: str | list[int], max_new_tokens: int = 128, k: int | None = None,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
               stop: str | list[str] | None = None, heal: bool = False, acceptor: str | Acceptor | None = None,
               draft_sampling: str = "greedy", max_len: int | None = None, **constraints) -> int:
        """Queue a request; returns its id. Bad settings raise RequestError / SamplingError now; a
        prompt that leaves no room in the context is refused here, alone. `acceptor` is a name
        ("greedy", "rejection", "block"), an `Acceptor`, or None (greedy at temperature 0, rejection
        sampling otherwise); `draft_sampling` "sample" draws EAGLE proposals from the draft's q."""
        k = self.k_max if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.k_max:
            raise RequestError(f"k = {k!r}; expected an integer in [0, {self.k_max}] (this engine's "
                               "num_speculative_tokens)")
        context = self.context if max_len is None else min(max_len, self.context)
        req = _validate_common(self.pair, prompt, max_new_tokens, stop, context, heal)
        params, acceptor = checked_settings(self.pair, temperature, top_p, top_k, acceptor, draft_sampling,
                                            **constraints)
        if self.fused and not fits(self.proposer, draft_sampling, params, acceptor, self.pair.attention):
            raise RequestError(FUSED_NEEDS)
        row = _Row(self._next_id, req, k, params, acceptor, seed, samples_drafts(self.drafter, draft_sampling, params))
        self._next_id += 1
        self.queue.append(row)
        return row.rid

    def cancel(self, rid: int) -> bool:
        """Stop a request (queued or decoding); False if it already ended."""
        for i, row in enumerate(self.rows):
            if row.rid == rid:
                self._finish(row, "cancelled")
                self._leave(i)
                return True
        for row in self.queue:
            if row.rid == rid:
                self.queue.remove(row)
                self._finish(row, "cancelled")
                return True
        return False

    @property
    def idle(self) -> bool:
        return not self.rows and not self.queue

    def result(self, rid: int) -> GenerationResult:
        """A finished request's result, as `SpecDecoder.generate` gives it (`error` set if it failed alone)."""
        row = self.finished[rid]
        if row.emitter is None:  # never prefilled (cancelled in the queue, or refused)
            res = GenerationResult([], "", [], _empty_stats(), row.req.prompt_ids, row.finish, row.k,
                                   self.acceptance_rule(row))
        else:
            res = result_of(row.events, row.emitter, row.t_end - row.t_start, row.k, self.acceptance_rule(row))
            res.finish_reason = row.finish
        res.error = row.error
        return res

    def acceptance_rule(self, row: _Row) -> str:
        return acceptance_rule(row.acceptor, self.k_max and row.k, row.sampled_draft)

    def generate_many(self, prompts: list, **settings) -> list[GenerationResult]:
        """Every prompt through the batch (at most max_batch_size at once, the rest joining as rows
        finish); results in the prompts' order. `settings` as `submit` takes them, the same for all.
        A prompt `submit` refuses (too long for the context, say) gets a result of its own with
        finish_reason "error" and the reason; the others decode as usual."""
        ids: list[int | GenerationResult] = []
        for p in prompts:
            try:
                ids.append(self.submit(p, **settings))
            except RequestError as e:
                ids.append(GenerationResult([], "", [], _empty_stats(), [], "error", error=str(e)))
        while not self.idle:
            self.step()
        return [i if isinstance(i, GenerationResult) else self.result(i) for i in ids]

    def stream(self) -> Iterator[tuple[int, StepEvent]]:
        """(request id, event) as the steps make them, until every request submitted so far has ended."""
        while not self.idle:
            yield from self.step()

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[tuple[int, StepEvent]]:
        """Admit what fits, then one batched speculative step; returns each row's event."""
        t0 = time.perf_counter()
        out = self.admit()
        if not self.rows:
            return out
        rows, B = self.rows, len(self.rows)
        vcache = self.vcache.view(0, B)
        lengths = vcache.lengths
        chosen = self.policy.choose([r.rid for r in rows], [r.k for r in rows], B) if self.k_max else [0] * B
        # within each row's context and token budget (0: a plain decode, as a request's last steps may be)
        ks = [max(0, min(k, r.req.max_len - n - 1, r.emitter.room())) for k, r, n in zip(chosen, rows, lengths)]
        t = time.perf_counter()
        props = (self.drafter.propose(rows, chosen, self.policy.stop_below) if self.drafter and (any(ks) or self.fused)
                 else [Proposal([], None, []) for _ in rows])
        props = [p.cut(k) for p, k in zip(props, ks)]
        props = [p.cut(self.policy.trim(r.rid, p.token_probs) if p.tokens else 0) for r, p in zip(rows, props)]
        t_draft = time.perf_counter() - t
        t = time.perf_counter()
        width = 1 + max(len(p.tokens) for p in props)
        x = torch.tensor([[r.verified[-1]] + p.tokens + [r.verified[-1]] * (width - 1 - len(p.tokens))
                          for r, p in zip(rows, props)], device=self.pair.device)
        v = self.pair.verifier(x, vcache)
        t_verify = time.perf_counter() - t
        t = time.perf_counter()
        verdicts = self._accept(rows, props, v, x, lengths)
        vcache.truncate([n + 1 + (d.num_accepted if d else 0) for n, d in zip(lengths, verdicts)])
        if self.drafter is not None and self.drafter.needs_aux:
            for b, (r, d) in enumerate(zip(rows, verdicts)):
                new = tuple(h[b:b + 1, : (d.num_accepted if d else 0) + 1] for h in v.aux_hidden_states)
                # after a step that drafted nothing the draft has not seen the last ones yet either
                r.aux = tuple(torch.cat(pair, 1) for pair in zip(r.aux, new)) if r.aux else new
        if self.fused:  # the acceptance drafted the next proposals
            t_draft += time.perf_counter() - t
        else:
            t_verify += time.perf_counter() - t
        for r, p, d in zip(rows, props, verdicts):
            if d is not None:
                self.policy.observe(r.rid, len(p.tokens), d.num_accepted)
                out.append((r.rid, self._emit(r, p, d, B, t_draft, t_verify)))
        self.history.append(BatchStep(B, [len(p.tokens) for p in props], t_draft, t_verify, time.perf_counter() - t0))
        for i in reversed(range(B)):  # from the end, so each move brings a row that is staying
            if rows[i].emitter.finish is not None:
                self._leave(i)
        return out

    def _accept(self, rows: list[_Row], props: list[Proposal], v, x: torch.Tensor,
                starts: list[int]) -> list[Verdict | None]:
        """Each row's verdict over its own k + 1 positions; a row whose logits or settings fail ends alone (None)."""
        logits = v.logits
        if self.fused:  # no row can fail but on its own logits
            verdicts = self.drafter.accept(rows, v, x, starts, [len(p.tokens) for p in props])
            for r, d in zip(rows, verdicts):
                if d is None:
                    self._finish(r, "error", nonfinite_error(self._where(r)))
            return verdicts
        verdicts: list[Verdict | None] = [None] * len(rows)
        plain = [b for b, r in enumerate(rows) if isinstance(r.acceptor, GreedyAcceptor) and r.params.greedy
                 and r.params.plain]
        broken = set()  # rows whose own logits are not all finite
        if plain:  # the plain greedy rows' verdicts in a few tensor ops (or one kernel pass), finiteness with them
            own = logits if len(plain) == len(rows) else logits[plain]
            for b, d in zip(plain, greedy_verdicts(own, [props[b].tokens for b in plain], self._kernels(own))):
                verdicts[b] = d
                if d is None:
                    broken.add(b)
        others = [b for b in range(len(rows)) if b not in plain]
        if others:  # check_finite's test for every other row in one op
            for b, f in zip(others, torch.isfinite(logits[others].amax(-1)).tolist()):
                if not all(f[:len(props[b].tokens) + 1]):
                    broken.add(b)
        for b, (r, p) in enumerate(zip(rows, props)):
            try:
                if b in broken:
                    raise nonfinite_error(self._where(r))
                if verdicts[b] is None:
                    context = Context(r.verified[:r.prompt_len], r.verified[r.prompt_len:])
                    verdicts[b] = r.acceptor.verify(p.tokens, p.draft_probs, logits[b, :len(p.tokens) + 1], r.params,
                                                    r.generator, context)
            except ValueError as e:  # SamplingError: unusable logits or settings
                verdicts[b] = None
                self._finish(r, "error", e)
        return verdicts

    def _kernels(self, logits: torch.Tensor) -> bool:
        """Whether greedy acceptance reads its row statistics with the CPU kernels: where the pair runs on them."""
        if self.pair.path.name != "cpu":
            return False
        from workbench.kernels import cpu

        return cpu.serves(logits)

    @staticmethod
    def _where(r: _Row) -> str:
        return f"request {r.rid}: verifier logits at step {len(r.events)}"

    def _emit(self, r: _Row, p: Proposal, d: Verdict, batch_size: int, t_draft: float, t_verify: float) -> StepEvent:
        """Take the row's accepted tokens (a stop inside them drops the rest) and make its event."""
        a, em = d.num_accepted, r.emitter
        emitted = p.tokens[:a] + [d.next_token]
        status = ["accepted"] * a + ["bonus" if a == len(p.tokens) else "corrected"]
        vprobs = d.verifier_probs[:a] + [d.next_token_prob]
        proposed_text = self.pair.tokenizer.token_texts(p.tokens, prefix=r.verified[-8:]) if p.tokens else []
        position, texts = len(r.verified), []
        for tok in emitted:
            texts.append(em.add(tok))
            if em.finish:
                break
        n = len(texts)
        r.verified += emitted[:n]
        ev = StepEvent(step=len(r.events), kind="spec" if self.k_max and r.k else "decode", proposed=p.tokens,
                       proposed_text=proposed_text, draft_probs=p.token_probs, verifier_probs=d.verifier_probs,
                       num_accepted=a, emitted=emitted[:n], emitted_text=texts, emitted_status=status[:n],
                       emitted_verifier_probs=vprobs[:n], position=position, draft_time=t_draft,
                       verify_time=t_verify, finish_reason=em.finish, batch_size=batch_size)
        r.events.append(ev)
        if em.finish:
            self._finish(r, em.finish)
        return ev

    def mark(self) -> Callable[[], None]:
        """A callable that puts the rows, their caches and their drafting back as they are now, so a
        benchmark can repeat one step on the code path that serves (`workbench bench --components`).
        For steps in which no row leaves a slot that another row then takes; a k policy's memory of
        what it observed is not put back."""
        saved = [(r, list(r.verified), r.aux, r.seen, r.base, r.upcoming, len(r.events), list(r.emitter.tokens),
                  r.emitter.text, r.emitter.finish, r.finish, r.generator.get_state()) for r in self.rows]
        rows, steps, vlens = list(self.rows), len(self.history), self.vcache.lengths
        dcache = getattr(self.drafter, "cache", None)
        dlens = dcache.lengths if dcache is not None else None

        def restore() -> None:
            self.rows[:] = rows
            for r, verified, aux, seen, base, upcoming, n, tokens, text, em_finish, finish, g in saved:
                r.verified, r.aux, r.seen, r.base, r.upcoming, r.finish = list(verified), aux, seen, base, upcoming, finish
                del r.events[n:]
                r.emitter.tokens, r.emitter.text, r.emitter.finish = list(tokens), text, em_finish
                r.generator.set_state(g)
                self.finished.pop(r.rid, None)
            self.vcache.set_lengths(vlens)
            if dlens is not None:
                dcache.set_lengths(dlens)
            del self.history[steps:]

        return restore

    # ---- joining and leaving -------------------------------------------------------------------

    def rows_needed(self, req: _Request) -> int:
        """The verifier cache's rows a request needs: room for a last step's k+1 tokens past its budget,
        within its context."""
        return min(req.max_len, len(req.prompt_ids) + req.max_new_tokens + self.k_max + 1)

    def admit(self) -> list[tuple[int, StepEvent]]:
        """Prefill queued requests into free slots, one at a time; a request that fails there ends alone.
        Returns their first events."""
        out: list[tuple[int, StepEvent]] = []
        while self.queue and len(self.rows) < self.max_batch_size:
            row, slot = self.queue.popleft(), len(self.rows)
            if not self.rows and not self.preallocate:
                self._reserve(self.rows_needed(row.req))
            try:
                ev, prefill = self._prefill(row, self.vcache.view(slot))
                out.append((row.rid, ev))
                if row.emitter.finish:
                    self._finish(row, row.emitter.finish)
                    continue
                if self.drafter is not None:
                    t0 = time.perf_counter()
                    self.drafter.admit(slot, row, prefill)
                    ev.draft_time = time.perf_counter() - t0  # the draft's prefill, part of the request's
            except ValueError as e:  # SamplingError: unusable logits or settings
                self._finish(row, "error", e)
                continue
            self.rows.append(row)
        return out

    def _prefill(self, row: _Row, cache):
        """The request's prompt into its slot and its first token: (its event, the verifier's output)."""
        row.t_start = time.perf_counter()
        row.generator.manual_seed(row.seed)
        row.emitter = em = _Emitter(self.pair, row.req)
        cache.length = 0
        ids = row.req.prompt_ids
        out = self.pair.verifier(torch.tensor([ids], device=self.pair.device), cache, logits_to_keep=1)
        logits = row.req.first_logits(out.logits[0, -1])
        check_finite(logits, f"request {row.rid}: verifier logits at the prompt's last position")
        first = next_token(logits, row.params, row.generator, Context(ids))
        piece = em.add(first)
        row.verified = ids + [first]
        row.t_first = time.perf_counter()
        ev = StepEvent(step=0, kind="prefill", emitted=[first], emitted_text=[piece], emitted_status=["bonus"],
                       emitted_verifier_probs=[shown_prob(logits, row.params, first, Context(ids))],
                       position=len(ids), verify_time=row.t_first - row.t_start, finish_reason=em.finish)
        row.events.append(ev)
        return ev, out

    def _finish(self, row: _Row, reason: str, error: Exception | None = None) -> None:
        row.t_end = time.perf_counter()
        row.error, row.exc, row.finish = (str(error) if error else None), error, reason
        if row.emitter is not None and row.emitter.finish is None:
            row.emitter.finish = reason
        self.policy.forget(row.rid)
        self.finished[row.rid] = row

    def _leave(self, i: int) -> None:
        """Row i leaves; the last row moves into its slot (its cache rows with it)."""
        last = len(self.rows) - 1
        if i != last:
            self.vcache.move(last, i)
            if self.drafter is not None:
                self.drafter.move(last, i)
            self.rows[i] = self.rows[last]
        self.rows.pop()

    # ---- accounting ----------------------------------------------------------------------------

    def settings(self) -> dict:
        """What runs: the loop and its fast path, for a report to name (bench, sweep)."""
        return {"loop": "batched", "max_batch_size": self.max_batch_size, "k": self.k_max, "fused": self.fused,
                "drafter": getattr(self.drafter, "name", "none"), "policy": self.policy.name,
                "attention": self.pair.attention, "compiled": self.pair.compiled,
                "weights": getattr(self.pair, "weights", "native")}

    def cache_bytes(self) -> dict[str, int]:
        """Bytes allocated for the caches of `max_batch_size` rows (verifier, draft; 0 for a drafter without one)."""
        draft = getattr(self.drafter, "cache", None)
        return {"verifier": self.vcache.nbytes_allocated if self.vcache else 0,
                "draft": draft.nbytes_allocated if draft else 0}

    def cache_rows(self) -> dict[str, int]:
        """Rows (token positions) each slot holds, per cache: the context plus a step's overhang."""
        draft = getattr(self.drafter, "cache", None)
        return {"verifier": self.vcache.max_len if self.vcache else 0, "draft": draft.max_len if draft else 0}


FUSED_NEEDS = ("fused = True needs greedy decoding with the pair's EAGLE draft, the greedy acceptor, no penalty or "
               "token constraint, and attention 'torch'")


def checked_settings(pair, temperature: float, top_p: float, top_k: int, acceptor: str | Acceptor | None,
                     draft_sampling: str, **constraints) -> tuple[SamplingParams, Acceptor]:
    """A request's sampling parameters and acceptor, checked (SamplingError / RequestError name the field)."""
    if draft_sampling not in ("greedy", "sample"):
        raise RequestError(f"draft sampling = {draft_sampling!r}; expected 'greedy' or 'sample'")
    params = sampling_params(pair, temperature, top_p, top_k, **constraints)
    return params, acceptor_for(params, acceptor) if isinstance(acceptor, (str, type(None))) else acceptor


def samples_drafts(drafter, draft_sampling: str, params: SamplingParams) -> bool:
    """Whether a request's EAGLE proposals are samples with their real q (else argmaxes, q one-hot)."""
    return isinstance(drafter, EagleDrafter) and draft_sampling == "sample" and not params.greedy


def _empty_stats():
    return compute_stats([])
