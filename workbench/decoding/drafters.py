"""Drafters: where each row's k speculative tokens come from, for every row of a step at once.

    drafter.admit(slot, row, prefill)     after a request's prefill (the verifier's output over its prompt)
    drafter.propose(rows, ks, stop_below) a `Proposal` per row: up to ks[b] tokens (the engine cuts them)
    drafter.move(src, dst)                the row in slot src now lives in slot dst
    drafter.reserve(max_len)              room for max_len positions a slot (called while no row decodes)

A drafter holds memory shared by its slots (the draft's cache, one slot a row); what it knows of a
row lives on the row (`seen`, `aux`, `base`, `upcoming`), so the engine can put a step back and
repeat it (`BatchDecoder.mark`). The EAGLE drafter is vLLM's chain EAGLE-3 (eagle3_mla.md §5.4):
a first pass over each row's newly verified positions with tokens shifted left by one (position j
gets token j+1 and the fused verifier state of j), then k-1 single-token steps, each feeding back
the draft's own state: `greedy_chain`, the one greedy chain (the fused step's too). Rows past a
first pass's end are provisional: the next first pass truncates to the verified length and
rewrites them. `NgramDrafter` is prompt lookup (no model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from workbench.cache import KVCache
from workbench.decoding.sampling import probs_from_logits, sample


@dataclass
class Proposal:
    tokens: list[int]
    draft_probs: torch.Tensor | None = None  # [k, V] q used for acceptance; None: greedy (q one-hot)
    token_probs: list[float] = field(default_factory=list)  # q(token_i) under the draft's softmax, for display

    def cut(self, n: int) -> "Proposal":
        q = self.draft_probs[:n] if self.draft_probs is not None else None
        return Proposal(self.tokens[:n], q, self.token_probs[:n])


class Drafter(Protocol):
    name: str
    needs_aux: bool  # whether rows keep the verifier's aux states of the positions it has not seen

    def admit(self, slot: int, row, prefill) -> None: ...

    def propose(self, rows: list, ks: list[int], stop_below: float | None) -> list[Proposal]: ...

    def move(self, src: int, dst: int) -> None: ...

    def reserve(self, max_len: int) -> None: ...


def greedy_chain(draft, input_ids: torch.Tensor, hidden: torch.Tensor | tuple[torch.Tensor, ...], cache: KVCache,
                 k: int, counts: list[int] | None = None, stop_below: float | None = None,
                 at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy chain, the only one in Python: the draft's first pass over input_ids [B, T] (with the
    fused state [B, T, H], or the verifier's aux states for fc to fuse), then k-1 passes each over the
    last argmax, with no trip to the host between them -> proposals [B, k], each one's probability [B, k].
    A fast path runs it its own way through its draft's `run_greedy_chain` (the CPU kernels'
    `wb_eagle_chain` is its C++ transform; a compiled pair, one graph of it). The engine's modes:
    `counts` (rows padded to T): sequence b's first counts[b] positions are real, its cache ends after
    them and its chain continues from its row counts[b]-1. `stop_below`: the chain ends once every
    sequence has proposed a token below that probability (a host read per step). `at` (the fused
    step): continue from each sequence's row at[b], a [B] tensor only the device knows, at the
    positions after it (`Eagle3Draft.forward_at`); the caller then sets the cache's lengths.
    """
    (B, T), start = input_ids.shape, cache.lengths
    post, state = draft.draft_pass(input_ids, hidden if isinstance(hidden, torch.Tensor)
                                   else draft.combine_hidden_states(hidden), cache)
    if at is None:  # each sequence's cache ends after its own new positions
        counts = counts or [T] * B
        cache.set_lengths([s + n for s, n in zip(start, counts)])
    last = torch.tensor(counts, device=input_ids.device) - 1 if at is None else at.reshape(-1)
    rows = torch.arange(len(last), device=input_ids.device)  # a static count (in a graph, B may be symbolic)
    post, state = post[rows, last][:, None], state[rows, last][:, None]
    tokens, probs, unsure = [], [], None
    for i in range(k):
        t, p = draft.greedy_pick(post)
        tokens.append(t), probs.append(p)
        if stop_below is not None:  # a host read per step: only adaptive policies ask for it
            unsure = (p < stop_below) if unsure is None else unsure | (p < stop_below)
            if bool(unsure.all()):
                break
        if i + 1 < k and at is None:
            post, state = draft.draft_pass(t, state, cache)
        elif i + 1 < k:  # at positions only the device knows, reading rows up to the chain's end
            base = start[0] if B == 1 else torch.tensor(start, device=input_ids.device)  # one row: an int a graph keeps symbolic
            post, state = draft.forward_at(t, state, cache, base + last + 1 + i, max(start) + T + k - 1)
    return torch.cat(tokens, 1), torch.cat(probs, 1)


