"""A request, checked: its prompt ids, budget, stops and context; the emitter that takes its tokens
and says when it ends; its result; and the name of the rule that judges its proposals.

Every way of decoding (`workbench.decoding.batch`, the one loop, and its batch-of-one and plain
faces in `workbench.decoding.engine`) checks requests and emits tokens through these.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.decoding.events import GenerationResult, StepEvent
from workbench.decoding.healing import Healing, first_piece, heal
from workbench.decoding.logits import bad_word_sequences
from workbench.decoding.sampling import GreedyAcceptor, SamplingParams
from workbench.decoding.stats import compute_stats

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


def result_of(events: list[StepEvent], em: _Emitter, elapsed: float, k: int,
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


def acceptance_rule(acceptor, k: int, sampled_draft: bool = False) -> str:
    """Which rule judges a request's proposals, and what q it sees (vLLM's docs tell these apart):
    the one name every decoder reports."""
    if not k:
        return "none (autoregressive)"
    name = getattr(acceptor, "name", type(acceptor).__name__)
    if isinstance(acceptor, GreedyAcceptor):
        return name
    return f"{name} ({'sampled draft, its real q' if sampled_draft else 'greedy draft, one-hot q'})"
