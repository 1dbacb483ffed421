"""Hand the pair to vLLM and read its acceptance back.

- `serve_command`: the `vllm serve ... --speculative-config '{...}'` line that serves the pair.
- `run_offline`: `vllm.LLM` with speculation, acceptance read from `LLM.get_metrics()`.
- `parse_spec_metrics` / `scrape` / `MetricsTracker`: a live server's `/metrics`, per interval.

vLLM is optional (CUDA only) and is imported inside `run_offline`; prometheus_client, used
only to parse `/metrics`, is imported inside `parse_spec_metrics`. Metric names and
definitions are vLLM V1's (`vllm/v1/spec_decode/metrics.py`, peers.md §2.1); the rates
come from `workbench.decoding.stats.counter_rates`, shared with our own engine's stats.
"""
from __future__ import annotations

import json
import logging
import shlex
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from workbench.analysis.vllm_keys import spec_decode_metrics, speculative_config, synthetic_acceptance_config  # noqa: F401 (re-exported: the hand-off's own API)
from workbench.config import nested_aux_ids
from workbench.decoding.stats import counter_rates
from workbench.integrations.spec_counters import SpecCounters

if TYPE_CHECKING:  # export_draft's annotation only; pair.py imports torch
    from workbench.pair import ModelPair

PREFIX = "vllm:spec_decode_"
SGLANG_PREFIX = "sglang:"  # SGLang's names (workbench.integrations.sglang), read where vLLM's are absent
# V1 counters (family name; on /metrics each sample carries a `_total` suffix).
V1_NAMES = {
    "num_drafts": PREFIX + "num_drafts",
    "num_draft_tokens": PREFIX + "num_draft_tokens",
    "num_accepted_tokens": PREFIX + "num_accepted_tokens",
}
PER_POS_NAME = PREFIX + "num_accepted_tokens_per_pos"
# V0 (removed with the V0 engine) had the same token counters plus emitted tokens, but no
# num_drafts and no per-position counter.
V0_EMITTED_NAME = PREFIX + "num_emitted_tokens"
INSTALL_HINT = "pip install 'workbench[vllm]' on a CUDA machine"


class ScrapeError(RuntimeError):
    """A `/metrics` endpoint that could not be read as Prometheus text."""


# ---- serving ------------------------------------------------------------------------------


def serve_command(
    verifier: str,
    draft: str,
    k: int = 3,
    tp: int = 8,
    *,
    extra_args: list[str] = (),
    trust_remote_code: bool = True,
    port: int | None = None,
    method: str = "eagle3",
    schedule=None,
) -> str:
    """The shell line that serves verifier + draft with EAGLE-3 speculation, quoted for a shell
    (`schedule`: k by batch size, as `speculative_config` takes it)."""
    if not verifier:
        raise ValueError("verifier: empty; expected a verifier checkpoint path or Hugging Face id")
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp = {tp!r}; expected --tensor-parallel-size >= 1")
    spec = json.dumps(speculative_config(draft, k, method, schedule), separators=(", ", ": "))
    parts = ["vllm", "serve", shlex.quote(verifier), "--tensor-parallel-size", str(tp),
             "--speculative-config", shlex.quote(spec)]
    if trust_remote_code:
        parts.append("--trust-remote-code")
    if port is not None:
        parts += ["--port", str(int(port))]
    parts += [shlex.quote(a) for a in extra_args]
    return " ".join(parts)


# ---- counters -----------------------------------------------------------------------------


def _add_pos(per_pos: list[int], labels: dict, value: float, where: str) -> None:
    pos = labels.get("position")
    if pos is None or not str(pos).isdigit():
        raise ValueError(f"{where}: label 'position' = {pos!r}; expected a draft position 0..k-1")
    i = int(pos)
    per_pos.extend([0] * (i + 1 - len(per_pos)))
    per_pos[i] += int(round(value))


def _finish(totals: dict[str, int], per_pos: list[int], seen: set[str]) -> SpecCounters:
    out = SpecCounters(accepted_per_pos=per_pos, **{k: totals.get(k, 0) for k in V1_NAMES})
    if seen & {"num_drafts", "per_pos"}:
        out.version = "v1"
    elif seen & {"num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens"}:
        out.version = "v0"
        out.num_emitted_tokens = totals.get("num_emitted_tokens")
        if out.num_emitted_tokens is not None:
            out.num_drafts = out.num_emitted_tokens - out.num_accepted_tokens
            out.drafts_derived = True
    return out


