"""How many tokens each request drafts this step: k policies for the batched engine.

A policy answers three questions in every step of `BatchDecoder`:

    choose(rids, caps, batch_size)   the most proposals each row drafts now (<= its request's k, its cap)
    trim(rid, probs)                 of those drafted, how many the row verifies (the draft's probability of each)
    observe(rid, proposed, accepted) what the verifier kept

The rows of a step share one padded forward: a step costs what its longest row costs, so a row
that drafts or verifies fewer tokens than the others saves nothing and can only lose accepted
tokens. The adaptive rules therefore decide for the batch as a whole by default (`per_row=False`);
with one row (or `per_row=True`) they decide per request.

- `StaticK`: always the request's k (vLLM's `num_speculative_tokens`).
- `ScheduleK`: k from the batch size (vLLM's `num_speculative_tokens_per_batch_size`).
- `ConfidenceStop`: stop drafting when the draft is unsure (SGLang's and vLLM's rule): the chain
  ends once every row has drafted a token whose probability is below the threshold
  (`stop_below`); per row, each also verifies only the proposals before its own first such token.
- `GoodputEMA`: per request, an exponential average of the acceptance at each draft position; k
  maximises the expected tokens per unit of step cost, sum over rows of E_r(k) / cost(B, k), with
  cost(B, k) any callable: a step's cost relative to a plain decode at the same batch size, as
  measured on this machine (`workbench.analysis.costmodel.StepCosts`) (vLLM #47111's per-position
  EMA goodput rule).
- `Compose(a, b, ...)`: the smallest k any of them allows.

Every policy works with any draft: it sees only ids, counts and the draft's probabilities.
Losslessness never depends on it: the verifier judges whatever is proposed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from workbench.decoding.stats import expected_accept_length


class KPolicy(Protocol):
    name: str
    stop_below: float | None  # the draft's chain may end once every row drafted a token below this

    def choose(self, rids: Sequence[int], caps: Sequence[int], batch_size: int) -> list[int]: ...

    def trim(self, rid: int, probs: Sequence[float]) -> int: ...

    def observe(self, rid: int, proposed: int, accepted: int) -> None: ...

    def forget(self, rid: int) -> None: ...


class StaticK:
    """The request's own k, every step."""

    name = "static"
    stop_below = None

    def choose(self, rids: Sequence[int], caps: Sequence[int], batch_size: int) -> list[int]:
        return list(caps)

    def trim(self, rid: int, probs: Sequence[float]) -> int:
        return len(probs)

    def observe(self, rid: int, proposed: int, accepted: int) -> None:
        pass

    def forget(self, rid: int) -> None:
        pass


class ScheduleK(StaticK):
    """k from the step's batch size, as vLLM's `num_speculative_tokens_per_batch_size` sets it
    (`workbench.batch_schedule`), never above the request's own k."""

    def __init__(self, schedule) -> None:
        self.schedule = schedule
        self.name = f"schedule {schedule.to_map()}"

    def choose(self, rids: Sequence[int], caps: Sequence[int], batch_size: int) -> list[int]:
        return [min(k, self.schedule.k_for(batch_size)) for k in caps]


class ConfidenceStop(StaticK):
    """Stop drafting when the draft is unsure: the chain ends once every row drafted a token whose
    probability is below `threshold`. `per_row`: each row also verifies only the proposals before
    its own first such token (at least `min_k`, so a request never stops drafting for good)."""

    def __init__(self, threshold: float = 0.5, min_k: int = 1, per_row: bool = False) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
            raise ValueError(f"ConfidenceStop: threshold = {threshold!r}; expected a probability in (0, 1)")
        if isinstance(min_k, bool) or not isinstance(min_k, int) or min_k < 0:
            raise ValueError(f"ConfidenceStop: min_k = {min_k!r}; expected an integer >= 0")
        self.threshold, self.min_k, self.per_row = float(threshold), min_k, per_row
        self.stop_below = self.threshold
        self.name = f"confidence >= {threshold:g}" + (" (per row)" if per_row else "")

    def trim(self, rid: int, probs: Sequence[float]) -> int:
        if not self.per_row:  # the chain's length is the batch's; padding makes a shorter row save nothing
            return len(probs)
        sure = next((i for i, p in enumerate(probs) if p < self.threshold), len(probs))
        return min(len(probs), max(self.min_k, sure))


