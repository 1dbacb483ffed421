"""Turning logits into tokens, and deciding which draft proposals the verifier keeps.

Every acceptor is lossless: the emitted tokens are distributed exactly as plain decoding with the
same settings would emit them. p is the verifier's distribution at each position after
`workbench.decoding.logits` (constraints, penalties with the tokens before that position,
temperature, top-k, top-p), q the draft's.
- Greedy: accept while the proposal is the verifier's argmax; at the first mismatch emit the
  argmax (a correction); if all k match, emit the argmax after them (a bonus).
- Rejection sampling (Leviathan et al. 2211.17192): accept proposal x with probability
  min(1, p(x)/q(x)); on rejection emit a sample of normalise(max(0, p - q)); if all k are
  accepted, sample a bonus from p. With greedy proposals q is one-hot at x (vLLM's EAGLE
  default), so acceptance is p(x) and the residual is p without x's mass.
- Block verification (Sun et al. 2403.10444): the block's prefixes are judged jointly, so a later
  position can keep a prefix whose last token alone would have been rejected (`BlockAcceptor`).
Randomness comes from a `Draws`: a generator's, or one a test gives (uniforms it chose).
The sweep's timing-only acceptor, which is not lossless, lives with it (`workbench.analysis.synthetic`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from workbench.decoding.logits import (Context, SamplingError, SamplingParams, adjust, adjust_rows,  # noqa: F401
                                       probs_from_logits)


def check_finite(logits: torch.Tensor, where: str) -> None:
    """-inf is a masked token; NaN, +inf (softmax turns it into NaN) or a row with no finite value is an error."""
    # One pass: a row's max is NaN if any entry is, +inf if one is, -inf if none is finite.
    if not bool(torch.isfinite(logits.amax(-1)).all()):
        raise nonfinite_error(where)


def nonfinite_error(where: str) -> SamplingError:
    """What check_finite raises (also for a check made on the device, as a fused step does)."""
    return SamplingError(f"{where}: the logits contain NaN or +inf (or no finite value); the model's weights or "
                         "inputs are broken (a corrupt checkpoint, or an overflow in this dtype)")


class Draws(Protocol):
    """Where an acceptor's and a sampler's randomness comes from."""

    def uniform(self) -> float: ...  # U[0, 1)

    def sample(self, probs: torch.Tensor) -> int: ...  # a token from a 1-D distribution


class GeneratorDraws:
    """A torch.Generator's draws (what every seeded run uses)."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator

    def uniform(self) -> float:
        return torch.rand((), generator=self.generator, dtype=torch.float64).item()

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


def as_draws(source) -> Draws:
    """A Draws from a torch.Generator (or None), or the Draws itself."""
    return source if hasattr(source, "uniform") and hasattr(source, "sample") else GeneratorDraws(source)


def sample(probs: torch.Tensor, generator) -> int:
    """One token from a 1-D probability vector (argmax when it is one-hot)."""
    return as_draws(generator).sample(probs)


def next_token(logits: torch.Tensor, params: SamplingParams, generator, context: Context | None = None) -> int:
    """Plain decoding's token from 1-D logits after `adjust` with the tokens before it: the argmax
    when greedy (what sampling the one-hot `probs_from_logits` gives), else a sample."""
    logits = adjust(logits, params, context)
    if params.greedy:  # over fp32, exact for bf16 logits, and ATen's argmax runs ~2x faster on it
        return int(logits.float().argmax())
    return sample(probs_from_logits(logits, params), generator)


def shown_prob(logits: torch.Tensor, params: SamplingParams, token: int, context: Context | None = None) -> float:
    """The verifier's probability of `token` from 1-D logits, as events show it: the softmax when
    greedy, else the processed distribution (temperature, top-k, top-p)."""
    logits = adjust(logits, params, context)
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
               params: SamplingParams, generator, context: Context | None = None) -> Verdict:
        """Judge `proposals` against the verifier's logits [k+1, V] (`draft_probs` [k, V] the draft's q,
        None for greedy proposals: one-hot); `generator` a torch.Generator or a `Draws`; `context`
        the tokens before the first proposal."""


