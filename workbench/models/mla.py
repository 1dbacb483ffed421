"""Multi-Latent Attention (DeepSeek-V2/V3, Kimi-K2), with its two exact paths.

Per token (eagle3_mla.md §4):
    c_q  = RMSNorm(W_qa x);  [q_nope | q_pe] = W_qb c_q          (per head: P + R)
    c_kv = RMSNorm(W_kva x)[:L];  k_pe = W_kva x [L:]            (one rope key for all heads)
    q_pe, k_pe = RoPE(q_pe, k_pe, position)
    cache row = [c_kv | k_pe]                                     (L + R values, all heads share it)
    [k_nope_h | v_h] = W_kvb c_kv;  score = scale * (q_nope.k_nope + q_pe.k_pe)

*Naive* (compute-friendly, for prefill): expand every cached c_kv to per-head k_nope and v,
then ordinary attention with qk dim P+R and v dim V.
*Absorbed* (data-movement-friendly, for decode and verifying k+1 tokens): fold W_UK into the
query, q_lat = q_nope W_UK (width L), attend MQA-style over the cache rows themselves with
values = c_kv, and unfold W_UV afterwards. Same numbers, reassociated. The softmax scale
stays 1/sqrt(P+R) * mscale^2 in both paths.

The absorbed path's attention is a child module, `LatentAttention`, so that a fast path can put
its own in its place and test it against this one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.cache import KVCache
from workbench.config import MLADims
from workbench.models.norm import RMSNorm
from workbench.models.rope import RotaryEmbedding

ABSORB_MAX_TOKENS = 16  # at most this many new tokens per call take the absorbed path under "auto"


def causal_mask(num_new: int, starts: list[int], device: torch.device) -> torch.Tensor:
    """[B, 1, T, max(starts)+T] bool (broadcast over heads): sequence b's new token t, at absolute
    position starts[b]+t, sees keys 0..starts[b]+t."""
    q = torch.tensor(starts, device=device)[:, None, None, None] + torch.arange(num_new, device=device)[:, None]
    return torch.arange(max(starts) + num_new, device=device) <= q


def attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                 causal: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [B,N,T,D], k [B,N,S,D], v [B,N,S,V], through torch's SDPA.

    mask: bool [B or 1,1,T,S] (None: all visible); `causal` instead: the T tokens are the whole
    sequence (S == T), each seeing itself and those before. A v narrower than q (MLA: v_head_dim
    below qk's) is zero-padded to q's head size and the padding cut from the output: torch's fused
    CPU kernel needs one head size for q, k and v, and without it SDPA falls back to unfused math,
    10-25x slower on a 2,048-token prompt (docs/PERFORMANCE.md).
    """
    V = v.shape[-1]
    if q.shape[-1] > V:
        v = F.pad(v, (0, q.shape[-1] - V))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask, is_causal=causal, scale=scale)
    return o[..., :V]


def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA of q_lat [B,T,N,L] and q_pe [B,T,N,R] over latent rows [B,S,L+R]: (out [B,T,N,L], lse [B,T,N]).

    Query t of sequence b sees rows j < seq_lens[b] - (T-1-t) (the T new tokens are the last of
    seq_lens[b]); seq_lens is [B], or 0-d for every sequence. fp32 math, out in q_lat's dtype; a query
    with no visible row gets out 0 and lse -inf.
    """
    B, T, N, L = q_lat.shape
    S = rows.shape[1]
    kv = rows.float()
    q = torch.cat([q_lat, q_pe], dim=-1).float()
    scores = torch.einsum("bshd,btd->bsht", q, kv) * scale  # [B, T, N, S]
    lens = torch.as_tensor(seq_lens, device=rows.device).reshape(-1, 1)  # [B or 1, 1]
    limit = lens - (T - 1 - torch.arange(T, device=rows.device))  # [B or 1, T]
    visible = torch.arange(S, device=rows.device) < limit[..., None]  # [B or 1, T, S]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("bsht,btl->bshl", probs, kv[..., :L]).to(q_lat.dtype), lse


class LatentAttention(nn.Module):
    """The absorbed path's attention: q_lat = q_nope W_UK, MQA over the latent rows, W_UV after."""

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                bound: int, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
        """q_nope [B,T,N,P], q_pe [B,T,N,R], a layer's cache rows [B,S_max,L+R] of which sequence b's
        first seq_lens[b] ([B], or 0-d for all) hold keys and the first `bound` (an int >= every
        length) may be read -> [B,T,N*V]."""
        B, T = q_nope.shape[:2]
        q_lat = torch.einsum("btnp,npl->btnl", q_nope, w_uk)
        o_lat, _ = latent_attention(q_lat, q_pe, rows[:, :bound], seq_lens, scale)
        return torch.einsum("btnl,nvl->btnv", o_lat, w_uv).reshape(B, T, -1)


