"""The speculative-decoding counters a serving engine exports, in vLLM's vocabulary: what
`workbench.integrations.vllm` reads from vLLM's /metrics and `workbench.integrations.sglang` derives
from SGLang's, so the live view and the rates treat both alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from workbench.decoding.stats import counter_rates


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over engines (cumulative since start)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_emitted_tokens: int | None = None  # V0 only
    version: str = ""  # "v1", "v0", "sglang", or "" when the server exposes no spec-decode counters
    drafts_derived: bool = False  # V0: num_drafts = emitted - accepted (see parse_spec_metrics)
    # SGLang's own gauges (its last logged batch, mean over ranks), beside the counters derived from its totals
    engine_accept_length: float | None = None
    engine_accept_rate: float | None = None

    @property
    def has_spec(self) -> bool:
        return bool(self.version)

    def rates(self) -> dict:
        """accept_length, draft_acceptance_rate, per-position (unconditional and conditional)."""
        return counter_rates(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.accepted_per_pos)