def check_proposals(proposals: list[int], vocab: int) -> None:
    bad = [t for t in proposals if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise SamplingError(f"proposal ids {bad}: out of the vocabulary; expected ids in [0, {vocab - 1}]")


def greedy_verdicts(logits: torch.Tensor, proposals: list[list[int]], kernels: bool = False) -> list[Verdict | None]:
    """Greedy verdicts of G sequences at once: logits [G, T, V] (sequence g's first len(proposals[g])
    + 1 positions its own), each proposal and argmax shown with its softmax probability, from one
    log-sum-exp per row, over fp32 (exact for bf16); None for a sequence whose own logits are not all
    finite (a NaN, +inf or a row of -inf make the log-sum-exp so: check_finite's test, for free).
    The one greedy rule on the host (every greedy acceptance goes through it); `kernels` reads the
    rows' max, argmax and log-sum-exp in one pass of the CPU kernels (its log-sum-exp rounds
    differently in the last bits; the tokens are the same). `workbench.decoding.fused.accept_and_draft`
    is its device form."""
    G, T, V = logits.shape
    if kernels:  # the proposals' logits with the rows' stats, in one kernel call
        from workbench.kernels import cpu  # below decoding; loaded only where the pair runs on it

        mx, arg, lse, picked = cpu.row_stats(logits.reshape(G * T, V), at=[t for p in proposals
                                                                             for t in p + [0] * (T - len(p))])
        top = [arg[g * T:(g + 1) * T] for g in range(G)]
        at_top = [mx[g * T:(g + 1) * T] for g in range(G)]
        lse = [lse[g * T:(g + 1) * T] for g in range(G)]
        at_prop = [picked[g * T:(g + 1) * T] for g in range(G)]
    else:
        chosen = torch.tensor([p + [0] * (T - len(p)) for p in proposals], device=logits.device)
        at_prop = logits.gather(-1, chosen[..., None])[..., 0].float().tolist() if any(proposals) else [[]] * G
        logits = logits.float()
        top_t = logits.argmax(-1)  # [G, T]
        lse = logits.logsumexp(-1).tolist()
        top, at_top = top_t.tolist(), logits.gather(-1, top_t[..., None])[..., 0].tolist()
    out: list[Verdict | None] = []
    for p, t, xp, xt, z in zip(proposals, top, at_prop, at_top, lse):
        if not all(math.isfinite(v) for v in z[:len(p) + 1]):
            out.append(None)
            continue
        a = 0
        while a < len(p) and p[a] == t[a]:
            a += 1
        out.append(Verdict(a, t[a], [math.exp(x - l) for x, l in zip(xp[:len(p)], z)], math.exp(xt[a] - z[a])))
    return out


class GreedyAcceptor:
    """Accept while proposal == verifier argmax (temperature 0)."""

    name = "greedy"

    def verify(self, proposals, draft_probs, target_logits, params, generator, context=None) -> Verdict:
        check_proposals(proposals, target_logits.shape[-1])
        logits = adjust_rows(target_logits, params, context, proposals).float()  # fp32: exact for bf16
        d = greedy_verdicts(logits[None], [list(proposals)])[0]
        if d is None:
            raise nonfinite_error("greedy acceptance: verifier logits")
        if params.greedy:
            return d
        shown = probs_from_logits(logits, params)  # at T > 0 the verdict is greedy, the probabilities shown p's
        a, t = d.num_accepted, d.next_token
        return Verdict(a, t, [float(shown[i, x]) for i, x in enumerate(proposals)], float(shown[a, t]))


def target_probs(target_logits, params, context, proposals) -> torch.Tensor:
    check_proposals(proposals, target_logits.shape[-1])
    return probs_from_logits(adjust_rows(target_logits, params, context, proposals), params)  # [k+1, V]


def _draft_rows(draft_probs: torch.Tensor | None, proposals: list[int], vocab: int) -> torch.Tensor:
    """q [k, V]: the draft's distributions, or one-hot at each greedy proposal."""
    if draft_probs is not None:
        return draft_probs.float()
    return torch.nn.functional.one_hot(torch.tensor(proposals, dtype=torch.long), vocab).float().reshape(-1, vocab)


class RejectionAcceptor:
    """min(1, p/q) acceptance with residual resampling, token by token (temperature > 0)."""

    name = "rejection"

    def verify(self, proposals, draft_probs, target_logits, params, generator, context=None) -> Verdict:
        draws = as_draws(generator)
        p_all = target_probs(target_logits, params, context, proposals)
        k = len(proposals)
        p = [float(p_all[i, t]) for i, t in enumerate(proposals)]
        for i, x in enumerate(proposals):
            q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
            u = draws.uniform()
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
            t = draws.sample(residual)
            return Verdict(i, t, p, float(p_all[i, t]))
        t = draws.sample(p_all[k])
        return Verdict(k, t, p, float(p_all[k, t]))


@dataclass
class BlockOutcome:
    accepted: torch.Tensor  # [N] the tokens kept of each block
    next_token: torch.Tensor  # [N] the correction (or the bonus after a whole block)
    tests: torch.Tensor  # [N, k] h_i, each position's pass probability


def block_verify(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, eta: torch.Tensor, u: torch.Tensor) -> BlockOutcome:
    """Block verification (Sun et al. 2403.10444, as vLLM #46781 implements it) of N blocks at once:
    p [N, k+1, V] the verifier's distributions, q [N, k, V] the draft's, x [N, k] the proposals,
    eta [N, k] the tests' uniforms and u [N] the next token's.

    With prefix weights w_0 = 1, w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)) and residual masses
    Z_i = sum_v max(w_i p_{i+1}(v) - q_{i+1}(v), 0) (q_{k+1} = 0), position i passes when
    eta_i <= h_i = Z_i / (Z_i + 1 - w_i). The longest prefix that passes is kept, failed tests
    before it included, and the next token is the inverse CDF at u of max(w_a p_{a+1} - q_{a+1}, 0)
    (of p_{k+1} after the whole block).
    """
    N, k, V = q.shape
    p_x = p[:, :k].gather(2, x[..., None])[..., 0]
    q_x = q.gather(2, x[..., None])[..., 0]
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(torch.finfo(q.dtype).tiny), 0.0)
    weights = [torch.ones(N, dtype=p.dtype)]
    for i in range(k):  # a running product, clipped at 1
        weights.append((weights[-1] * ratio[:, i]).clamp(max=1.0))
    w = torch.stack(weights, 1)  # [N, k+1], w_0 = 1
    q_full = torch.cat([q, torch.zeros(N, 1, V, dtype=q.dtype)], 1)  # q_{k+1} = 0
    z = (w[:, 1:, None] * p[:, 1:] - q_full[:, 1:]).clamp_min(0).sum(-1)
    denom = z + 1 - w[:, 1:]
    h = torch.where(denom > 0, z / denom.clamp_min(torch.finfo(p.dtype).tiny), 1.0)
    accepted = ((eta <= h) * torch.arange(1, k + 1)).amax(1)  # 0 when no test passes
    rows = torch.arange(N)
    p_a, q_a, w_a = p[rows, accepted], q_full[rows, accepted], w[rows, accepted][:, None]
    residual = torch.where((accepted == k)[:, None], p_a, (w_a * p_a - q_a).clamp_min(0))
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p_a)
    cdf = residual.double().cumsum(-1)
    nxt = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=V - 1)
    return BlockOutcome(accepted, nxt, h)


