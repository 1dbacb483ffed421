"""RMSNorm as DeepSeek/Kimi (and transformers) compute it: statistics in fp32, scale in the input dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.kernels import cpu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and cpu.serves(x):  # one call, the same roundings
            return cpu.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
