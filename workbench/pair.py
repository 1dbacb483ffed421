"""Loading a verifier, a draft, and the pair they make, with the pairing checked up front.

A draft that does not fit its verifier fails silently in serving (accept length near 1), so
every mismatch we can see from configs and shapes is an error here, naming both directories.
Models are built on the meta device and filled from memory-mapped safetensors, so a large
checkpoint is never initialised randomly first nor held twice.
"""
from __future__ import annotations

import functools

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench.cache import KVCache
from workbench.checkpoint import (SafetensorsReader, draft_name, load_state, skipped_multimodal, text_prefix,
                                  verifier_name)
from workbench.config import ConfigError, DraftConfig, load_draft_config, load_verifier_config
from workbench.fast import FastPath, apply, choose
from workbench.kernels import resolve_backend
from workbench.models import Eagle3Draft, Verifier
from workbench.variants import variant

OFF = FastPath("off", "torch", "plain PyTorch models")

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EMBEDDED = ASSETS / "tiny-kimi"
log = logging.getLogger(__name__)


class PairingError(ValueError):
    """A draft that does not match its verifier."""


def _dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype = {dtype!r}; expected one of {', '.join(names)}")
    return names[dtype]


def _build(module_fn, device: torch.device, dtype: torch.dtype):
    with torch.device("meta"):
        module = module_fn()
    module = module.to_empty(device=device).to(dtype)
    return module


def _keep_routers_fp32(model: torch.nn.Module) -> None:
    """Routing scores decide discrete expert choices: keep the gate and its bias in fp32."""
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate"):
            mod.float()


def load_verifier(directory: str | Path, device: str | torch.device = "cpu",
                  dtype: str | torch.dtype | None = torch.float32,
                  aux_layer_ids: tuple[int, ...] | None = None) -> Verifier:
    """A `deepseek_v3` / `kimi_k2` / `deepseek_v2` checkpoint directory as a `Verifier`, or the text
    model of a Kimi-K2.5/K2.6 one (`text_config`, tensors under `language_model.`; the vision tower
    and projector are skipped, and `model.load_notes` says how many). FP8 block-scaled and
    compressed-tensors int4 weights are dequantised as they load."""
    device, dtype = torch.device(device), _dtype(dtype, device)
    cfg = load_verifier_config(directory)
    reader = SafetensorsReader(directory, cfg.quantization, str(Path(directory) / "config.json"))
    names = reader.keys()
    prefix, skipped = text_prefix(names), skipped_multimodal(names)
    model = _build(lambda: Verifier(cfg, aux_layer_ids), device, dtype)
    # Routers go fp32 *before* loading (dtype=None loads each tensor at its module dtype), so an
    # fp32 e_score_correction_bias is never rounded through bf16 on the way in.
    _keep_routers_fp32(model)
    optional = ["lm_head.weight"] if cfg.tie_word_embeddings else []
    load_state(model, reader, rename=verifier_name(cfg.num_hidden_layers, prefix), dtype=None, device=device,
               optional=optional)
    if cfg.tie_word_embeddings and prefix + "lm_head.weight" not in reader:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.source = str(directory)
    model.load_notes = []
    if skipped:
        model.load_notes.append(f"{directory}: skipped {sum(skipped.values())} tensors of no text-model part ("
                                + ", ".join(f"{p}* x{n}" for p, n in skipped.items()) + ")")
    if cfg.quantization:
        model.load_notes.append(f"{directory}: dequantised {cfg.quantization.get('quant_method')} weights to {dtype}")
    for note in model.load_notes:
        log.info(note)
    return model.eval()


def load_draft(directory: str | Path, verifier: Verifier, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None) -> Eagle3Draft:
    """An EAGLE-3 draft (MLA or MHA) sharing the verifier's embedding/lm_head where it ships none.

    Sets the verifier's aux layer ids to the draft's, so the verifier captures what the draft fuses:
    the ids vLLM would capture for this config.json (`config.read_aux_ids`: a top-level
    `eagle_aux_hidden_state_layer_ids`, else the verifier's default; never `eagle_config`'s).
    """
    draft = _read_draft(directory, verifier, device, dtype)
    verifier.aux_layer_ids = draft.config.aux_layer_ids
    return draft


