"""Verifier and draft configs, read from and written to Hugging Face `config.json`.

Real checkpoints disagree on where fields live (Kimi-K2.5 nests the text model under
`text_config`; transformers 5 writes `rope_parameters` where real checkpoints have
`rope_theta` + `rope_scaling`; trainers nest EAGLE aux ids in `eagle_config`, where vLLM never
reads them). This module absorbs those differences once, so the models see one flat dataclass.
Every error names the file, the field and what was expected.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

VERIFIER_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v2", "kimi_k25")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")  # DeepSeek-V2's two, DeepSeek-V3's one
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
DRAFT_ARCHITECTURES = {
    "Eagle3DeepseekV2ForCausalLM": "mla",
    "Eagle3DeepseekV3ForCausalLM": "mla",
    "LlamaForCausalLMEagle3": "mha",
    "Eagle3LlamaForCausalLM": "mha",
}


class ConfigError(ValueError):
    """A config.json that cannot describe a model we can build."""


def _need(d: dict, key: str, source: str, kind: type | tuple = (int,)) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{source}: field '{key}' is missing; expected {_kind_name(kind)}")
    v = d[key]
    if not isinstance(v, kind) or isinstance(v, bool) and bool not in _as_tuple(kind):
        raise ConfigError(f"{source}: field '{key}' = {v!r}; expected {_kind_name(kind)}")
    return v


def _as_tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kind))


def _rope_from_hf(d: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the classic or the transformers-5 spelling."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) not in ("default", None):
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if theta is None:
        theta = 10000.0
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' = {theta!r}; expected a positive number")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ConfigError(f"{source}: field 'rope_scaling' = {scaling!r}; expected a dict or null")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
        elif kind not in ("yarn", "deepseek_yarn"):
            raise ConfigError(f"{source}: field 'rope_scaling.type' = {kind!r}; expected 'yarn' (DeepSeek YaRN)")
        else:
            scaling = {
                "type": "yarn",
                "factor": float(scaling.get("factor", 1.0)),
                "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 4096)),
                "beta_fast": float(scaling.get("beta_fast", 32.0)),
                "beta_slow": float(scaling.get("beta_slow", 1.0)),
                "mscale": float(scaling.get("mscale", 1.0)),
                "mscale_all_dim": float(scaling.get("mscale_all_dim", 0.0)),
            }
    return float(theta), scaling


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's `yarn_get_mscale`: 0.1 * mscale * ln(factor) + 1, or 1 when not scaled."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def vllm_default_aux_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's (2, L // 2, L - 3); clamped into range so a model shallower than 4 layers still loads."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def _rope_to_hf(theta: float, scaling: dict | None) -> dict:
    out: dict[str, Any] = {"rope_theta": theta}
    out["rope_scaling"] = dict(scaling, rope_type="yarn") if scaling else None
    return out


@dataclass
class MLADims:
    """The attention shape shared by the verifier's layers and the MLA draft."""

    num_attention_heads: int
    q_lora_rank: int | None  # None: a direct q_proj (DeepSeek-V2-Lite); else q_a -> norm -> q_b
    kv_lora_rank: int  # latent width L: one cache row is L + qk_rope_head_dim values
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    rope_interleave: bool = True  # DeepSeek/Kimi checkpoints pair rope dims (0,1),(2,3),...
    max_position_embeddings: int = 4096

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(P+R) times YaRN's mscale^2 (also in the absorbed 576-wide path)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling:
            m = yarn_mscale(self.rope_scaling["factor"], self.rope_scaling["mscale_all_dim"])
            scale *= m * m
        return scale

    @property
    def cache_row(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class VerifierConfig(MLADims):
    """A DeepSeek-V3 / Kimi-K2 causal LM (MLA attention, sigmoid-routed MoE)."""

    model_type: str = "deepseek_v3"
    vocab_size: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0  # dense SwiGLU width (layers < first_k_dense_replace)
    moe_intermediate_size: int = 0  # per-expert width
    num_hidden_layers: int = 0
    n_routed_experts: int | None = None  # None: every layer dense
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict)  # unknown fields, written back untouched
    # The checkpoint's `quantization_config` (the wrapper's when text_config has none), for the weight
    # reader; never written back, since what we save is dequantised.
    quantization: dict | None = field(default=None, compare=False)

    @property
    def has_correction_bias(self) -> bool:
        """Only noaux_tc routing has an `e_score_correction_bias` (DeepSeek-V3, Kimi-K2); V2 has none."""
        return self.n_routed_experts is not None and self.topk_method == "noaux_tc"

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.n_routed_experts is not None
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    @property
    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        """vLLM's (2, L // 2, L - 3); clamped into range so a model shallower than 4 layers still loads."""
        return vllm_default_aux_ids(self.num_hidden_layers)

    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> "VerifierConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if isinstance(d.get("text_config"), dict):  # Kimi-K2.5: the LM lives under text_config
            lifted = ("eos_token_id", "bos_token_id", "quantization_config")
            d = dict(d["text_config"], **{k: v for k, v in d.items() if k in lifted and k not in d["text_config"]})
            source = f"{source} (text_config)"
        quant = d.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise ConfigError(f"{source}: field 'quantization_config' = {quant!r}; expected an object")
        mt = d.get("model_type")
        if mt not in VERIFIER_MODEL_TYPES:
            raise ConfigError(
                f"{source}: field 'model_type' = {mt!r}; expected one of {', '.join(VERIFIER_MODEL_TYPES)}"
            )
        theta, scaling = _rope_from_hf(d, source)
        known = {f for f in cls.__dataclass_fields__}
        q_lora = d.get("q_lora_rank")
        if q_lora is not None:
            _need(d, "q_lora_rank", source)
        routed = d.get("n_routed_experts")
        cfg = cls(
            model_type=mt,
            num_attention_heads=_need(d, "num_attention_heads", source),
            q_lora_rank=q_lora,
            kv_lora_rank=_need(d, "kv_lora_rank", source),
            qk_nope_head_dim=_need(d, "qk_nope_head_dim", source),
            qk_rope_head_dim=_need(d, "qk_rope_head_dim", source),
            v_head_dim=_need(d, "v_head_dim", source),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            # vLLM and SGLang always rotate DeepSeek MLA interleaved; transformers needs the flag.
            rope_interleave=bool(d.get("rope_interleave", True)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            vocab_size=_need(d, "vocab_size", source),
            hidden_size=_need(d, "hidden_size", source),
            intermediate_size=_need(d, "intermediate_size", source),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            num_hidden_layers=_need(d, "num_hidden_layers", source),
            n_routed_experts=routed,
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 1),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", mt != "deepseek_v2")),
            first_k_dense_replace=int(d.get("first_k_dense_replace", 0)),
            moe_layer_freq=int(d.get("moe_layer_freq", 1)),
            scoring_func=d.get("scoring_func", "sigmoid" if mt != "deepseek_v2" else "softmax"),
            topk_method=d.get("topk_method", "noaux_tc" if mt != "deepseek_v2" else "greedy"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            extra={k: v for k, v in d.items() if k not in known and k not in _HF_ONLY},
            quantization=quant,
        )
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        positive = ["num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{source}: field '{name}' = {getattr(self, name)!r}; expected a positive integer")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{source}: field 'qk_rope_head_dim' = {self.qk_rope_head_dim}; expected an even number")
        if self.n_routed_experts is not None:
            if self.n_routed_experts % self.n_group:
                raise ConfigError(f"{source}: field 'n_group' = {self.n_group}; expected a divisor of n_routed_experts={self.n_routed_experts}")
            if self.scoring_func not in ("sigmoid", "softmax"):
                raise ConfigError(f"{source}: field 'scoring_func' = {self.scoring_func!r}; expected 'sigmoid' or 'softmax'")
            if self.topk_method not in TOPK_METHODS:
                raise ConfigError(f"{source}: field 'topk_method' = {self.topk_method!r}; expected one of "
                                  f"{', '.join(TOPK_METHODS)}")
            if self.moe_intermediate_size <= 0:
                raise ConfigError(f"{source}: field 'moe_intermediate_size' is missing; expected a positive integer for an MoE model")
            per_group = self.n_routed_experts // self.n_group
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"{source}: field 'topk_group' = {self.topk_group}; "
                                  f"expected 1..n_group={self.n_group}")
            kept = self.n_routed_experts if self.topk_method == "greedy" else self.topk_group * per_group
            if not 1 <= self.num_experts_per_tok <= kept:
                raise ConfigError(f"{source}: field 'num_experts_per_tok' = {self.num_experts_per_tok}; "
                                  f"expected 1..{kept} (the experts {self.topk_method} routing can choose from)")

    def to_hf(self) -> dict:
        d = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3" if self.model_type == "kimi_k25" else self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "head_dim": self.qk_rope_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "scoring_func": self.scoring_func,
            "topk_method": self.topk_method,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_interleave": self.rope_interleave,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "torch_dtype": "bfloat16",
            **_rope_to_hf(self.rope_theta, self.rope_scaling),
        }
        return {**self.extra, **d}


