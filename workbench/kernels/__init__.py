"""Attention kernels for the MLA draft and verifier, with one dispatching entry point.

`mla_attention` runs absorbed-MLA attention over the latent cache (decode: Sq = 1,
speculative verification: Sq = k+1) on either backend:

* "torch"  -> `reference.mla_attention_torch`, fp32 PyTorch; the CPU path and the oracle;
* "triton" -> `triton_mla.mla_attention_triton`, the split-KV Triton kernel, on CUDA
  tensors, or on CPU tensors under the Triton interpreter (`TRITON_INTERPRET=1`);
* "auto"   -> Triton for CUDA tensors when triton imports, else the twin.

`with_attention("triton", verifier, draft)` is the models with this kernel in their absorbed path.

Triton and the kernel module are imported lazily so this package imports on machines
without triton (macOS, aarch64 wheels, minimal CPU installs). The kernel file is
`triton_mla.py`, not `mla_attention.py`: importing a submodule binds its name on this
package, which would replace the `mla_attention` function with a module object.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from workbench.kernels.reference import mla_attention_torch
from workbench.models.mla import LatentAttention

__all__ = ["KernelLatentAttention", "mla_attention", "mla_attention_torch", "resolve_backend", "triton_available",
           "with_attention"]

BACKENDS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether `import triton` works here (cached: importing it takes about a second)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install failing inside triton's own imports
        return False
    return True


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Map "auto"/"torch"/"triton" and the tensors' device to "torch" or "triton".

    Raises ValueError for an unknown name and RuntimeError when "triton" cannot run here.
    """
    if backend == "torch":  # first: the per-layer hot path, and nothing for torch.compile to trace
        return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"workbench/kernels/__init__.py: backend must be one of {BACKENDS}, "
                         f"got {backend!r}")
    device = torch.device(device)
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError("workbench/kernels/__init__.py: backend='triton' but triton does not "
                           "import; install triton or use backend='torch'")
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and _interpreter_requested():
        return "triton"
    raise RuntimeError(f"workbench/kernels/__init__.py: backend='triton' on {device.type} tensors "
                       "needs a CUDA device, or TRITON_INTERPRET=1 set before triton is imported "
                       "(CPU interpreter, slow; for tests)")


def mla_attention(q_lat: Tensor, q_pe: Tensor, cache: Tensor, seq_lens: Tensor, sm_scale: float,
                  *, block_table: Tensor | None = None, num_kv_splits: int | None = None,
                  max_seq_len: int | None = None, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Absorbed-MLA attention over the latent cache; returns (out [B,Sq,H,L], lse [B,Sq,H]).

    See `reference.py` for the math: q_lat [B,Sq,H,L], q_pe [B,Sq,H,R], cache rows
    [c_kv | k_pe] (contiguous [B,S_max,L+R] or paged [blocks,page,L+R] + block_table [B,max_blocks]),
    seq_lens [B] counting the Sq new tokens, bottom-right-aligned causal mask, fp32 lse.
    `max_seq_len` = max(seq_lens) when the caller knows it: the twin then never syncs (the
    Triton kernel needs no host-side maximum and ignores it).
    """
    if resolve_backend(backend, q_lat.device) == "torch":
        return mla_attention_torch(q_lat, q_pe, cache, seq_lens, sm_scale, block_table=block_table,
                                   num_kv_splits=num_kv_splits, max_seq_len=max_seq_len)
    from workbench.kernels.triton_mla import mla_attention_triton

    return mla_attention_triton(q_lat, q_pe, cache, seq_lens, sm_scale,
                                block_table=block_table, num_kv_splits=num_kv_splits)


class KernelLatentAttention(LatentAttention):
    """The models' `LatentAttention` with its attention in `mla_attention` on `backend` ("triton")."""

    backend = "triton"

    def forward(self, q_nope: Tensor, q_pe: Tensor, rows: Tensor, seq_lens: Tensor, bound: int, w_uk: Tensor,
                w_uv: Tensor, scale: float) -> Tensor:
        B, T = q_nope.shape[:2]
        q_lat = torch.einsum("btnp,npl->btnl", q_nope, w_uk)
        seq_lens = seq_lens.to(torch.int32).reshape(-1).expand(B)  # [B], or 0-d for every sequence
        o_lat, _ = mla_attention(q_lat, q_pe.contiguous(), rows, seq_lens, scale, max_seq_len=bound,
                                 backend=self.backend)
        return torch.einsum("btnl,nvl->btnv", o_lat, w_uv).reshape(B, T, -1)


def with_attention(backend: str, *models: torch.nn.Module, memo: dict | None = None) -> tuple[torch.nn.Module, ...]:
    """Copies of `models` whose absorbed-MLA attention runs on `backend` ("torch": the models' own;
    "triton"); the models given are unchanged. `memo` as in `workbench.variants.copy_modules`."""
    from workbench.variants import copy_modules, shallow_copy

    memo = {} if memo is None else memo
    if resolve_backend(backend, next(models[0].parameters()).device) == "torch":
        return tuple(copy_modules(m, memo=memo) for m in models)

    def twin(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
        if type(module) is not LatentAttention:
            return None
        new = shallow_copy(module)
        new.__class__ = KernelLatentAttention
        return new

    return tuple(copy_modules(m, twin, memo) for m in models)
