"""CPU kernels for the eager per-token steps: a decode, a verify of k+1 tokens, a draft pass.

At the embedded pair's size an eager step is hundreds of tiny operations whose calls cost more
than their arithmetic (docs/PERFORMANCE.md). `cpu_kernels.cpp` does each piece of a layer in one
call over weights packed once: a linear that streams its packed weights for up to four rows at a
time, RMSNorm, absorbed-MLA attention over one sequence's cache rows, the MoE routing and SwiGLU.
Each output row is computed alone and in the same order however many rows a call has, so a
verify rounds every row as a decode does.

A call large enough to pay for it is split over a pool of threads that the library starts once
and reuses (idle workers sleep): a linear's output columns, attention's heads or a batch's
sequences, the MoE's experts, in contiguous ranges, each output computed by the same code on
whichever thread, so the bits do not depend on the count. The count follows
`torch.get_num_threads()` unless `set_threads(n)` or `WORKBENCH_CPU_THREADS` fixes it: read when
the library loads, at each call's `serves` check, and by `threads()` and `status()`.

The library is compiled from `cpu_kernels.cpp` on first use (`g++ -O3 -march=native`, a few
seconds) into `$WORKBENCH_CACHE_DIR` (default `~/.cache/workbench`), keyed by the source, the
compiler and this CPU, and loaded with ctypes. Where it cannot be built or this CPU lacks the
instructions (`wb_isa()` < 1), or `WORKBENCH_CPU_KERNELS=0`, `available()` is False and models
run torch's own operations. `status()` says which, and why, and the kernels' thread count.

Weights are packed in the activations' dtype, or in int8 (`WEIGHTS`: "int8" with an fp32 scale
per output channel, "int8-b32" with one per output channel and 32 inputs, llama.cpp's Q8_0
granularity): weight-only quantisation, the activations in fp32 or bf16 and the sums in fp32
(`PackedLinear`, `quantise_int8`). "bf16" packs an fp32 model's weights in bf16 (rounded once,
to nearest even) for fp32 activations: each is widened back as it is read, so the result is the
fp32 kernel's over the rounded weights, for half the weight traffic; with bf16 activations it is
the native packing.

A verifier's whole forward from its token ids (the embedding and RoPE rows, every layer's norms,
attention block, FFN block and residual adds, the final norm and the lm_head) is one more call,
`DecoderStack`, over the layers' plans; an EAGLE-3 draft's greedy chain another (`EagleChain`:
from the fused state, from the verifier's aux states with fc's fusion, or as the fused greedy
step's acceptance then chain).

This file is the library and its calls; `cpu_modules.py` builds kernel-backed twins of the
models' modules from their weights and swaps them into a copy of a model (`accelerate`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-shared", "-fPIC")
MAX_ROWS = 128  # tokens per sequence a call takes: a decode, a verify of k+1 <= 17, a prompt of up to 128
MAX_BATCH_ROWS = 1024  # tokens per call over every sequence of a batch (64 requests verifying 16 each)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The weight formats a PackedLinear takes: "native" packs W in the activations' dtype (its weight
# type is the dtype's code); the int8 ones are weight types 2 and 3 of cpu_kernels.cpp, "bf16"
# under fp32 activations weight type 4 (under bf16 ones it is "native").
WEIGHTS = ("native", "int8", "int8-b32", "bf16")
_WTYPES = {"int8": 2, "int8-b32": 3, "bf16": 4}
QK = 32  # inputs per scale of "int8-b32" (cpu_kernels.cpp's QK)
_ISA_NAMES = {1: "AVX2+FMA", 2: "AVX-512", 3: "AVX512-BF16"}  # wb_isa()'s answers that serve
_lock = threading.Lock()
_state: dict = {}  # "lib": CDLL or None, "why": str, "pinned": set_threads' count or None, "applied": the count set


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def library_path() -> Path:
    """Where this machine's build lives: keyed by the source, the compiler and the CPU."""
    from workbench.machine import cpu_info

    model, flags = cpu_info()
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "none"
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), version, model,
                                    " ".join(sorted(flags))]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("WORKBENCH_CACHE_DIR") or Path.home() / ".cache" / "workbench")
    return root / f"cpu_kernels-{key}.so"