_HF_ONLY = {"architectures", "torch_dtype", "dtype", "transformers_version", "rope_parameters",
            "rope_scaling", "rope_theta", "head_dim", "num_key_value_heads", "hidden_act",
            "attention_bias", "text_config", "auto_map", "quantization_config"}


@dataclass
class DraftConfig(MLADims):
    """An EAGLE-3 draft: fc over 3 aux states, one decoder layer with a 2H input, shared head.

    `attention` is "mla" (vLLM's Eagle3DeepseekV2ForCausalLM) or "mha" (vLLM's
    LlamaForCausalLMEagle3 layout, q/k/v projections over the same 2H input) so the
    two can be compared at the same width.
    """

    attention: str = "mla"
    architecture: str = "Eagle3DeepseekV2ForCausalLM"
    model_type: str = "deepseek_v3"
    hidden_size: int = 0
    target_hidden_size: int = 0  # width of each verifier aux state; fc input is 3x this
    intermediate_size: int = 0
    vocab_size: int = 0  # the verifier's vocabulary
    draft_vocab_size: int = 0  # lm_head rows; target id = i + d2t[i]
    aux_layer_ids: tuple[int, ...] = ()  # the ids vLLM captures for this config (see `read_aux_ids`)
    use_aux_hidden_state: bool = True
    norm_before_residual: bool = False  # vLLM flag: residual = hidden_norm(h) instead of h
    norm_output: bool = False  # EAGLE-3.1: feed back the post-norm state
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm on each aux state before fc (`fc_norm` or `use_aux_norm`)
    num_key_value_heads: int = 0  # MHA draft only
    head_dim: int = 0  # MHA draft only
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    extra: dict = field(default_factory=dict)
    # Provenance, not identity (left out of ==, so a saved config reads back equal):
    aux_ids_source: str = field(default="", compare=False)  # "top-level" | "eagle_config" | "default"
    nested_aux_layer_ids: tuple[int, ...] | None = field(default=None, compare=False)  # eagle_config's, if other
    eagle_config_aux_ids: tuple[int, ...] | None = field(default=None, compare=False)  # eagle_config's, as written
    unstated: tuple[str, ...] = field(default=(), compare=False)  # fields config.json lacks, filled by default

    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json", num_target_layers: int | None = None) -> "DraftConfig":
        # long: every field is read and checked in one place, so each error names its file and field
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in DRAFT_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: field 'architectures' = {archs!r}; expected one of {', '.join(DRAFT_ARCHITECTURES)}"
            )
        attention = DRAFT_ARCHITECTURES[arch]
        n_layers = int(d.get("num_hidden_layers", 1))
        if n_layers != 1:
            raise ConfigError(f"{source}: field 'num_hidden_layers' = {n_layers}; expected 1 (one EAGLE-3 decoder layer)")
        theta, scaling = _rope_from_hf(d, source)
        hidden = _need(d, "hidden_size", source)
        eagle = d.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ConfigError(f"{source}: field 'eagle_config' = {eagle!r}; expected an object")
        aux, aux_source, nested = read_aux_ids(d, source, num_target_layers)
        vocab = _need(d, "vocab_size", source)
        heads = _need(d, "num_attention_heads", source)
        common = dict(
            architecture=arch,
            attention=attention,
            model_type=d.get("model_type", "deepseek_v3" if attention == "mla" else "llama"),
            num_attention_heads=heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            hidden_size=hidden,
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            intermediate_size=_need(d, "intermediate_size", source),
            vocab_size=vocab,
            draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
            aux_layer_ids=aux,
            aux_ids_source=aux_source,
            nested_aux_layer_ids=nested if nested is not None and nested != aux else None,
            eagle_config_aux_ids=nested,
            unstated=tuple(k for k in ("max_position_embeddings", "rope_theta") if d.get(k) is None
                           and not (k == "rope_theta" and isinstance(d.get("rope_parameters"), dict))),
            use_aux_hidden_state=bool(eagle.get("use_aux_hidden_state", True)),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            norm_output=_flag(d, "norm_output", source),
            # SGLang's rule (`fc_norm or use_aux_norm`): either name switches the norms on
            fc_norm=_flag(d, "fc_norm", source) or _flag(d, "use_aux_norm", source),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )
        if attention == "mla":
            cfg = cls(
                q_lora_rank=d.get("q_lora_rank"),
                kv_lora_rank=_need(d, "kv_lora_rank", source),
                qk_nope_head_dim=_need(d, "qk_nope_head_dim", source),
                qk_rope_head_dim=_need(d, "qk_rope_head_dim", source),
                v_head_dim=_need(d, "v_head_dim", source),
                rope_interleave=bool(d.get("rope_interleave", True)),
                **common,
            )
        else:
            head_dim = int(d.get("head_dim") or hidden // heads)
            cfg = cls(
                q_lora_rank=None, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=head_dim,
                v_head_dim=head_dim, rope_interleave=bool(d.get("rope_interleave", False)),
                num_key_value_heads=int(d.get("num_key_value_heads") or heads), head_dim=head_dim,
                **common,
            )
        # Fields to_hf writes itself (or drops on purpose) stay out of `extra`: from_hf(to_hf(c)) == c.
        known = set(cls.__dataclass_fields__) | {"eagle_config", AUX_IDS_KEY, "use_aux_norm",
                                                 "num_hidden_layers", "tie_word_embeddings", "n_routed_experts",
                                                 "first_k_dense_replace", "moe_layer_freq"}
        cfg.extra = {k: v for k, v in d.items() if k not in known and k not in _HF_ONLY}
        return cfg

    @property
    def softmax_scale(self) -> float:
        if self.attention == "mha":
            return self.head_dim ** -0.5
        return MLADims.softmax_scale.fget(self)

    @property
    def cache_row(self) -> int:
        """Values cached per token: [c_kv | k_pe] for MLA, [K | V] of every KV head for MHA."""
        if self.attention == "mha":
            return 2 * self.num_key_value_heads * self.head_dim
        return self.kv_lora_rank + self.qk_rope_head_dim

    def to_hf(self) -> dict:
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "num_attention_heads": self.num_attention_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            # vLLM reads only the top level (capture-before); SGLang, lmdeploy and trainers read eagle_config,
            # where SGLang takes the ids as "output of layer i": so there, one less (see `nested_aux_ids`).
            AUX_IDS_KEY: list(self.aux_layer_ids),
            "eagle_config": {"use_aux_hidden_state": self.use_aux_hidden_state},
            "norm_before_residual": self.norm_before_residual,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "bfloat16",
            **_rope_to_hf(self.rope_theta, self.rope_scaling),
        }
        nested = nested_aux_ids(self.aux_layer_ids)
        if nested is not None:
            d["eagle_config"] = {AUX_IDS_KEY: nested, **d["eagle_config"]}
        if self.norm_output:
            d["norm_output"] = True
        if self.fc_norm:
            d["fc_norm"] = True
        if self.attention == "mla":
            d.update(
                num_key_value_heads=self.num_attention_heads,
                q_lora_rank=self.q_lora_rank,
                kv_lora_rank=self.kv_lora_rank,
                qk_nope_head_dim=self.qk_nope_head_dim,
                qk_rope_head_dim=self.qk_rope_head_dim,
                v_head_dim=self.v_head_dim,
                rope_interleave=self.rope_interleave,
                # no n_routed_experts: transformers 5's DeepseekV3Config rejects null (strict int), and
                # the draft is dense whatever it says (public MLA draft configs omit it too).
                first_k_dense_replace=1,
                moe_layer_freq=1,
            )
        else:
            d.update(num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim)
        return {**self.extra, **d}


