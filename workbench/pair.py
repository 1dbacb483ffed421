"""Loading a verifier, a draft, and the pair they make, with the pairing checked up front.

A draft that does not fit its verifier fails silently in serving (accept length near 1), so
every mismatch we can see from configs and shapes is an error here, naming both directories.
Models are built on the meta device and filled from memory-mapped safetensors, so a large
checkpoint is never initialised randomly first nor held twice.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench.cache import KVCache
from workbench.checkpoint import (SafetensorsReader, draft_name, load_state, skipped_multimodal, text_prefix,
                                  verifier_name)
from workbench.config import ConfigError, DraftConfig, load_draft_config, load_verifier_config
from workbench.models import Eagle3Draft, Verifier

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
    verifier.aux_layer_ids = cfg.aux_layer_ids
    draft.source = str(directory)
    draft.load_notes = []
    if cfg.nested_aux_layer_ids is not None:
        draft.load_notes.append(f"{directory}: eagle_config names aux ids {list(cfg.nested_aux_layer_ids)}; "
                                f"capturing {list(cfg.aux_layer_ids)} ({cfg.aux_ids_source}), as vLLM does")
    for note in draft.load_notes:
        log.info(note)
    return draft.eval()


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
    """A verifier, its draft (or None) and their tokenizer: what the engine and apps run on."""

    verifier: Verifier
    draft: Eagle3Draft | None
    tokenizer: object
    verifier_dir: str
    draft_dir: str | None
    info: dict = field(default_factory=dict)

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
        ids = [self.tokenizer.eos_token_id, self.verifier.config.eos_token_id]
        flat = [i for x in ids for i in (x if isinstance(x, list) else [x])]
        return sorted({i for i in flat if i is not None})

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=self.tokenizer.bos_token_id is not None)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def verifier_cache(self, max_len: int) -> KVCache:
        return self.verifier.new_cache(max_len)

    def resolve_attention(self, attention: str) -> str:
        from workbench.kernels import resolve_backend

        return resolve_backend(attention, self.device)

    @property
    def compiled(self) -> bool:
        from workbench.compiled import is_compiled

        return is_compiled(self.verifier)

    def compile(self) -> "ModelPair":
        """torch.compile the verifier's and the draft's per-token forwards (`workbench.compiled`); returns self.

        Any dtype: one compiled graph serves 1 and k+1 new tokens with the same kernels, so in
        bf16 too greedy speculative output equals compiled autoregressive output, up to exact
        logit ties (see `workbench.compiled` on weight packing). Compiled and eager bf16 round
        differently from each other: compare like with like.
        """
        from workbench.compiled import compile_model

        for model in (self.verifier, self.draft):
            if model is not None:
                compile_model(model)
        return self

    def with_draft(self, draft_dir: str | Path | None) -> "ModelPair":
        """The same verifier with another draft (None: no draft), e.g. the MHA twin."""
        draft = load_draft(draft_dir, self.verifier) if draft_dir else None
        pair = ModelPair(self.verifier, draft, self.tokenizer, self.verifier_dir,
                         str(draft_dir) if draft_dir else None, dict(self.info))
        return pair.compile() if self.compiled else pair  # the shared verifier is compiled already


def load_pair(verifier: str | Path | None = None, draft: str | Path | None = None,
              device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
              no_draft: bool = False) -> ModelPair:
    """The embedded tiny-kimi pair by default; any verifier/draft directories otherwise."""
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
    return ModelPair(v, d, Tokenizer.from_dir(tok_dir), str(vdir), str(ddir) if ddir else None)


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
