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
prompt's last position, makes the first proposal after a prefill.

Greedy only: rejection sampling draws from the host's generator between the two halves.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from workbench.cache import KVCache


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


class FusedGreedyStep:
    """`accept_and_draft` after the verifier's forward, for one pair and k; compiled when the pair is."""

    def __init__(self, verifier, draft, k: int, compiled: bool) -> None:
        self.verifier, self.draft, self.k = verifier, draft, k
        self.calls = 0
        self.fn = accept_and_draft
        if compiled:
            from workbench.compiled import compile_function

            self.fn = compile_function(accept_and_draft, next(draft.parameters()).dtype)

    def draft_after(self, logits, aux, x: torch.Tensor, dcache: KVCache) -> FusedOutcome:
        """The second half alone: accept after the verifier's forward over x (its logits [T, V] and
        aux states) and draft the next k from dcache.length on (a benchmark times it apart)."""
        self.calls += 1
        # As in CompiledForward, a cache of 0 or 1 rows (after a 1- or 2-token prompt) runs eagerly
        # rather than specialising a graph on those lengths.
        fn = self.fn if dcache.length >= 2 else accept_and_draft
        ints, floats, finite = fn(self.draft, logits, aux, x, dcache, self.k)
        ints, floats, T = ints.tolist(), floats.tolist(), x.shape[1]
        a = ints[0]
        return FusedOutcome(a, ints[1 + a], floats[:T - 1], floats[T - 1 + a], ints[1 + T:], floats[2 * T - 1:],
                            bool(finite))

    @torch.inference_mode()
    def __call__(self, last: int, proposals: list[int], vcache: KVCache, dcache: KVCache) -> FusedOutcome:
        """Verify `proposals` (up to k) after `last` at vcache.length, accept, draft the next k; both
        caches end at the verified length."""
        start = vcache.length
        x = torch.tensor([[last] + proposals], device=vcache.rows.device)
        out = self.verifier(x, vcache)  # the per-token graph on a compiled pair; advances vcache
        dcache.truncate(start)
        outcome = self.draft_after(out.logits[0], out.aux_hidden_states, x, dcache)
        vcache.truncate(start + 1 + outcome.num_accepted)
        dcache.truncate(start + 1 + outcome.num_accepted)  # the first pass's rows up to the accepted count are final
        return outcome

    @torch.inference_mode()
    def first(self, logits: torch.Tensor, aux: tuple[torch.Tensor, ...], token: int, dcache: KVCache) -> FusedOutcome:
        """The first proposal after a prefill: `token` (the prompt's last argmax, `logits` [1, V] its row)
        at dcache.length, with the prompt's last aux states [1, 1, H]."""
        start = dcache.length
        fresh = torch.contiguous_format  # the prefill's slices: their strides would fail the graph's stride guards
        logits, aux = logits.clone(memory_format=fresh), tuple(h.clone(memory_format=fresh) for h in aux)
        outcome = self.draft_after(logits, aux, torch.tensor([[token]], device=dcache.rows.device), dcache)
        dcache.truncate(start + 1)
        return outcome


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft -> {(id(verifier), k, compiled): step}


def fused_step_for(verifier, draft, k: int, compiled: bool) -> FusedGreedyStep:
    """The pair's fused step for k, made once: a compiled one compiles its graph on first use, and
    every decoder of the pair shares it rather than compiling again."""
    steps = _STEPS.setdefault(draft, {})
    key = (id(verifier), k, compiled)
    if key not in steps or steps[key].verifier is not verifier:
        steps[key] = FusedGreedyStep(verifier, draft, k, compiled)
    return steps[key]
