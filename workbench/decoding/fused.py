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
them; the chain (the drafter's `greedy_chain`) continues from the accepted count's row, at
positions only the device knows. The host reads one small result per step. The same call, over
the prompt's last position, makes the first proposal after a prefill. `FusedDrafter` is this as
the engine's drafter for one row (`workbench.decoding.batch`).

Greedy only: rejection sampling draws from the host's generator between the two halves.
"""
from __future__ import annotations

import weakref

import torch

from workbench.cache import KVCache
from workbench.decoding.drafters import Proposal, greedy_chain
from workbench.decoding.sampling import GreedyAcceptor, Verdict, nonfinite_error


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
    proposals, q = greedy_chain(draft, target[None], aux, dcache, k, at=accepted)
    return torch.cat([accepted[None], target, proposals[0]]), torch.cat([p_proposals, p_target, q[0]]), finite


_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft -> its compiled accept_and_draft


def _accept_and_draft_for(draft, compiled: bool):
    """`accept_and_draft`, compiled once per draft when the pair is (every decoder of the pair shares it)."""
    if not compiled:
        return accept_and_draft
    if draft not in _FNS:
        from workbench.compiled import compile_function

        _FNS[draft] = compile_function(accept_and_draft, next(draft.parameters()).dtype)
    return _FNS[draft]


class FusedDrafter:
    """The drafter of the engine's fused greedy step (one row): it drafts each step's proposals at the end
    of the step before, in `accept`, which the engine calls after the verifier's forward in place of the
    acceptor: `accept_and_draft`, compiled on a compiled pair. The proposals waiting for the next step
    are the row's (`row.upcoming`)."""

    needs_aux = False  # the verify's aux states go straight into `accept`

    def __init__(self, draft, k: int, compiled: bool) -> None:
        self.draft, self.k = draft, k
        self.fn = _accept_and_draft_for(draft, compiled)
        self.calls = 0
        self.cache = None  # allocated by `reserve`
        self.name = f"eagle3-{draft.attention_kind} (fused)"

    def reserve(self, max_len: int) -> None:
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.draft.new_cache(max_len)

    def move(self, src: int, dst: int) -> None:
        raise ValueError("the fused step serves one row; expected max_batch_size = 1")

    def _after(self, logits: torch.Tensor, aux, x: torch.Tensor) -> tuple[Verdict | None, Proposal]:
        """Accept after the verifier's forward over x (its logits [T, V] and aux states) and draft the
        next k from the draft cache's length on: (the verdict, None if a logit row was not finite; the
        next proposals)."""
        self.calls += 1
        # A cache of 0 or 1 rows (after a 1- or 2-token prompt) runs eagerly rather than specialising a graph
        fn = self.fn if self.cache.length >= 2 else accept_and_draft
        ints, floats, finite = fn(self.draft, logits, aux, x, self.cache, self.k)
        ints, floats, T = ints.tolist(), floats.tolist(), x.shape[1]
        a = ints[0]
        verdict = Verdict(a, ints[1 + a], floats[:T - 1], floats[T - 1 + a]) if finite else None
        return verdict, Proposal(ints[1 + T:], None, floats[2 * T - 1:])

    def admit(self, slot: int, row, prefill) -> None:
        """The first proposal after a prefill: the draft's pass over the prompt but its last position
        as usual, then that position and the chain through `accept_and_draft`."""
        self.cache.reset()
        aux, ids = prefill.aux_hidden_states, torch.tensor([row.verified[1:-1]], device=prefill.logits.device)
        if ids.shape[1] > 0:
            self.draft(ids, self.draft.combine_hidden_states(tuple(h[:, :-1] for h in aux)), self.cache)
        fresh = torch.contiguous_format  # the prefill's slices: their strides would fail a graph's stride guards
        logits = prefill.logits[0, -1:].clone(memory_format=fresh)
        aux = tuple(h[:, -1:].clone(memory_format=fresh) for h in aux)
        start = self.cache.length
        _, row.upcoming = self._after(logits, aux, torch.tensor([[row.verified[-1]]], device=logits.device))
        self.cache.truncate(start + 1)

    def propose(self, rows: list, ks: list[int], stop_below: float | None) -> list[Proposal]:
        return [r.upcoming.cut(k) for r, k in zip(rows, ks)]

    def accept(self, rows: list, out, x: torch.Tensor, start: int, where: str) -> list[Verdict]:
        """The row's verdict and its next proposals, after the verifier's forward `out` over x at `start`."""
        self.cache.truncate(start)
        verdict, rows[0].upcoming = self._after(out.logits[0], out.aux_hidden_states, x)
        if verdict is None:
            raise nonfinite_error(where)
        self.cache.truncate(start + 1 + verdict.num_accepted)  # the first pass's rows up to the accepted count are final
        return [verdict]


def fits(drafter: str, draft_sampling: str, params, acceptor, attention: str) -> bool:
    """Whether a request can take the fused step: greedy decoding with the pair's EAGLE draft, the
    greedy acceptor, no penalty or token constraint, and attention 'torch'."""
    return (drafter == "eagle" and (draft_sampling == "greedy" or params.greedy) and params.greedy and params.plain
            and isinstance(acceptor, GreedyAcceptor) and attention == "torch")
