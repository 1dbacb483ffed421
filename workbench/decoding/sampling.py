"""Turning logits into tokens, and deciding which draft proposals the verifier keeps.

Both acceptors are lossless: the emitted tokens are distributed exactly as plain decoding
with the same sampling settings would emit them (Leviathan et al. 2211.17192).
- Greedy: accept while the proposal is the verifier's argmax; at the first mismatch emit
  the argmax (a correction); if all k match, emit the argmax after them (a bonus).
- Rejection sampling: accept proposal x with probability min(1, p(x)/q(x)); on rejection
  emit a sample of normalise(max(0, p - q)); if all k are accepted, sample a bonus from p.
  With greedy proposals q is one-hot at x (vLLM's EAGLE default), so acceptance is p(x)
  and the residual is p without x's mass.
p has temperature, top-k and top-p applied exactly as plain decoding applies them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch



class SamplingError(ValueError):
    """Bad sampling settings or unusable logits."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise SamplingError(f"temperature = {self.temperature!r}; expected a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p = {self.top_p!r}; expected a number in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k = {self.top_k!r}; expected an integer >= 0 (0 turns it off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_finite(logits: torch.Tensor, where: str) -> None:
    """-inf is a masked token; NaN, +inf (softmax turns it into NaN) or a row with no finite value is an error."""
    # One pass: a row's max is NaN if any entry is, +inf if one is, -inf if none is finite.
    if not bool(torch.isfinite(logits.amax(-1)).all()):
        raise nonfinite_error(where)


def nonfinite_error(where: str) -> SamplingError:
    """What check_finite raises (also for a check made on the device, as a fused step does)."""
    return SamplingError(f"{where}: the logits contain NaN or +inf (or no finite value); the model's weights or "
                         "inputs are broken (a corrupt checkpoint, or an overflow in this dtype)")


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


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a 1-D probability vector (argmax when it is one-hot)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Plain decoding's token from 1-D logits: the argmax when greedy (what sampling the one-hot
    `probs_from_logits` gives, without a multinomial over the vocabulary), else a sample."""
    if params.greedy:  # over fp32, exact for bf16 logits, and ATen's argmax runs ~2x faster on it
        return int(logits.float().argmax())
    return sample(probs_from_logits(logits, params), generator)


def shown_prob(logits: torch.Tensor, params: SamplingParams, token: int) -> float:
    """The verifier's probability of `token` from 1-D logits, as events show it: the softmax when
    greedy, else the processed distribution (temperature, top-k, top-p)."""
    if params.greedy:
        logits = logits.float()
        return float((logits[token] - logits.logsumexp(-1)).exp())
    return float(probs_from_logits(logits, params)[token])


@dataclass
class Verdict:
    num_accepted: int
    next_token: int  # the correction (num_accepted < k) or the bonus (num_accepted == k)
    verifier_probs: list[float]  # p(proposal_i) under the verifier, i < k (processed p, or softmax when greedy)
    next_token_prob: float


class Acceptor(Protocol):
    name: str

    def verify(self, proposals: list[int], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
               params: SamplingParams, generator: torch.Generator | None) -> Verdict: ...


class GreedyAcceptor:
    """Accept while proposal == verifier argmax (temperature 0)."""

    name = "greedy"

    def verify(self, proposals, draft_probs, target_logits, params, generator) -> Verdict:
        k = len(proposals)
        logits = target_logits.float()  # exact for bf16; ATen's argmax is ~2x faster over fp32
        argmax = logits.argmax(-1)  # [k+1]
        if params.greedy:  # the softmax of each proposal and of each argmax, from one log-sum-exp per row
            lse = logits.logsumexp(-1)
            rows = torch.arange(k + 1)
            chosen = logits[rows, torch.tensor(proposals + [0], dtype=torch.long)]
            p_all = torch.stack([chosen, logits[rows, argmax]]).sub(lse).exp().tolist()
            p, p_top, argmax = p_all[0][:k], p_all[1], argmax.tolist()
        else:
            shown = probs_from_logits(logits, params)
            argmax = argmax.tolist()
            p = [float(shown[i, t]) for i, t in enumerate(proposals)]
            p_top = [float(shown[i, t]) for i, t in enumerate(argmax)]
        a = 0
        while a < k and proposals[a] == argmax[a]:
            a += 1
        return Verdict(a, argmax[a], p, p_top[a])


class RejectionAcceptor:
    """min(1, p/q) acceptance with residual resampling (temperature > 0)."""

    name = "rejection"

    def verify(self, proposals, draft_probs, target_logits, params, generator) -> Verdict:
        p_all = probs_from_logits(target_logits, params)  # [k+1, V]
        k = len(proposals)
        p = [float(p_all[i, t]) for i, t in enumerate(proposals)]
        for i, x in enumerate(proposals):
            q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
            u = torch.rand((), generator=generator, dtype=torch.float64).item()
            if q_x > 0 and p[i] / q_x >= u and p[i] > 0:
                continue
            if draft_probs is None:
                residual = p_all[i].clone()
                residual[x] = 0.0
            else:
                residual = (p_all[i] - draft_probs[i].float()).clamp_min(0)
            total = residual.sum()
            # p <= q everywhere means p == q: any rejection is then impossible in exact arithmetic.
            residual = residual / total if total > 0 else p_all[i]
            t = sample(residual, generator)
            return Verdict(i, t, p, float(p_all[i, t]))
        t = sample(p_all[k], generator)
        return Verdict(k, t, p, float(p_all[k, t]))


def acceptor_for(params: SamplingParams) -> Acceptor:
    return GreedyAcceptor() if params.greedy else RejectionAcceptor()
