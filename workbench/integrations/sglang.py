"""Hand the pair to SGLang: its launch command, and its `/metrics` read as vLLM's counters are.

SGLang serves MLA EAGLE-3 and EAGLE-3.1 drafts with `Eagle3DeepseekV2ForCausalLM`
(`python/sglang/srt/models/kimi_k25_eagle3.py`); what it reads of a draft's config is in
`workbench.engine_readings`, and `workbench export-vllm` writes a config both engines read
alike. The command uses `python -m sglang.launch_server` with the speculative flags as SGLang's
`ServerArgs` names them: chain drafting is `--speculative-eagle-topk 1` with
`--speculative-num-draft-tokens` = steps + 1 (the root token counts).

Metrics (SGLang's `metrics/collector.py`, served with `--enable-metrics`): the gauges
`sglang:spec_accept_length` (accepted drafts + 1 per verify, over the last logged batch),
`sglang:spec_accept_rate`, `sglang:spec_num_steps`, `sglang:spec_num_draft_tokens`, and the
counters `sglang:spec_verify_calls_total`, `sglang:generation_tokens_total`,
`sglang:num_requests_total`. Each request's first token comes from prefill and each verify emits
its accepted drafts plus one, so accepted drafts = generated - requests - verify calls: vLLM's
`num_accepted_tokens`, with `num_drafts` = verify calls and `num_draft_tokens` = verify calls x
steps. SGLang adds a request's counts when it finishes, so intervals move in whole requests; it
has no per-position counter.
"""
from __future__ import annotations

import shlex

from workbench.integrations.spec_counters import SpecCounters

PREFIX = "sglang:"
COUNTERS = {"verify": "sglang:spec_verify_calls", "generated": "sglang:generation_tokens",
            "requests": "sglang:num_requests"}  # families; each sample carries a `_total` suffix
GAUGES = {"accept_length": "sglang:spec_accept_length", "accept_rate": "sglang:spec_accept_rate",
          "num_steps": "sglang:spec_num_steps", "num_draft_tokens": "sglang:spec_num_draft_tokens"}


def speculative_args(draft: str, k: int = 3, algorithm: str = "EAGLE3") -> list[str]:
    """SGLang's speculative flags for a chain of k draft tokens."""
    if not draft:
        raise ValueError("draft: empty; expected a draft checkpoint path or Hugging Face id")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k = {k!r}; expected --speculative-num-steps >= 1")
    if algorithm not in ("EAGLE3", "EAGLE"):
        raise ValueError(f"algorithm = {algorithm!r}; expected 'EAGLE3' (or 'EAGLE')")
    return ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", draft,
            "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(k + 1)]


def serve_command(verifier: str, draft: str, k: int = 3, tp: int = 8, *, extra_args: list[str] = (),
                  trust_remote_code: bool = True, port: int | None = None, metrics: bool = True,
                  algorithm: str = "EAGLE3") -> str:
    """The shell line that serves verifier + draft under SGLang with EAGLE-3 chain speculation
    (`metrics`: `--enable-metrics`, which the live view reads), quoted for a shell."""
    if not verifier:
        raise ValueError("verifier: empty; expected a verifier checkpoint path or Hugging Face id")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp = {tp!r}; expected --tp >= 1")
    parts = ["python", "-m", "sglang.launch_server", "--model-path", verifier, "--tp", str(tp)]
    if trust_remote_code:
        parts.append("--trust-remote-code")
    parts += speculative_args(draft, k, algorithm)
    if metrics:
        parts.append("--enable-metrics")
    if port is not None:
        parts += ["--port", str(int(port))]
    parts += list(extra_args)
    return " ".join(shlex.quote(p) for p in parts)


def _family(name: str) -> tuple[str, str] | None:
    """("counter"|"gauge", key) for an SGLang spec-decoding sample name, else None."""
    base = name[: -len("_total")] if name.endswith("_total") else name
    for key, family in COUNTERS.items():
        if name.endswith("_total") and base == family:
            return "counter", key
    for key, family in GAUGES.items():
        if name == family:
            return "gauge", key
    return None


def counters_from_samples(samples) -> SpecCounters:
    """SGLang's samples ((name, labels, value), already filtered by model) as vLLM's counters, or
    counters with version "" when none of SGLang's speculative metrics is among them."""
    totals: dict[str, float] = {}
    gauges: dict[str, list[float]] = {}
    for name, _labels, value in samples:
        kind = _family(name)
        if kind is None:
            continue
        if kind[0] == "counter":
            totals[kind[1]] = totals.get(kind[1], 0.0) + value  # one sample per scheduler (dp/tp rank): sum
        else:
            gauges.setdefault(kind[1], []).append(value)
    spec_seen = "verify" in totals or any(k in gauges for k in ("accept_length", "accept_rate"))
    if not spec_seen:
        return SpecCounters()
    verify = int(round(totals.get("verify", 0)))
    accepted = max(0, int(round(totals.get("generated", 0) - totals.get("requests", 0))) - verify) if verify else 0
    steps = max(gauges.get("num_steps", [0])) or max(gauges.get("num_draft_tokens", [1])) - 1
    mean = lambda key: sum(gauges[key]) / len(gauges[key]) if key in gauges else None  # noqa: E731 (dp ranks: mean)
    return SpecCounters(num_drafts=verify, num_draft_tokens=verify * int(steps), num_accepted_tokens=accepted,
                        version="sglang", engine_accept_length=mean("accept_length"),
                        engine_accept_rate=mean("accept_rate"))