def _flag(d: dict, key: str, source: str) -> bool:
    """A boolean config switch; absent or null is False, anything but a bool is an error."""
    v = d.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ConfigError(f"{source}: field '{key}' = {v!r}; expected true or false")
    return v


def nested_aux_ids(ids: tuple[int, ...] | list[int]) -> list[int] | None:
    """The `eagle_config` ids to write beside top-level (capture-before) `ids`, or None to write none.

    SGLang reads eagle_config's ids as "output of layer i" and captures i + 1 (the residual entering
    layer i + 1); since sgl-project/sglang#25454 it adds the 1 only when the first id is 1 (else it
    takes them as capture-before). Top-level minus one, whose first id is then 1 whenever the
    top-level's is 2 (vLLM's and SGLang's default (2, L // 2, L - 3) among them), is read alike by
    both SGLang versions and by trainers (SpecForge/TorchSpec write [1, 29, 57] for (2, 30, 58)).
    An id 0 (the embedding output) has no "output of" name: None then, and SGLang uses its default.
    """
    if not ids or min(ids) < 1:
        return None
    return [i - 1 for i in ids]


def _aux_list(value, source: str, where: str) -> tuple[int, ...] | None:
    """Layer ids as written at `where`; None for absent, null or [] (vLLM's `if layer_ids` skips those)."""
    if value is None or isinstance(value, (list, tuple)) and not value:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ConfigError(f"{source}: field '{where}' = {value!r}; expected a list of integer layer ids")
    return tuple(value)