class BlockAcceptor:
    """Block verification (`block_verify`): a later position can keep a prefix whose last token
    alone would have been rejected, so it accepts at least as much as token-by-token rejection."""

    name = "block"

    def verify(self, proposals, draft_probs, target_logits, params, generator, context=None) -> Verdict:
        draws = as_draws(generator)
        p_all = target_probs(target_logits, params, context, proposals)
        k, vocab = len(proposals), p_all.shape[-1]
        eta = torch.tensor([[draws.uniform() for _ in range(k)]], dtype=torch.float64)
        u = torch.tensor([draws.uniform()], dtype=torch.float64)
        x = torch.tensor([proposals], dtype=torch.long).reshape(1, k)
        out = block_verify(p_all[None].double(), _draft_rows(draft_probs, proposals, vocab)[None].double(), x, eta, u)
        a, t = int(out.accepted[0]), int(out.next_token[0])
        return Verdict(a, t, [float(p_all[i, x]) for i, x in enumerate(proposals)], float(p_all[a, t]))


ACCEPTORS = {"greedy": GreedyAcceptor, "rejection": RejectionAcceptor, "block": BlockAcceptor}


def acceptor_for(params: SamplingParams, name: str | None = None) -> Acceptor:
    """The acceptor called `name`; without one, greedy at temperature 0 and rejection sampling otherwise."""
    if name is None:
        return GreedyAcceptor() if params.greedy else RejectionAcceptor()
    if name not in ACCEPTORS:
        raise SamplingError(f"acceptor = {name!r}; expected one of {', '.join(ACCEPTORS)}")
    return ACCEPTORS[name]()
