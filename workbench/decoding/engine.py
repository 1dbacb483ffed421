"""The speculative decoding loop (vLLM's chain EAGLE-3, one request; many at once:
`workbench.decoding.batch`) and its fair baseline.

`SpecDecoder.stream` prefills, then calls one `Step` (`workbench.decoding.step`, eagle3_mla.md
§5) until the request ends, turning each outcome into a `StepEvent`. `generate_autoregressive`
runs the same verifier, cache and sampling one token per forward, so every comparison is like
for like.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from workbench.cache import KVCache
from workbench.decoding.events import GenerationResult, StepEvent
from workbench.decoding.fused import FusedGreedyStep
from workbench.decoding.healing import Healing, first_piece, heal
from workbench.decoding.proposers import EagleProposer, NgramProposer, Proposer
from workbench.decoding.logits import Context, bad_word_sequences
from workbench.decoding.sampling import (Acceptor, GreedyAcceptor, SamplingError, SamplingParams, SyntheticAcceptor,
                                         acceptor_for, check_synthetic_rates,
                                         check_finite, next_token, shown_prob)
from workbench.decoding.stats import compute_stats
from workbench.decoding.step import ProposeVerifyAccept, Step

MAX_K = 16


class RequestError(ValueError):
    """A request the decoder cannot serve (empty prompt, too long, bad k...)."""


@dataclass
class _Request:
    prompt_ids: list[int]  # what the verifier reads (without a healed last token)
    max_new_tokens: int
    stop: tuple[str, ...]
    max_len: int
    healing: Healing | None = None

    def first_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The prefill's logits for the first token: only tokens that extend a healed prefix."""
        return self.healing.constrain(logits) if self.healing else logits


class _Emitter:
    """Accumulates emitted tokens and applies EOS, stop strings, max_new_tokens and the context limit."""

    def __init__(self, pair, req: _Request) -> None:
        self.tok, self.req = pair.tokenizer, req
        self.eos = set(pair.eos_token_ids)
        self.tokens: list[int] = []
        self.text = ""
        self.finish: str | None = None

    def room(self) -> int:
        return self.req.max_new_tokens - len(self.tokens)

    def add(self, token: int) -> str:
        """Take one token; return its text. Sets `finish` when generation must end after it."""
        context = self.tokens[-8:] if self.tokens else self.req.prompt_ids[-4:]
        # End-of-sequence is a control token, not text (vLLM skips special tokens the same way).
        if token in self.eos:
            piece = ""
        elif not self.tokens and self.req.healing:  # the healed prefix is the user's text already
            piece = first_piece(self.tok, self.req.healing, token)
        else:
            piece = self.tok.token_texts([token], prefix=context)[0]
        self.tokens.append(token)
        self.text += piece
        window = self.text[-(len(piece) + max((len(s) for s in self.req.stop), default=0)):]
        if token in self.eos:
            self.finish = "eos"
        elif any(s in window for s in self.req.stop):
            self.finish = "stop"
        elif len(self.tokens) >= self.req.max_new_tokens:
            self.finish = "length"
        elif len(self.req.prompt_ids) + len(self.tokens) >= self.req.max_len:
            self.finish = "context"
        return piece

    def final_text(self) -> str:
        """The text, cut before a stop string (the stop string itself is not output, as in vLLM)."""
        if self.finish == "stop":
            cut = min(i for i in (self.text.find(s) for s in self.req.stop) if i >= 0)
            return self.text[:cut]
        return self.text


