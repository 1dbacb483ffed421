"""What plain decoding and every acceptor do to a row of logits before choosing a token, in vLLM's order:

    allowed ids, banned ids, bad words    everything else / those at -inf
    repetition penalty                     tokens in the prompt or the output: logit / r if > 0, else * r
    frequency and presence penalties       tokens in the output: minus f * count + p (once)
    temperature, top-k, top-p              `probs_from_logits`

The penalties and bad words read the tokens before the position (`Context`). At draft position i
of a verify that is the prompt, the output so far and the proposals before i: a per-step context
would give a distribution plain decoding never had there, and speculation would not be lossless.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """Bad sampling settings or unusable logits."""


def _ids(name: str, value) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = tuple(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise SamplingError(f"{name} = {list(ids)!r}; expected token ids (integers >= 0)")
    return ids


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0  # vLLM's: > 1 discourages every token of the prompt and the output
    frequency_penalty: float = 0.0  # per occurrence in the output, in [-2, 2]
    presence_penalty: float = 0.0  # once for a token in the output, in [-2, 2]
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be chosen
    banned_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences: the last is banned right after the others

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise SamplingError(f"temperature = {self.temperature!r}; expected a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p = {self.top_p!r}; expected a number in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SamplingError(f"top_k = {self.top_k!r}; expected an integer >= 0 (0 turns it off)")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            raise SamplingError(f"repetition_penalty = {self.repetition_penalty!r}; expected a number > 0 (1: off)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise SamplingError(f"{name} = {value!r}; expected a number in [-2, 2] (0: off)")
        allowed = _ids("allowed_token_ids", self.allowed_token_ids)
        if allowed is not None and not allowed:
            raise SamplingError("allowed_token_ids = []; expected at least one token id (None: every token)")
        object.__setattr__(self, "allowed_token_ids", allowed)
        object.__setattr__(self, "banned_token_ids", _ids("banned_token_ids", self.banned_token_ids))
        words = tuple(_ids("bad_words", w) for w in self.bad_words)
        if any(not w for w in words):
            raise SamplingError("bad_words holds an empty sequence; expected token id sequences of length >= 1")
        object.__setattr__(self, "bad_words", words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """No penalty and no token constraint: a row's logits need no context."""
        return (self.repetition_penalty == 1 and self.frequency_penalty == 0 and self.presence_penalty == 0
                and self.allowed_token_ids is None and not self.banned_token_ids and not self.bad_words)

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id these settings name is below `vocab_size`."""
        named = [*(self.allowed_token_ids or ()), *self.banned_token_ids, *(i for w in self.bad_words for i in w)]
        bad = sorted({i for i in named if i >= vocab_size})
        if bad:
            raise SamplingError(f"token ids {bad[:8]} in allowed_token_ids / banned_token_ids / bad_words are not in "
                                f"the vocabulary; expected ids below {vocab_size}")


@dataclass(frozen=True)
class Context:
    """The tokens before a position: the prompt's and the output's (penalties tell them apart)."""

    prompt: Sequence[int] = ()
    output: Sequence[int] = field(default_factory=list)

    def then(self, tokens: Sequence[int]) -> "Context":
        return Context(self.prompt, [*self.output, *tokens])


def bad_word_sequences(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as vLLM tokenizes it: as written and with a leading space, without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise SamplingError(f"bad_words: {word!r}; expected non-empty strings")
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def adjust(logits: torch.Tensor, params: SamplingParams, context: Context | None = None) -> torch.Tensor:
    """A 1-D row of logits with the constraints and penalties applied (fp32; the row itself when `plain`)."""
    if params.plain:
        return logits
    out = logits.float().clone()
    ctx = context or Context()
    if params.allowed_token_ids is not None:
        keep = torch.tensor(params.allowed_token_ids, device=out.device)
        out = torch.full_like(out, float("-inf")).index_copy(0, keep, out[keep])
    banned = list(params.banned_token_ids)
    seen = [*ctx.prompt, *ctx.output]
    for word in params.bad_words:
        if len(word) == 1 or (len(seen) >= len(word) - 1 and tuple(seen[len(seen) - len(word) + 1:]) == word[:-1]):
            banned.append(word[-1])
    if banned:
        out[torch.tensor(banned, device=out.device)] = float("-inf")
    if params.repetition_penalty != 1 and seen:
        ids = torch.tensor(sorted(set(seen)), device=out.device)
        got = out[ids]
        out[ids] = torch.where(got > 0, got / params.repetition_penalty, got * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and ctx.output:
        ids, counts = torch.tensor(list(ctx.output), device=out.device).unique(return_counts=True)
        out[ids] -= params.frequency_penalty * counts.float() + params.presence_penalty
    return out


def adjust_rows(logits: torch.Tensor, params: SamplingParams, context: Context | None,
                proposals: Sequence[int]) -> torch.Tensor:
    """A verify's rows [k+1, V]: row i adjusted with the context and the proposals before i."""
    if params.plain:
        return logits
    ctx = context or Context()
    return torch.stack([adjust(logits[i], params, ctx.then(proposals[:i])) for i in range(logits.shape[0])])


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 probabilities [..., V] after temperature, top-k and top-p (greedy: one-hot argmax)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
