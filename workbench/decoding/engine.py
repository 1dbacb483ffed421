"""One request at a time on the engine (`workbench.decoding.batch`, the one loop): `SpecDecoder`,
speculative decoding as a batch of one (vLLM's chain EAGLE-3), and `generate_autoregressive`, its
fair baseline: k = 0 of the same loop, so the verifier, cache and sampling are the same and every
comparison is like for like.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from workbench.decoding.adaptive import KPolicy
from workbench.decoding.batch import FUSED_NEEDS, BatchDecoder, checked_settings, samples_drafts
from workbench.decoding.drafters import Drafter
from workbench.decoding.events import GenerationResult, StepEvent
from workbench.decoding.fused import fits
from workbench.decoding.request import MAX_K, RequestError, acceptance_rule, result_of, sampling_params
from workbench.decoding.sampling import Acceptor, SamplingError


class SpecDecoder:
    """Speculative decoding with a draft proposer and a lossless acceptor: the engine with one row.

    `proposer` is "eagle" (the pair's draft), "ngram" (prompt lookup), or any `Drafter`;
    `acceptor` defaults to greedy at temperature 0, rejection sampling otherwise. `attention`
    picks the absorbed attention's backend (`ModelPair.with_attention`). `fused` runs each step's
    verify, greedy acceptance and next drafting as one step (`workbench.decoding.fused`): None
    (default) where it applies and pays (a compiled pair with greedy EAGLE), True requires it, False never.
    """

    def __init__(self, pair, num_speculative_tokens: int = 3, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, proposer: str | Drafter = "eagle",
                 acceptor: Acceptor | str | None = None, attention: str = "auto", draft_sampling: str = "greedy",
                 fused: bool | None = None, policy: KPolicy | None = None, **constraints) -> None:
        """`constraints`: vLLM's repetition_penalty, frequency_penalty, presence_penalty,
        allowed_token_ids, banned_token_ids and bad_words (strings), as `sampling_params` takes them.
        `policy` sets k each step (`workbench.decoding.adaptive`; default: always k)."""
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise RequestError(f"num_speculative_tokens = {k!r}; expected an integer in [1, {MAX_K}]")
        if fused not in (None, True, False):
            raise RequestError(f"fused = {fused!r}; expected None (where it applies), True or False")
        attention = pair.with_attention(attention).attention
        self.params, self.acceptor = checked_settings(pair, temperature, top_p, top_k, acceptor, draft_sampling,
                                                      **constraints)
        fit = fits(proposer if isinstance(proposer, str) else "custom", draft_sampling, self.params, self.acceptor,
                   attention)
        if fused and not fit:
            raise RequestError(FUSED_NEEDS)
        use = bool(fit and (fused or (fused is None and pair.compiled)))
        self.engine = BatchDecoder(pair, k, max_batch_size=1, policy=policy, proposer=proposer, attention=attention,
                                   fused=use, preallocate=False)
        self.pair, self.k, self.seed, self.attention = self.engine.pair, k, seed, attention
        self.proposer = self.engine.drafter
        self.fused = self.engine.drafter if use else None
        self.request_settings = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                     acceptor=self.acceptor, draft_sampling=draft_sampling, **constraints)
        self._sampled = samples_drafts(self.proposer, draft_sampling, self.params)

    @property
    def acceptance_rule(self) -> str:
        """Which rule judges the proposals, and what q it sees (vLLM's docs tell these apart)."""
        return acceptance_rule(self.acceptor, self.k, self._sampled)

    def engine_report(self) -> dict:
        """What runs a request: the loop and its settings, the drafter, the acceptance rule, the fast path."""
        return {**self.engine.settings(), "acceptance_rule": self.acceptance_rule}

    def submit(self, prompt: str | list[int], max_new_tokens: int = 128, stop: str | list[str] | None = None,
               max_len: int | None = None, heal: bool = False) -> int:
        """Queue the request on the engine with this decoder's settings; returns its id. A request still
        in flight (a stream left unfinished) is cancelled: a decoder serves one request at a time."""
        for r in [*self.engine.rows, *self.engine.queue]:
            self.engine.cancel(r.rid)
        self.engine.history.clear()
        self.engine.finished.clear()  # the last request's row (`generate` reads it)
        return self.engine.submit(prompt, max_new_tokens, stop=stop, heal=heal, max_len=max_len, **self.request_settings)

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, stop: str | list[str] | None = None,
                 max_len: int | None = None, heal: bool = False) -> GenerationResult:
        t0 = time.perf_counter()
        events = list(self.stream(prompt, max_new_tokens, stop, max_len, heal))
        row, = self.engine.finished.values()
        return result_of(events, row.emitter, time.perf_counter() - t0, self.k, self.acceptance_rule)

    @torch.inference_mode()  # the caller's grad mode is its own: each resumption runs without autograd
    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, stop: str | list[str] | None = None,
               max_len: int | None = None, heal: bool = False) -> Iterator[StepEvent]:
        """Yield one StepEvent per verifier forward: the prefill token first, then each spec step.

        `heal` backs off a prompt's last token and lets the first token be any that extends it
        (`workbench.decoding.healing`): for prompts that end in whitespace or mid-token.

        Runs in inference mode whatever the caller's grad mode (as generate_autoregressive does):
        under autograd the verifier would record a graph, and speculation would be measured
        against a baseline that pays none.
        """
        yield from run_one(self.engine, self.submit(prompt, max_new_tokens, stop, max_len, heal))


def run_one(engine: BatchDecoder, rid: int) -> Iterator[StepEvent]:
    """Step `engine` until request `rid`, its only one, ends, yielding its events (its first as soon as
    it is prefilled); a request that failed raises its error (SamplingError: broken logits) after the
    events before it. A caller that stops early cancels it."""
    done = False
    try:
        for _, ev in engine.admit():
            yield ev
        while not engine.idle:
            for _, ev in engine.step():
                yield ev
        done = True
    finally:
        if not done:
            engine.cancel(rid)
    if engine.finished[rid].exc is not None:
        raise engine.finished.pop(rid).exc


@torch.inference_mode()
def generate_autoregressive(pair, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                            top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop: str | list[str] | None = None,
                            attention: str = "auto", max_len: int | None = None, heal: bool = False,
                            **constraints) -> GenerationResult:
    """Plain decoding with the same verifier, cache and sampling: one token per forward, k = 0 of the
    engine (`heal` and the penalties and token constraints as in `SpecDecoder`)."""
    engine = BatchDecoder(pair, 0, max_batch_size=1, attention=attention, preallocate=False)
    rid = engine.submit(prompt, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        stop=stop, heal=heal, max_len=max_len, **constraints)
    t0 = time.perf_counter()
    events = list(run_one(engine, rid))
    return result_of(events, engine.finished[rid].emitter, time.perf_counter() - t0, 0)


__all__ = ["SpecDecoder", "generate_autoregressive", "sampling_params", "RequestError", "SamplingError", "MAX_K"]