class GoodputEMA(StaticK):
    """k = argmax over k of sum_r E_r(k) / cost(B, k), E_r from an exponential moving average of
    request r's conditional acceptance at each draft position (`alpha` the newest step's weight):
    one k for the batch (each row capped by its request's k), or with `per_row` each row's own.

    A position the verifier never saw keeps its estimate; when k = 0 is chosen nothing is observed,
    so every estimate drifts back toward `prior` by `alpha` a step and the request probes again."""

    def __init__(self, costs: Callable[[int, int], float], k_max: int = 8, alpha: float = 0.25, prior: float = 0.7, per_row: bool = False) -> None:
        for name, value in (("alpha", alpha), ("prior", prior)):
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"GoodputEMA: {name} = {value!r}; expected a number in (0, 1]")
        self.costs, self.k_max, self.alpha, self.prior = costs, k_max, float(alpha), float(prior)
        self.per_row = per_row
        self.rates: dict[int, list[float]] = {}
        self.name = (f"goodput EMA (alpha {alpha:g}, costs {getattr(costs, 'source', 'given')}"
                     + (", per row)" if per_row else ")"))

    def choose(self, rids: Sequence[int], caps: Sequence[int], batch_size: int) -> list[int]:
        rates = [self.rates.setdefault(rid, [self.prior] * self.k_max) for rid in rids]
        groups = [[i] for i in range(len(rids))] if self.per_row else [list(range(len(rids)))]
        out = [0] * len(rids)
        for rows in groups:
            top = min(max(caps[i] for i in rows), self.k_max)
            best = max(range(top + 1), key=lambda j: (sum(expected_accept_length(rates[i], min(j, caps[i]))
                                                          for i in rows) / self.costs(batch_size, j), -j))
            for i in rows:
                out[i] = min(best, caps[i])
                if out[i] == 0:  # nothing will be observed: forget a little, so that a later step tries again
                    rates[i][:] = [(1 - self.alpha) * r + self.alpha * self.prior for r in rates[i]]
        return out

    def observe(self, rid: int, proposed: int, accepted: int) -> None:
        rates = self.rates.setdefault(rid, [self.prior] * self.k_max)
        for i in range(min(proposed, accepted + 1, self.k_max)):  # position i was judged iff 0..i-1 were accepted
            rates[i] = (1 - self.alpha) * rates[i] + self.alpha * (1.0 if i < accepted else 0.0)

    def forget(self, rid: int) -> None:
        self.rates.pop(rid, None)


class Compose:
    """Several policies at once: the smallest k any allows, the fewest proposals any keeps."""

    def __init__(self, *policies: KPolicy) -> None:
        if not policies:
            raise ValueError("Compose: expected at least one policy")
        self.policies = policies
        stops = [p.stop_below for p in policies if p.stop_below is not None]
        self.stop_below = max(stops) if stops else None
        self.name = " + ".join(p.name for p in policies)

    def choose(self, rids: Sequence[int], caps: Sequence[int], batch_size: int) -> list[int]:
        return [min(ks) for ks in zip(*(p.choose(rids, caps, batch_size) for p in self.policies))]

    def trim(self, rid: int, probs: Sequence[float]) -> int:
        return min(p.trim(rid, probs) for p in self.policies)

    def observe(self, rid: int, proposed: int, accepted: int) -> None:
        for p in self.policies:
            p.observe(rid, proposed, accepted)

    def forget(self, rid: int) -> None:
        for p in self.policies:
            p.forget(rid)