def _validate_common(pair, prompt, max_new_tokens: int, stop, max_len: int | None, healing: bool = False) -> _Request:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty; expected at least one token of text")
        ids = pair.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise RequestError("prompt is empty; expected at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise RequestError(f"max_new_tokens = {max_new_tokens!r}; expected an integer >= 1")
    context = pair.context_length if max_len is None else min(max_len, pair.context_length)
    if len(ids) >= context:
        raise RequestError(f"prompt has {len(ids)} tokens; the context is {context} tokens, so at most "
                           f"{context - 1} prompt tokens leave room to generate")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    special = set(pair.eos_token_ids) | {i for i in (pair.tokenizer.bos_token_id, pair.tokenizer.pad_token_id) if i is not None}
    h = heal(pair.tokenizer, ids, special) if healing else None
    return _Request(h.prompt_ids if h else ids, max_new_tokens, tuple(s for s in stop if s), context, h)


class SpecDecoder:
    """Speculative decoding with a draft proposer and a lossless acceptor.

    `proposer` is "eagle" (the pair's draft), "ngram" (prompt lookup), or any `Proposer`;
    `acceptor` defaults to greedy at temperature 0, rejection sampling otherwise. `attention`
    picks the absorbed attention's backend (`ModelPair.with_attention`). `fused` runs each step's
    verify, greedy acceptance and next drafting as one step (`FusedGreedyStep`): None (default)
    where it applies and pays (a compiled pair with greedy EAGLE), True requires it, False never.
    """

    def __init__(self, pair, num_speculative_tokens: int = 3, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, proposer: str | Proposer = "eagle",
                 acceptor: Acceptor | str | None = None, attention: str = "auto", draft_sampling: str = "greedy",
                 fused: bool | None = None, **constraints) -> None:
        """`constraints`: vLLM's repetition_penalty, frequency_penalty, presence_penalty,
        allowed_token_ids, banned_token_ids and bad_words (strings), as `sampling_params` takes them."""
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise RequestError(f"num_speculative_tokens = {k!r}; expected an integer in [1, {MAX_K}]")
        self.pair = pair = pair.with_attention(attention)
        self.k = k
        self.params = sampling_params(pair, temperature, top_p, top_k, **constraints)
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.attention = pair.attention
        self.acceptor = acceptor if not isinstance(acceptor, (str, type(None))) else acceptor_for(self.params, acceptor)
        if isinstance(self.acceptor, SyntheticAcceptor):
            check_synthetic_rates(self.acceptor.rates, k)
        if proposer == "eagle":
            if pair.draft is None:
                raise RequestError("proposer 'eagle' needs a draft; this pair has none (use proposer='ngram')")
            proposer = EagleProposer(pair.draft, draft_sampling, self.params, self.generator)
        elif proposer == "ngram":
            proposer = NgramProposer()
        elif isinstance(proposer, str):
            raise RequestError(f"proposer = {proposer!r}; expected 'eagle', 'ngram' or a Proposer object")
        self.proposer = proposer
        self.fused = self._fused_step(fused)
        self.step: Step = self.fused or ProposeVerifyAccept(pair.verifier, proposer, self.acceptor, self.params,
                                                            self.generator, k)

    def _fused_step(self, fused: bool | None) -> FusedGreedyStep | None:
        if fused not in (None, True, False):
            raise RequestError(f"fused = {fused!r}; expected None (where it applies), True or False")
        fits = (isinstance(self.proposer, EagleProposer) and self.proposer.greedy and self.params.greedy
                and self.params.plain and isinstance(self.acceptor, GreedyAcceptor) and self.attention == "torch")
        if fused and not fits:
            raise RequestError("fused = True needs greedy decoding with the pair's EAGLE draft, the greedy "
                               "acceptor, no penalty or token constraint, and attention 'torch'")
        if fused is False or not fits or (fused is None and not self.pair.compiled):
            return None
        return FusedGreedyStep(self.pair.verifier, self.pair.draft, self.k, self.pair.compiled)

    @property
    def acceptance_rule(self) -> str:
        """Which rule judges the proposals, and what q it sees (vLLM's docs tell these apart)."""
        name = getattr(self.acceptor, "name", type(self.acceptor).__name__)
        if isinstance(self.acceptor, GreedyAcceptor):
            return name
        sampled = isinstance(self.proposer, EagleProposer) and not self.proposer.greedy
        return f"{name} ({'sampled draft, its real q' if sampled else 'greedy draft, one-hot q'})"

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, stop: str | list[str] | None = None,
                 max_len: int | None = None, heal: bool = False) -> GenerationResult:
        t0 = time.perf_counter()
        events = list(self.stream(prompt, max_new_tokens, stop, max_len, heal))
        return self.result(events, time.perf_counter() - t0)

    def cache_rows(self, prompt_len: int, max_new_tokens: int, context: int) -> int:
        """The verifier cache's rows for a request: room for a last step's k+1 tokens past the
        budget, within the context (a benchmark of one step allocates the same)."""
        return min(context, prompt_len + max_new_tokens + self.k + 1)

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
        req = self.request(prompt, max_new_tokens, stop, max_len, heal)
        out, cache, first, event = self.prefill(req)
        verified = req.prompt_ids + [first]
        self.step.begin(verified, out, cache)
        yield event
        yield from self.steps(verified, cache)

    def request(self, prompt: str | list[int], max_new_tokens: int = 128, stop: str | list[str] | None = None,
                max_len: int | None = None, heal: bool = False) -> _Request:
        """A checked request; the decoder's generator is reseeded and its emitter starts empty."""
        return self.begin(_validate_common(self.pair, prompt, max_new_tokens, stop, max_len, heal))

    def begin(self, req: _Request, first_token: int | None = None) -> _Request:
        """Start serving `req`: the generator reseeded, the emitter empty, or holding the first token a
        prefill instance already sampled (a decode instance takes over from there)."""
        self.generator.manual_seed(self.seed)
        self._emitter = _Emitter(self.pair, req)
        if first_token is not None:
            self._emitter.add(first_token)
        return req

    def result(self, events: list[StepEvent], elapsed: float) -> GenerationResult:
        """The request's result from its events, as `generate` returns it."""
        return _result(events, self._emitter, elapsed, self.k, self.acceptance_rule)

    def prefill(self, req: _Request):
        """The prompt's forward into a new cache and the first token: (verifier output, cache, token, event)."""
        pair, em = self.pair, self._emitter
        cache = pair.verifier_cache(self.cache_rows(len(req.prompt_ids), req.max_new_tokens, req.max_len))
        t = time.perf_counter()
        out = pair.verifier(torch.tensor([req.prompt_ids], device=pair.device), cache, logits_to_keep=1)
        logits = req.first_logits(out.logits[0, -1])
        check_finite(logits, "verifier logits at the prompt's last position")
        first = next_token(logits, self.params, self.generator, Context(req.prompt_ids))
        piece = em.add(first)
        event = StepEvent(step=0, kind="prefill", emitted=[first], emitted_text=[piece], emitted_status=["bonus"],
                          emitted_verifier_probs=[shown_prob(logits, self.params, first, Context(req.prompt_ids))],
                          position=len(req.prompt_ids), verify_time=time.perf_counter() - t, finish_reason=em.finish)
        return out, cache, first, event

    def steps(self, verified: list[int], cache: KVCache) -> Iterator[StepEvent]:
        """The speculative steps after the prefill (`self.step` begun on `verified` and `cache`)."""
        pair, k, em = self.pair, self.k, self._emitter
        step = 0
        while em.finish is None:
            step += 1
            k_now = max(0, min(k, em.req.max_len - cache.length - 1, em.room()))  # 0: no room, a plain decode
            o = self.step.step(verified, k_now, cache)
            a, proposals = o.verdict.num_accepted, o.proposals
            emitted = proposals[:a] + [o.verdict.next_token]
            status = ["accepted"] * a + ["bonus" if a == k_now else "corrected"]
            vprobs = o.verdict.verifier_probs[:a] + [o.verdict.next_token_prob]
            proposed_text = pair.tokenizer.token_texts(proposals, prefix=verified[-8:]) if proposals else []
            position = len(verified)
            texts = []
            for tok in emitted:  # a stop inside the accepted run drops the tokens after it
                texts.append(em.add(tok))
                if em.finish:
                    break
            n = len(texts)
            verified += emitted[:n]
            yield StepEvent(
                step=step, kind="spec", proposed=proposals, proposed_text=proposed_text,
                draft_probs=o.token_probs, verifier_probs=o.verdict.verifier_probs, num_accepted=a,
                emitted=emitted[:n], emitted_text=texts, emitted_status=status[:n],
                emitted_verifier_probs=vprobs[:n], position=position,
                draft_time=o.draft_time, verify_time=o.verify_time, finish_reason=em.finish)


