"""llama.cpp as a peer: the verifier written as GGUF for llama.cpp's `deepseek2` architecture, and
llama.cpp's plain greedy decoding timed on the same token ids as ours.

The GGUF carries what llama.cpp's own `convert_hf_to_gguf.py` writes for a DeepSeek-V3 checkpoint:
MLA as MQA over the latent (one KV head of kv_lora + rope width), `kv_b_proj` split into `attn_k_b`
(transposed, for the absorbed query) and `attn_v_b`, the routed experts stacked per layer, the
correction bias as `exp_probs_b.bias`, grouped top-k, and the sigmoid gate written out (llama.cpp
falls back to softmax when the key is absent). Names come from the `gguf` package's tensor map.
Norms and biases stay f32, as llama.cpp needs; matrices are bf16, f32 or Q8_0 (32-weight blocks,
one f16 scale each).

llama.cpp's byte-level BPE has no pre-tokenizer for our tokenizer's split regex, so the vocabulary
is written for loading only ("default" pre-tokenizer) and the peer is fed token ids, never text.
Both `gguf` and `llama-cpp-python` are optional (`pip install -e ".[llama]"`), imported here lazily.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workbench.checkpoint import SafetensorsReader
from workbench.config import load_verifier_config

GGUF_TYPES = ("bf16", "f32", "q8_0")
ARCH = "deepseek2"


class GGUFExportError(ValueError):
    """A verifier this exporter cannot write for llama.cpp (names the file and the field)."""


def _gguf():
    try:
        import gguf
    except ImportError as e:  # an optional extra
        raise ImportError("export-gguf needs the `gguf` package: pip install -e '.[llama]'") from e
    return gguf


def _check_config(cfg, source: str) -> None:
    need = {"rope_interleave": (cfg.extra.get("rope_interleave", True), True),
            "scoring_func": (cfg.scoring_func, "sigmoid"), "topk_method": (cfg.topk_method, "noaux_tc"),
            "moe_layer_freq": (cfg.moe_layer_freq, 1)}
    for field, (value, want) in need.items():
        if value != want:  # llama.cpp's deepseek2 graph has no other form of these
            raise GGUFExportError(f"{source}: field '{field}' = {value!r}; llama.cpp's deepseek2 expects {want!r}")
    if cfg.q_lora_rank is None:
        raise GGUFExportError(f"{source}: field 'q_lora_rank' is null; this exporter writes the q_a/q_b form")
    if cfg.quantization is not None:
        raise GGUFExportError(f"{source}: field 'quantization_config' is set; export a bf16 or fp32 checkpoint")


def _vocab(writer, directory: Path, vocab_size: int, bos: int | None, eos: int | None) -> None:
    """Tokens, types and merges from tokenizer.json (byte-level BPE), for loading only (module docstring)."""
    gguf = _gguf()
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise GGUFExportError(f"{path}: not found; export-gguf writes a byte-level BPE vocabulary from tokenizer.json")
    tj = json.loads(path.read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise GGUFExportError(f"{path}: field 'model.type' = {model.get('type')!r}; expected 'BPE' with a vocab")
    added = {t["id"]: t["content"] for t in tj.get("added_tokens", [])}
    by_id = {i: s for s, i in model["vocab"].items()} | added
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.CONTROL if i in added else
             gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if bos is not None:
        writer.add_bos_token_id(bos)
    if eos is not None:
        writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)  # the peer is fed our ids, a BOS included only where ours has one


def _hparams(writer, cfg) -> None:
    gguf = _gguf()
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1)  # MLA as MQA over the latent
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.n_routed_experts:
        writer.add_expert_count(cfg.n_routed_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_shared_count(cfg.n_shared_experts)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    rs = cfg.rope_scaling
    if rs and rs.get("type", rs.get("rope_type")) == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rs["factor"])
        writer.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rs.get("beta_fast", 32.0))
        writer.add_rope_scaling_yarn_beta_slow(rs.get("beta_slow", 1.0))
        # llama.cpp's deepseek2 reads mscale_all_dim through this key, scaled by 0.1 (its converter's convention)
        writer.add_rope_scaling_yarn_log_mul(0.1 * rs.get("mscale_all_dim", 1.0))
    elif rs:
        raise GGUFExportError(f"rope_scaling type {rs.get('type')!r}: this exporter writes YaRN or none")


def _tensors(reader: SafetensorsReader, cfg):
    """(HF-style name, tensor) in GGUF's shapes: kv_b split, experts stacked (module docstring)."""
    H, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for name in reader.keys():
        if ".mlp.experts." in name:
            continue
        t = reader.get(name, torch.float32)
        if name.endswith("self_attn.kv_b_proj.weight"):
            kv_b = t.view(H, nope + v, t.shape[-1])
            k_b, v_b = kv_b.split([nope, v], dim=1)
            yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2).contiguous()
            yield name.replace("kv_b_proj", "v_b_proj"), v_b.contiguous()
        elif name.endswith("e_score_correction_bias"):
            yield name.replace("e_score_correction_bias", "e_score_correction.bias"), t
        else:
            yield name, t
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        for w in ("down_proj", "gate_proj", "up_proj"):
            stack = [reader.get(f"model.layers.{i}.mlp.experts.{e}.{w}.weight", torch.float32)
                     for e in range(cfg.n_routed_experts)]
            yield f"model.layers.{i}.mlp.experts.{w}.weight", torch.stack(stack)


