"""vLLM's key names for what the workbench measures: the `speculative_config` a sweep recommends,
synthetic acceptance that replays a measured acceptance at a deployment's speed, and a request's
`metrics.speculative_decoding`. Here, below the hand-off (`workbench.integrations.vllm`), because
the sweeps write them; key names and rules read from `vllm/config/speculative.py` and vLLM #48915.
"""
from __future__ import annotations

from workbench.decoding.stats import counter_rates


def speculative_config(draft: str, k: int = 3, method: str = "eagle3", schedule=None) -> dict:
    """vLLM's `speculative_config`, keys in the order the seed's command writes them. `schedule`: a
    batch-size schedule (a `BatchSchedule`, or either syntax `read_schedule` reads), checked against
    k and written as `num_speculative_tokens_per_batch_size` in the map syntax."""
    if not draft:
        raise ValueError("draft: empty; expected a draft checkpoint path or Hugging Face id")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k = {k!r}; expected num_speculative_tokens >= 1")
    spec = {"model": draft, "method": method, "num_speculative_tokens": k}
    if schedule is not None:
        from workbench.batch_schedule import FIELD, read_schedule

        ranges = schedule.to_list() if hasattr(schedule, "to_list") else schedule
        spec[FIELD] = read_schedule(ranges, k).to_map()
    return spec


def synthetic_acceptance_config(draft: str, k: int, rates: list[float] | None = None, length: float | None = None,
                                method: str = "eagle3") -> dict:
    """`speculative_config` that replays an acceptance at a deployment's own speed: vLLM's
    `rejection_sample_method: "synthetic"` with exactly one of `synthetic_acceptance_rates` (k
    unconditional per-position rates, in [0, 1], non-increasing) or `synthetic_acceptance_length`
    (in [1, k + 1]), the rules `SpeculativeConfig._resolve_synthetic_acceptance_rates` enforces."""
    from workbench.analysis.synthetic import check_synthetic_rates  # imports torch: only when asked

    spec = speculative_config(draft, k, method)
    if (rates is None) == (length is None):
        raise ValueError("synthetic acceptance: expected exactly one of rates or length, as vLLM requires")
    spec["rejection_sample_method"] = "synthetic"
    if rates is not None:
        rates = check_synthetic_rates(rates, k)  # in [0, 1], non-increasing, at most k
        if len(rates) != k:
            raise ValueError(f"synthetic_acceptance_rates = {rates}; expected exactly {k}, as vLLM requires")
        spec["synthetic_acceptance_rates"] = rates
    else:
        if not 1.0 <= length <= k + 1:
            raise ValueError(f"synthetic_acceptance_length = {length}; expected a value in [1, {k + 1}]")
        spec["synthetic_acceptance_length"] = float(length)
    return spec


def spec_decode_metrics(stats, k: int) -> dict:
    """A `GenerationStats` as vLLM's per-request `metrics.speculative_decoding` (vLLM #48915, summary
    level): `acceptance_histogram[j]` is the verify steps that accepted exactly j draft tokens."""
    hist = list(stats.accepted_length_histogram) + [0] * (k + 1 - len(stats.accepted_length_histogram))
    rates = counter_rates(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_pos)
    return {
        "mean_acceptance_length": rates["accept_length"],
        "draft_acceptance_rate": rates["draft_acceptance_rate"],
        "acceptance_histogram": hist[:k + 1],
        "num_spec_steps": stats.num_drafts,
        "num_accepted_draft_tokens": stats.num_accepted_tokens,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_spec_tokens": k,
    }