def _metric_key(name: str) -> str | None:
    base = name[: -len("_total")] if name.endswith("_total") else name
    for key, family in V1_NAMES.items():
        if base == family:
            return key
    if base == V0_EMITTED_NAME:
        return "num_emitted_tokens"
    if base == PER_POS_NAME:
        return "per_pos"
    return None


def counters_from_llm_metrics(metrics: Iterable, model_name: str | None = None) -> SpecCounters:
    """Sum `LLM.get_metrics()` (vllm.v1.metrics.reader: Counter `.value`, Vector `.values`)."""
    totals: dict[str, int] = {}
    per_pos: list[int] = []
    seen: set[str] = set()
    for m in metrics:
        key = _metric_key(m.name)
        labels = getattr(m, "labels", {}) or {}
        if key is None or (model_name is not None and labels.get("model_name", model_name) != model_name):
            continue
        seen.add(key)
        if key == "per_pos":
            if hasattr(m, "values"):  # Vector: values[i] is position i
                for i, v in enumerate(m.values):
                    _add_pos(per_pos, {"position": str(i)}, v, f"LLM.get_metrics() {m.name}")
            else:
                _add_pos(per_pos, labels, m.value, f"LLM.get_metrics() {m.name}")
        else:
            totals[key] = totals.get(key, 0) + int(round(m.value))
    return _finish(totals, per_pos, seen)


def parse_spec_metrics(text: str, model_name: str | None = None) -> SpecCounters:
    """Spec-decode counters from a Prometheus `/metrics` body (vLLM's, else SGLang's), summed over engines.

    A body with no vLLM spec-decode counter but SGLang's `sglang:spec_*` metrics is read by
    `workbench.integrations.sglang.counters_from_samples` (version "sglang").

    V1 names: `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
    `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position="i"}`
    (`_created` samples are skipped). `model_name` keeps only that served model.

    Legacy V0 names (`..._num_accepted_tokens_total`, `..._num_draft_tokens_total`,
    `..._num_emitted_tokens_total`) have no num_drafts and no per-position counter. The draft
    acceptance rate (accepted / draft tokens) is exact. V0's rejection sampler emitted one
    verifier token (recovered or bonus) after each step's accepted drafts, so
    num_drafts = emitted - accepted (marked `drafts_derived`), which gives the accept length
    (= emitted / drafts) and k (= draft tokens / drafts). That undercounts the steps that
    accepted all k when V0 ran with bonus tokens disabled (`disable_bonus_tokens`, which
    masks the bonus). Per-position rates cannot be derived from V0 counters.
    """
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise RuntimeError("parse_spec_metrics needs prometheus_client: pip install prometheus_client") from None
    totals: dict[str, int] = {}
    per_pos: list[int] = []
    seen: set[str] = set()
    sglang = []  # SGLang's samples, read only if the body has no vLLM spec-decode counter
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created") or (model_name is not None
                                               and s.labels.get("model_name", model_name) != model_name):
                continue
            if s.name.startswith(SGLANG_PREFIX):
                sglang.append((s.name, s.labels, s.value))
            key = _metric_key(s.name)
            if key is None:
                continue
            seen.add(key)
            if key == "per_pos":
                _add_pos(per_pos, s.labels, s.value, s.name)
            else:
                totals[key] = totals.get(key, 0) + int(round(s.value))
    if not seen and sglang:
        from workbench.integrations.sglang import counters_from_samples

        return counters_from_samples(sglang)
    return _finish(totals, per_pos, seen)


def _metrics_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ScrapeError(f"{url}: not an http(s) URL; expected e.g. http://127.0.0.1:8000/metrics")
    if parts.path in ("", "/"):  # a bare server address means its /metrics
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


def scrape(url: str, timeout: float = 2.0, model_name: str | None = None) -> SpecCounters:
    """GET a vLLM (or SGLang) server's `/metrics` and parse it; every failure is a ScrapeError naming the URL."""
    url = _metrics_url(url)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        raise ScrapeError(f"{url}: HTTP {e.code} {e.reason}; expected 200 with Prometheus metrics") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ScrapeError(f"{url}: cannot reach the server ({reason}); is vLLM or SGLang running there?") from None
    try:
        return parse_spec_metrics(body, model_name)
    except ValueError as e:
        raise ScrapeError(f"{url}: the body is not Prometheus text format ({e}); expected vLLM's or SGLang's /metrics") from None