def read_aux_ids(d: dict, source: str = "config.json",
                 num_target_layers: int | None = None) -> tuple[tuple[int, ...], str, tuple[int, ...] | None]:
    """(the ids vLLM captures, where they came from, eagle_config's ids as written).

    vLLM (`get_eagle3_aux_layers_from_config`, v1 worker) reads only a top-level
    `eagle_aux_hidden_state_layer_ids`; without one (or with an empty list) it takes the
    verifier's default (2, L // 2, L - 3), whatever `eagle_config` holds. So SpecForge/TorchSpec
    drafts that nest [1, 29, 57] ("output of layer i") get (2, 30, 58) for a 61-layer verifier:
    the same hidden states, in vLLM's capture-before convention. Only when the verifier's layer
    count is not known (a config read on its own) are the nested ids taken, marked "eagle_config".
    """
    eagle = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    top = _aux_list(d.get(AUX_IDS_KEY), source, AUX_IDS_KEY)
    nested = _aux_list(eagle.get(AUX_IDS_KEY), source, f"eagle_config.{AUX_IDS_KEY}")
    if top is not None:
        ids, where = top, "top-level"
    elif num_target_layers is not None:
        ids, where = vllm_default_aux_ids(num_target_layers), "default"
    elif nested is not None:
        ids, where = nested, "eagle_config"
    else:
        raise ConfigError(f"{source}: field '{AUX_IDS_KEY}' is missing (top level and eagle_config) and no verifier "
                          f"layer count was given; expected 3 layer ids or the verifier's num_hidden_layers")
    if len(ids) != 3:
        raise ConfigError(f"{source}: field '{AUX_IDS_KEY}' = {list(ids)} ({where}); expected 3 integer layer ids")
    return ids, where, nested


def read_config_json(directory: str | Path) -> tuple[dict, str]:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise ConfigError(f"{directory}: not a directory; expected a checkpoint directory with config.json")
    if not path.is_file():
        raise ConfigError(f"{path}: missing; expected a Hugging Face config.json in the checkpoint directory")
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); expected a Hugging Face config.json") from None


def load_verifier_config(directory: str | Path) -> VerifierConfig:
    d, src = read_config_json(directory)
    return VerifierConfig.from_hf(d, src)


def load_draft_config(directory: str | Path, num_target_layers: int | None = None) -> DraftConfig:
    d, src = read_config_json(directory)
    return DraftConfig.from_hf(d, src, num_target_layers)


def write_config_json(cfg: VerifierConfig | DraftConfig, directory: str | Path) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    return path / "config.json"


def as_dict(cfg: VerifierConfig | DraftConfig) -> dict:
    return asdict(cfg)
