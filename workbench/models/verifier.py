"""The verifier: a DeepSeek-V3 / Kimi-K2 causal LM (MLA attention, MoE after the first dense layers).

Module and parameter names are exactly Hugging Face's `DeepseekV3ForCausalLM` names, so
checkpoints load by name and what we save loads in transformers. Besides logits it returns the
aux hidden states the EAGLE-3 draft fuses, in vLLM's *capture-before* convention: id k is the
residual stream entering decoder layer k (= transformers' `output_hidden_states[k]`, where
index 0 is the embeddings). Getting that index wrong costs acceptance silently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workbench.cache import KVCache
from workbench.config import VerifierConfig
from workbench.models.mla import MLAttention
from workbench.models.moe import MLP, MoE
from workbench.models.norm import RMSNorm


@dataclass
class VerifierOutput:
    logits: torch.Tensor  # [B, T', V] (T' = logits_to_keep or T)
    aux_hidden_states: tuple[torch.Tensor, ...]  # one [B, T, H] per aux id, ascending
    hidden_states: torch.Tensor  # final normed hidden [B, T', H]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: VerifierConfig, idx: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, cfg.hidden_size, cfg.hidden_size)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.idx = idx

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache | None, path: str = "auto") -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, cache, self.idx, path)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: VerifierConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Verifier(nn.Module):
    """`DeepseekV3ForCausalLM` with a latent KV cache and aux-state capture."""

    def __init__(self, cfg: VerifierConfig, aux_layer_ids: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = DeepseekV3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.aux_layer_ids = tuple(aux_layer_ids or cfg.default_aux_layer_ids)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self._aux

    @aux_layer_ids.setter
    def aux_layer_ids(self, ids: tuple[int, ...]) -> None:
        n = self.config.num_hidden_layers
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"aux layer ids {list(ids)}: {bad} out of range; expected ids in [0, {n - 1}] "
                             f"for a verifier with {n} layers")
        self._aux = tuple(sorted(ids))

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, cfg.cache_row, max_len or cfg.max_position_embeddings, batch,
                       self.dtype, self.device, name="verifier cache")

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None,
                logits_to_keep: int = 0, path: str = "auto") -> VerifierOutput:
        """input_ids [B, T] continuing `cache` (or from position 0 without one).

        With a cache the new tokens' rows are appended to each sequence (at its own length) and the
        lengths advanced by T; a caller that padded a sequence's tokens truncates it afterwards.
        `logits_to_keep` > 0 computes logits for the last that many positions only.
        """
        T = input_ids.shape[1]
        if cache is not None:
            cache.check_room(T)
        if positions is None:
            positions = (cache.positions(T, input_ids.device) if cache is not None
                         else torch.arange(T, device=input_ids.device)[None])
        h = self.model.embed_tokens(input_ids)
        aux = []
        for layer in self.model.layers:
            aux += [h] * self._aux.count(layer.idx)
            h = layer(h, positions, cache, path)
        if cache is not None:
            cache.advance(T)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        h = self.model.norm(h)
        return VerifierOutput(self.lm_head(h), tuple(aux), h)