def _result(events: list[StepEvent], em: _Emitter, elapsed: float, k: int,
            rule: str = "none (autoregressive)") -> GenerationResult:
    stats = compute_stats(events, elapsed=elapsed, num_tokens=len(em.tokens))
    return GenerationResult(list(em.tokens), em.final_text(), events, stats, em.req.prompt_ids,
                            em.finish or "length", k, rule)


def sampling_params(pair, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                    repetition_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                    allowed_token_ids=None, banned_token_ids=(), bad_words=()) -> SamplingParams:
    """`SamplingParams` as vLLM's request fields give them, bad words as strings (tokenized with the
    pair's tokenizer), every token id checked against the verifier's vocabulary."""
    params = SamplingParams(temperature, top_p, top_k, repetition_penalty, frequency_penalty, presence_penalty,
                            allowed_token_ids, tuple(banned_token_ids or ()),
                            bad_word_sequences(pair.tokenizer, bad_words) if bad_words else ())
    params.check_vocab(pair.verifier.config.vocab_size)
    return params


@torch.inference_mode()
def generate_autoregressive(pair, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                            top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop: str | list[str] | None = None,
                            attention: str = "auto", max_len: int | None = None, heal: bool = False,
                            **constraints) -> GenerationResult:
    """Plain decoding with the same verifier, cache and sampling: one token per forward (`heal` and
    the penalties and token constraints as in `SpecDecoder`)."""
    params = sampling_params(pair, temperature, top_p, top_k, **constraints)
    req = _validate_common(pair, prompt, max_new_tokens, stop, max_len, heal)
    pair = pair.with_attention(attention)
    gen = torch.Generator().manual_seed(seed)
    cache = pair.verifier_cache(min(req.max_len, len(req.prompt_ids) + max_new_tokens + 1))
    em = _Emitter(pair, req)
    events: list[StepEvent] = []
    t_start = time.perf_counter()
    x = torch.tensor([req.prompt_ids], device=pair.device)
    while em.finish is None:
        t = time.perf_counter()
        logits = pair.verifier(x, cache, logits_to_keep=1).logits[0, -1]
        if not events:
            logits = req.first_logits(logits)
        check_finite(logits, f"verifier logits at position {cache.length - 1}")
        context = Context(req.prompt_ids, list(em.tokens))
        tok = next_token(logits, params, gen, context)
        shown = shown_prob(logits, params, tok, context)
        piece = em.add(tok)
        events.append(StepEvent(step=len(events), kind="prefill" if not events else "decode", emitted=[tok],
                                emitted_text=[piece], emitted_status=["bonus"], emitted_verifier_probs=[shown],
                                position=cache.length, verify_time=time.perf_counter() - t, finish_reason=em.finish))
        x = torch.tensor([[tok]], device=pair.device)
    return _result(events, em, time.perf_counter() - t_start, 0)


__all__ = ["SpecDecoder", "generate_autoregressive", "sampling_params", "RequestError", "SamplingError", "MAX_K"]