class MLAttention(nn.Module):
    def __init__(self, dims: MLADims, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.n_heads = dims.num_attention_heads
        self.nope, self.rope, self.v_dim = dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
        self.kv_lora = dims.kv_lora_rank
        self.q_lora = dims.q_lora_rank
        qk = self.nope + self.rope
        if self.q_lora is None:
            self.q_proj = nn.Linear(input_size, self.n_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(input_size, self.q_lora, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora, dims.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(input_size, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, dims.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, hidden_size, bias=False)
        self.rotary = RotaryEmbedding(self.rope, dims.rope_theta, dims.rope_scaling, dims.rope_interleave)
        self.scale = dims.softmax_scale
        self.latent = LatentAttention()

    @property
    def row_width(self) -> int:
        return self.kv_lora + self.rope

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, in] -> q_nope [B,T,N,P], roped q_pe [B,T,N,R], cache rows [B,T,L+R]."""
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_lora is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.n_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q_pe = self.rotary(q_pe, cos, sin)
        k_pe = self.rotary(k_pe, cos, sin)
        return q_nope, q_pe, torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)

    def attend_naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                     mask: torch.Tensor | None, causal: bool = False, heads=None) -> torch.Tensor:
        """Per-head K/V expanded from the latent rows [B,S,L+R]; mask [B or 1,1,T,S] bool (None: all
        visible), or `causal` where the rows are the new tokens' own (`attend_heads`, or `heads` with
        its arguments: a trainer's own pattern)."""
        B, T = q_nope.shape[:2]
        S = rows.shape[1]
        c_kv, k_pe = rows.split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(c_kv).view(B, S, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, self.n_heads, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = (heads or attend_heads)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.scale, causal)
        return o.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim)  # from [B, N, T, V]

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [N, P, L] and W_UV [N, V, L]: the two halves of kv_b_proj, per head."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope], w[:, self.nope:]

    def attend_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                        seq_lens: torch.Tensor, bound: int) -> torch.Tensor:
        """Attention over a layer's cache rows [B, S_max, L+R] of which sequence b's first seq_lens[b]
        hold its keys (the T new ones last); `bound` rows are read (a traced graph sees the whole buffer)."""
        w_uk, w_uv = self.absorbed_weights()
        return self.latent(q_nope, q_pe, rows, seq_lens, bound, w_uk, w_uv, self.scale)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, path: str = "auto") -> torch.Tensor:
        """Attend the new tokens x [B,T,in] to each sequence's cached tokens and themselves.

        Writes the new rows into `cache` at each sequence's length (`KVCache.write`); the caller
        advances the lengths once every layer has written. Without a cache the tokens attend
        causally among themselves.
        """
        T = x.shape[1]
        q_nope, q_pe, new_rows = self.project(x, positions)
        if cache is None:
            return self.o_proj(self.attend_naive(q_nope, q_pe, new_rows, None, causal=True))
        starts = cache.lengths
        rows = cache.write(layer, new_rows)
        if path == "absorbed" or (path == "auto" and T <= ABSORB_MAX_TOKENS):
            ends = torch.tensor(starts, device=x.device) + T  # each sequence's own end
            return self.o_proj(self.attend_absorbed(q_nope, q_pe, cache.layer(layer), ends, max(starts) + T))
        if max(starts) == 0:  # every sequence's first tokens: its rows are the new ones
            return self.o_proj(self.attend_naive(q_nope, q_pe, rows, None, causal=True))
        return self.o_proj(self.attend_naive(q_nope, q_pe, rows, causal_mask(T, starts, x.device)))

    def forward_at(self, x: torch.Tensor, position: torch.Tensor, cache: KVCache, layer: int,
                   bound: int) -> torch.Tensor:
        """`forward` for new tokens x [B,T,in] from a position held on the device, 0-d (every
        sequence's) or [B] (each its own), on the absorbed path.

        The rows go to position.. (`KVCache.write_at`) and each token attends the rows up to its
        own; `bound`, a Python int past the last position, is how many rows are read. The
        caller sets the cache's length.
        """
        T = x.shape[1]
        q_nope, q_pe, new_rows = self.project(x, position.reshape(-1, 1) + torch.arange(T, device=x.device)[None])
        cache.write_at(layer, position, new_rows)
        return self.o_proj(self.attend_absorbed(q_nope, q_pe, cache.layer(layer), position + T, bound))
