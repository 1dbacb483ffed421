"""CPU kernels for the eager per-token steps: a decode, a verify of k+1 tokens, a draft pass.

At the embedded pair's size an eager step is hundreds of tiny operations whose calls cost more
than their arithmetic (docs/PERFORMANCE.md). `cpu_kernels.cpp` does each piece of a layer in one
call over weights packed once: a linear that streams its
packed weights for up to four rows at a time, RMSNorm, absorbed-MLA attention over one
sequence's cache rows, the MoE routing and SwiGLU. Each output row is computed alone and in the
same order however many rows a call has, so a verify rounds every row as a decode does.

The library is compiled from `cpu_kernels.cpp` on first use (`g++ -O3 -march=native`, a few
seconds) into `$WORKBENCH_CACHE_DIR` (default `~/.cache/workbench`), keyed by the source, the
compiler and this CPU, and loaded with ctypes. Where it cannot be built or this CPU lacks the
instructions (`wb_isa()` < 1), or `WORKBENCH_CPU_KERNELS=0`, `available()` is False and models
run torch's own operations. `status()` says which, and why.

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
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
MAX_ROWS = 128  # tokens per sequence a call takes: a decode, a verify of k+1 <= 17, a prompt of up to 128
MAX_BATCH_ROWS = 1024  # tokens per call over every sequence of a batch (64 requests verifying 16 each)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ISA_NAMES = {1: "AVX2+FMA", 2: "AVX-512", 3: "AVX512-BF16"}  # wb_isa()'s answers that serve
_lock = threading.Lock()
_state: dict = {}  # "lib": CDLL or None, "why": str


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
    if os.environ.get("WORKBENCH_CPU_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
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
    lib.wb_rms_norm.argtypes = [p, lng, p, p, lng, i, i, f, i]
    lib.wb_rope.argtypes = [p, p, lng, p, p, p, lng, i, i, i, i]
    lib.wb_attention.argtypes = [p, p, lng, lng, p, p, i, i, i, i, i, f, i]
    lib.wb_moe_route.argtypes = [p, p, p, p, i, i, i, i, i, i, i, i, f, i, i]
    lib.wb_swiglu.argtypes = [p, p, p, i, i, i, i]
    lib.wb_row_stats.argtypes = [p, lng, i, i, p, p, p, i, i]
    lib.wb_mla_block.argtypes = [p, p, i, p, p, lng, p, p, p, p]
    lib.wb_ffn_block.argtypes = [p, p, i, p]
    lib.wb_eagle_chain.argtypes = [p, p, i, p, p, p, lng, p, i, f, p, p, p]
    return lib, f"{path} ({_ISA_NAMES.get(isa, f'wb_isa() {isa}')})"


def _lib():
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["why"] = _load()
    return _state["lib"]


def available() -> bool:
    """Whether the kernels are built and loaded here (building them on first call)."""
    return _lib() is not None


def status() -> str:
    """Whether the kernels serve eager steps here: the library's path, or why not."""
    _lib()
    return ("on: " if _state["lib"] is not None else "") + _state["why"]


def reset() -> None:
    """Forget the loaded library, so that the next call loads (or declines) afresh (tests)."""
    with _lock:
        _state.clear()


def serves(x: Tensor, rows: int | None = None) -> bool:
    """Whether a call on activations `x` [..., H] can go to these kernels: inference on the CPU (no
    autograd), fp32 or bf16, at most MAX_ROWS tokens a sequence (`rows`, else x's next-to-last
    dim) and MAX_BATCH_ROWS in all, and the library loaded."""
    if torch.is_grad_enabled() or not x.is_cpu or x.dtype not in _DTYPES:
        return False
    total = x.numel() // max(x.shape[-1], 1)
    per_sequence = rows if rows is not None else (x.shape[-2] if x.dim() >= 2 else 1)
    if per_sequence > MAX_ROWS or total > MAX_BATCH_ROWS:
        return False
    lib = _state.get("lib", False)
    return (_lib() if lib is False else lib) is not None


def _ints(values: Sequence[int]):
    """A C int array (a call's per-sequence counts or lengths; cheaper than a tensor for a few values)."""
    return (ctypes.c_int * len(values))(*values)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"workbench/kernels/cpu_kernels.cpp: {what} returned {rc}")


class PackedLinear:
    """A weight [N, K] packed for `wb_linear`: fp32 as [N/16][K][16], bf16 as [N/16][K/2][16][2]
    (pairs of k per lane, AVX512-BF16's dot-product layout), rows past N and a column past an odd K zero."""

    def __init__(self, weight: Tensor) -> None:
        w = weight.detach()
        if w.dtype not in _DTYPES or w.dim() != 2:
            raise ValueError(f"PackedLinear: expected a 2-D fp32 or bf16 weight, got {w.dtype} {tuple(w.shape)}")
        self.out_features, self.in_features = N, K = w.shape
        self.dtype = w.dtype
        Np = (N + 15) // 16 * 16
        Kp = K + (K % 2 if w.dtype == torch.bfloat16 else 0)
        padded = torch.zeros(Np, Kp, dtype=w.dtype)
        padded[:N, :K] = w
        if w.dtype == torch.bfloat16:
            self.data = padded.view(Np // 16, 16, Kp // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            self.data = padded.view(Np // 16, 16, Kp).transpose(1, 2).contiguous()
        self.k_padded = Kp

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x [..., K] @ W^T (+ residual [..., N]), in x's dtype (the weight's)."""
        if x.dtype != self.dtype:
            raise ValueError(f"PackedLinear: activations are {x.dtype}, the weight {self.dtype}")
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
        _check(_state["lib"].wb_linear(self.data.data_ptr(), x.data_ptr(), y.data_ptr(),
                                       None if r is None else r.data_ptr(), x.shape[0], N, self.k_padded,
                                       _DTYPES[x.dtype]), "wb_linear")
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


def row_stats(logits: Tensor, lse: bool = True) -> tuple[list[float], list[int], list[float]]:
    """Per row of logits [T, V] (fp32 or bf16): its max, the first index of it (ATen's argmax
    rule) and its log-sum-exp (the max again when `lse` is False), in fp32, as Python lists. A
    row with a NaN has max NaN; a softmax probability is exp(logit - lse). A greedy step's reads."""
    T, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    mx, out = torch.empty(T), torch.empty(T)
    arg = torch.empty(T, dtype=torch.int64)
    _check(_state["lib"].wb_row_stats(logits.data_ptr(), logits.stride(0), T, V, mx.data_ptr(), arg.data_ptr(),
                                      out.data_ptr(), int(lse), _DTYPES[logits.dtype]), "wb_row_stats")
    return mx.tolist(), arg.tolist(), out.tolist()


