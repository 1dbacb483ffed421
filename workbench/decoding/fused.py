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
the engine's drafter (`workbench.decoding.batch`), for every row of a step at once: each row's
padding is never accepted, and each continues from its own accepted count.

Greedy only: rejection sampling draws from the host's generator between the two halves.
"""
from __future__ import annotations

import weakref

import torch

from workbench.cache import KVCache
from workbench.decoding.drafters import Proposal, greedy_chain
from workbench.decoding.sampling import GreedyAcceptor, Verdict


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


def accept_and_draft(draft, logits: torch.Tensor, aux: tuple[torch.Tensor, ...], x: torch.Tensor, n: torch.Tensor,
                     dcache: KVCache, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After the verifier's forward over x [B, T]: row b is [last verified token] + its n[b] proposals,
    padded to T (logits [B, T, V], aux states [B, T, H] each), with the draft cache holding each row's
    positions before x.

    Returns (ints [B, 1 + T + k], floats [B, 2T - 1 + k], finite [B, T]): ints = [accepted, the T
    argmaxes, the next k proposals], floats = [p of each proposal, p of each argmax, q of each next
    proposal], finite = whether each logit row had a finite max. T = 1 (no proposals) drafts after
    a prefill.
    """
    logits = logits.float()  # exact for bf16 logits
    target = first_argmax(logits)  # [B, T]
    B, T = x.shape
    index = torch.arange(T, device=x.device)
    # the first rejected position, or a row's end (its padding is never accepted): a min over an index
    stop = (index[:-1] >= n[:, None]) | (x[:, 1:] != target[:, :-1])
    accepted = torch.cat([torch.where(stop, index[:-1], T - 1), torch.full_like(n[:, None], T - 1)], 1).amin(1)
    probs = logits.softmax(-1)
    p_proposals = probs[:, :-1].gather(2, x[:, 1:, None])[..., 0]
    p_target = probs.gather(2, target[..., None])[..., 0]
    finite = torch.isfinite(logits.amax(-1))
    proposals, q = greedy_chain(draft, target, aux, dcache, k, at=accepted)
    return torch.cat([accepted[:, None], target, proposals], 1), torch.cat([p_proposals, p_target, q], 1), finite


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
    """The drafter of the engine's fused greedy step: it drafts each step's proposals at the end of the
    step before, in `accept`, which the engine calls after the verifier's forward in place of the
    acceptor: `accept_and_draft` over every row at once, compiled on a compiled pair. Row b's draft
    cache is slot b; the proposals waiting for the next step are the row's (`row.upcoming`)."""

    needs_aux = False  # the verify's aux states go straight into `accept`

    def __init__(self, draft, k: int, compiled: bool, slots: int = 1) -> None:
        self.draft, self.k, self.slots = draft, k, slots
        self.fn = _accept_and_draft_for(draft, compiled)
        self.calls = 0
        self.cache = None  # allocated by `reserve`
        self.name = f"eagle3-{draft.attention_kind} (fused)"

    def reserve(self, max_len: int) -> None:
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.draft.new_cache(max_len, batch=self.slots)

    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst)

    def _after(self, cache: KVCache, logits: torch.Tensor, aux, x: torch.Tensor,
               counts: list[int]) -> list[tuple[Verdict | None, Proposal]]:
        """Accept after the verifier's forward over x [B, T] (its logits [B, T, V] and aux states), row b
        with counts[b] proposals, and draft each row's next k from its draft cache's length on: per row
        (the verdict, None if one of its logit rows was not finite; the next proposals)."""
        self.calls += 1
        # A cache of 0 or 1 rows (after a 1- or 2-token prompt) runs eagerly rather than specialising a graph
        fn = self.fn if min(cache.lengths) >= 2 else accept_and_draft
        n = torch.tensor(counts, device=x.device)
        run = getattr(self.draft, "run_accept_and_draft", None)  # a fast path's own call (the CPU kernels')
        out = run(fn, logits, aux, x, n, cache, self.k) if run else fn(self.draft, logits, aux, x, n, cache, self.k)
        ints, floats, finite = (t.tolist() for t in out)
        T, out = x.shape[1], []
        for i, f, ok, c in zip(ints, floats, finite, counts):
            a = i[0]
            verdict = Verdict(a, i[1 + a], f[:c], f[T - 1 + a]) if all(ok[:c + 1]) else None
            out.append((verdict, Proposal(i[1 + T:], None, f[2 * T - 1:])))
        return out

    def admit(self, slot: int, row, prefill) -> None:
        """The first proposal after a prefill: the draft's pass over the prompt but its last position
        as usual, then that position and the chain through `accept_and_draft`."""
        cache = self.cache.view(slot)
        cache.length = 0
        aux, ids = prefill.aux_hidden_states, torch.tensor([row.verified[1:-1]], device=prefill.logits.device)
        if ids.shape[1] > 0:
            self.draft(ids, self.draft.combine_hidden_states(tuple(h[:, :-1] for h in aux)), cache)
        fresh = torch.contiguous_format  # the prefill's slices: their strides would fail a graph's stride guards
        logits = prefill.logits[:, -1:].clone(memory_format=fresh)
        aux = tuple(h[:, -1:].clone(memory_format=fresh) for h in aux)
        start = cache.length
        [(_, row.upcoming)] = self._after(cache, logits, aux, torch.tensor([[row.verified[-1]]], device=logits.device), [0])
        cache.truncate(start + 1)

    def propose(self, rows: list, ks: list[int], stop_below: float | None) -> list[Proposal]:
        return [r.upcoming.cut(k) for r, k in zip(rows, ks)]

    def accept(self, rows: list, out, x: torch.Tensor, starts: list[int], counts: list[int]) -> list[Verdict | None]:
        """Each row's verdict (None: a logit row of its own was not finite) and its next proposals, after
        the verifier's forward `out` over x, row b from position starts[b] with counts[b] proposals."""
        cache = self.cache.view(0, len(rows))
        cache.set_lengths(starts)
        judged = self._after(cache, out.logits, out.aux_hidden_states, x, counts)
        verdicts = [verdict for verdict, _ in judged]
        for r, (_, upcoming) in zip(rows, judged):
            r.upcoming = upcoming
        # each row's first-pass rows up to its accepted count are final
        cache.set_lengths([s + 1 + (d.num_accepted if d else 0) for s, d in zip(starts, verdicts)])
        return verdicts


def fits(drafter: str, draft_sampling: str, params, acceptor, attention: str) -> bool:
    """Whether a request can take the fused step: greedy decoding with the pair's EAGLE draft, the
    greedy acceptor, no penalty or token constraint, and attention 'torch'."""
    return (drafter == "eagle" and (draft_sampling == "greedy" or params.greedy) and params.greedy and params.plain
            and isinstance(acceptor, GreedyAcceptor) and attention == "torch")
