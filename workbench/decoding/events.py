"""What the engine says: one `StepEvent` per speculation step, a `GenerationResult` per call.

Plain JSON-serialisable dataclasses, so the chat, the dashboard, the CLI's `--json` and the
tests all read the same record and nothing has to be reconstructed from decoded text.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepEvent:
    """One verifier forward and what it decided.

    `kind` is "prefill" for the token sampled from the prompt's last position (no draft
    involved) and "spec" for a propose/verify step. Emitted tokens are the accepted
    proposals followed by exactly one verifier token: a correction (a proposal was
    rejected) or a bonus (all k accepted). A stop inside the step truncates `emitted`.
    """

    step: int
    kind: str  # "prefill" | "spec"
    proposed: list[int] = field(default_factory=list)  # the k draft tokens
    proposed_text: list[str] = field(default_factory=list)
    draft_probs: list[float] = field(default_factory=list)  # q(proposal) under the draft
    verifier_probs: list[float] = field(default_factory=list)  # p(proposal) under the verifier
    num_accepted: int = 0  # proposals accepted (bonus/correction not counted)
    emitted: list[int] = field(default_factory=list)
    emitted_text: list[str] = field(default_factory=list)
    emitted_status: list[str] = field(default_factory=list)  # "accepted" | "corrected" | "bonus"
    emitted_verifier_probs: list[float] = field(default_factory=list)  # p of each emitted token
    position: int = 0  # absolute position of the first emitted token
    draft_time: float = 0.0  # seconds drafting (a fused step: its acceptance and drafting the next proposals)
    verify_time: float = 0.0  # seconds verifying (the prefill's: the prompt's forward)
    finish_reason: str | None = None  # set on the last event: "eos" | "stop" | "length" | "context"
    batch_size: int = 1  # requests in the verifier forward that made this step (the batched engine's)

    @property
    def k(self) -> int:
        return len(self.proposed)

    @property
    def correction(self) -> int | None:
        return self.emitted[-1] if self.emitted_status[-1:] == ["corrected"] else None

    @property
    def bonus(self) -> int | None:
        return self.emitted[-1] if self.emitted_status[-1:] == ["bonus"] else None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationStats:
    """vLLM's counters and what follows from them (peers.md §2)."""

    num_drafts: int = 0  # spec steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # steps where positions 0..i all accepted
    accept_length: float = 1.0  # 1 + accepted / drafts (vLLM's mean acceptance length)
    per_position_acceptance: list[float] = field(default_factory=list)  # unconditional (vLLM)
    conditional_acceptance: list[float] = field(default_factory=list)  # EAGLE's alpha
    accepted_length_histogram: list[int] = field(default_factory=list)  # index a: steps with a accepted
    num_tokens: int = 0
    elapsed: float = 0.0
    tokens_per_s: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    events: list[StepEvent]
    stats: GenerationStats
    prompt_tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    k: int = 0  # 0 for the autoregressive baseline
    acceptance_rule: str = "none (autoregressive)"  # which rule judged the proposals (SpecDecoder.acceptance_rule)
    error: str | None = None  # why a request of a batch failed alone (finish_reason "error")

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "k": self.k,
            "acceptance_rule": self.acceptance_rule,
            "steps": [e.to_dict() for e in self.events],
            "stats": self.stats.to_dict(),
            "accept_length": self.stats.accept_length,
            "error": self.error,
        }
