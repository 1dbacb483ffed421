"""A fresh EAGLE-3 draft shaped for a given verifier (before training)."""
from __future__ import annotations

import torch

from workbench.config import DraftConfig, VerifierConfig
from workbench.models import Eagle3Draft


def draft_config_for(verifier: VerifierConfig, attention: str = "mla", intermediate_size: int | None = None,
                     aux_layer_ids: tuple[int, ...] | None = None, fc_norm: bool = False,
                     norm_output: bool = False) -> DraftConfig:
    """MLA: the verifier's own attention dims (one KV pool for both, as vLLM wants).
    MHA: Llama-style heads of the same width (head_dim = hidden / heads), for comparison.
    `fc_norm` / `norm_output`: EAGLE-3.1's per-state norms before fc and post-norm feedback."""
    v = verifier
    common = dict(
        num_attention_heads=v.num_attention_heads, rms_norm_eps=v.rms_norm_eps, rope_theta=v.rope_theta,
        rope_scaling=v.rope_scaling, max_position_embeddings=v.max_position_embeddings,
        hidden_size=v.hidden_size, target_hidden_size=v.hidden_size,
        intermediate_size=intermediate_size or v.intermediate_size, vocab_size=v.vocab_size,
        draft_vocab_size=v.vocab_size, aux_layer_ids=tuple(aux_layer_ids or v.default_aux_layer_ids),
        bos_token_id=v.bos_token_id, eos_token_id=v.eos_token_id, fc_norm=fc_norm, norm_output=norm_output,
    )
    if attention == "mla":
        return DraftConfig(
            q_lora_rank=v.q_lora_rank, kv_lora_rank=v.kv_lora_rank, qk_nope_head_dim=v.qk_nope_head_dim,
            qk_rope_head_dim=v.qk_rope_head_dim, v_head_dim=v.v_head_dim, rope_interleave=v.rope_interleave,
            attention="mla", architecture="Eagle3DeepseekV2ForCausalLM", model_type="kimi_k2", **common)
    if attention == "mha":
        head_dim = v.hidden_size // v.num_attention_heads
        return DraftConfig(
            q_lora_rank=None, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=head_dim, v_head_dim=head_dim,
            rope_interleave=False, attention="mha", architecture="LlamaForCausalLMEagle3", model_type="llama",
            num_key_value_heads=v.num_attention_heads, head_dim=head_dim, **common)
    raise ValueError(f"attention = {attention!r}; expected 'mla' or 'mha'")


def init_draft(cfg: DraftConfig, seed: int = 0, std: float = 0.02) -> Eagle3Draft:
    """N(0, std) weights, unit norms; fc starts near an average of the three aux states."""
    g = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        if hasattr(draft, "fc"):
            n = len(cfg.aux_layer_ids)
            eye = torch.eye(cfg.hidden_size, cfg.target_hidden_size) / n
            draft.fc.weight.add_(torch.cat([eye] * n, dim=1))
    return draft
