"""One speculative step, behind one protocol the engine's loop calls.

    proposals = proposer(verified tokens, fresh verifier aux states, k)
    out = verifier([last token] + proposals)            # one forward, k+1 positions
    a, next = acceptor(proposals, out.logits)           # lossless: greedy or rejection sampling
    emit proposals[:a] + [next]; roll the verifier cache back to the verified length
    the aux states of [last token] + proposals[:a] seed the next draft pass

`ProposeVerifyAccept` is that step with any proposer and acceptor; `FusedGreedyStep`
(`workbench.decoding.fused`) is the same step for greedy EAGLE, with the acceptance and the next
drafting in one call after the verify. The engine knows neither, only `Step`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from workbench.cache import KVCache
from workbench.decoding.logits import Context
from workbench.decoding.sampling import Acceptor, SamplingParams, Verdict, check_finite


@dataclass
class StepOutcome:
    proposals: list[int]  # what was verified (at most k)
    token_probs: list[float]  # the draft's probability of each, for display
    verdict: Verdict
    draft_time: float  # seconds drafting (for a fused step, its acceptance and the next drafting)
    verify_time: float  # seconds in the verifier's forward and the acceptance (fused: the forward)


class Step(Protocol):
    def begin(self, verified: list[int], prefill, cache: KVCache) -> None:
        """After the prefill: `verified` = prompt + first token, `prefill` the verifier's output
        over the prompt (its aux states), `cache` the verifier's cache at the prompt's length."""

    def step(self, verified: list[int], k: int, cache: KVCache) -> StepOutcome:
        """Propose up to k tokens after `verified` (0: none, verify the last token alone), verify
        them at cache.length, accept; the cache ends at the verified length."""

    def mark(self, cache: KVCache) -> Callable[[], None]:
        """A callable that puts this step and `cache` back as they are now (a benchmark repeats a step)."""


class ProposeVerifyAccept:
    """The step of DESIGN's parts: a `Proposer`, the verifier's forward, an `Acceptor`."""

    def __init__(self, verifier, proposer, acceptor: Acceptor, params: SamplingParams,
                 generator: torch.Generator, k: int) -> None:
        self.verifier, self.proposer, self.acceptor = verifier, proposer, acceptor
        self.params, self.generator, self.k = params, generator, k
        self.aux: tuple[torch.Tensor, ...] = ()  # verifier states of the positions the proposer has not seen

    def begin(self, verified: list[int], prefill, cache: KVCache) -> None:
        self.proposer.reset(cache.max_len + self.k)  # a chain's provisional rows may pass the context
        self.aux = prefill.aux_hidden_states
        self.prompt_len = len(verified) - 1  # the penalties tell the prompt from the output
        self.steps = 0

    def step(self, verified: list[int], k: int, cache: KVCache) -> StepOutcome:
        self.steps += 1
        t = time.perf_counter()
        prop = self.proposer.propose(verified, self.aux if self.proposer.needs_aux else None, max(k, 1))
        proposals = prop.tokens[:k]
        t_draft = time.perf_counter() - t
        t = time.perf_counter()
        start = cache.length
        out = self.verifier(torch.tensor([[verified[-1]] + proposals], device=cache.rows.device), cache)
        check_finite(out.logits, f"verifier logits at step {self.steps}")
        dq = prop.draft_probs[:k] if prop.draft_probs is not None else None
        context = Context(verified[:self.prompt_len], verified[self.prompt_len:])
        verdict = self.acceptor.verify(proposals, dq, out.logits[0], self.params, self.generator, context)
        cache.truncate(start + 1 + verdict.num_accepted)
        self.aux = tuple(h[:, : verdict.num_accepted + 1] for h in out.aux_hidden_states)
        return StepOutcome(proposals, prop.token_probs[:k], verdict, t_draft, time.perf_counter() - t)

    def mark(self, cache: KVCache) -> Callable[[], None]:
        if not callable(getattr(self.proposer, "rewind", None)):
            raise ValueError(f"the proposer {type(self.proposer).__name__} has no rewind(n), which puts it back "
                             "to a position to repeat a step; expected a workbench.Proposer with it")
        length, aux = cache.length, self.aux
        seen = getattr(self.proposer, "seen", length)  # the positions it has drafted from

        def restore() -> None:
            cache.truncate(length)
            self.aux = aux
            self.proposer.rewind(seen)

        return restore
