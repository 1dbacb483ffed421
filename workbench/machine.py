"""What CPU this is: the default dtype, the compiled GEMMs and every speed figure depend on it."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


@functools.cache  # the CPU does not change under a process
def cpu_info() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags from /proc/cpuinfo (('', set()) where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", set()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    return fields.get("model name", ""), set(fields.get("flags", "").split())


def machine() -> dict:
    """What a report was measured on. The same bench gives other ratios on another CPU: with
    AVX512-BF16 (or AMX) bf16 is the default dtype and a 4-row bf16 matmul costs about a 1-row
    one; on an AVX2 CPU fp32 is the default and a 4-row fp32 matmul costs 2-3 one-row ones."""
    model, flags = cpu_info()
    return {"cpu": model, "cores": os.cpu_count(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "fast_bf16": bool(flags & {"avx512_bf16", "amx_bf16"}), "amx_bf16": "amx_bf16" in flags,
            "torch": torch.__version__}