def export_gguf(verifier_dir: str | Path, out: str | Path, dtype: str = "bf16") -> Path:
    """Write the verifier in `verifier_dir` (config.json, safetensors, tokenizer.json) as one GGUF file."""
    gguf = _gguf()
    if dtype not in GGUF_TYPES:
        raise GGUFExportError(f"dtype = {dtype!r}; expected one of {', '.join(GGUF_TYPES)}")
    directory, out = Path(verifier_dir), Path(out)
    cfg = load_verifier_config(directory)
    _check_config(cfg, str(directory / "config.json"))
    reader = SafetensorsReader(directory)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), ARCH)
    writer.add_name(directory.name)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    _hparams(writer, cfg)
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    _vocab(writer, directory, cfg.vocab_size, cfg.bos_token_id, eos)
    for hf, t in _tensors(reader, cfg):
        base, suffix = hf.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            raise GGUFExportError(f"{directory}: tensor '{hf}' has no deepseek2 name in the gguf package's map")
        data = t.numpy()
        if t.dim() == 1 or dtype == "f32" or (dtype == "q8_0" and t.shape[-1] % 32):
            writer.add_tensor(f"{name}.{suffix}", data.astype(np.float32))
        elif dtype == "bf16":
            raw = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            writer.add_tensor(f"{name}.{suffix}", raw, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            q = gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(f"{name}.{suffix}", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def read_gguf(path: str | Path) -> tuple[dict, dict[str, tuple[tuple[int, ...], str, np.ndarray]]]:
    """(metadata, {tensor name: (numpy shape, GGML type name, data)}) of a GGUF file, as the gguf package reads it."""
    gguf = _gguf()
    r = gguf.GGUFReader(str(path))
    meta = {}
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                                    "tokenizer.ggml.token_type"):
            continue
        meta[f.name] = f.contents()
    meta["tokenizer.ggml.tokens.count"] = len(r.fields["tokenizer.ggml.tokens"].data)
    tensors = {t.name: (tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name, t.data) for t in r.tensors}
    return meta, tensors


def dequantize(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor read back by `read_gguf`, as float32 of its logical shape."""
    gguf = _gguf()
    if kind == "BF16":
        return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16).float().numpy().reshape(shape)
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(shape).astype(np.float32)


@dataclass
class PeerRun:
    tokens: list[int]
    prefill_s: float
    decode_s: float  # the generated tokens after the first

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


class LlamaCppPeer:
    """llama.cpp's plain greedy decoding through `llama-cpp-python`, fed token ids."""

    def __init__(self, gguf_path: str | Path, threads: int, n_ctx: int = 2048, extra_buffers: bool = True) -> None:
        """`extra_buffers`: llama.cpp's repacked weight buffers (AMX, interleaved quants). Off for Q8_0 on
        an AMX CPU: there its AMX buffer holds the 3-D `attn_k_b`, which no AMX op takes, and llama.cpp
        aborts building the graph (GGML_ASSERT(*cur_backend_id != -1), llama-cpp-python 0.3.36)."""
        try:
            import llama_cpp
            from llama_cpp import llama_cpp as lib  # what Llama() reads its defaults from
        except ImportError as e:
            raise ImportError("the llama.cpp peer needs llama-cpp-python (it builds llama.cpp from source): "
                              "pip install -e '.[llama]'") from e
        defaults = lib.llama_model_default_params

        def params():  # Llama() takes no such argument: it reads the library's defaults
            p = defaults()
            p.use_extra_bufts = extra_buffers
            return p

        lib.llama_model_default_params = params
        try:
            self.llm = llama_cpp.Llama(str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                       n_batch=n_ctx, logits_all=False, verbose=False, seed=0)
        finally:
            lib.llama_model_default_params = defaults
        self.threads, self.extra_buffers = threads, extra_buffers
        self.n_vocab = self.llm.n_vocab()

    def greedy(self, ids: list[int], max_new_tokens: int, eos: set[int] = frozenset()) -> PeerRun:
        """Prefill `ids`, then argmax decoding (the first of tied maxima, as ours) until max_new_tokens or EOS."""
        llm, last = self.llm, self._last_logits
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        out = [int(np.argmax(last()))]  # numpy's argmax: the first of tied maxima, as ours
        t1 = time.perf_counter()
        while len(out) < max_new_tokens and out[-1] not in eos:
            llm.eval([out[-1]])
            out.append(int(np.argmax(last())))
        return PeerRun(out, t1 - t0, time.perf_counter() - t1)

    def _last_logits(self) -> np.ndarray:
        """The last evaluated position's logits, read in place (llama-cpp-python keeps `scores` only with logits_all)."""
        import llama_cpp

        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))


__all__ = ["GGUF_TYPES", "GGUFExportError", "LlamaCppPeer", "PeerRun", "dequantize", "export_gguf", "read_gguf"]
