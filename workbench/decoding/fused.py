"""A greedy speculative step with no trip to the host between verifying and drafting.

Unfused, a step is: the verifier's forward over [last token] + k proposals; on the host, the
argmaxes, the accepted count, the probabilities shown, the cache rollback and the draft's inputs;
then the draft's chain over the accepted positions. Fused, the verifier's forward is the same
call (its per-token graph on a compiled pair, the one plain decoding runs, so its rows are plain
decoding's), and everything after it is one more call, `accept_and_draft`: the greedy
acceptance runs on the device, and the draft's first pass covers every one of the k+1 verified
positions with the verifier's own argmaxes as its tokens. For each position up to the accepted
count the argmax *is* the next verified token (an accepted proposal, then the correction or
the bonus), and the rows after it are never read before the next step's first pass overwrites
them; the chain continues from the accepted count's row, at positions only the device knows
(`Eagle3Draft.forward_at`). The host reads one small result per step. The same call, over the
prompt's last position, makes the first proposal after a prefill. `FusedGreedyStep` is this as a
`workbench.decoding.step.Step`.

Greedy only: rejection sampling draws from the host's generator between the two halves.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from workbench.cache import KVCache
from workbench.decoding.sampling import Verdict
from workbench.decoding.step import StepOutcome


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim that picks the first of tied maxima, as ATen's argmax (plain decoding's) does.

    A generated argmax may resolve an exact tie to another index (one did, in one of 64 bench
    prompts: two logits of 5.5), and greedy output must not depend on which kernel took the
    argmax; a max, an equality and a min over indices are exact in any order. Indices stay in
    range for NaN rows (the caller raises on those).
    """
    V = logits.shape[-1]
    index = torch.arange(V, device=logits.device)
    first = torch.where(logits == logits.amax(-1, keepdim=True), index, V).amin(-1)
    return first.clamp(max=V - 1)


