"""KV-cache bytes of the verifier, the MLA draft and an MHA draft of the same width.

Why MLA for the draft: the draft keeps its own cache over the whole context (vLLM's EAGLE
proposer processes every verified token), so at long context and large batch its cache is
not negligible next to the verifier's. MLA caches one latent row [c_kv | k_pe] of
kv_lora_rank + qk_rope_head_dim values per token per layer; a Llama-style EAGLE-3 draft
(vLLM's LlamaForCausalLMEagle3) caches K and V for every KV head.
"""
from __future__ import annotations

from workbench.config import ConfigError, DraftConfig, VerifierConfig
from workbench.analysis.disagg import MODES

# Kimi-K2 (0711) text model, eagle3_mla.md §1.2.
KIMI_K2_VERIFIER = VerifierConfig.from_hf(
    {
        "model_type": "kimi_k2",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,  # Kimi-K2's config.json; not in §1.2, unused by the cache maths
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 131072,
        "bos_token_id": 163584,
        "eos_token_id": 163585,
    },
    source="KIMI_K2_VERIFIER (eagle3_mla.md §1.2)",
)

# The public Kimi-K2.5 MLA EAGLE-3 draft (k-l-lambda/Kimi-K2.5-Eagle3), eagle3_mla.md §1.2.
KIMI_K2_MLA_DRAFT = DraftConfig.from_hf(
    {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "num_hidden_layers": 1,
        "hidden_size": 7168,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "intermediate_size": 18432,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 262144,
        "vocab_size": 163840,
        "draft_vocab_size": 163840,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "tie_word_embeddings": False,
    },
    source="KIMI_K2_MLA_DRAFT (eagle3_mla.md §1.2)",
)


def bytes_per_token(cfg: VerifierConfig | DraftConfig, dtype_bytes: int = 2) -> int:
    """Cache bytes one token adds: every verifier layer, or the draft's single layer."""
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes = {dtype_bytes!r}; expected a positive byte count (2 for bf16)")
    if isinstance(cfg, VerifierConfig):
        return cfg.num_hidden_layers * cfg.cache_row * dtype_bytes
    if isinstance(cfg, DraftConfig):
        return cfg.cache_row * dtype_bytes  # EAGLE-3 drafts have exactly one decoder layer
    raise TypeError(f"bytes_per_token: got {type(cfg).__name__}; expected a VerifierConfig or DraftConfig")


def mha_equivalent(draft_mla: DraftConfig) -> DraftConfig:
    """The Llama-style EAGLE-3 draft of the same width: heads = num_attention_heads, no GQA,
    head_dim = hidden / heads, as vLLM's LlamaForCausalLMEagle3 would build it."""
    if draft_mla.attention == "mha":
        return draft_mla
    heads, hidden = draft_mla.num_attention_heads, draft_mla.hidden_size
    if hidden % heads:
        raise ConfigError(
            f"draft config: field 'hidden_size' = {hidden}; expected a multiple of num_attention_heads = {heads}"
        )
    d = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": hidden,
        "target_hidden_size": draft_mla.target_hidden_size,
        "intermediate_size": draft_mla.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": draft_mla.rms_norm_eps,
        "rope_theta": draft_mla.rope_theta,
        "rope_scaling": dict(draft_mla.rope_scaling) if draft_mla.rope_scaling else None,
        "max_position_embeddings": draft_mla.max_position_embeddings,
        "vocab_size": draft_mla.vocab_size,
        "draft_vocab_size": draft_mla.draft_vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(draft_mla.aux_layer_ids),
                         "use_aux_hidden_state": draft_mla.use_aux_hidden_state},
        "bos_token_id": draft_mla.bos_token_id,
        "eos_token_id": draft_mla.eos_token_id,
    }
    return DraftConfig.from_hf(d, source="mha_equivalent")


def memory_table(
    verifier: VerifierConfig,
    draft: DraftConfig,
    batches: tuple[int, ...] = (1, 8, 32, 64),
    contexts: tuple[int, ...] = (1024, 4096, 16384, 131072),
    dtype_bytes: int = 2,
) -> list[dict]:
    """Cache bytes for each (batch, context): verifier, this draft and its MHA twin, and the
    share of the pair's total the draft takes in each case."""
    v_tok = bytes_per_token(verifier, dtype_bytes)
    d_tok = bytes_per_token(draft, dtype_bytes)
    m_tok = bytes_per_token(mha_equivalent(draft), dtype_bytes)
    rows = []
    for b in batches:
        for t in contexts:
            if b <= 0 or t <= 0:
                raise ValueError(f"memory_table: batch {b} / context {t}; expected positive integers")
            tokens = b * t
            v, d, m = v_tok * tokens, d_tok * tokens, m_tok * tokens
            rows.append({
                "batch": b,
                "context": t,
                "tokens": tokens,
                "verifier_bytes": v,
                "draft_bytes": d,
                "mha_draft_bytes": m,
                "draft_share": d / (v + d),
                "mha_draft_share": m / (v + m),
                "mha_over_mla": m / d,
            })
    return rows


HANDOVER_MODES = MODES  # what crosses between the instances: workbench.analysis.disagg


def handover_bytes(vcfg: VerifierConfig, dcfg: DraftConfig, prompt_len: int, mode: str, dtype_bytes: int = 2) -> dict:
    """The bytes a request's prefill-to-decode hand-over carries (`workbench.analysis.disagg`), from configs.

    Every mode: the verifier's KV of the prompt and the aux states of its last position (what the
    draft fuses to propose). "full" adds the draft's KV of every prompt position but the last;
    "recompute" the aux states of every prompt position instead. `page_layouts` is 1 where the
    draft's rows fit the verifier's page (an MLA draft of the same latent width), else 2."""
    if mode not in HANDOVER_MODES:
        raise ValueError(f"mode = {mode!r}; expected one of {', '.join(HANDOVER_MODES)}")
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len = {prompt_len!r}; expected an integer >= 1")
    aux_row = len(dcfg.aux_layer_ids) * vcfg.hidden_size * dtype_bytes
    out = {"verifier_kv": bytes_per_token(vcfg, dtype_bytes) * prompt_len, "last_aux": aux_row,
           "draft_kv": bytes_per_token(dcfg, dtype_bytes) * (prompt_len - 1) if mode == "full" else 0,
           "prompt_aux": aux_row * prompt_len if mode == "recompute" else 0}
    out["total"] = sum(out.values())
    out["page_layouts"] = 1 if dcfg.attention == "mla" and dcfg.cache_row == vcfg.cache_row else 2
    return out