def _read_draft(directory: str | Path, verifier: Verifier, device: str | torch.device | None = None,
                dtype: str | torch.dtype | None = None) -> Eagle3Draft:
    """`load_draft` without touching the verifier."""
    device = torch.device(device) if device is not None else verifier.device
    dtype = _dtype(dtype, device) if dtype is not None else verifier.dtype
    vcfg = verifier.config
    cfg = load_draft_config(directory, vcfg.num_hidden_layers)
    reader = SafetensorsReader(directory)
    names = {draft_name(n) for n in reader.keys()}
    check_pairing(cfg, vcfg, directory, getattr(verifier, "source", "verifier"))
    own_embed, own_head = "embed_tokens.weight" in names, "lm_head.weight" in names
    draft = _build(lambda: Eagle3Draft(cfg, own_embed=own_embed, own_lm_head=own_head), device, dtype)
    optional = ["d2t"] if cfg.draft_vocab_size != cfg.vocab_size else []
    if optional:
        draft.d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=device)
    load_state(draft, reader, rename=draft_name, dtype=dtype, device=device, optional=optional,
               ignore=lambda n: n.removeprefix("model.") in ("d2t",) and not optional)
    if not own_head and cfg.draft_vocab_size != vcfg.vocab_size:
        raise PairingError(f"{directory}: the draft ships no lm_head but draft_vocab_size = {cfg.draft_vocab_size} "
                           f"differs from the verifier's vocab_size = {vcfg.vocab_size}; expected its own lm_head")
    draft.share(verifier.model.embed_tokens, verifier.lm_head)
    draft.source = str(directory)
    draft.load_notes = []
    if cfg.nested_aux_layer_ids is not None:
        draft.load_notes.append(f"{directory}: eagle_config names aux ids {list(cfg.nested_aux_layer_ids)}; "
                                f"capturing {list(cfg.aux_layer_ids)} ({cfg.aux_ids_source}), as vLLM does")
    for note in draft.load_notes:
        log.info(note)
    for note in engine_notes(cfg, vcfg.num_hidden_layers, directory):
        (log.warning if note.startswith("!") else log.info)(note)  # not silent: SGLang may use what vLLM ignores
        draft.load_notes.append(note)
    return draft.eval()


def engine_notes(cfg: DraftConfig, num_layers: int, directory="draft") -> list[str]:
    """Which verifier states vLLM and SGLang would fuse for this draft config, one line each, then a
    line starting with "!" for each problem (out-of-range ids, engines that disagree, dropped flags)."""
    from workbench.engine_readings import config_view, engine_readings, problems

    readings = engine_readings(config_view(cfg), num_layers)
    return ([f"{directory}: {r.describe()}" for r in readings.values()]
            + [f"! {directory}: {p}" for p in problems(readings, cfg.fc_norm, cfg.norm_output)])


@functools.lru_cache(maxsize=32)
def _generation_eos(path: str, mtime_ns: int) -> tuple[int, ...]:
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    eos = d.get("eos_token_id") if isinstance(d, dict) else None
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: field 'eos_token_id' = {eos!r}; expected a token id or a list of them")
    return tuple(ids)


def generation_eos_ids(directory: str | Path | None) -> list[int]:
    """`eos_token_id` of `directory`/generation_config.json (an id or a list), [] without the file."""
    path = Path(directory) / "generation_config.json" if directory else None
    if path is None or not path.is_file():
        return []
    return list(_generation_eos(str(path), path.stat().st_mtime_ns))


def check_pairing(dcfg: DraftConfig, vcfg, draft_dir="draft", verifier_dir="verifier") -> None:
    """Everything a config can tell about a draft that does not fit its verifier."""
    problems = []
    if dcfg.target_hidden_size != vcfg.hidden_size:
        problems.append(f"target_hidden_size = {dcfg.target_hidden_size}; expected the verifier's hidden_size "
                        f"{vcfg.hidden_size}")
    if dcfg.hidden_size != vcfg.hidden_size:
        problems.append(f"hidden_size = {dcfg.hidden_size}; expected {vcfg.hidden_size} to share the verifier's "
                        "embedding and lm_head")
    if dcfg.vocab_size != vcfg.vocab_size:
        problems.append(f"vocab_size = {dcfg.vocab_size}; expected the verifier's vocab_size {vcfg.vocab_size}")
    bad = [i for i in dcfg.aux_layer_ids if not 0 <= i < vcfg.num_hidden_layers]
    if bad:
        problems.append(f"eagle_aux_hidden_state_layer_ids = {list(dcfg.aux_layer_ids)}: {bad} out of range; "
                        f"expected ids in [0, {vcfg.num_hidden_layers - 1}] for a {vcfg.num_hidden_layers}-layer verifier")
    if problems:
        raise PairingError(f"{draft_dir}/config.json does not match the verifier {verifier_dir}: " + "; ".join(problems))