def accept_and_draft(draft, logits: torch.Tensor, aux: tuple[torch.Tensor, ...], x: torch.Tensor, dcache: KVCache,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After the verifier's forward over x [1, T] = [last verified token] + T-1 proposals (logits
    [T, V], aux states [1, T, H] each), with the draft cache holding the positions before x.

    Returns (ints, floats, finite): ints = [accepted, the T argmaxes, the next k proposals],
    floats = [p of each proposal, p of each argmax, q of each next proposal], finite = whether
    every logit row had a finite max. T = 1 (no proposals) drafts after a prefill.
    """
    logits = logits.float()  # exact for bf16 logits
    target = first_argmax(logits)  # [T]
    accepted = (x[0, 1:] == target[:-1]).to(torch.int64).cumprod(0).sum()
    probs = logits.softmax(-1)
    p_proposals = probs[:-1].gather(1, x[0, 1:, None])[:, 0]
    p_target = probs.gather(1, target[:, None])[:, 0]
    finite = torch.isfinite(logits.amax(-1)).all()
    proposals, q = type(draft).greedy_chain(draft, target[None], aux, dcache, k, last=accepted)
    return torch.cat([accepted[None], target, proposals[0]]), torch.cat([p_proposals, p_target, q[0]]), finite


@dataclass
class FusedOutcome:
    num_accepted: int
    next_token: int  # the correction or the bonus
    verifier_probs: list[float]  # p(proposal_i), softmax of the verifier's logits
    next_token_prob: float
    proposals: list[int]  # the next step's k proposals
    draft_probs: list[float]  # q of each, under the draft's softmax
    finite: bool  # every verified logit row had a finite max (the caller raises otherwise)


_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft -> its compiled accept_and_draft


def _accept_and_draft_for(draft, compiled: bool):
    """`accept_and_draft`, compiled once per draft when the pair is (every decoder of the pair shares it)."""
    if not compiled:
        return accept_and_draft
    if draft not in _FNS:
        from workbench.compiled import compile_function

        _FNS[draft] = compile_function(accept_and_draft, next(draft.parameters()).dtype)
    return _FNS[draft]


class FusedGreedyStep:
    """The `Step` for greedy EAGLE: the verifier's forward, then `accept_and_draft` (compiled on a
    compiled pair). It drafts each step's proposals at the end of the step before."""

    def __init__(self, verifier, draft, k: int, compiled: bool) -> None:
        self.verifier, self.draft, self.k = verifier, draft, k
        self.fn = _accept_and_draft_for(draft, compiled)
        self.calls = 0
        self.dcache: KVCache | None = None
        self.upcoming: FusedOutcome | None = None  # the proposals the next step verifies

    def draft_after(self, logits: torch.Tensor, aux, x: torch.Tensor) -> FusedOutcome:
        """Accept after the verifier's forward over x (its logits [T, V] and aux states) and draft
        the next k from the draft cache's length on."""
        self.calls += 1
        # A cache of 0 or 1 rows (after a 1- or 2-token prompt) runs eagerly rather than specialising a graph
        fn = self.fn if self.dcache.length >= 2 else accept_and_draft
        ints, floats, finite = fn(self.draft, logits, aux, x, self.dcache, self.k)
        ints, floats, T = ints.tolist(), floats.tolist(), x.shape[1]
        a = ints[0]
        return FusedOutcome(a, ints[1 + a], floats[:T - 1], floats[T - 1 + a], ints[1 + T:], floats[2 * T - 1:],
                            bool(finite))

    @torch.inference_mode()
    def begin(self, verified: list[int], prefill, cache: KVCache) -> None:
        """The first proposal after a prefill: the draft's pass over the prompt but its last position
        as usual, then that position and the chain through `accept_and_draft`."""
        if self.dcache is None or self.dcache.max_len < cache.max_len + self.k:
            self.dcache = self.draft.new_cache(cache.max_len + self.k)  # provisional rows past the context
        self.dcache.reset()
        self.steps = 0
        aux = prefill.aux_hidden_states
        ids = torch.tensor([verified[1:-1]], device=cache.rows.device)
        if ids.shape[1] > 0:
            self.draft(ids, self.draft.combine_hidden_states(tuple(h[:, :-1] for h in aux)), self.dcache)
        fresh = torch.contiguous_format  # the prefill's slices: their strides would fail a graph's stride guards
        logits = prefill.logits[0, -1:].clone(memory_format=fresh)
        aux = tuple(h[:, -1:].clone(memory_format=fresh) for h in aux)
        start = self.dcache.length
        self.upcoming = self.draft_after(logits, aux, torch.tensor([[verified[-1]]], device=cache.rows.device))
        self.dcache.truncate(start + 1)

    @torch.inference_mode()
    def step(self, verified: list[int], k: int, cache: KVCache) -> StepOutcome:
        from workbench.decoding.sampling import nonfinite_error

        self.steps += 1
        proposals, token_probs = self.upcoming.proposals[:k], self.upcoming.draft_probs[:k]
        t = time.perf_counter()
        start = cache.length
        x = torch.tensor([[verified[-1]] + proposals], device=cache.rows.device)
        out = self.verifier(x, cache)  # the per-token graph on a compiled pair; advances the cache
        t_verify = time.perf_counter() - t
        t = time.perf_counter()
        self.dcache.truncate(start)
        o = self.draft_after(out.logits[0], out.aux_hidden_states, x)
        cache.truncate(start + 1 + o.num_accepted)
        self.dcache.truncate(start + 1 + o.num_accepted)  # the first pass's rows up to the accepted count are final
        if not o.finite:
            raise nonfinite_error(f"verifier logits at step {self.steps}")
        self.upcoming = o
        verdict = Verdict(o.num_accepted, o.next_token, o.verifier_probs, o.next_token_prob)
        return StepOutcome(proposals, token_probs, verdict, time.perf_counter() - t, t_verify)

    def mark(self, cache: KVCache):
        length, dlength, upcoming = cache.length, self.dcache.length, self.upcoming

        def restore() -> None:
            cache.truncate(length)
            self.dcache.truncate(dlength)
            self.upcoming = upcoming

        return restore
