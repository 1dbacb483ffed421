"""Prefill/decode disaggregation, measured: acceptance, decode speed and bytes per hand-over mode.

For each draft (MLA, and an MHA twin) and each mode of `workbench.analysis.disagg`, every prompt
is prefilled on the "prefill instance", handed over as bytes and decoded on the "decode
instance"; greedy outputs are checked against the same decoder in one process. Long prompts
show how a missing draft KV ("cold") costs more as the prompt grows.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from workbench.analysis.degeneracy import accept_split
from workbench.analysis.kvcache import HANDOVER_MODES, handover_bytes
from workbench.decoding.stats import compute_stats
from workbench.analysis.protocol import Arm, measure
from workbench.analysis.disagg import decode_instance, prefill_instance
from workbench.decoding.engine import SpecDecoder


@dataclass
class ModeResult:
    draft: str  # "mla" | "mha"
    prompts: str  # which prompt set: "short" | "long-<tokens>"
    mode: str
    num_prompts: int
    mean_prompt_tokens: float
    accept_length: float  # pooled over the prompts' steps
    decode_tokens_per_s: float
    bytes_per_request: float  # measured: what the hand-overs carried, on average
    model_bytes_per_request: float  # `handover_bytes` at the mean prompt length, for comparison
    identical: int  # prompts whose tokens equal one-process decoding (greedy)
    accept_length_clean: float | None = None  # over the continuations that do not loop (None: all loop)
    degenerate: int = 0  # continuations that loop (`analysis.degeneracy`)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PDReport:
    k: int
    max_new_tokens: int
    results: list[ModeResult] = field(default_factory=list)

    def result(self, draft: str, prompts: str, mode: str) -> ModeResult:
        return next(r for r in self.results if (r.draft, r.prompts, r.mode) == (draft, prompts, mode))

    def to_dict(self) -> dict:
        return {"k": self.k, "max_new_tokens": self.max_new_tokens, "results": [r.to_dict() for r in self.results]}

    def summary(self) -> str:
        lines = [f"prefill/decode hand-over, k = {self.k}, {self.max_new_tokens} new tokens",
                 f"{'draft':>5} {'prompts':>7} {'mode':>9} {'tokens':>7} {'accept':>7} {'clean':>6} {'loops':>6} "
                 f"{'tok/s':>8} {'bytes':>11} {'identical':>9}"]
        for r in self.results:
            clean = "n/a" if r.accept_length_clean is None else f"{r.accept_length_clean:.3f}"
            lines.append(f"{r.draft:>5} {r.prompts:>7} {r.mode:>9} {r.mean_prompt_tokens:>7.0f} {r.accept_length:>7.3f} "
                         f"{clean:>6} {f'{r.degenerate}/{r.num_prompts}':>6} "
                         f"{r.decode_tokens_per_s:>8.1f} {r.bytes_per_request:>11.0f} {r.identical:>4}/{r.num_prompts}")
        return "\n".join(lines)


def document_cuts(pair, documents: list[str], tokens: int, count: int = 4) -> list[str]:
    """The first `tokens` tokens of each of the first `count` documents long enough (long held-out
    code, `assets/documents/long.jsonl`), as text."""
    out = []
    for text in documents:
        ids = pair.encode(text)
        if len(ids) >= tokens:
            out.append(pair.decode(ids[1:tokens] if pair.tokenizer.bos_token_id is not None else ids[:tokens]))
        if len(out) == count:
            return out
    raise ValueError(f"{len(out)} of the documents reach {tokens} tokens; expected {count}")


def _modes(pair, kind: str, name: str, prompts: list[str], modes, k: int, max_new: int) -> list[ModeResult]:
    """Every mode on these prompts as arms of `protocol.measure` (warmed up, interleaved per prompt)."""
    sent: dict[tuple[str, str], int] = {}

    def arm(mode: str) -> Arm:
        def run(prompt: str):
            h = prefill_instance(SpecDecoder(pair, k, fused=False), prompt, max_new, mode)
            sent[mode, prompt] = h.nbytes
            return decode_instance(SpecDecoder(pair, k, fused=False), h)
        return Arm(mode, k, run)

    m = measure([arm(mode) for mode in modes], prompts, repeats=1)
    plain = [SpecDecoder(pair, k, fused=False).generate(p, max_new).tokens for p in prompts]
    nb = pair.verifier.dtype.itemsize
    out = []
    for mode in modes:
        results = m.results[mode][0]
        lengths = [len(r.prompt_tokens) for r in results]
        model = [handover_bytes(pair.verifier.config, pair.draft.config, n, mode, nb)["total"] for n in lengths]
        split = accept_split([r.events for r in results])
        out.append(ModeResult(kind, name, mode, len(prompts), sum(lengths) / len(lengths),
                              compute_stats([e for r in results for e in r.events]).accept_length,
                              m.rate(mode).pooled, sum(sent[mode, p] for p in prompts) / len(prompts),
                              sum(model) / len(model), sum(r.tokens == t for r, t in zip(results, plain)),
                              split.clean, split.num_degenerate))
    return out


def pd_study(pairs: dict, prompt_sets: dict[str, list[str]], k: int = 3, max_new_tokens: int = 64,
             modes: tuple[str, ...] = HANDOVER_MODES) -> PDReport:
    """Every (draft, prompt set, mode): `pairs` maps a draft kind ("mla", "mha") to a pair with that draft."""
    report = PDReport(k, max_new_tokens)
    for kind, pair in pairs.items():
        for name, prompts in prompt_sets.items():
            report.results += _modes(pair, kind, name, prompts, modes, k, max_new_tokens)
    return report


SPEC_KEYS = ("method", "model", "num_speculative_tokens", "eagle_aux_hidden_state_layer_ids")


def role_mismatches(prefill: dict, decode: dict) -> list[str]:
    """The speculative-config fields on which the prefill and the decode role disagree (vLLM requires the
    same config on both: vllm-rbln #1006, vllm #39266); [] when they agree."""
    for name, cfg in (("prefill", prefill), ("decode", decode)):
        if not isinstance(cfg, dict):
            raise ValueError(f"{name} role: expected a speculative_config JSON object, got {type(cfg).__name__}")
    return [f"{key}: prefill {prefill.get(key)!r}, decode {decode.get(key)!r}" for key in SPEC_KEYS
            if prefill.get(key) != decode.get(key)]