# ---- per-interval deltas ------------------------------------------------------------------


@dataclass
class Interval:
    """What happened between two scrapes (vLLM's log-line numbers, peers.md §2.2)."""

    t0: float
    t1: float
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]
    accept_length: float  # 1 + d_accepted / d_drafts
    draft_acceptance_rate: float  # d_accepted / d_draft_tokens
    per_position_acceptance: list[float]  # d_per_pos[i] / d_drafts
    conditional_acceptance: list[float]
    accepted_throughput: float  # d_accepted / dt, tokens/s
    drafted_throughput: float  # d_draft_tokens / dt
    reset: bool = False  # a counter went down: the server restarted within the interval

    @property
    def dt(self) -> float:
        return self.t1 - self.t0


class MetricsTracker:
    """Keeps (time, counters) samples of a live server and turns them into per-interval rates.

    vLLM's counters are cumulative; the dashboard wants what happened since the last poll.
    If any counter went down the server restarted: the new values are then the deltas since
    the restart (all counters at once, so one interval never mixes two server lifetimes).
    """

    def __init__(self, max_samples: int = 1000):
        self.max_samples = max_samples
        self.samples: list[tuple[float, SpecCounters]] = []
        self.intervals: list[Interval] = []

    def add(self, counters: SpecCounters, t: float | None = None) -> Interval | None:
        """Record a sample; return the interval since the previous one (None for the first)."""
        t = time.monotonic() if t is None else float(t)
        prev = self.samples[-1] if self.samples else None
        if prev is not None and t <= prev[0]:
            raise ValueError(f"MetricsTracker.add: time {t} is not after the previous sample's {prev[0]}")
        self.samples.append((t, counters))
        del self.samples[: -self.max_samples]
        if prev is None:
            return None
        interval = _delta(prev[0], prev[1], t, counters)
        self.intervals.append(interval)
        del self.intervals[: -self.max_samples]
        return interval

    def poll(self, url: str, timeout: float = 2.0, model_name: str | None = None) -> Interval | None:
        return self.add(scrape(url, timeout, model_name))

    @property
    def latest(self) -> Interval | None:
        return self.intervals[-1] if self.intervals else None


def _delta(t0: float, old: SpecCounters, t1: float, new: SpecCounters) -> Interval:
    k = max(len(old.accepted_per_pos), len(new.accepted_per_pos))
    old_pos = old.accepted_per_pos + [0] * (k - len(old.accepted_per_pos))
    new_pos = new.accepted_per_pos + [0] * (k - len(new.accepted_per_pos))
    pairs = [(old.num_drafts, new.num_drafts), (old.num_draft_tokens, new.num_draft_tokens),
             (old.num_accepted_tokens, new.num_accepted_tokens), *zip(old_pos, new_pos)]
    reset = any(b < a for a, b in pairs)
    d = [b if reset else b - a for a, b in pairs]
    d_drafts, d_draft_tokens, d_accepted, d_pos = d[0], d[1], d[2], d[3:]
    rates = counter_rates(d_drafts, d_draft_tokens, d_accepted, d_pos)
    dt = t1 - t0
    return Interval(
        t0=t0, t1=t1, num_drafts=d_drafts, num_draft_tokens=d_draft_tokens, num_accepted_tokens=d_accepted,
        accepted_per_pos=d_pos, accept_length=rates["accept_length"],
        draft_acceptance_rate=rates["draft_acceptance_rate"],
        per_position_acceptance=rates["per_position_acceptance"],
        conditional_acceptance=rates["conditional_acceptance"],
        accepted_throughput=d_accepted / dt, drafted_throughput=d_draft_tokens / dt, reset=reset,
    )


# ---- offline runs -------------------------------------------------------------------------