@dataclass
class ModelPair:
    """A verifier, its draft (or None) and their tokenizer: what the engine and apps run on.

    `verifier` and `draft` are what runs: the plain models, or their copies on a fast path
    (`workbench.fast`; `status()` says which and why). `plain` holds the plain models they came
    from, which `reference()`, `variant()` and every other path start from.
    """

    verifier: Verifier
    draft: Eagle3Draft | None
    tokenizer: object
    verifier_dir: str
    draft_dir: str | None
    info: dict = field(default_factory=dict)
    path: FastPath = OFF
    plain: tuple = ()  # (verifier, draft) as loaded; empty: `verifier` and `draft` are plain

    def __post_init__(self) -> None:
        if not self.plain:
            self.plain = (self.verifier, self.draft)

    @property
    def device(self) -> torch.device:
        return self.verifier.device

    @property
    def dtype(self) -> torch.dtype:
        return self.verifier.dtype

    @property
    def context_length(self) -> int:
        return self.verifier.config.max_position_embeddings

    @property
    def eos_token_ids(self) -> list[int]:
        """Where a generation ends: the tokenizer's and the config's EOS, and generation_config.json's
        (a chat model lists its end-of-turn token there, as Kimi-K2 does with <|im_end|>)."""
        ids = [self.tokenizer.eos_token_id, self.verifier.config.eos_token_id,
               generation_eos_ids(self.verifier_dir)]
        flat = [i for x in ids for i in (x if isinstance(x, list) else [x])]
        return sorted({i for i in flat if i is not None})

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=self.tokenizer.bos_token_id is not None)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def verifier_cache(self, max_len: int) -> KVCache:
        return self.verifier.new_cache(max_len)

    def status(self) -> str:
        """Which path runs the models, and why."""
        return self.path.describe()

    @property
    def compiled(self) -> bool:
        return self.path.name == "compile"

    @property
    def attention(self) -> str:
        return self.path.attention

    @property
    def weights(self) -> str:
        """How the running models hold their linears' weights: "native", or "int8" / "int8-b32" /
        "bf16" (an fp32 pair's, rounded) on the CPU kernels (`workbench.fast`); the plain models keep theirs."""
        return self.path.weights

    def _on(self, path: FastPath, verifier: Verifier | None = None, draft: Eagle3Draft | None = None,
            draft_dir: str | None = None) -> "ModelPair":
        v, d = verifier or self.plain[0], draft if draft is not None else self.plain[1]
        fast = apply(path, *([v] if d is None else [v, d]))
        return ModelPair(fast[0], fast[1] if d is not None else None, self.tokenizer, self.verifier_dir,
                         draft_dir if draft is not None else self.draft_dir, dict(self.info), path, (v, d))

    def with_path(self, fast: str = "auto", attention: str = "auto", weights: str | None = None) -> "ModelPair":
        """The same plain models on another path (`workbench.fast.choose`); `weights` None keeps this
        pair's ("native" on a plain pair)."""
        path = choose(fast, self.device, self.dtype, attention, self.weights if weights is None else weights)
        return self if path == self.path else self._on(path)

    def with_weights(self, weights: str) -> "ModelPair":
        """The same plain models on the CPU kernels with their linears' weights as `weights` says
        ("native", "int8", "int8-b32", "bf16"), quantised afresh from the plain weights."""
        return self.with_path("cpu" if self.path.name == "cpu" else "auto", "torch", weights)

    def with_attention(self, attention: str) -> "ModelPair":
        """This pair with the absorbed attention on `attention` ("auto" keeps this pair's path
        unless the device asks for Triton; "torch" this pair's path; "triton" the plain models with it)."""
        backend = resolve_backend(attention, self.device)
        if backend == self.path.attention:
            return self
        cached = self.__dict__.setdefault("_by_attention", {})
        if backend not in cached:
            cached[backend] = self.with_path("off" if backend == "triton" else "auto", backend)
        return cached[backend]

    def reference(self) -> "ModelPair":
        """The plain models, as a pair (the oracle every fast path is tested against)."""
        return self if self.path == OFF else self._on(OFF)

    def compile(self) -> "ModelPair":
        """Run the per-token forwards as torch.compile'd graphs (`workbench.compiled`); returns self.

        One compiled graph serves 1 and k+1 new tokens with the same kernels, so greedy speculative
        output equals compiled autoregressive output in bf16 too. Compiled and eager bf16 round
        differently from each other: compare like with like.
        """
        if not self.compiled:
            other = self._on(choose("compile", self.device, self.dtype, "torch", self.weights))
            self.verifier, self.draft, self.path = other.verifier, other.draft, other.path
        return self

    def variant(self, verifier: dict | None = None, draft: dict | None = None) -> "ModelPair":
        """A pair on copies of the plain models with settings changed (`workbench.variants.variant`),
        sharing every weight: what the doctor's and the fusion analysis' probes run, so the models
        the caller holds never change. On this pair's path, except that a compiled pair's variants
        run eagerly (a variant would compile its graphs again)."""
        v, d = self.plain
        memo: dict = {}
        v2 = variant(v, verifier or {}, memo)
        d2 = variant(d, draft or {}, memo) if d is not None else None
        path = self.path if not self.compiled else choose("auto", self.device, self.dtype, "torch")
        return self._on(path, v2, d2, self.draft_dir)

    def with_draft(self, draft_dir: str | Path | None) -> "ModelPair":
        """The same verifier with another draft (None: no draft), e.g. the MHA twin."""
        if not draft_dir:
            return ModelPair(self.verifier, None, self.tokenizer, self.verifier_dir, None, dict(self.info), self.path,
                             (self.plain[0], None))
        v = self.plain[0]
        d = _read_draft(draft_dir, v)
        if tuple(d.config.aux_layer_ids) != tuple(v.aux_layer_ids):  # the verifier must capture what it fuses
            return self._on(self.path, variant(v, {"aux_layer_ids": d.config.aux_layer_ids}), d, str(draft_dir))
        memo = {id(a): b for a, b in zip(v.modules(), self.verifier.modules())}  # keep this pair's fast verifier
        fast = apply(self.path, d, memo=memo)[0]
        return ModelPair(self.verifier, fast, self.tokenizer, self.verifier_dir, str(draft_dir), dict(self.info),
                         self.path, (v, d))