class EagleDrafter:
    """EAGLE-3 chain drafting with an MLA (or MHA) draft layer: row b's draft cache is slot b.

    Greedy rows (vLLM's EAGLE: argmaxes, q one-hot) draft together in one `greedy_chain` with each
    row's count of new positions, run the fast path's way where the draft has one; a row that samples
    its drafts (`draft_sampling="sample"` at temperature > 0) draws them with its own generator and
    keeps each q for rejection sampling.
    """

    needs_aux = True

    def __init__(self, draft, slots: int) -> None:
        self.draft, self.slots = draft, slots
        self.cache = None  # allocated by `reserve`
        self.name = f"eagle3-{draft.attention_kind}"

    def reserve(self, max_len: int) -> None:
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.draft.new_cache(max_len, batch=self.slots)

    def admit(self, slot: int, row, prefill) -> None:
        """The draft's pass over the prompt but its last position; that position's aux states wait for the chain."""
        aux, n = prefill.aux_hidden_states, row.prompt_len
        cache = self.cache.view(slot)
        cache.length = 0
        if n > 1:
            ids = torch.tensor([row.verified[1:n]], device=aux[0].device)
            self.draft(ids, self.draft.combine_hidden_states(tuple(h[:, :-1] for h in aux)), cache)
        row.seen, row.base, row.aux = n - 1, 0, tuple(h[:, -1:] for h in aux)

    def start_at(self, slot: int, row, position: int, rows: torch.Tensor | None) -> None:
        """Begin at `position` of a prompt whose earlier verifier states this drafter will not see
        (prefill/decode disaggregation): with `rows` ([layers, 1, position, width], the draft's own rows
        for positions 0..position-1, handed over), or cold (None): the row's draft cache then starts at
        `position` (`row.base`); RoPE scores depend only on position differences, so that is the same
        attention as at the absolute positions. `row.aux` holds the states from `position` on."""
        cache = self.cache.view(slot)
        cache.length = 0
        if rows is not None:
            cache.rows[:, :, :position] = rows
            cache.length = position
        row.seen, row.base = position, 0 if rows is not None else position

    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst)

    def propose(self, rows: list, ks: list[int], stop_below: float | None) -> list[Proposal]:
        if all(not r.sampled_draft for r in rows):
            out = self._greedy(rows, ks, self.cache.view(0, len(rows)), stop_below)
        else:  # each row alone, in its own slot
            out = [self._sampled(r, k, self.cache.view(b)) if r.sampled_draft
                   else self._greedy([r], [k], self.cache.view(b), stop_below)[0]
                   for b, (r, k) in enumerate(zip(rows, ks))]
        for r in rows:
            r.seen, r.aux = len(r.verified) - 1, ()
        return out

    def _new(self, rows: list) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], list[int]]:
        """Every row's new tokens (shifted left by one) and aux states, padded to the longest: [B, T], [B, T, H]."""
        counts = [r.aux[0].shape[1] for r in rows]
        width, dev = max(counts), rows[0].aux[0].device
        ids = torch.tensor([r.verified[r.seen + 1:] + [0] * (width - n) for r, n in zip(rows, counts)], device=dev)
        if len(rows) == 1:  # nothing to pad or join
            return ids, rows[0].aux, counts
        aux = tuple(torch.cat([torch.nn.functional.pad(r.aux[i], (0, 0, 0, width - n)) for r, n in zip(rows, counts)])
                    for i in range(len(rows[0].aux)))  # zeros past each row's own
        return ids, aux, counts

    def _greedy(self, rows: list, ks: list[int], cache, stop_below: float | None) -> list[Proposal]:
        cache.set_lengths([r.seen - r.base for r in rows])  # the last chain's provisional rows go
        ids, aux, counts = self._new(rows)
        # Within the cache: a chain writes k - 1 provisional rows past each row's first pass.
        k = min(max(ks), self.cache.max_len - max(n + c for n, c in zip(cache.lengths, counts)) + 1)
        run = getattr(self.draft, "run_greedy_chain", lambda chain, *a: chain(self.draft, *a))  # a fast path's own way
        tokens, probs = run(greedy_chain, ids, aux, cache, k, counts, stop_below)
        return [Proposal(t[:kb], None, p[:kb]) for t, p, kb in zip(tokens.tolist(), probs.tolist(), ks)]

    def _sampled(self, row, k: int, cache) -> Proposal:
        """k proposals, each sampled from the draft's q (after the row's temperature, top-k, top-p) with the
        row's generator; q is kept for rejection sampling."""
        cache.length = row.seen - row.base
        ids, aux, _ = self._new([row])
        post, state = self.draft(ids, self.draft.combine_hidden_states(aux), cache)
        out, qs = [], []
        for i in range(k):
            q = probs_from_logits(self.draft.compute_logits(post)[0, -1], row.params)
            out.append(sample(q, row.generator)), qs.append(q)
            if i + 1 < k:
                post, state = self.draft(torch.tensor([[out[-1]]], device=ids.device), state[:, -1:], cache)
        return Proposal(out, torch.stack(qs) if qs else None, [float(q[t]) for q, t in zip(qs, out)])


class NgramDrafter:
    """Prompt lookup: copy what followed the latest earlier match of a row's last n tokens."""

    needs_aux = False
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def admit(self, slot: int, row, prefill) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass

    def reserve(self, max_len: int) -> None:
        pass

    def propose(self, rows: list, ks: list[int], stop_below: float | None) -> list[Proposal]:
        return [Proposal(self.lookup(r.verified, k), None, [1.0] * k) for r, k in zip(rows, ks)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) <= n:
                continue
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow + [follow[-1]] * (k - len(follow))
        return [tokens[-1]] * k