def run_offline(
    verifier: str,
    draft: str,
    prompts: list[str],
    k: int = 3,
    tp: int = 1,
    max_tokens: int = 128,
    temperature: float = 0.0,
    method: str = "eagle3",
    **llm_kwargs,
) -> dict:
    """Generate with `vllm.LLM` + EAGLE-3 speculation and report vLLM's own acceptance numbers."""
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("run_offline: argument 'prompts'; expected a non-empty list of strings")
    spec = speculative_config(draft, k, method)
    try:
        import vllm
    except ImportError:
        raise RuntimeError(f"run_offline needs vLLM, which is not installed: {INSTALL_HINT}") from None
    llm_kwargs.setdefault("trust_remote_code", True)
    llm = vllm.LLM(model=verifier, speculative_config=spec, tensor_parallel_size=tp,
                   disable_log_stats=False, **llm_kwargs)
    outputs = llm.generate(prompts, vllm.SamplingParams(max_tokens=max_tokens, temperature=temperature))
    counters = counters_from_llm_metrics(llm.get_metrics())
    return {
        "texts": [o.outputs[0].text for o in outputs],
        "num_drafts": counters.num_drafts,
        "num_draft_tokens": counters.num_draft_tokens,
        "num_accepted_tokens": counters.num_accepted_tokens,
        "accepted_per_pos": counters.accepted_per_pos,
        **counters.rates(),
    }


# ---- export -------------------------------------------------------------------------------

VLLM_MLA_DRAFT = "Eagle3DeepseekV2ForCausalLM"
# What the published Kimi MLA drafts write. Not deepseek_v3: vLLM's SpeculativeConfig.hf_config_override
# rewrites that to deepseek_mtp (DeepSeekMTPModel), so the draft would not load as EAGLE-3.
EXPORT_MODEL_TYPE = "kimi_k2"
ROPE_FIELDS = ("rope_theta", "rope_scaling", "max_position_embeddings")
_EXPORT_DTYPES = ("bfloat16", "float16", "float32")
log = logging.getLogger(__name__)