class _MlaPlan(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("w_a", "w_q", "w_o", "q_norm", "kv_norm")] + \
        [(n, ctypes.c_float) for n in ("q_eps", "kv_eps", "scale")] + \
        [(n, ctypes.c_int) for n in ("in_features", "hidden", "q_lora", "N", "L", "R", "dtype")]


class _FfnPlan(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("w_gate_up", "w_down", "router", "bias")] + \
        [(n, ctypes.c_int) for n in ("hidden", "groups", "inter", "experts", "n_group", "topk_group", "top_k", "norm",
                                     "sigmoid", "dtype")] + [("scaling", ctypes.c_float)]


class MlaBlock:
    """An absorbed-MLA attention in one call (`wb_mla_block`): normed x [T, in] -> o_proj's output,
    the T new cache rows written first. `a` maps x to [c_q or q | c_kv | k_pe's two halves], `q`
    maps the normed c_q to [q_lat per head (L) | q_pe's two halves per head] (None without q_lora),
    `o` maps the heads' latent outputs to the hidden size (`MLAttention._build_kernel_block`)."""

    def __init__(self, a: Tensor, q: Tensor | None, o: Tensor, q_norm: tuple[Tensor, float] | None,
                 kv_norm: tuple[Tensor, float], scale: float, heads: int, kv_lora: int, rope: int) -> None:
        self.a, self.o = PackedLinear(a), PackedLinear(o)
        self.q = PackedLinear(q) if q is not None else None
        self.norms = (q_norm[0].detach().contiguous() if q_norm is not None else None, kv_norm[0].detach().contiguous())
        self.dtype = a.dtype
        self.plan = _MlaPlan(self.a.data.data_ptr(), self.q.data.data_ptr() if self.q else None, self.o.data.data_ptr(),
                             self.norms[0].data_ptr() if self.q else None, self.norms[1].data_ptr(),
                             q_norm[1] if q_norm is not None else 0.0, kv_norm[1], scale, a.shape[1], o.shape[0],
                             q.shape[1] if self.q else 0, heads, kv_lora, rope, _DTYPES[a.dtype])

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
    router the first `experts` groups are routed and the rest (shared experts) weighted 1."""

    def __init__(self, gate_up: Tensor, down: Tensor, groups: int, router=None) -> None:
        self.gate_up, self.down = PackedLinear(gate_up), PackedLinear(down)
        self.dtype = gate_up.dtype
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
                             float(router.scaling) if router is not None else 1.0)

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
        [(n, ctypes.c_int) for n in ("hidden", "draft_vocab", "limit", "norm_before_residual", "norm_output", "dtype")]


class EagleChain:
    """An EAGLE-3 MLA draft's greedy chain in one call (`wb_eagle_chain`): from the fused state (fc
    over the verifier's aux states), the first pass over T new positions, k-1 passes each fed the
    last state and the previous proposal, and each head's argmax (through d2t) with its softmax
    probability: what the engine's `greedy_chain` computes, pass by pass the same kernels (so the
    same bits)."""

    def __init__(self, attn: MlaBlock, mlp: FfnBlock, norms: Sequence[tuple[Tensor, float]], embed: Tensor,
                 head: PackedLinear, d2t: Tensor | None, cos2: Tensor, sin2: Tensor, norm_before_residual: bool,
                 norm_output: bool) -> None:
        """norms: (weight, eps) of the input, hidden, post-attention and final norms."""
        self.parts = (attn, mlp, head)
        self.tensors = [w.detach().contiguous() for w, _ in norms] + [embed.detach().contiguous(), cos2, sin2]
        self.d2t = None if d2t is None else d2t.detach().to(torch.int64).contiguous()
        n_in, n_hid, n_post, n_fin, emb, cos, sin = (t.data_ptr() for t in self.tensors)
        self.dtype = embed.dtype
        self.limit = cos2.shape[0]
        self.plan = _EaglePlan(ctypes.addressof(attn.plan), ctypes.addressof(mlp.plan), n_in, n_hid, n_post, n_fin,
                               emb, head.data.data_ptr(), self.d2t.data_ptr() if self.d2t is not None else None, cos,
                               sin, *(eps for _, eps in norms), embed.shape[1], head.out_features, self.limit,
                               int(norm_before_residual), int(norm_output), _DTYPES[embed.dtype])

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
