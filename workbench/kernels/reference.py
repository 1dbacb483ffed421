"""PyTorch twin of the Triton MLA attention kernel: the oracle in tests and the CPU path.

Absorbed MLA (DeepSeek-V2/V3, Kimi-K2) is multi-query attention with ONE shared key/value
"head" per token: the cache row `[c_kv (L) | k_pe (R)]`. Queries arrive already folded into
latent space (`q_lat = q_nope @ W_UK`, width L) plus their roped part (`q_pe`, width R).
For sequence b, query token s (0..Sq-1), head h and cache position t:

    score[b, s, h, t] = sm_scale * (q_lat[b, s, h] . c_kv[b, t]  +  q_pe[b, s, h] . k_pe[b, t])
    visible(b, s, t)  = t < seq_lens[b] - (Sq - 1 - s)        (bottom-right-aligned causal)
    lse[b, s, h]      = log sum_{t visible} exp(score[b, s, h, t])        (natural log)
    out[b, s, h]      = sum_{t visible} exp(score[b, s, h, t] - lse[b, s, h]) * c_kv[b, t]

`seq_lens[b]` counts the Sq new tokens, whose rows are already in the cache. A row with no
visible key (seq_lens[b] < Sq - s) gets out = 0 and lse = -inf, which is what merging partial
attentions by their LSE expects of an empty set of keys.

The math is fp32 whatever the input dtype; `out` comes back in q_lat's dtype, `lse` in fp32.
The math itself is the models' own (`workbench.models.mla.latent_attention`); this twin adds the
kernel's signature: checked inputs, paged caches, stale slots zeroed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from workbench.models.mla import latent_attention

_WHERE = "workbench/kernels/reference.py: mla_attention"
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class MLAShapes:
    """Sizes read off validated inputs; shared by the twin and the Triton wrapper."""

    batch: int
    q_len: int  # Sq: query tokens per sequence (1 for decode, k+1 for verification)
    heads: int
    kv_lora: int  # L: latent width, also the value width
    rope: int  # R: roped key width
    paged: bool
    page_size: int  # tokens per cache page; S_max for the contiguous layout
    capacity: int  # most tokens a sequence can hold in this cache (S_max or max_blocks*page)


def check_mla_inputs(q_lat: Tensor, q_pe: Tensor, cache: Tensor, seq_lens: Tensor,
                     block_table: Tensor | None) -> MLAShapes:
    """Check shapes, dtypes and devices (no device sync) and return the sizes."""
    def fail(msg: str) -> ValueError:
        return ValueError(f"{_WHERE}: {msg}")

    if q_lat.dim() != 4:
        raise fail(f"q_lat must be [B, Sq, H, L], got shape {tuple(q_lat.shape)}")
    if not q_lat.is_floating_point():
        raise fail(f"q_lat must be a floating tensor, got {q_lat.dtype}")
    batch, q_len, heads, kv_lora = q_lat.shape
    if min(batch, q_len, heads, kv_lora) < 1:
        raise fail(f"q_lat must have non-empty dims, got shape {tuple(q_lat.shape)}")
    if q_pe.dim() != 4 or tuple(q_pe.shape[:3]) != (batch, q_len, heads) or q_pe.shape[3] < 1:
        raise fail(f"q_pe must be [B={batch}, Sq={q_len}, H={heads}, R>=1], "
                   f"got shape {tuple(q_pe.shape)}")
    rope = q_pe.shape[3]
    for name, t in (("q_pe", q_pe), ("cache", cache)):
        if t.dtype != q_lat.dtype:
            raise fail(f"{name} dtype must match q_lat ({q_lat.dtype}), got {t.dtype}")
    for name, t in (("q_pe", q_pe), ("cache", cache), ("seq_lens", seq_lens)):
        if t.device != q_lat.device:
            raise fail(f"{name} must be on {q_lat.device} like q_lat, got {t.device}")
    if cache.dim() != 3 or cache.shape[2] != kv_lora + rope:
        raise fail(f"cache must be [B, S_max, L+R={kv_lora + rope}] or "
                   f"[num_blocks, page_size, {kv_lora + rope}], got shape {tuple(cache.shape)}")
    if seq_lens.shape != (batch,) or seq_lens.dtype not in _INDEX_DTYPES:
        raise fail(f"seq_lens must be int32/int64 of shape [{batch}], "
                   f"got {seq_lens.dtype} of shape {tuple(seq_lens.shape)}")
    if block_table is None:
        if cache.shape[0] != batch:
            raise fail(f"contiguous cache must have B={batch} rows in dim 0, "
                       f"got shape {tuple(cache.shape)}")
        return MLAShapes(batch, q_len, heads, kv_lora, rope, False, cache.shape[1], cache.shape[1])
    if block_table.dim() != 2 or block_table.shape[0] != batch \
            or block_table.dtype not in _INDEX_DTYPES:
        raise fail(f"block_table must be int32/int64 of shape [{batch}, max_blocks], "
                   f"got {block_table.dtype} of shape {tuple(block_table.shape)}")
    if block_table.device != q_lat.device:
        raise fail(f"block_table must be on {q_lat.device} like q_lat, got {block_table.device}")
    page_size = cache.shape[1]
    return MLAShapes(batch, q_len, heads, kv_lora, rope, True, page_size,
                     block_table.shape[1] * page_size)


def check_mla_values(shapes: MLAShapes, cache: Tensor, seq_lens: Tensor,
                     block_table: Tensor | None) -> int:
    """Check seq_lens and the used block-table entries; returns max(seq_lens). Syncs."""
    if seq_lens.numel() and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > shapes.capacity):
        raise ValueError(f"{_WHERE}: seq_lens must lie in [0, {shapes.capacity}] (the cache "
                         f"capacity), got {seq_lens.tolist()}")
    n = int(seq_lens.max())
    if block_table is not None and n > 0:
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] \
            * shapes.page_size < seq_lens[:, None]
        pages = block_table[used]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= cache.shape[0]):
            raise ValueError(f"{_WHERE}: block_table entries covering seq_lens must lie in "
                             f"[0, {cache.shape[0]}), got range "
                             f"[{int(pages.min())}, {int(pages.max())}]")
    return n


def gather_kv(cache: Tensor, seq_lens: Tensor, n: int, block_table: Tensor | None) -> Tensor:
    """Rows [B, n, L+R] of positions 0..n-1, zeroed past each sequence's length.

    Zeroing matters: slots past seq_lens may hold stale (or NaN-poisoned) rows, and a
    probability of exactly 0 times NaN is still NaN in the value matmul.
    """
    pos = torch.arange(n, device=cache.device)
    if block_table is None:
        kv = cache[:, :n]
    else:
        page_size = cache.shape[1]
        valid = pos[None, :] < seq_lens[:, None]
        pages = block_table[:, pos // page_size].long()
        pages = torch.where(valid, pages, torch.zeros_like(pages))  # unused entries may be junk
        kv = cache[pages, (pos % page_size)[None, :]]  # [B, n, L+R]
    if seq_lens.shape[0] > 1 or block_table is not None:  # a single contiguous row is all valid
        kv = _zero_past_lengths(kv, pos, seq_lens)
    return kv


def _zero_past_lengths(kv: Tensor, pos: Tensor, seq_lens: Tensor) -> Tensor:
    """kv [B, n, L+R] with the rows at positions pos [n] >= each sequence's length set to 0."""
    return torch.where((pos[None, :] < seq_lens[:, None])[..., None], kv, torch.zeros_like(kv))