def _build(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        out = subprocess.run([_compiler(), *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"{_compiler()} failed on {SOURCE}:\n{out.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent build or reader never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load():
    if _off(os.environ.get("WORKBENCH_CPU_KERNELS", "1")):
        return None, "off (WORKBENCH_CPU_KERNELS=0)"
    try:
        path = library_path()
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"not built: {e}"
    isa = lib.wb_isa()
    if isa < 1:
        return None, "this CPU has neither AVX2+FMA nor AVX-512: torch's operations instead"
    p, i, f, lng = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.wb_linear.argtypes = [p, p, p, p, i, i, i, i]
    lib.wb_linear_w.argtypes = [p, p, p, p, p, i, i, i, i, i]
    lib.wb_rms_norm.argtypes = [p, lng, p, p, lng, i, i, f, i]
    lib.wb_rope.argtypes = [p, p, lng, p, p, p, lng, i, i, i, i]
    lib.wb_attention.argtypes = [p, p, lng, lng, p, p, i, i, i, i, i, f, i]
    lib.wb_moe_route.argtypes = [p, p, p, p, i, i, i, i, i, i, i, i, f, i, i]
    lib.wb_swiglu.argtypes = [p, p, p, i, i, i, i]
    lib.wb_row_stats.argtypes = [p, lng, i, i, p, p, p, i, i]
    lib.wb_row_stats_at.argtypes = [p, lng, i, i, p, p, p, p, p, i, i]
    lib.wb_xent_grad.argtypes = [p, lng, i, i, p, f, p, i]
    lib.wb_soft_xent_grad.argtypes = [p, lng, i, i, p, lng, p, p, p, p]
    lib.wb_mla_block.argtypes = [p, p, i, p, p, lng, p, p, p, p]
    lib.wb_ffn_block.argtypes = [p, p, i, p]
    lib.wb_eagle_chain.argtypes = [p, p, i, p, p, p, lng, p, i, f, p, p, p]
    lib.wb_eagle_chain_aux.argtypes = [p, p, lng, i, p, i, p, lng, i, p, p, i, p, lng, p, i, f, p, p, p]
    lib.wb_accept_and_draft.argtypes = [p, p, i, i, p, i, i, p, i, p, p, i, p, i, i, p, p, p]
    lib.wb_decoder_stack.argtypes = [p, p, p, lng, i, p, p, lng, lng, p, p, p, lng, p, i, p, p, i, p, p]
    lib.wb_set_threads.argtypes, lib.wb_set_min_work.argtypes, lib.wb_pool_trace.argtypes = [i], [lng], [i, p]
    lib.wb_set_min_work.restype = lib.wb_threads_created.restype = lib.wb_pool_jobs.restype = lng
    lib.wb_set_steal_micros.argtypes, lib.wb_set_steal_micros.restype = [lng], lng
    lib.wb_set_amx.argtypes = [i]
    if _off(os.environ.get("WORKBENCH_AMX", "1")):
        lib.wb_set_amx(0)
    return lib, f"{path} ({_ISA_NAMES.get(isa, f'wb_isa() {isa}')})"


def _off(value: str) -> bool:
    return value.strip().lower() in ("0", "off", "false", "no")


def _lib():
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                pinned = _state.get("pinned") or _threads_from_env()  # a bad value fails before the build
                lib, why = _load()
                _state["pinned"], _state["applied"] = pinned, None
                _state["lib"], _state["why"] = lib, why
                _follow_torch()
    return _state["lib"]


def _threads_from_env() -> int | None:
    """WORKBENCH_CPU_THREADS, where set: the kernels' thread count, whatever torch's is."""
    text = os.environ.get("WORKBENCH_CPU_THREADS", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"WORKBENCH_CPU_THREADS = {text!r}; expected a positive integer")
    return int(text)


def _follow_torch() -> None:
    """Unless set_threads pinned a count, use torch's (`torch.get_num_threads()`), read again here."""
    lib = _state.get("lib")
    if lib is None:
        return
    wanted = _state.get("pinned") or torch.get_num_threads()
    if wanted != _state.get("applied"):
        _state["applied"] = wanted
        lib.wb_set_threads(wanted)


def set_threads(n: int | None) -> int:
    """Run each kernel call on up to `n` threads (the caller and n - 1 pool workers, started once
    and reused); None follows `torch.get_num_threads()` again. Returns the count in force."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"set_threads: n = {n!r}; expected a positive integer or None")
    _lib()
    _state["pinned"] = n
    _follow_torch()
    return threads()


def threads() -> int:
    """The threads a kernel call may use now (1 where the kernels are not loaded)."""
    lib = _lib()
    if lib is None:
        return 1
    _follow_torch()
    return lib.wb_get_threads()


def set_min_work(macs: int) -> int:
    """The multiply-adds each thread must get before a call is split (tests split every call with 1;
    the default keeps small matrices on the calling thread). Returns the previous value."""
    if _lib() is None:
        raise RuntimeError(f"set_min_work: the CPU kernels are not loaded: {status()}")
    return _state["lib"].wb_set_min_work(macs)


def available() -> bool:
    """Whether the kernels are built and loaded here (building them on first call)."""
    return _lib() is not None


def status(with_threads: bool = True) -> str:
    """Whether the kernels serve eager steps here: the library's path (and the threads a call may
    use), or why not."""
    if _lib() is None:
        return _state["why"]
    tiles = ", bf16 linears on AMX tiles" if amx() else ""
    return f"on: {_state['why']}{tiles}" + (f", {threads_text()}" if with_threads else "")


def amx() -> bool:
    """Whether bf16 linears run on AMX tiles (a CPU with AMX-BF16 whose OS grants them, unless
    WORKBENCH_AMX=0 or set_amx(False)); else they use AVX512-BF16 or fmas."""
    return _lib() is not None and bool(_state["lib"].wb_amx())


def set_amx(on: bool) -> bool:
    """Ask for AMX tiles (granted only where amx() can be true) or switch them off; returns whether
    they serve now. A tile sums its products in its own order, so a run's one-row and many-row calls
    must take one path: switch before decoding, not during it."""
    if _lib() is not None:
        _state["lib"].wb_set_amx(int(bool(on)))
    return amx()


def threads_text() -> str:
    """The kernels' thread count as status() and the pair's path describe it: "1 thread", "2 threads"."""
    n = threads()
    return f"{n} thread{'s' if n > 1 else ''}"


def reset() -> None:
    """Forget the loaded library, so that the next call loads (or declines) afresh (tests)."""
    with _lock:
        _state.clear()


def serves(x: Tensor, rows: int | None = None) -> bool:
    """Whether a call on activations `x` [..., H] can go to these kernels: inference on the CPU (no
    autograd), fp32 or bf16, at most MAX_ROWS tokens a sequence (`rows`, else x's next-to-last
    dim) and MAX_BATCH_ROWS in all, and the library loaded."""
    if not x.is_cpu:
        return False
    shape = x.shape  # read once: each tensor attribute costs a call on this hot path
    per_sequence = rows if rows is not None else (shape[-2] if len(shape) >= 2 else 1)
    return serves_rows(x.dtype, per_sequence, x.numel() // max(shape[-1], 1))


def serves_rows(dtype: torch.dtype, per_sequence: int, total: int) -> bool:
    """`serves` for activations in `dtype` of `per_sequence` tokens a sequence and `total` in all (also
    for a call that starts from token ids: no activations yet). Follows a change of torch's thread count."""
    if torch.is_grad_enabled() or dtype not in _DTYPES or per_sequence > MAX_ROWS or total > MAX_BATCH_ROWS:
        return False
    lib = _state.get("lib", False)
    if (_lib() if lib is False else lib) is None:
        return False
    if _state["pinned"] is None and torch.get_num_threads() != _state["applied"]:
        _follow_torch()  # torch's count changed since: the kernels follow it (~20 ns a call to ask)
    return True


def _ints(values: Sequence[int]):
    """A C int array (a call's per-sequence counts or lengths; cheaper than a tensor for a few values)."""
    return (ctypes.c_int * len(values))(*values)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"workbench/kernels/cpu_kernels.cpp: {what} returned {rc}")


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise ValueError(f"weights = {weights!r}; expected one of {', '.join(WEIGHTS)}")
    return weights


def quantise_int8(w: Tensor, block: int | None = None) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (q [N, K] int8, scales [N, S] fp32), symmetric: each scale is the largest |w|
    of its group over 127, and q = round(w / scale) (half to even), so |w - q * scale| <= scale / 2.

    The groups are each output's row (`block` None, S = 1: the simplest, and the sum needs the
    scale once, at the end) or each run of `block` inputs of it (S = ceil(K / block): as llama.cpp's
    Q8_0 does with 32, an outlier then coarsens 32 weights rather than a row). A group of zeros
    gets scale 0 and zeros."""
    w = w.detach().float()
    if w.dim() != 2 or not bool(torch.isfinite(w).all()):
        raise ValueError(f"quantise_int8: expected a finite 2-D weight, got {tuple(w.shape)}")
    N, K = w.shape
    g = block or max(K, 1)
    S = (K + g - 1) // g
    groups = torch.nn.functional.pad(w, (0, S * g - K)).view(N, S, g)
    scale = groups.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (groups / safe[..., None]).round().clamp_(-127, 127)
    return q.reshape(N, S * g)[:, :K].to(torch.int8).contiguous(), scale.contiguous()


class PackedLinear:
    """A weight [N, K] packed for `wb_linear_w`, against activations in `dtype` (default the weight's).

    "native" weights in dtype: fp32 as [N/16][K][16], bf16 as [N/16][K/2][16][2] (pairs of k per
    lane, AVX512-BF16's dot-product layout), rows past N and a column past an odd K zero.
    "bf16" under fp32 activations: the weight rounded to bf16 (nearest even) as [N/16][K][16],
    widened back to fp32 in the kernel; under bf16 activations it is "native" (`weights` says so).
    "int8" and "int8-b32" (`quantise_int8` of the weight in fp32, whatever its dtype): int8 as
    [N/16][K][16] with fp32 scales [N/16][S][16], S = 1 or ceil(K / 32); padded rows have scale 0."""

    def __init__(self, weight: Tensor, weights: str = "native", dtype: torch.dtype | None = None) -> None:
        w = weight.detach()
        dtype = dtype or w.dtype
        if dtype not in _DTYPES or w.dim() != 2 or not w.is_floating_point():
            raise ValueError(f"PackedLinear: expected a 2-D float weight and fp32 or bf16 activations, got "
                             f"{w.dtype} {tuple(w.shape)} and {dtype}")
        if check_weights(weights) == "bf16" and dtype == torch.bfloat16:
            weights = "native"  # bf16 weights under bf16 activations: the native packing
        self.weights = weights
        self.out_features, self.in_features = N, K = w.shape
        self.dtype = dtype
        Np = (N + 15) // 16 * 16
        self.scale: Tensor | None = None
        if weights == "bf16":
            padded = torch.zeros(Np, K, dtype=torch.bfloat16)
            padded[:N] = w.float()  # fp32 -> bf16: round to nearest even, once
            self.data = padded.view(Np // 16, 16, K).transpose(1, 2).contiguous()
            self.wtype, self.k_padded = _WTYPES[weights], K
            return
        if weights != "native":
            q, scale = quantise_int8(w, QK if weights == "int8-b32" else None)
            pad = torch.nn.functional.pad
            self.data = pad(q, (0, 0, 0, Np - N)).view(Np // 16, 16, K).transpose(1, 2).contiguous()
            self.scale = pad(scale, (0, 0, 0, Np - N)).view(Np // 16, 16, scale.shape[1]).transpose(1, 2).contiguous()
            self.wtype, self.k_padded = _WTYPES[weights], K
            return
        w = w.to(dtype)
        Kp = K + (K % 2 if dtype == torch.bfloat16 else 0)
        padded = torch.zeros(Np, Kp, dtype=dtype)
        padded[:N, :K] = w
        if dtype == torch.bfloat16:
            self.data = padded.view(Np // 16, 16, Kp // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            self.data = padded.view(Np // 16, 16, Kp).transpose(1, 2).contiguous()
        self.wtype, self.k_padded = _DTYPES[dtype], Kp

    @property
    def scale_ptr(self) -> int | None:
        return None if self.scale is None else self.scale.data_ptr()

    @property
    def nbytes(self) -> int:
        """The packed weights' bytes, scales included: what a call streams."""
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def int8(self) -> tuple[Tensor, Tensor]:
        """An int8 weight's (q [N, K] int8, scales [N, S] fp32), read back from the packing."""
        if self.scale is None:
            raise ValueError("PackedLinear.int8: the weights are not int8")
        N, K = self.out_features, self.in_features
        q = self.data.transpose(1, 2).reshape(-1, K)[:N]
        return q, self.scale.transpose(1, 2).reshape(-1, self.scale.shape[1])[:N]

    def dequantised(self) -> Tensor:
        """The weight the kernel multiplies by, [N, K] fp32: q * scale for int8 (elementwise in fp32,
        as "int8-b32" forms each weight; "int8" applies its scale to the sum instead), else the
        packed weight itself."""
        N, K = self.out_features, self.in_features
        if self.scale is None:
            if self.dtype == torch.bfloat16 and self.weights == "native":
                return self.data.permute(0, 2, 1, 3).reshape(-1, self.k_padded)[:N, :K].float()
            return self.data.transpose(1, 2).reshape(-1, K)[:N].float()
        q, scale = self.int8()
        return q.float() * scale.repeat_interleave(QK if self.weights == "int8-b32" else max(K, 1), 1)[:, :K]

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x [..., K] @ W^T (+ residual [..., N]), in x's dtype (this one's)."""
        if x.dtype != self.dtype:
            raise ValueError(f"PackedLinear: activations are {x.dtype}, the weight's {self.dtype}")
        K, N = self.in_features, self.out_features
        lead = x.shape[:-1]
        x = x.reshape(-1, K)
        if self.k_padded != K:
            x = torch.nn.functional.pad(x, (0, self.k_padded - K))
        x = x.contiguous()
        y = torch.empty(*lead, N, dtype=x.dtype)
        r = None
        if residual is not None:
            r = residual.reshape(-1, N).contiguous()
        _check(_state["lib"].wb_linear_w(self.data.data_ptr(), self.scale_ptr, x.data_ptr(), y.data_ptr(),
                                         None if r is None else r.data_ptr(), x.shape[0], N, self.k_padded,
                                         _DTYPES[x.dtype], self.wtype), "wb_linear_w")
        return y


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """weight * round(x * rsqrt(mean(x^2) + eps)) over the last dim: `models/norm.py`'s RMSNorm.

    x [..., H] (rows may be strided); `out` [M, H] with unit stride inside a row (a slice of
    cache rows, say) receives the result instead of a new tensor."""
    H = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.dtype != x.dtype or weight.stride(0) != 1:
        raise ValueError(f"rms_norm: weight must be contiguous {x.dtype}, got {weight.dtype}")
    y = torch.empty(x.shape, dtype=x.dtype) if out is None else out
    y2 = y if y.dim() == 2 else y.view(-1, H)
    _check(_state["lib"].wb_rms_norm(x2.data_ptr(), x2.stride(0), weight.data_ptr(), y2.data_ptr(), y2.stride(0),
                                     x2.shape[0], H, eps, _DTYPES[x.dtype]), "wb_rms_norm")
    return y


def rope(a: Tensor, b: Tensor, cos2: Tensor, sin2: Tensor, out: Tensor | None = None) -> Tensor:
    """a * cos2 + b * sin2 for a, b [T, N, R] (`RotaryEmbedding.as_rows`' halves; tokens may be
    strided) and cos2, sin2 [T, R] (`halves`), in a's dtype, into `out` [T, N*R] when given."""
    T, N, R = a.shape
    if a.stride()[1:] != (R, 1) or b.stride() != a.stride():
        raise ValueError("rope: a and b must share their strides, each head's values contiguous")
    y = torch.empty(T, N, R, dtype=a.dtype) if out is None else out
    c, s = cos2.contiguous(), sin2.contiguous()
    _check(_state["lib"].wb_rope(a.data_ptr(), b.data_ptr(), a.stride(0), c.data_ptr(), s.data_ptr(), y.data_ptr(),
                                 y.stride(0), T, N, R, _DTYPES[a.dtype]), "wb_rope")
    return y


def attention(q_lat: Tensor, q_pe: Tensor, rows: Tensor, start: int, scale: float) -> Tensor:
    """Absorbed-MLA attention of T new tokens over one sequence's cache rows.

    q_lat [T, N, L] and q_pe [T, N, R] (each head's values contiguous; tokens may be strided),
    rows [S, L+R] (the first start+T valid, the T new ones last). Token t sees rows 0..start+t.
    Returns [T, N, L], as `reference.mla_attention_torch`'s output for one sequence.
    """
    T, N, L = q_lat.shape
    R = q_pe.shape[-1]
    if q_lat.stride(2) != 1 or q_lat.stride(1) != L or q_pe.stride(2) != 1 or q_pe.stride(1) != R:
        raise ValueError("attention: each head's q values must be contiguous")
    if not rows.is_contiguous() or rows.shape[-1] != L + R or rows.shape[0] < start + T:
        raise ValueError(f"attention: rows must be contiguous [>= {start + T}, {L + R}], got {tuple(rows.shape)}")
    out = torch.empty(T, N, L, dtype=q_lat.dtype)
    _check(_state["lib"].wb_attention(q_lat.data_ptr(), q_pe.data_ptr(), q_lat.stride(0), q_pe.stride(0),
                                      rows.data_ptr(), out.data_ptr(), T, N, L, R, start, scale,
                                      _DTYPES[q_lat.dtype]), "wb_attention")
    return out


def moe_route(x: Tensor, router, extra: int) -> Tensor:
    """`models/moe.py`'s Router on x [T, H] as dense weights [T, E + extra] fp32: the chosen
    experts' weights, zeros elsewhere, and `extra` trailing columns of 1 (the shared experts)."""
    T, H = x.shape
    E = router.weight.shape[0]
    w = router_weights(router)
    x = x.contiguous()
    dense = torch.empty(T, E + extra)
    _check(_state["lib"].wb_moe_route(x.data_ptr(), w[0].data_ptr(), None if w[1] is None else w[1].data_ptr(), dense.data_ptr(), T, H, E,
                                      extra, router.n_group, router.topk_group, router.top_k,
                                      int(router.norm_topk_prob), router.scaling, int(router.sigmoid),
                                      _DTYPES[x.dtype]), "wb_moe_route")
    return dense


def router_weights(router) -> tuple[Tensor, Tensor | None]:
    """A router's weight [E, H] and correction bias [E] (None without one) as contiguous fp32."""
    bias = getattr(router, "e_score_correction_bias", None)
    return (router.weight.detach().float().contiguous(),
            None if bias is None else bias.detach().float().contiguous())


def swiglu(h: Tensor, groups: int, weight: Tensor | None = None) -> Tensor:
    """h [T, groups * 2I] (each group's gate, then its up) -> silu(gate) * up [T, groups * I],
    times weight [T, groups] fp32 per group when given (a zero weight gives exact zeros)."""
    T = h.shape[0]
    I = h.shape[-1] // (2 * groups)
    h = h.contiguous()
    out = torch.empty(T, groups * I, dtype=h.dtype)
    w = None if weight is None else weight.contiguous()
    _check(_state["lib"].wb_swiglu(h.data_ptr(), None if w is None else w.data_ptr(), out.data_ptr(), T, groups, I,
                                   _DTYPES[h.dtype]), "wb_swiglu")
    return out


def row_stats(logits: Tensor, lse: bool = True, at: Sequence[int] | None = None):
    """Per row of logits [T, V] (fp32 or bf16): its max, the first index of it (ATen's argmax
    rule) and its log-sum-exp (the max again when `lse` is False), in fp32, as Python lists. A
    row with a NaN has max NaN; a softmax probability is exp(logit - lse). A greedy step's reads.
    `at` (one index a row): also each row's logit there, as fp32 (exactly: `logits.gather` then
    `.float()`), a fourth list, from the same call (a greedy acceptance's proposals' logits)."""
    T, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    mx, out, arg = (ctypes.c_float * T)(), (ctypes.c_float * T)(), (ctypes.c_long * T)()
    if at is None:
        _check(_state["lib"].wb_row_stats(logits.data_ptr(), logits.stride(0), T, V, mx, arg, out, int(lse),
                                          _DTYPES[logits.dtype]), "wb_row_stats")
        return list(mx), list(arg), list(out)
    if len(at) != T:
        raise ValueError(f"row_stats: {len(at)} indices for {T} rows")
    picked = (ctypes.c_float * T)()
    rc = _state["lib"].wb_row_stats_at(logits.data_ptr(), logits.stride(0), T, V, (ctypes.c_long * T)(*at), picked,
                                       mx, arg, out, int(lse), _DTYPES[logits.dtype])
    if rc == -3:
        raise IndexError(f"row_stats: an index in `at` outside [0, {V})")
    _check(rc, "wb_row_stats_at")
    return list(mx), list(arg), list(out), list(picked)


def xent_grad_(logits: Tensor, target: Tensor, scale: float) -> Tensor:
    """A training loss's cross-entropy and its gradient in one call (`wb_xent_grad`): logits [T, V]
    (fp32 or bf16, contiguous rows) against target [T]; returns each row's loss (lse - logit at
    the target) as fp32 [T], and overwrites the logits with (softmax - onehot(target)) * scale in
    their own dtype. A row with a NaN or no finite value gets loss NaN and keeps its logits."""
    T, V = logits.shape
    if logits.stride(-1) != 1 or logits.dtype not in _DTYPES or not logits.is_cpu:
        raise ValueError(f"xent_grad_: logits {tuple(logits.shape)} {logits.dtype} with strides {logits.stride()}; "
                         "expected fp32 or bf16 rows on the CPU, each contiguous")
    target = target.to(torch.long).contiguous()
    if target.shape != (T,):
        raise ValueError(f"xent_grad_: target {tuple(target.shape)} for {T} rows; expected one index a row")
    losses = torch.empty(T, dtype=torch.float32)
    rc = _lib().wb_xent_grad(logits.data_ptr(), logits.stride(0), T, V, target.data_ptr(), scale, losses.data_ptr(),
                             _DTYPES[logits.dtype])
    if rc == -3:
        raise IndexError(f"xent_grad_: a target outside [0, {V})")
    _check(rc, "wb_xent_grad")
    return losses


def soft_xent_grad(logits: Tensor, target: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The draft's TTT loss per row in one call (`wb_soft_xent_grad`): fp32 logits [T, V] against
    target probabilities [T, V], log-softmax clamped at -1e4 (as `training.eagle3` clamps it).
    Returns (each row's loss [T], the gradient of sum_t weights[t] * loss_t [T, V], each row's argmax
    [T]). A row with a NaN or no finite value gets loss NaN and a zero gradient."""
    T, V = logits.shape
    logits = logits.contiguous()  # the gradient's rows take the logits' stride
    for name, t in (("logits", logits), ("target", target)):
        if t.dtype != torch.float32 or not t.is_cpu or t.stride(-1) != 1 or t.shape != (T, V):
            raise ValueError(f"soft_xent_grad: {name} {tuple(t.shape)} {t.dtype} with strides {t.stride()}; "
                             f"expected fp32 [{T}, {V}] on the CPU, rows contiguous")
    weights = weights.to(torch.float32).contiguous()
    if weights.shape != (T,):
        raise ValueError(f"soft_xent_grad: weights {tuple(weights.shape)} for {T} rows; expected one a row")
    grad = torch.empty(T, V, dtype=torch.float32)
    losses, args = torch.empty(T, dtype=torch.float32), torch.empty(T, dtype=torch.long)
    _check(_lib().wb_soft_xent_grad(logits.data_ptr(), logits.stride(0), T, V, target.data_ptr(), target.stride(0),
                                    weights.data_ptr(), grad.data_ptr(), losses.data_ptr(), args.data_ptr()),
           "wb_soft_xent_grad")
    return losses, grad, args


class _MlaPlan(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("w_a", "w_q", "w_o", "q_norm", "kv_norm")] + \
        [(n, ctypes.c_float) for n in ("q_eps", "kv_eps", "scale")] + \
        [(n, ctypes.c_int) for n in ("in_features", "hidden", "q_lora", "N", "L", "R", "dtype", "wtype")] + \
        [(n, ctypes.c_void_p) for n in ("s_a", "s_q", "s_o")]


class _FfnPlan(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("w_gate_up", "w_down", "router", "bias")] + \
        [(n, ctypes.c_int) for n in ("hidden", "groups", "inter", "experts", "n_group", "topk_group", "top_k", "norm",
                                     "sigmoid", "dtype")] + [("scaling", ctypes.c_float), ("wtype", ctypes.c_int)] + \
        [(n, ctypes.c_void_p) for n in ("s_gate_up", "s_down")]


class MlaBlock:
    """An absorbed-MLA attention in one call (`wb_mla_block`): normed x [T, in] -> o_proj's output,
    the T new cache rows written first. `a` maps x to [c_q or q | c_kv | k_pe's two halves], `q`
    maps the normed c_q to [q_lat per head (L) | q_pe's two halves per head] (None without q_lora),
    `o` maps the heads' latent outputs to the hidden size (`MLAttention._build_kernel_block`).
    The three are packed as `weights` says, against activations in `dtype` (default a's)."""

    def __init__(self, a: Tensor, q: Tensor | None, o: Tensor, q_norm: tuple[Tensor, float] | None,
                 kv_norm: tuple[Tensor, float], scale: float, heads: int, kv_lora: int, rope: int,
                 weights: str = "native", dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype or a.dtype
        self.a, self.o = PackedLinear(a, weights, self.dtype), PackedLinear(o, weights, self.dtype)
        self.q = PackedLinear(q, weights, self.dtype) if q is not None else None
        self.weights = weights
        self.norms = (q_norm[0].detach().contiguous() if q_norm is not None else None, kv_norm[0].detach().contiguous())
        self.plan = _MlaPlan(self.a.data.data_ptr(), self.q.data.data_ptr() if self.q else None, self.o.data.data_ptr(),
                             self.norms[0].data_ptr() if self.q else None, self.norms[1].data_ptr(),
                             q_norm[1] if q_norm is not None else 0.0, kv_norm[1], scale, a.shape[1], o.shape[0],
                             q.shape[1] if self.q else 0, heads, kv_lora, rope, _DTYPES[self.dtype], self.a.wtype,
                             self.a.scale_ptr, self.q.scale_ptr if self.q else None, self.o.scale_ptr)

    def __call__(self, x: Tensor, rows: Tensor, start: int | Sequence[int], cos2: Tensor, sin2: Tensor,
                 counts: Sequence[int] | None = None) -> Tensor:
        """x [T, in] (this dtype); rows [S, L+R] contiguous with room at start..start+T; cos2, sin2 [T, R].

        A batch: rows [B, S, L+R] (each sequence's rows contiguous), start[b] each sequence's length
        and counts[b] its new tokens, which come after the earlier sequences' in x, cos2 and sin2."""
        T = x.shape[0]
        rows3 = rows if rows.dim() == 3 else rows[None]
        B, S = rows3.shape[:2]
        starts = [start] if isinstance(start, int) else list(start)
        counts = [T] if counts is None else list(counts)
        if (x.dtype != self.dtype or rows3.stride(1) != rows3.shape[2] or rows3.stride(2) != 1 or len(starts) != B
                or len(counts) != B or sum(counts) != T or any(s + n > S for s, n in zip(starts, counts))):
            raise ValueError(f"MlaBlock: x must be {self.dtype} [{T}, in], rows [B, S, L+R] with each sequence's "
                             f"rows contiguous and room for its new tokens (starts {starts}, counts {counts}, S {S})")
        x, c, s = x.contiguous(), cos2.contiguous(), sin2.contiguous()
        out = torch.empty(T, self.plan.hidden, dtype=x.dtype)
        _check(_state["lib"].wb_mla_block(ctypes.byref(self.plan), x.data_ptr(), B, _ints(counts), rows3.data_ptr(),
                                          rows3.stride(0), _ints(starts), c.data_ptr(), s.data_ptr(), out.data_ptr()),
               "wb_mla_block")
        return out


class FfnBlock:
    """A SwiGLU MLP, or a dense-expert MoE with its router, in one call (`wb_ffn_block`): normed x
    [T, H] -> [T, H]. gate_up holds `groups` blocks of [gate | up] rows of width `inter`; with a
    router the first `experts` groups are routed and the rest (shared experts) weighted 1. The two
    weights are packed as `weights` says (each expert's rows keep their own scales)."""

    def __init__(self, gate_up: Tensor, down: Tensor, groups: int, router=None, weights: str = "native") -> None:
        self.gate_up, self.down = PackedLinear(gate_up, weights), PackedLinear(down, weights)
        self.dtype, self.weights = gate_up.dtype, weights
        inter = down.shape[1] // groups
        r = b = None
        E = n_group = topk_group = top_k = 0
        if router is not None:
            self.router = router_weights(router)
            r, b = self.router[0].data_ptr(), None if self.router[1] is None else self.router[1].data_ptr()
            E, n_group, topk_group, top_k = router.weight.shape[0], router.n_group, router.topk_group, router.top_k
        self.plan = _FfnPlan(self.gate_up.data.data_ptr(), self.down.data.data_ptr(), r, b, down.shape[0], groups,
                             inter, E, n_group, topk_group, top_k, int(bool(router and router.norm_topk_prob)),
                             int(bool(router and router.sigmoid)), _DTYPES[gate_up.dtype],
                             float(router.scaling) if router is not None else 1.0, self.gate_up.wtype,
                             self.gate_up.scale_ptr, self.down.scale_ptr)

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype != self.dtype:
            raise ValueError(f"FfnBlock: activations are {x.dtype}, the weights {self.dtype}")
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty(*lead, self.plan.hidden, dtype=x.dtype)
        _check(_state["lib"].wb_ffn_block(ctypes.byref(self.plan), x.data_ptr(), x.shape[0], out.data_ptr()),
               "wb_ffn_block")
        return out


class _EaglePlan(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("attn", "mlp", "input_norm", "hidden_norm", "post_norm", "final_norm",
                                               "embed", "head", "d2t", "cos", "sin")] + \
        [(n, ctypes.c_float) for n in ("input_eps", "hidden_eps", "post_eps", "final_eps")] + \
        [(n, ctypes.c_int) for n in ("hidden", "draft_vocab", "limit", "norm_before_residual", "norm_output", "dtype",
                                     "head_wtype")] + [("head_scale", ctypes.c_void_p)]


class EagleChain:
    """An EAGLE-3 MLA draft's greedy chain in one call (`wb_eagle_chain`): from the fused state (fc
    over the verifier's aux states), the first pass over T new positions, k-1 passes each fed the
    last state and the previous proposal, and each head's argmax (through d2t) with its softmax
    probability: what the engine's `greedy_chain` computes, pass by pass the same kernels (so the
    same bits)."""

    def __init__(self, attn: MlaBlock, mlp: FfnBlock, norms: Sequence[tuple[Tensor, float]], embed: Tensor,
                 head: PackedLinear, d2t: Tensor | None, cos2: Tensor, sin2: Tensor, norm_before_residual: bool,
                 norm_output: bool, fc: PackedLinear | None = None) -> None:
        """norms: (weight, eps) of the input, hidden, post-attention and final norms. `fc`: the draft's
        fc (aux states -> the fused state), for `from_aux`; None without one in this dtype."""
        if fc is not None and (fc.dtype != embed.dtype or fc.k_padded != fc.in_features
                               or fc.out_features != embed.shape[1]):
            fc = None  # from_aux needs fc's rows as the kernels pack them, in the chain's dtype
        self.fc = fc
        self.parts = (attn, mlp, head, fc)
        self.tensors = [w.detach().contiguous() for w, _ in norms] + [embed.detach().contiguous(), cos2, sin2]
        self.d2t = None if d2t is None else d2t.detach().to(torch.int64).contiguous()
        n_in, n_hid, n_post, n_fin, emb, cos, sin = (t.data_ptr() for t in self.tensors)
        self.dtype = embed.dtype
        self.limit = cos2.shape[0]
        self.plan = _EaglePlan(ctypes.addressof(attn.plan), ctypes.addressof(mlp.plan), n_in, n_hid, n_post, n_fin,
                               emb, head.data.data_ptr(), self.d2t.data_ptr() if self.d2t is not None else None, cos,
                               sin, *(eps for _, eps in norms), embed.shape[1], head.out_features, self.limit,
                               int(norm_before_residual), int(norm_output), _DTYPES[embed.dtype], head.wtype,
                               head.scale_ptr)

    def __call__(self, ids: Tensor, state: Tensor, rows: Tensor, start: int | Sequence[int], k: int,
                 counts: Sequence[int] | None = None, stop_below: float | None = None) -> tuple[Tensor, Tensor]:
        """ids [T] int64, the fused state [T, H] in this dtype, the draft cache's rows [S, L+R] with
        room for start..start+T+k-2 -> (tokens [k] int64, probs [k] fp32).

        A batch: rows [B, S, L+R], start[b] and counts[b] each sequence's length and new positions
        (theirs come after the earlier sequences' in ids and state) -> (tokens [B, k], probs [B, k]).
        `stop_below`: the chain ends once every sequence proposed a token below it (fewer columns)."""
        T = ids.shape[0]
        rows3 = rows if rows.dim() == 3 else rows[None]
        B, S = rows3.shape[:2]
        starts = [start] if isinstance(start, int) else list(start)
        counts = [T] if counts is None else list(counts)
        room = min(self.limit, S)
        if (state.dtype != self.dtype or rows3.stride(1) != rows3.shape[2] or rows3.stride(2) != 1
                or len(starts) != B or len(counts) != B or sum(counts) != T
                or any(n < 1 or s + n + k - 1 > room for s, n in zip(starts, counts))):
            raise ValueError(f"EagleChain: positions {counts} and {k - 1} more from {starts} do not fit the cache "
                             f"({S} rows) or the RoPE table ({self.limit}), or the state is not {self.dtype}")
        ids, state = ids.to(torch.int64).contiguous(), state.contiguous()
        tokens, probs = torch.empty(B, k, dtype=torch.int64), torch.empty(B, k)
        made = ctypes.c_int(k)  # the proposals made: k, or fewer once every row is unsure
        _check(_state["lib"].wb_eagle_chain(ctypes.byref(self.plan), ids.data_ptr(), B, _ints(counts),
                                            state.data_ptr(), rows3.data_ptr(), rows3.stride(0), _ints(starts), k,
                                            float(stop_below or 0.0), ctypes.byref(made), tokens.data_ptr(),
                                            probs.data_ptr()), "wb_eagle_chain")
        if made.value < k:
            tokens, probs = tokens[:, :made.value], probs[:, :made.value]
        return (tokens, probs) if rows.dim() == 3 else (tokens[0], probs[0])

    def accept_and_draft(self, logits: Tensor, x: Tensor, aux: Sequence[Tensor], rows: Tensor, start: int,
                         k: int) -> tuple[Tensor, Tensor, bool]:
        """The fused greedy step's call after the verifier's forward over x [1, T] (= [last verified
        token] + T - 1 proposals; its logits [T, V], its aux states [1, T, W] each), for one sequence
        whose draft cache rows [S, L+R] hold `start` positions before x (`wb_accept_and_draft`):
        `workbench.decoding.fused.accept_and_draft`'s results, (ints [1 + T + k] = [accepted, the T
        argmaxes, the next k proposals], floats [(T - 1) + T + k] = [p of each proposal, p of each
        argmax, q of each next proposal], whether every logit row's max is finite), with the draft
        rows up to the accepted count's written as the unfused chain writes them (the proposals are
        its bits). The caller sets the draft cache's length."""
        return _accept_and_draft(self, logits, x, aux, rows, start, k)

    def from_aux(self, ids: Tensor, aux: Sequence[Tensor], rows: Tensor, starts: Sequence[int], k: int,
                 counts: Sequence[int], stop_below: float | None = None) -> tuple[Tensor, Tensor]:
        """The chain from the verifier's aux states, fc's fusion in the same call (`wb_eagle_chain_aux`):
        ids [B, T] int64 and each aux state [B, T, W] in this dtype, sequence b's first counts[b]
        positions its own (the rest padding), the draft cache's rows [B, S, L+R] -> (tokens [B, k],
        probs [B, k]), the bits of fc's twin then `__call__` over the real positions."""
        fc = self.fc
        B, T = ids.shape
        S = rows.shape[1]
        room = min(self.limit, S)
        if (fc is None or ids.dtype != torch.int64 or rows.dim() != 3 or rows.shape[0] != B
                or rows.stride(1) != rows.shape[2] or rows.stride(2) != 1 or len(starts) != B or len(counts) != B
                or any(n < 1 or n > T or s + n + k - 1 > room for s, n in zip(starts, counts))):
            raise ValueError(f"EagleChain.from_aux: positions {list(counts)} and {k - 1} more from {list(starts)} do "
                             f"not fit the cache ({S} rows) or the RoPE table ({self.limit}), or there is no fc")
        if ids.stride(1) != 1:
            ids = ids.contiguous()
        W, stride = aux[0].shape[-1], aux[0].stride(0)
        if (len(aux) * W != fc.in_features
                or any(a.dtype != self.dtype or a.shape != (B, T, W) for a in aux)):
            raise ValueError(f"EagleChain.from_aux: expected {fc.in_features // max(W, 1)} aux states "
                             f"[{B}, {T}, {W}] in {self.dtype}")
        if any(a.stride(2) != 1 or a.stride(1) != W or a.stride(0) != stride for a in aux):
            aux = [a.contiguous() for a in aux]
            stride = T * W
        tokens, probs = torch.empty(B, k, dtype=torch.int64), torch.empty(B, k)
        made = ctypes.c_int(k)
        _check(_state["lib"].wb_eagle_chain_aux(
            ctypes.byref(self.plan), ids.data_ptr(), ids.stride(0), B, _ints(counts), len(aux),
            (ctypes.c_void_p * len(aux))(*(a.data_ptr() for a in aux)), stride, W, fc.data.data_ptr(), fc.scale_ptr,
            fc.wtype, rows.data_ptr(), rows.stride(0), _ints(starts), k, float(stop_below or 0.0), ctypes.byref(made),
            tokens.data_ptr(), probs.data_ptr()), "wb_eagle_chain_aux")
        if made.value < k:
            tokens, probs = tokens[:, :made.value], probs[:, :made.value]
        return tokens, probs


def _accept_and_draft(chain: "EagleChain", logits: Tensor, x: Tensor, aux: Sequence[Tensor], rows: Tensor, start: int,
                      k: int) -> tuple[Tensor, Tensor, bool]:
    """`EagleChain.accept_and_draft`'s call (see there)."""
    fc = chain.fc
    T, V = logits.shape
    S = rows.shape[0]
    if (fc is None or logits.dtype not in _DTYPES or logits.stride(1) != 1 or logits.stride(0) != V
            or x.shape != (1, T) or x.dtype != torch.int64 or rows.dim() != 2 or rows.stride(0) != rows.shape[1]
            or rows.stride(1) != 1 or start + T + k - 1 > min(chain.limit, S) or k < 1):
        raise ValueError(f"EagleChain.accept_and_draft: logits [{T}, V] after x [1, {T}] and {k} proposals from "
                         f"{start} must fit the cache ({S} rows) and the RoPE table ({chain.limit})")
    W = aux[0].shape[-1]
    if len(aux) * W != fc.in_features or any(a.dtype != chain.dtype or a.shape != (1, T, W) for a in aux):
        raise ValueError(f"EagleChain.accept_and_draft: expected {fc.in_features // max(W, 1)} aux states "
                         f"[1, {T}, {W}] in {chain.dtype}")
    aux = [a if a.stride(2) == 1 and a.stride(1) == W else a.contiguous() for a in aux]
    x = x if x.is_contiguous() else x.contiguous()
    ints, floats, finite = torch.empty(1 + T + k, dtype=torch.int64), torch.empty(2 * T - 1 + k), ctypes.c_int(0)
    _check(_state["lib"].wb_accept_and_draft(
        ctypes.byref(chain.plan), logits.data_ptr(), V, _DTYPES[logits.dtype], x.data_ptr(), T, len(aux),
        (ctypes.c_void_p * len(aux))(*(a.data_ptr() for a in aux)), W, fc.data.data_ptr(), fc.scale_ptr, fc.wtype,
        rows.data_ptr(), start, k, ints.data_ptr(), floats.data_ptr(), ctypes.byref(finite)), "wb_accept_and_draft")
    return ints, floats, bool(finite.value)


class _StackPlan(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("attn", "ffn", "input_norm", "post_norm", "input_eps", "post_eps",
                                               "final_norm", "head", "head_scale")] + \
        [("final_eps", ctypes.c_float)] + [(n, ctypes.c_int) for n in ("layers", "hidden", "vocab", "dtype",
                                                                      "head_wtype")]


class DecoderStack:
    """A verifier's forward from its token ids in one call (`wb_decoder_stack`): each token's
    embedding row and RoPE rows, then for each layer the stream entering it kept where it is an aux
    layer, h += attention(input_norm(h)) (an `MlaBlock`, writing the cache rows), h +=
    ffn(post_norm(h)) (an `FfnBlock`), each add rounded to the dtype as torch's `h + x`; then the
    final norm and the head over each sequence's last rows. The same rows as torch.embedding and
    the same kernels on the same rows as the layers' twins call one by one, so the same bits."""

    def __init__(self, attn: Sequence[MlaBlock], ffn: Sequence[FfnBlock], input_norms: Sequence[tuple[Tensor, float]],
                 post_norms: Sequence[tuple[Tensor, float]], final_norm: tuple[Tensor, float],
                 head: PackedLinear) -> None:
        n = len(attn)
        self.dtype = attn[0].dtype
        if (len(ffn) != n or len(input_norms) != n or len(post_norms) != n or head.dtype != self.dtype
                or head.k_padded != head.in_features or any(b.plan.hidden != head.in_features for b in (*attn, *ffn))
                or any(b.dtype != self.dtype for b in (*attn, *ffn)) or len({b.plan.R for b in attn}) != 1
                or any(w.dtype != self.dtype for w, _ in (*input_norms, *post_norms, final_norm))):
            raise ValueError(f"DecoderStack: every part must be {n} layers' in {self.dtype}")
        self.parts = (list(attn), list(ffn), head)  # kept alive: the plan points into them
        self.norms = [w.detach().contiguous() for w, _ in (*input_norms, *post_norms, final_norm)]
        ptrs = ctypes.c_void_p * n
        self.arrays = (ptrs(*(ctypes.addressof(b.plan) for b in attn)), ptrs(*(ctypes.addressof(b.plan) for b in ffn)),
                       ptrs(*(w.data_ptr() for w in self.norms[:n])), ptrs(*(w.data_ptr() for w in self.norms[n:2 * n])),
                       (ctypes.c_float * n)(*(eps for _, eps in input_norms)),
                       (ctypes.c_float * n)(*(eps for _, eps in post_norms)))
        self.hidden, self.vocab, self.layers = attn[0].plan.hidden, head.out_features, n
        self.row_width, self.rope = attn[0].plan.L + attn[0].plan.R, attn[0].plan.R
        self.plan = _StackPlan(*(ctypes.addressof(a) for a in self.arrays), self.norms[-1].data_ptr(),
                               head.data.data_ptr(), head.scale_ptr, final_norm[1], n, self.hidden, self.vocab,
                               _DTYPES[self.dtype], head.wtype)

    def __call__(self, ids: Tensor, embed: Tensor, rows: Tensor, starts: Sequence[int], cos: Tensor, sin: Tensor,
                 positions: Sequence[int] | None, aux_ids: Sequence[int],
                 keep: int) -> tuple[list[Tensor], Tensor, Tensor]:
        """ids [B, T] int64 (each < embed's rows), embed [vocab, H] in this dtype; rows [layers, B, S,
        L+R] (a cache's, each sequence's rows contiguous) with room for T new rows at starts[b]; cos,
        sin [limit, R] the RoPE tables, read at positions[i] for token i ([B * T], in sequence
        order) or at starts[b] + t where positions is None; aux_ids distinct, ascending; 1 <= keep <=
        T -> ([aux [B, T, H] per aux id], normed hidden [B, keep, H], logits [B, keep, vocab]).
        An id outside the embedding raises IndexError."""
        B, T = ids.shape
        H = self.hidden
        if (embed.dtype != self.dtype or embed.dim() != 2 or embed.shape[1] != H or embed.stride(1) != 1
                or embed.stride(0) != H or ids.dtype != torch.int64 or rows.dtype != self.dtype or rows.dim() != 4
                or rows.shape[:2] != (self.layers, B) or rows.shape[3] != self.row_width or rows.stride(3) != 1
                or rows.stride(2) != self.row_width or len(starts) != B or not 1 <= keep <= T
                or any(s + T > rows.shape[2] for s in starts) or cos.dtype != self.dtype or cos.shape != sin.shape
                or cos.dim() != 2 or cos.shape[1] != self.rope or not cos.is_contiguous() or not sin.is_contiguous()
                or (positions is not None and len(positions) != B * T)):
            raise ValueError(f"DecoderStack: ids must be int64 [B, T], embed {self.dtype} [vocab, {H}], rows "
                             f"[{self.layers}, B, S, {self.row_width}] with room for T = {T} from {list(starts)} "
                             f"and the RoPE tables [limit, {self.rope}]")
        if not ids.is_contiguous():
            ids = ids.contiguous()
        aux = [torch.empty(B, T, H, dtype=self.dtype) for _ in aux_ids]
        hidden = torch.empty(B, keep, H, dtype=self.dtype)
        logits = torch.empty(B, keep, self.vocab, dtype=self.dtype)
        rc = _state["lib"].wb_decoder_stack(
            ctypes.byref(self.plan), ids.data_ptr(), embed.data_ptr(), embed.shape[0], B, _ints([T] * B),
            rows.data_ptr(), rows.stride(0), rows.stride(1), _ints(starts), cos.data_ptr(), sin.data_ptr(),
            cos.shape[0], None if positions is None else _ints(positions), len(aux_ids), _ints(aux_ids),
            (ctypes.c_void_p * len(aux))(*(a.data_ptr() for a in aux)), keep, hidden.data_ptr(), logits.data_ptr())
        if rc == -4:
            raise IndexError(f"DecoderStack: a token id outside the embedding's {embed.shape[0]} rows")
        if rc == -3:
            raise ValueError(f"DecoderStack: a position outside the RoPE tables' {cos.shape[0]} rows")
        _check(rc, "wb_decoder_stack")
        return aux, hidden, logits
