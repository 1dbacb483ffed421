"""DeepSeek YaRN rotary embedding on the qk_rope_head_dim slice (eagle3_mla.md §4).

Kimi and DeepSeek checkpoints rotate *interleaved* pairs (0,1),(2,3),...; Llama-style
(neox) checkpoints rotate the halves. The interleaved form here writes its output in
half-split order, as transformers does: q and k are permuted alike, so every dot product
is unchanged and the extra re-interleave copy is saved. Getting the pairing wrong does not
crash anything, it only ruins the model, which is why the doctor probes the other pairing.
"""
from __future__ import annotations

import math

import torch

from workbench.config import yarn_mscale


def yarn_inv_freq(dim: int, base: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (dim/2,) and the cos/sin magnitude scale for DeepSeek YaRN."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    inv_extra = 1.0 / pos_freqs
    if not scaling:
        return inv_extra, 1.0
    factor = scaling["factor"]
    orig = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(scaling["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp
    inv_freq = inv_extra / factor * (1 - extrapolate) + inv_extra * extrapolate
    mag = yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    return inv_freq, mag


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, dim: int, base: float, scaling: dict | None, interleave: bool) -> None:
        super().__init__()
        # A plain fp32 attribute, not a buffer: it must survive model.to(bfloat16) and meta init.
        self.inv_freq, self.magnitude = yarn_inv_freq(dim, base, scaling)
        self.interleave = interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [..., dim/2] for integer positions of shape [...]."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        return (freqs.cos() * self.magnitude).to(dtype), (freqs.sin() * self.magnitude).to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [B, T, (heads,) dim]; cos/sin [B or 1, T, dim/2] broadcast over heads."""
        if x.dim() == 4:
            cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