def mla_attention_torch(q_lat: Tensor, q_pe: Tensor, cache: Tensor, seq_lens: Tensor,
                        sm_scale: float, *, block_table: Tensor | None = None,
                        num_kv_splits: int | None = None,
                        max_seq_len: int | None = None) -> tuple[Tensor, Tensor]:
    """Absorbed-MLA attention over the latent cache in fp32 PyTorch; see the module docstring.

    Returns (out [B, Sq, H, L] in q_lat's dtype, lse [B, Sq, H] fp32). `num_kv_splits` is
    accepted so the signature matches the Triton kernel; a single pass needs no splits.
    `max_seq_len`, when the caller knows it (the model layers do, as vLLM's attention metadata
    does), skips reading seq_lens back to the host: no sync, and nothing that stops
    torch.compile from tracing the decode step as one graph. The values are then trusted.
    """
    del num_kv_splits
    shapes = check_mla_inputs(q_lat, q_pe, cache, seq_lens, block_table)
    if max_seq_len is None:
        n = check_mla_values(shapes, cache, seq_lens, block_table)
    elif not 0 <= max_seq_len <= shapes.capacity:
        raise ValueError(f"{_WHERE}: max_seq_len must lie in [0, {shapes.capacity}] (the cache "
                         f"capacity), got {max_seq_len}")
    else:
        n = max_seq_len
    if n == 0:
        return (torch.zeros_like(q_lat),
                torch.full(q_lat.shape[:3], float("-inf"), device=q_lat.device))
    return latent_attention(q_lat, q_pe, gather_kv(cache, seq_lens, n, block_table), seq_lens, sm_scale)