def load_pair(verifier: str | Path | None = None, draft: str | Path | None = None,
              device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
              no_draft: bool = False, fast: str = "auto", attention: str = "auto",
              weights: str = "native") -> ModelPair:
    """The embedded tiny-kimi pair by default; any verifier/draft directories otherwise.

    `fast` picks the path the models run on ("auto", "cpu", "compile", "off"; `workbench.fast`),
    `attention` the absorbed attention's backend where the plain modules run, `weights` how the
    CPU kernels hold the linears' weights: "native" (the dtype's), or "int8" / "int8-b32"
    (quantised once here, activations in `dtype`; only on the CPU kernels), or "bf16" (an fp32
    pair's weights rounded to bf16 once, everything else fp32; a bf16 pair's is "native").
    """
    from workbench.tokenizer import Tokenizer

    vdir = Path(verifier) if verifier else EMBEDDED / "verifier"
    ddir = None if no_draft else (Path(draft) if draft else (EMBEDDED / "draft" if verifier is None else None))
    if verifier is None and not (vdir / "model.safetensors").exists():
        raise ConfigError(f"{vdir}: the embedded pair is missing; expected assets/tiny-kimi in the repository")
    v = load_verifier(vdir, device=device, dtype=dtype)
    d = load_draft(ddir, v) if ddir else None
    tok_dir = vdir if any((vdir / f).exists() for f in ("tokenizer.json", "tiktoken.model")) else ddir
    if tok_dir is None:
        raise ConfigError(f"{vdir}: no tokenizer.json or tiktoken.model; expected the verifier's tokenizer beside it")
    plain = ModelPair(v, d, Tokenizer.from_dir(tok_dir), str(vdir), str(ddir) if ddir else None)
    return plain.with_path(fast, attention, weights)


def save_model(model: Verifier | Eagle3Draft, directory: str | Path, dtype: torch.dtype | None = None,
               max_shard_bytes: int | None = None) -> Path:
    """config.json + safetensors in the Hugging Face layout (a draft's shared parts are not saved)."""
    from workbench.checkpoint import save_state
    from workbench.config import write_config_json

    directory = Path(directory)
    path = write_config_json(model.config, directory)
    tensors = {n: (t.to(dtype) if dtype is not None and t.is_floating_point() else t)
               for n, t in model.state_dict().items()}
    config = json.loads(path.read_text())
    config["torch_dtype"] = str(dtype or next(iter(model.parameters())).dtype).replace("torch.", "")
    path.write_text(json.dumps(config, indent=2) + "\n")
    save_state(tensors, directory, max_shard_bytes=max_shard_bytes)
    return directory
