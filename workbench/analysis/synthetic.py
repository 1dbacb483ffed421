"""A timing-only acceptor for the sweep: vLLM's `rejection_sample_method: "synthetic"`.

`SyntheticAcceptor` accepts position i with a given rate whatever the verifier says, so a sweep can
measure this machine's cost curve for a draft of any quality; its output is not lossless and its
`name` says so. It plugs into the engine as any `Acceptor` does.
"""
from __future__ import annotations

from workbench.decoding.logits import SamplingError
from workbench.decoding.sampling import Verdict, as_draws, target_probs


def check_synthetic_rates(rates, k: int | None = None) -> list[float]:
    """vLLM's `synthetic_acceptance_rates` rules: unconditional per-position rates in [0, 1], non-increasing,
    at most k of them (vLLM asks for exactly k; fewer repeat the last conditional rate)."""
    if isinstance(rates, (str, bytes)) or not hasattr(rates, "__len__") or not len(rates):
        raise SamplingError(f"synthetic_acceptance_rates = {rates!r}; expected a non-empty list of rates in [0, 1]")
    out = []
    for i, r in enumerate(rates):
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise SamplingError(f"synthetic_acceptance_rates[{i}] = {r!r}; expected a rate in [0, 1]")
        if out and r > out[-1]:
            raise SamplingError(f"synthetic_acceptance_rates = {list(rates)}: entry {i} ({r}) is above entry {i - 1} "
                                f"({out[-1]}); expected non-increasing unconditional rates, as vLLM requires")
        out.append(float(r))
    if k is not None and len(out) > k:
        raise SamplingError(f"synthetic_acceptance_rates has {len(out)} entries; expected at most "
                            f"num_speculative_tokens = {k}")
    return out


def conditional_rates(unconditional: list[float], k: int) -> list[float]:
    """P(position i accepted | 0..i-1 accepted) for i < k, from unconditional rates; past the given
    ones the last conditional rate repeats (as `expected_accept_length` extrapolates)."""
    cond = [u / prev if prev > 0 else 0.0 for u, prev in zip(unconditional, [1.0] + unconditional[:-1])]
    return (cond + [cond[-1]] * k)[:k]


class SyntheticAcceptor:
    """Accepts proposal i with the conditional rate that the unconditional `rates` imply, then emits the
    verifier's own token (its argmax, or a sample of p) where it stops: a cost curve apart from the
    draft's quality. Not lossless: an accepted proposal need not be the verifier's choice."""

    def __init__(self, rates, k: int | None = None) -> None:
        """`k`: the most proposals a step will make, if the rates are to be checked against it (vLLM's rule)."""
        self.rates = check_synthetic_rates(rates, k)
        self.name = f"synthetic (rates {self.rates}; timing only, not lossless)"

    def verify(self, proposals, draft_probs, target_logits, params, generator, context=None) -> Verdict:
        draws = as_draws(generator)
        p_all = target_probs(target_logits, params, context, proposals)
        k = len(proposals)
        p = [float(p_all[i, t]) for i, t in enumerate(proposals)]
        a = 0
        for rate in conditional_rates(self.rates, k):
            if draws.uniform() >= rate:
                break
            a += 1
        t = int(p_all[a].argmax()) if params.greedy else draws.sample(p_all[a])
        return Verdict(a, t, p, float(p_all[a, t]))