def export_draft(pair: ModelPair, out_dir: str | Path, dtype: str = "bfloat16", rope_from: str = "verifier") -> Path:
    """Write `pair.draft` as vLLM's `Eagle3DeepseekV2ForCausalLM` loads it (eagle3_mla.md §1-2).

    config.json follows the public Kimi-K2.5 MLA draft layout: `model_type` kimi_k2; the aux ids
    the draft was loaded with at the top level (the only place vLLM reads them, capture-before) and,
    one less, in eagle_config (SGLang, lmdeploy and trainers read "output of layer i" there), so
    both engines fuse the same states (`workbench.engine_readings`); `fc_norm` and its
    `fc_norm.{i}.weight` tensors for an EAGLE-3.1 draft (SGLang applies them; vLLM's class skips
    them, which is logged); `rope_theta`, `rope_scaling` and
    `max_position_embeddings` the verifier's (`rope_from="draft"` keeps the draft's own; a
    difference is logged, since the export then rotates as the verifier does). Tensors: `fc.weight`,
    `layers.0.*`, `norm.weight`, `lm_head.weight` and, for a reduced draft vocabulary, `d2t`;
    no `model.` prefix. `lm_head` is always written (the verifier's, copied, when the draft
    shares it) because SGLang only takes the target's head when `draft_vocab_size` is absent,
    and we always write it. `embed_tokens` is never written: vLLM shares the target's table when
    it is absent, and SGLang and lmdeploy use the target's table regardless.
    Returns the output directory.
    """
    import torch

    from workbench.checkpoint import save_state

    draft = getattr(pair, "draft", None)
    where = getattr(pair, "draft_dir", None) or "draft"
    if draft is None:
        raise ValueError("export_draft: the pair has no draft; expected a pair loaded with an MLA draft")
    cfg = draft.config
    _check_exportable(cfg, dtype, rope_from, where)
    torch_dtype = getattr(torch, dtype)

    tensors: dict[str, torch.Tensor] = {}
    for name, t in draft.state_dict().items():
        if name == "embed_tokens.weight":
            shared = draft._shared.get("embed_tokens")
            if shared is None or not torch.equal(t, shared.weight.to(t.dtype)):
                raise ValueError(
                    f"{where}: tensor 'embed_tokens.weight' differs from the verifier's embedding; the vLLM "
                    f"export carries no embed_tokens (servers embed with the target's table), so it would "
                    f"not be this draft; expected a draft that shares the verifier's embedding")
            continue
        tensors[name] = t.to(torch_dtype) if t.is_floating_point() else t
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = draft.part("lm_head").weight.to(torch_dtype)
    if cfg.draft_vocab_size < cfg.vocab_size:
        tensors["d2t"] = draft.d2t.to(torch.int64)
    head = tuple(tensors["lm_head.weight"].shape)
    if head != (cfg.draft_vocab_size, cfg.hidden_size):
        raise ValueError(f"{where}: lm_head has shape {head}; expected "
                         f"({cfg.draft_vocab_size}, {cfg.hidden_size}) = (draft_vocab_size, hidden_size)")

    config = export_config(cfg, pair.verifier.config, dtype, rope_from, where)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_state(tensors, out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_config(cfg, verifier_cfg, dtype: str = "bfloat16", rope_from: str = "verifier",
                  where: str = "draft") -> dict:
    """The config.json `export_draft` writes for an MLA draft config `cfg` of `verifier_cfg`."""
    _check_exportable(cfg, dtype, rope_from, where)
    config = cfg.to_hf()
    ids = list(cfg.aux_layer_ids)
    nested = nested_aux_ids(ids)
    config.update(
        architectures=[VLLM_MLA_DRAFT],
        model_type=EXPORT_MODEL_TYPE,
        num_hidden_layers=1,
        draft_vocab_size=cfg.draft_vocab_size,
        tie_word_embeddings=False,
        torch_dtype=dtype,
        eagle_aux_hidden_state_layer_ids=ids,
        # "output of layer i" for SGLang and trainers (see config.nested_aux_ids); none where it cannot say it
        eagle_config={**({"eagle_aux_hidden_state_layer_ids": nested} if nested is not None else {}),
                      "use_aux_hidden_state": True},
    )
    config.pop("n_routed_experts", None)  # the draft layer is dense; transformers 5 refuses a null here
    rope = _export_rope(cfg, verifier_cfg, rope_from, where)
    config.update(rope_theta=rope["rope_theta"], max_position_embeddings=rope["max_position_embeddings"],
                  rope_scaling=None)
    if rope["rope_scaling"]:
        # rope_theta inside too: vLLM's draft layer copies rope_scaling into rope_parameters, and newer
        # vLLM reads the base from there (eagle3_mla.md §4, "verify" note).
        config["rope_scaling"] = dict(rope["rope_scaling"], rope_type="yarn", rope_theta=rope["rope_theta"])
    _warn_engine_readings(config, cfg, verifier_cfg.num_hidden_layers, where)
    return config


def _warn_engine_readings(config: dict, cfg, num_layers: int, where: str) -> None:
    """Log each engine that would fuse other states than the draft was trained on, or drop its
    EAGLE-3.1 flags (e.g. vLLM and fc_norm): the export is still right for the engines that agree."""
    from workbench.engine_readings import disagreements, engine_readings

    for line in disagreements(engine_readings(config, num_layers), tuple(cfg.aux_layer_ids), cfg.fc_norm,
                              cfg.norm_output):
        log.warning("%s: exported config: %s", where, line)


def _check_exportable(cfg, dtype: str, rope_from: str, where: str) -> None:
    if cfg.attention != "mla":
        raise ValueError(
            f"{where}: the draft is {cfg.architecture} ({cfg.attention.upper()} attention); vLLM's "
            f"{VLLM_MLA_DRAFT} builds an MLA layer (q_a/kv_a/kv_b projections) and cannot load it; "
            f"expected an MLA draft")
    if not cfg.use_aux_hidden_state:
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state is false (no fc); expected an EAGLE-3 "
                         f"draft that fuses three verifier states, which is what {VLLM_MLA_DRAFT} builds")
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"export_draft: dtype = {dtype!r}; expected one of {', '.join(_EXPORT_DTYPES)}")
    if rope_from not in ("verifier", "draft"):
        raise ValueError(f"export_draft: rope_from = {rope_from!r}; expected 'verifier' or 'draft'")


def _export_rope(draft_cfg, verifier_cfg, rope_from: str, where: str) -> dict:
    """The rope fields to export: the verifier's (logging any the draft had otherwise) or the draft's."""
    own = {f: getattr(draft_cfg, f) for f in ROPE_FIELDS}
    if rope_from == "draft":
        return own
    theirs = {f: getattr(verifier_cfg, f) for f in ROPE_FIELDS}
    changed = [f"{f} {own[f]!r} -> {theirs[f]!r}" for f in ROPE_FIELDS if own[f] != theirs[f]]
    if changed:
        log.warning("%s: exported with the verifier's %s (rope_from='draft' keeps the draft's)", where,
                    "; ".join(changed))
    return theirs
