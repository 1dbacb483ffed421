"""Proposers: where the k speculative tokens come from.

A proposer sees the verified token ids and the verifier's aux states of the verified tokens
it has not seen yet, and returns k proposals (with the draft's distribution q when it has
one). The engine owns the loop; proposers own their state (the draft's cache).

`EagleProposer` is vLLM's chain EAGLE-3 loop (eagle3_mla.md §5.4): a first pass over every
newly verified position with tokens shifted left by one (position j gets token j+1 and the
fused verifier state of j), then k-1 single-token steps, each feeding back the draft's own
state and advancing the position by one. Draft rows written by those steps are provisional:
the next first pass truncates the draft cache to the verified length and rewrites them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from workbench.decoding.sampling import SamplingParams, probs_from_logits, sample
from workbench.models.draft import Eagle3Draft
from workbench.models.mla import ABSORB_MAX_TOKENS


@dataclass
class Proposal:
    tokens: list[int]
    draft_probs: torch.Tensor | None = None  # [k, V] q used for acceptance; None: greedy (q one-hot)
    token_probs: list[float] = field(default_factory=list)  # q(token_i) under the draft's softmax, for display


class Proposer(Protocol):
    name: str
    needs_aux: bool

    def reset(self, max_len: int) -> None: ...

    def propose(self, tokens: list[int], new_aux: tuple[torch.Tensor, ...] | None, k: int) -> Proposal: ...

    def rewind(self, n: int) -> None: ...  # forget positions n.. (stateless proposers: nothing to do)


class EagleProposer:
    """EAGLE-3 chain drafting with an MLA (or MHA) draft layer."""

    needs_aux = True

    def __init__(self, draft: Eagle3Draft, sampling: str = "greedy", params: SamplingParams | None = None,
                 generator: torch.Generator | None = None) -> None:
        if sampling not in ("greedy", "sample"):
            raise ValueError(f"draft sampling = {sampling!r}; expected 'greedy' or 'sample'")
        self.draft, self.sampling = draft, sampling
        self.params = params or SamplingParams()
        self.generator = generator
        self.name = f"eagle3-{draft.attention_kind}"
        self.cache = None
        self.seen = 0  # positions whose draft rows were computed from verifier states
        self.base = 0  # positions before it have no draft row (a cold start): cache row i is position base + i
        self.chain_k = 0  # the longest greedy chain run so far (see propose)

    @property
    def greedy(self) -> bool:
        """Whether proposals are argmaxes (vLLM's EAGLE; q = 1), as they are at temperature 0."""
        return self.sampling == "greedy" or self.params.greedy

    def reset(self, max_len: int) -> None:
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.draft.new_cache(max_len)
        self.cache.reset()
        self.seen = self.base = 0

    def start_at(self, position: int, rows: torch.Tensor | None = None) -> None:
        """Begin at `position` of a prompt whose earlier verifier states this proposer will not see: with
        `rows` ([layers, 1, position, width], the draft's own rows for positions 0..position-1, handed
        over), or cold (None): the draft then attends only to positions from `position` on. Cold rows
        sit at cache row position - base; RoPE scores depend only on position differences, so that is
        the same attention as at their absolute positions."""
        self.cache.reset()
        if rows is not None:
            self.cache.rows[:, :, :position] = rows
            self.cache.length = position
        self.seen, self.base = position, 0 if rows is not None else position
    def rewind(self, n: int) -> None:
        """Forget the draft's rows from position n on, as if the verifier had seen only n positions:
        the next `propose` takes aux states from there (a benchmark repeats one step this way)."""
        if not self.base <= n <= self.seen:
            raise ValueError(f"EAGLE proposer: rewind to {n}; expected {self.base}..{self.seen} (the positions seen)")
        self.seen = n
        self.cache.truncate(n - self.base)

    def _prefix_pass(self, ids: torch.Tensor, new_aux: tuple[torch.Tensor, ...]):
        """The first pass over all but the last new position; returns that position's ids and aux states."""
        prefix = self.draft.combine_hidden_states(tuple(h[:, :-1] for h in new_aux))
        self.draft(ids[:, :-1], prefix, self.cache)
        return ids[:, -1:], tuple(h[:, -1:] for h in new_aux)

    @torch.inference_mode()
    def propose(self, tokens: list[int], new_aux: tuple[torch.Tensor, ...] | None, k: int) -> Proposal:
        n_new = len(tokens) - 1 - self.seen  # positions seen..len-2 have fresh verifier states
        if new_aux is None or new_aux[0].shape[1] != n_new:
            raise ValueError(f"EAGLE proposer expected aux states for {n_new} new positions")
        device = self.draft.norm.weight.device
        self.cache.truncate(self.seen - self.base)
        ids = torch.tensor([tokens[self.seen + 1:]], device=device)
        self.seen = len(tokens) - 1
        if self.greedy:  # vLLM's EAGLE: argmax proposals, q = 1
            # The chain runs the longest k asked so far, cut to k: a traced chain is one graph per
            # length, and the engine asks for fewer only in a request's last steps.
            self.chain_k = max(k, self.chain_k)
            room = self.cache.length + ids.shape[1] + self.chain_k - 1 <= self.cache.max_len
            run = self.chain_k if room else k  # near the context's end: only the k asked for
            if ids.shape[1] > 1 and (self.cache.length < 2 or ids.shape[1] > ABSORB_MAX_TOKENS):
                # The prompt's pass (or a long catch-up) runs apart, as the prefill does, so the chain
                # covers a step's few positions: its last position's pass and k-1 steps.
                ids, new_aux = self._prefix_pass(ids, new_aux)
            # The aux states go in unfused: the chain runs fc itself.
            chain, probs = self.draft.greedy_chain(ids, new_aux, self.cache, run)
            return Proposal(chain[0, :k].tolist(), None, probs[0, :k].tolist())
        hidden = self.draft.combine_hidden_states(new_aux)
        post, state = self.draft(ids, hidden, self.cache)
        out, qs = [], []
        for i in range(k):  # sampled proposals carry their real q for rejection sampling
            q = probs_from_logits(self.draft.compute_logits(post)[0, -1], self.params)
            out.append(sample(q, self.generator)), qs.append(q)
            if i + 1 < k:
                post, state = self.draft(torch.tensor([[out[-1]]], device=device), state[:, -1:], self.cache)
        return Proposal(out, torch.stack(qs), [float(q[t]) for q, t in zip(qs, out)])


class NgramProposer:
    """Prompt-lookup decoding: copy what followed the latest earlier match of the last n tokens."""

    needs_aux = False
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def reset(self, max_len: int) -> None:
        pass

    def rewind(self, n: int) -> None:
        pass

    def propose(self, tokens: list[int], new_aux, k: int) -> Proposal:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) <= n:
                continue
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        follow = follow + [follow[-1]] * (k - len(follow))
                        return Proposal(follow, None, [1.0] * k)
        return Proposal([tokens[-1]] * k, None, [1.0] * k)
