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
values = c_kv, and unfold W_UV afterwards. Same numbers, reassociated; the attention
itself runs in `workbench.kernels.mla_attention` (Triton on CUDA, its PyTorch twin on CPU).
The softmax scale stays 1/sqrt(P+R) * mscale^2 in both paths.

Eager decode and verify steps on the CPU go through `workbench.kernels.cpu` (`_kernel_step`):
the absorbed path with W_UK folded into the query projection and W_UV into o_proj ahead of
time, q_a and kv_a as one projection, RoPE as two rows of it, the whole attention one call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.cache import KVCache
from workbench.config import MLADims
from workbench.kernels import cpu, mla_attention
from workbench.models.norm import RMSNorm
from workbench.models.rope import RotaryEmbedding

ABSORB_MAX_TOKENS = 16  # at most this many new tokens per call take the absorbed path under "auto"


def causal_mask(num_new: int, start: int, device: torch.device) -> torch.Tensor:
    """[T, start+T] bool: new token t (at absolute position start+t) sees keys 0..start+t."""
    q = torch.arange(num_new, device=device)[:, None] + start
    k = torch.arange(start + num_new, device=device)[None, :]
    return k <= q


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
                     mask: torch.Tensor | None) -> torch.Tensor:
        """Per-head K/V expanded from the latent rows [B,S,L+R]; mask [T,S] bool (None: all visible)."""
        B, T = q_nope.shape[:2]
        S = rows.shape[1]
        c_kv, k_pe = rows.split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(c_kv).view(B, S, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, self.n_heads, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.scale
        )  # [B, N, T, V]
        return o.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [N, P, L] and W_UV [N, V, L]: the two halves of kv_b_proj, per head."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope], w[:, self.nope:]

    def attend_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache_rows: torch.Tensor,
                        seq_len: int | torch.Tensor, backend: str, bound: int | None = None) -> torch.Tensor:
        """MQA over the cache rows [B, S_max, L+R] (first seq_len valid, the T new ones last).

        `seq_len` may be a 0-d tensor (a length known only on the device); `bound` >= it is then
        how many rows are read, the rest masked.
        """
        B, T = q_nope.shape[:2]
        w_uk, w_uv = self.absorbed_weights()
        if torch.compiler.is_compiling():
            # Compiled, the kernel of a matmul (and einsum's own shape checks) depend on T, so a
            # 1-token decode and a k+1-token verify would round the same row differently (in bf16
            # a greedy near-tie then flips). Plain reductions give every row the same code
            # whatever T is, so one graph serves both and rounds them alike. contiguous(): in fp32
            # `.float()` is a no-op, and inductor specialised the 1-token graph on this strided
            # split of q (a size-1 dim's stride), so a verify compiled and ran a graph of its own.
            q_lat = (q_nope.float().contiguous()[..., None] * w_uk.float()).sum(-2).to(q_nope.dtype)
        else:
            q_lat = torch.einsum("btnp,npl->btnl", q_nope, w_uk)
        if isinstance(seq_len, torch.Tensor):
            seq_lens = seq_len.to(torch.int32).reshape(1).expand(B)
        else:
            seq_lens, bound = torch.full((B,), seq_len, dtype=torch.int32, device=q_nope.device), seq_len
        o_lat, _ = mla_attention(q_lat, q_pe.contiguous(), cache_rows, seq_lens, self.scale,
                                 max_seq_len=bound, backend=backend)
        if torch.compiler.is_compiling():  # as for q_lat above
            o = (o_lat.float()[:, :, :, None, :] * w_uv.float()).sum(-1).to(o_lat.dtype)
        else:
            o = torch.einsum("btnl,nvl->btnv", o_lat, w_uv)
        return o.reshape(B, T, self.n_heads * self.v_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, path: str = "auto", backend: str = "torch") -> torch.Tensor:
        """Attend the new tokens x [B,T,in] to the cache's first `cache.length` tokens and themselves.

        Writes the new rows into `cache` at `cache.length`; the caller advances the length once
        every layer has written. Without a cache the tokens attend causally among themselves.
        """
        T = x.shape[1]
        if cache is not None and path != "naive" and backend == "torch" and x.shape[0] == 1 and cpu.serves(x):
            return self._kernel_step(x, positions, cache, layer)  # any T the kernels take: their attention is absorbed
        absorbed = path == "absorbed" or (path == "auto" and T <= ABSORB_MAX_TOKENS)
        q_nope, q_pe, new_rows = self.project(x, positions)
        if cache is None:
            mask = causal_mask(T, 0, x.device) if T > 1 else None
            return self.o_proj(self.attend_naive(q_nope, q_pe, new_rows, mask))
        start = cache.length
        rows = cache.write(layer, start, new_rows)
        if absorbed:
            o = self.attend_absorbed(q_nope, q_pe, cache.layer(layer), start + T, backend)
        else:
            o = self.attend_naive(q_nope, q_pe, rows, causal_mask(T, start, x.device))
        return self.o_proj(o)

    def _kernel_settings(self) -> tuple:
        """What `_build_kernel_block` bakes in besides the weights (the doctor flips the RoPE pairing)."""
        eps = (self.kv_a_layernorm.eps, self.q_a_layernorm.eps if self.q_lora is not None else None)
        return self.rotary.interleave, self.scale, eps

    def _kernel_sources(self) -> list[torch.Tensor]:
        q = (self.q_proj,) if self.q_lora is None else (self.q_a_proj, self.q_b_proj, self.q_a_layernorm)
        return [m.weight for m in (*q, self.kv_a_proj_with_mqa, self.kv_a_layernorm, self.kv_b_proj, self.o_proj)]

    def kernel_block(self) -> cpu.MlaBlock:
        """This attention as one `cpu.MlaBlock` call, kept until a weight or a setting changes."""
        return cpu.derived(self, "absorbed", self._kernel_sources, self._build_kernel_block, self._kernel_settings())

    def _build_kernel_block(self) -> cpu.MlaBlock:
        """The absorbed projections, packed.

        "a" maps x to [c_q (q_lora) | c_kv | k_pe as `as_rows`' two halves] (with q_lora), "q"
        maps c_q (or x) to [q_lat = q_nope W_UK per head (L) | q_pe's two halves per head], and
        "o" maps the heads' latent outputs to the hidden size through W_UV and o_proj at once.
        Products are formed in fp32 and rounded to the weights' dtype once.
        """
        N, P, L = self.n_heads, self.nope, self.kv_lora
        dtype = self.kv_a_proj_with_mqa.weight.dtype
        w_uk, w_uv = (w.float() for w in self.absorbed_weights())
        wq = (self.q_proj if self.q_lora is None else self.q_b_proj).weight.float().view(N, P + self.rope, -1)
        q_lat = torch.einsum("npl,npi->nli", w_uk, wq[:, :P]).reshape(N * L, -1)
        pe = [self.rotary.as_rows(wq[h, P:]) for h in range(N)]
        q = torch.cat([q_lat, *(a for a, _ in pe), *(b for _, b in pe)])
        kv = self.kv_a_proj_with_mqa.weight.float()
        a = torch.cat([kv[:L], *self.rotary.as_rows(kv[L:])])
        a = torch.cat([q if self.q_lora is None else self.q_a_proj.weight.float(), a])
        wo = self.o_proj.weight.float().view(-1, N, self.v_dim)
        o = torch.einsum("hnv,nvl->hnl", wo, w_uv).reshape(wo.shape[0], N * L)
        q_norm = None if self.q_lora is None else (self.q_a_layernorm.weight, self.q_a_layernorm.eps)
        return cpu.MlaBlock(a.to(dtype), None if self.q_lora is None else q.to(dtype), o.to(dtype), q_norm,
                            (self.kv_a_layernorm.weight, self.kv_a_layernorm.eps), self.scale, N, L, self.rope)

    def _kernel_step(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """`forward`'s absorbed path for one sequence through `workbench.kernels.cpu`, in one call."""
        cache.check_room(x.shape[1])  # the new rows go straight into the cache
        cos2, sin2 = self.rotary.halves(positions[0], x.dtype, cache.max_len)
        return self.kernel_block()(x[0], cache.layer(layer)[0], cache.length, cos2, sin2)[None]

    def forward_at(self, x: torch.Tensor, position: torch.Tensor, cache: KVCache, layer: int, bound: int,
                   backend: str = "torch") -> torch.Tensor:
        """`forward` for new tokens x [B,T,in] from a position held as a 0-d tensor (absorbed path).

        The rows go to position.. (`KVCache.write_at`) and each token attends the rows up to its
        own; `bound`, a Python int past the last position, is how many rows are read. The
        caller sets the cache's length.
        """
        T = x.shape[1]
        q_nope, q_pe, new_rows = self.project(x, position + torch.arange(T, device=x.device)[None])
        cache.write_at(layer, position, new_rows)
        return self.o_proj(self.attend_absorbed(q_nope, q_pe, cache.layer(layer), position + T, backend, bound))
