"""
Split-KV MLA attention over the latent cache, for decode and speculative verification
=====================================================================================

Absorbed MLA (DeepSeek-V2/V3, Kimi-K2) is multi-query attention with one shared key/value
"head": each cache row is `[c_kv (L) | k_pe (R)]` (L = 512, R = 64 in the real models), the
scores are `q_lat . c_kv + q_pe . k_pe` and the values are c_kv itself. The math, the causal
rule and the empty-row convention are stated in `workbench/kernels/reference.py`, the
PyTorch twin that tests this kernel.

Algorithm (flash-decoding with split KV, LightLLM -> SGLang -> vLLM lineage):

* Rows are (query token, head) pairs: row r of sequence b is token s = r // H, head h = r % H,
  so the Sq = k+1 verification tokens fill the tensor-core M dimension next to the heads
  (FlashMLA's trick) and one program reads each KV tile once for BLOCK_R rows. Row r sees
  cache positions t < seq_lens[b] - (Sq - 1 - s) (bottom-right-aligned causal mask).
* Stage 1, grid (B, cdiv(Sq*H, BLOCK_R), NUM_KV_SPLITS): each program takes one slice of
  [0, seq_len) and runs an online softmax (fp32, base 2) over BLOCK_N-token tiles. The latent
  tile is loaded once and used for both the scores (`tl.trans`) and the values. It writes an
  fp32 partial output normalised by its own sum plus that split's log-sum-exp.
* Stage 2, grid (B, cdiv(Sq*H, BLOCK_M)): merge the splits of each row with the LSE rule
  out = sum_i exp(lse_i - m) o_i / sum_i exp(lse_i - m), lse = m + log sum_i exp(lse_i - m).
  With one split, stage 1 writes the final output directly and stage 2 is skipped.

Contiguous caches `[B, S_max, L+R]` and paged caches `[num_blocks, page, L+R]` + block table
go through the same kernel (`PAGED` constexpr). Splits trade SM occupancy at low batch for
fp32 partial traffic at high batch; `choose_num_kv_splits` says how.

CPU: under `TRITON_INTERPRET=1` (set before triton is imported) the same kernels run in
numpy. The interpreter stores bf16 as raw bits, so loads are upcast to fp32 there (`UPCAST`);
on the GPU 16-bit tiles stay 16-bit for the tensor cores and fp32 inputs use IEEE dots.

References:
* Dao et al., "Flash-Decoding for long-context inference" (2023); Milakov & Gimelshein,
  "Online normalizer calculation for softmax" (arXiv:1805.02867).
* DeepSeek-AI, "DeepSeek-V2" (arXiv:2405.04434), weight absorption for MLA.
* sgl-project/sglang `triton_ops/decode_attention.py` (`_fwd_grouped_kernel_stage1/2`),
  vllm-project/vllm `v1/attention/ops/triton_decode_attention.py`,
  deepseek-ai/FlashMLA (s_q folded into the head rows), flagos-ai/FlagGems `fused/flash_mla.py`
  (latent tile reused for V, BLOCK_H 64 on Hopper).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from workbench.kernels.reference import MLAShapes, check_mla_inputs, check_mla_values

# The interpreter is chosen when @triton.jit runs, i.e. when this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
LN2 = tl.constexpr(0.6931471805599453)  # log(2): the kernel's base-2 LSE -> natural log
LOG2E = tl.constexpr(1.4426950408889634)  # 1/log(2): scores scaled once so the loop uses exp2
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (Q load, partial write) dominates
MAX_KV_SPLITS = 64  # SGLang/vLLM tuning tables top out at 32-64 splits for MLA


# %%
# Stage 1: one (sequence, row block, KV split) per program.


@triton.jit
def _attend_kv_range(acc, l_i, m_i, q_lat, q_pe, cache_base, block_table_row,
                     start, end, row_limit, qk_scale,
                     KV_LORA, ROPE, PAGE_SIZE,
                     stride_c_page, stride_c_tok, stride_c_d, stride_bt_p,
                     BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
                     PAGED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over tokens [start, end); returns the running (acc, l_i, m_i)."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_p = tl.arange(0, BLOCK_P)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        tok_valid = offs_n < end
        if PAGED:  # token t lives at cache[block_table[t // page], t % page]
            page = tl.load(block_table_row + (offs_n // PAGE_SIZE) * stride_bt_p,
                           mask=tok_valid, other=0).to(tl.int64)
            row_off = page * stride_c_page + (offs_n % PAGE_SIZE).to(tl.int64) * stride_c_tok
        else:  # cache_base already points at this sequence's rows
            row_off = offs_n.to(tl.int64) * stride_c_tok
        row_ptrs = cache_base + row_off[:, None]
        # one load of the latent tile serves as K (transposed) and as V
        kv = tl.load(row_ptrs + offs_l[None, :] * stride_c_d,
                     mask=tok_valid[:, None] & (offs_l[None, :] < KV_LORA), other=0.0)
        k_pe = tl.load(row_ptrs + (KV_LORA + offs_p[None, :]) * stride_c_d,
                       mask=tok_valid[:, None] & (offs_p[None, :] < ROPE), other=0.0)
        if UPCAST:
            kv = kv.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        qk = tl.dot(q_lat, tl.trans(kv), input_precision=DOT_PRECISION)
        qk = tl.dot(q_pe, tl.trans(k_pe), qk, input_precision=DOT_PRECISION)
        qk = qk * qk_scale  # base-2 logits: sm_scale * log2(e) * q.k
        visible = tok_valid[None, :] & (offs_n[None, :] < row_limit[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Q_LEN and NUM_KV_SPLITS only set bounds outside the KV loop; specialising on the value 1 (as
# Triton does by default) would double the binaries (decode and verification, one split or
# several: compiled on the GPU at first use, and in the AOT tests) for no speed.
@triton.jit(do_not_specialize=["Q_LEN", "NUM_KV_SPLITS"])
def _mla_split_kernel(
    # pointers
    QLat, QPe, Cache, BlockTable, SeqLens, Out, Lse,
    # sizes
    sm_scale, Q_LEN, HEADS, KV_LORA, ROPE, PAGE_SIZE, CAPACITY, NUM_KV_SPLITS,
    # strides
    stride_ql_b, stride_ql_s, stride_ql_h, stride_ql_d,
    stride_qp_b, stride_qp_s, stride_qp_h, stride_qp_d,
    stride_c_page, stride_c_tok, stride_c_d,
    stride_bt_b, stride_bt_p,
    stride_o_b, stride_o_s, stride_o_h, stride_o_split, stride_o_d,
    stride_lse_b, stride_lse_s, stride_lse_h, stride_lse_split,
    # meta-parameters
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
    PAGED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # long: one kernel, in the order Triton's tutorials write theirs (offsets, loads, online softmax, store)
    pid_b = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_split = tl.program_id(2)

    # the cache can hold CAPACITY tokens; clamping keeps a bad seq_len from reading past it
    seq_len = tl.minimum(tl.load(SeqLens + pid_b).to(tl.int32), CAPACITY)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_valid = offs_r < Q_LEN * HEADS
    offs_s = offs_r // HEADS
    offs_h = offs_r % HEADS
    row_limit = tl.where(row_valid, seq_len - (Q_LEN - 1 - offs_s), 0)

    # this split's slice of [0, seq_len), a whole number of tiles, cut at the last visible key
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_KV_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_split * split_len
    end = tl.minimum(start + split_len, tl.max(row_limit, 0))

    offs_l = tl.arange(0, BLOCK_L)
    offs_p = tl.arange(0, BLOCK_P)
    q_rows = pid_b.to(tl.int64) * stride_ql_b + offs_s * stride_ql_s + offs_h * stride_ql_h
    q_lat = tl.load(QLat + q_rows[:, None] + offs_l[None, :] * stride_ql_d,
                    mask=row_valid[:, None] & (offs_l[None, :] < KV_LORA), other=0.0)
    q_rows = pid_b.to(tl.int64) * stride_qp_b + offs_s * stride_qp_s + offs_h * stride_qp_h
    q_pe = tl.load(QPe + q_rows[:, None] + offs_p[None, :] * stride_qp_d,
                   mask=row_valid[:, None] & (offs_p[None, :] < ROPE), other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    if PAGED:
        cache_base = Cache
    else:
        cache_base = Cache + pid_b.to(tl.int64) * stride_c_page
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_L], dtype=tl.float32)
    acc, l_i, m_i = _attend_kv_range(
        acc, l_i, m_i, q_lat, q_pe, cache_base, BlockTable + pid_b * stride_bt_b,
        start, end, row_limit, sm_scale * LOG2E,
        KV_LORA, ROPE, PAGE_SIZE, stride_c_page, stride_c_tok, stride_c_d, stride_bt_p,
        BLOCK_N, BLOCK_L, BLOCK_P, PAGED, UPCAST, DOT_PRECISION)

    # epilogue: normalised partial output and natural-log LSE; empty rows -> 0 and -inf
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2, float("-inf"))
    o_rows = pid_b.to(tl.int64) * stride_o_b + offs_s * stride_o_s + offs_h * stride_o_h \
        + pid_split * stride_o_split
    tl.store(Out + o_rows[:, None] + offs_l[None, :] * stride_o_d,
             out.to(Out.dtype.element_ty),
             mask=row_valid[:, None] & (offs_l[None, :] < KV_LORA))
    lse_rows = pid_b.to(tl.int64) * stride_lse_b + offs_s * stride_lse_s + offs_h * stride_lse_h \
        + pid_split * stride_lse_split
    tl.store(Lse + lse_rows, lse, mask=row_valid)


# %%
# Stage 2: merge the splits of BLOCK_M (query token, head) rows of one sequence.


@triton.jit(do_not_specialize=["Q_LEN"])  # as in stage 1: one binary for every Sq
def _mla_merge_kernel(
    # pointers
    MidO, MidLse, Out, Lse,
    # sizes
    Q_LEN, HEADS, KV_LORA, NUM_KV_SPLITS,
    # strides
    stride_mo_b, stride_mo_s, stride_mo_h, stride_mo_split, stride_mo_d,
    stride_ml_b, stride_ml_s, stride_ml_h, stride_ml_split,
    stride_o_b, stride_o_s, stride_o_h, stride_o_d,
    stride_lse_b, stride_lse_s, stride_lse_h,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_r = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_r < Q_LEN * HEADS
    offs_s = offs_r // HEADS
    offs_h = offs_r % HEADS
    offs_l = tl.arange(0, BLOCK_L)
    tile_mask = row_valid[:, None] & (offs_l[None, :] < KV_LORA)
    lse_ptrs = MidLse + pid_b.to(tl.int64) * stride_ml_b + offs_s * stride_ml_s \
        + offs_h * stride_ml_h
    mo_ptrs = MidO + pid_b.to(tl.int64) * stride_mo_b + offs_s[:, None] * stride_mo_s \
        + offs_h[:, None] * stride_mo_h + offs_l[None, :] * stride_mo_d

    # online merge over splits; an empty split has lse -inf, weight 0 and a stored 0 output
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    for i in range(0, NUM_KV_SPLITS):
        lse_i = tl.load(lse_ptrs + i * stride_ml_split, mask=row_valid, other=float("-inf"))
        o_i = tl.load(mo_ptrs + i * stride_mo_split, mask=tile_mask, other=0.0)
        m_new = tl.maximum(m_i, lse_i)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every split so far empty
        alpha = tl.exp(m_i - m_safe)
        w = tl.exp(lse_i - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * o_i
        l_i = l_i * alpha + w
        m_i = m_new
    has_keys = l_i > 0.0
    l_div = tl.where(has_keys, l_i, 1.0)
    out = acc / l_div[:, None]
    lse = tl.where(has_keys, m_i + tl.log(l_div), float("-inf"))
    o_ptrs = Out + pid_b.to(tl.int64) * stride_o_b + offs_s[:, None] * stride_o_s \
        + offs_h[:, None] * stride_o_h + offs_l[None, :] * stride_o_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=tile_mask)
    tl.store(Lse + pid_b.to(tl.int64) * stride_lse_b + offs_s * stride_lse_s
             + offs_h * stride_lse_h, lse, mask=row_valid)


# %%
# Launch parameters, chosen by plain functions (multi-config autotune needs a GPU to run).


@functools.lru_cache(maxsize=None)
def _cuda_props(index: int) -> tuple[int, tuple[int, int]]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, (props.major, props.minor)


def _device_props(device: torch.device) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability); small stand-ins off the GPU (interpreter)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())
    return 4, (0, 0)


# What the config lists promise, per compute-capability major. `workbench/kernels/aot.py`
# compiles every variant the wrapper launches for sm_80, sm_90 and sm_100 (tests/kernels/
# test_aot.py) and holds the FIRST config of each list to these, so on those GPUs the launcher
# never falls back (the fallbacks serve smaller parts, and tiles nobody has measured).
# Shared memory: the smallest opt-in per-block maximum of the family, so one list serves it all:
# 8.x includes sm_86/sm_89 (99 KB; sm_80 has 163 KB), 9.0 and 10.0 have 227 KB.
SHARED_MEMORY_BUDGET = {8: 99 * 1024, 9: 227 * 1024, 10: 227 * 1024}
# Spills: none. A spill is a local-memory store and load per KV tile (L1 at best, DRAM at worst)
# in a loop that should only stream the cache.
MAX_SPILL_BYTES = 0


def config_budget(capability: tuple[int, int]) -> dict:
    """The claim each list's first config must meet on `capability`: shared bytes and spills."""
    return dict(shared_bytes=SHARED_MEMORY_BUDGET[capability[0]], spill_bytes=MAX_SPILL_BYTES)


def stage1_configs(rows: int, kv_lora: int, dtype: torch.dtype,
                   capability: tuple[int, int]) -> list[dict]:
    """Block sizes for stage 1, best first; later entries are fallbacks if the first
    does not fit in shared memory/registers (checked at launch, see `_launch_stage1`).

    The first entry meets `config_budget` on sm_80, sm_90 and sm_100 (no spills), which the
    AOT tests check by compiling for those targets with the pinned Triton (`bench-kernels
    --aot` prints the table). Triton 3.9, L = 512, R = 64, 16-bit, 64 heads:
    * BLOCK_R 32: a [64, 512] fp32 accumulator (BLOCK_R 64, one program and one KV read for
      all 64 heads of a Kimi-K2 row group) spills at 8 warps on every target: sm_90 255
      registers and 280 B of spill stores per thread (216 KB shared; BLOCK_N 32: 76 B;
      16 warps: 624 B), sm_100 20-92 B. The two row blocks of 64 heads run side by side and
      share each KV tile through L2.
    * sm_90 and sm_100: BLOCK_N 64, 8 warps: 178-252 registers, no spills, 112 KB shared.
    * sm_80: BLOCK_N 32, 8 warps: 169-186 registers, no spills, 74 KB (4 warps: 72 B spilled),
      so it also fits the 99 KB of sm_86/sm_89.
    * fp32 (IEEE dots on FMA units, tiles twice as wide): BLOCK_R 16, BLOCK_N 16, 8 warps,
      73 KB (BLOCK_N 32 spills 8 B on sm_90 and 104 B on sm_80).
    Not yet timed on a GPU: spill-free is the compile-time proxy for "streams at bandwidth".
    """
    block_l = max(16, triton.next_power_of_2(kv_lora))
    block_r = max(16, min(32, triton.next_power_of_2(rows)))
    if capability == (0, 0):  # interpreter: 32 rows so CPU tests cover several row blocks
        return [dict(BLOCK_R=block_r, BLOCK_N=32, num_warps=4, num_stages=1)]
    if dtype == torch.float32:
        block_r, block_n = 16, 16
    elif capability[0] >= 9:  # 227 KB of shared memory per block
        block_n = 64
    else:  # Ampere/Ada: 99-163 KB
        block_n = 32 if block_l >= 256 else 64
    warps = 8 if block_r * block_l >= 64 * 128 or dtype == torch.float32 else 4
    configs = [
        dict(BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps, num_stages=2),
        dict(BLOCK_R=block_r, BLOCK_N=32, num_warps=warps, num_stages=2),
        dict(BLOCK_R=block_r, BLOCK_N=16, num_warps=warps, num_stages=1),
        dict(BLOCK_R=block_r, BLOCK_N=16, num_warps=4, num_stages=1),
        dict(BLOCK_R=16, BLOCK_N=16, num_warps=4, num_stages=1),
    ]
    return [c for i, c in enumerate(configs) if c not in configs[:i]]


def choose_num_kv_splits(batch: int, row_blocks: int, capacity: int, num_sms: int) -> int:
    """Splits per sequence: enough programs to cover the SMs once, each split >= 256 tokens.

    Uses the cache capacity rather than max(seq_lens) so choosing costs no device sync.
    Kimi-K2 (H=64, Sq=1: 2 row blocks of 32) on 132 SMs: B=1 -> 4/16/64 splits at
    1k/4k/16k, B=8 -> 8, B=32 -> 2, B>=64 -> 1; with Sq=4 (8 row blocks) B>=16 -> 1.
    """
    by_sms = max(1, num_sms // max(1, batch * row_blocks))
    by_ctx = max(1, capacity // MIN_TOKENS_PER_SPLIT)
    return int(min(by_sms, by_ctx, MAX_KV_SPLITS))


def default_num_kv_splits(batch: int, q_len: int, heads: int, kv_lora: int, capacity: int,
                          dtype: torch.dtype, device: torch.device) -> int:
    """The split count `mla_attention_triton` uses when `num_kv_splits` is None."""
    num_sms, capability = _device_props(device)
    block_r = stage1_configs(q_len * heads, kv_lora, dtype, capability)[0]["BLOCK_R"]
    return choose_num_kv_splits(batch, triton.cdiv(q_len * heads, block_r), capacity, num_sms)


_CONFIG_CACHE: dict[tuple, dict] = {}


def _launch_stage1(grid, key: tuple, configs: list[dict], args: tuple, meta: dict) -> dict:
    """Launch with the first config that compiles within the device's resources."""
    if key in _CONFIG_CACHE:
        configs = [_CONFIG_CACHE[key]]
    last_error: Exception | None = None
    for cfg in configs:
        try:
            _mla_split_kernel[grid(cfg)](*args, **meta, **cfg)
        except OutOfResources as err:  # too much shared memory/registers: try smaller tiles
            last_error = err
            continue
        _CONFIG_CACHE[key] = cfg
        return cfg
    raise RuntimeError(f"workbench/kernels/triton_mla.py: no stage-1 config fits this "
                       f"device for {key}: {last_error}")


# %%
# The wrapper: check constraints -> allocate -> launch.


@dataclass
class LaunchPlan:
    """Everything `mla_attention_triton` launches for one call, built without launching.

    `workbench/kernels/aot.py` compiles exactly these arguments for GPUs that are not here,
    so an AOT compile and a real launch see the same kernel specialisation.
    """
    out: torch.Tensor
    lse: torch.Tensor
    configs: list[dict]  # stage-1 block sizes, best first
    key: tuple  # what `_CONFIG_CACHE` remembers the chosen config under
    grid: Callable[[dict], tuple[int, int, int]]  # stage-1 grid for a config
    stage1_args: tuple
    stage1_meta: dict  # constexprs besides the config's
    merge_grid: tuple[int, int] | None  # None: one split, stage 1 writes `out` itself
    merge_args: tuple = ()
    merge_meta: dict = field(default_factory=dict)


def plan_launch(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                seq_lens: torch.Tensor, sm_scale: float, block_table: torch.Tensor | None,
                num_kv_splits: int | None, shapes: MLAShapes, num_sms: int,
                capability: tuple[int, int]) -> LaunchPlan:
    """Allocate the outputs and partials and build both kernels' arguments for `capability`."""
    batch, q_len, heads, kv_lora = q_lat.shape
    rows = q_len * heads
    device = q_lat.device
    configs = stage1_configs(rows, kv_lora, q_lat.dtype, capability)
    if num_kv_splits is None:
        row_blocks = triton.cdiv(rows, configs[0]["BLOCK_R"])
        num_kv_splits = choose_num_kv_splits(batch, row_blocks, shapes.capacity, num_sms)

    out = torch.empty_like(q_lat)
    lse = torch.empty((batch, q_len, heads), dtype=torch.float32, device=device)
    if num_kv_splits == 1:  # stage 1 writes the final result; stage 2 is not needed
        mid_o, mid_lse = out.unsqueeze(3), lse.unsqueeze(3)
    else:
        mid_o = torch.empty((batch, q_len, heads, num_kv_splits, kv_lora),
                            dtype=torch.float32, device=device)
        mid_lse = torch.empty((batch, q_len, heads, num_kv_splits),
                              dtype=torch.float32, device=device)

    block_table_arg = block_table if block_table is not None else seq_lens  # never read
    bt_strides = block_table.stride() if block_table is not None else (0, 0)
    block_l = max(16, triton.next_power_of_2(kv_lora))
    args = (
        q_lat, q_pe, cache, block_table_arg, seq_lens, mid_o, mid_lse,
        float(sm_scale), q_len, heads, kv_lora, shapes.rope, shapes.page_size, shapes.capacity,
        num_kv_splits,
        *q_lat.stride(), *q_pe.stride(), *cache.stride(), *bt_strides,
        *mid_o.stride(), *mid_lse.stride(),
    )
    meta = dict(BLOCK_L=block_l, BLOCK_P=max(16, triton.next_power_of_2(shapes.rope)),
                PAGED=shapes.paged, UPCAST=INTERPRETED,
                DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32")
    plan = LaunchPlan(
        out=out, lse=lse, configs=configs,
        key=(capability, q_lat.dtype, rows, kv_lora, shapes.rope, shapes.paged),
        grid=lambda cfg: (batch, triton.cdiv(rows, cfg["BLOCK_R"]), num_kv_splits),
        stage1_args=args, stage1_meta=meta, merge_grid=None)
    if num_kv_splits > 1:
        # [8, 512] fp32 tiles keep registers low on the GPU; the interpreter prefers big tiles
        block_m = 64 if INTERPRETED else 8
        plan.merge_grid = (batch, triton.cdiv(rows, block_m))
        plan.merge_args = (mid_o, mid_lse, out, lse, q_len, heads, kv_lora, num_kv_splits,
                           *mid_o.stride(), *mid_lse.stride(), *out.stride(), *lse.stride())
        plan.merge_meta = dict(BLOCK_M=block_m, BLOCK_L=block_l, num_warps=4)
    return plan


def mla_attention_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         seq_lens: torch.Tensor, sm_scale: float, *,
                         block_table: torch.Tensor | None = None,
                         num_kv_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton MLA attention; same contract as `reference.mla_attention_torch`.

    Returns (out [B, Sq, H, L] in q_lat's dtype, lse [B, Sq, H] fp32, natural log).
    A row with no visible key gets out 0 and lse -inf. On CUDA nothing here syncs:
    seq_lens values are not checked on the host (the kernel clamps them to the cache
    capacity so a bad value cannot read out of bounds).
    """
    # 1. check constraints
    shapes = check_mla_inputs(q_lat, q_pe, cache, seq_lens, block_table)
    device = q_lat.device
    if device.type == "cpu":
        if not INTERPRETED:
            raise RuntimeError("workbench/kernels/triton_mla.py: CPU tensors need the Triton "
                               "interpreter; set TRITON_INTERPRET=1 before triton is imported")
        check_mla_values(shapes, cache, seq_lens, block_table)  # cheap on CPU
    if num_kv_splits is not None and not (isinstance(num_kv_splits, int) and num_kv_splits >= 1):
        raise ValueError(f"workbench/kernels/triton_mla.py: num_kv_splits must be an int "
                         f">= 1 or None, got {num_kv_splits!r}")
    # 2. allocate and build the arguments, 3. launch
    num_sms, capability = _device_props(device)
    plan = plan_launch(q_lat, q_pe, cache, seq_lens, sm_scale, block_table, num_kv_splits,
                       shapes, num_sms, capability)
    _launch_stage1(plan.grid, plan.key, plan.configs, plan.stage1_args, plan.stage1_meta)
    if plan.merge_grid is not None:
        _mla_merge_kernel[plan.merge_grid](*plan.merge_args, **plan.merge_meta)
    return plan.out, plan.lse


# %%
# Cost model (FlashMLA's bench_flash_mla.py formulas; partial buffers not counted).


def mla_bytes(batch: int, context: int, q_len: int, heads: int, kv_lora: int, rope: int,
              elem_bytes: int = 2) -> int:
    """Bytes a perfect kernel moves: KV once + Q + O = e*(B*S*(L+R) + B*Sq*H*(L+R) + B*Sq*H*L)."""
    d_qk = kv_lora + rope
    return elem_bytes * (batch * context * d_qk + batch * q_len * heads * d_qk
                         + batch * q_len * heads * kv_lora)


def mla_flops(batch: int, context: int, q_len: int, heads: int, kv_lora: int, rope: int) -> int:
    """FLOPs = B*Sq*H*S*2*(d_qk + d_v): QK^T over L+R, PV over L (masking ignored)."""
    return batch * q_len * heads * context * 2 * (kv_lora + rope + kv_lora)


# %%
# Benchmark (GPU only): `python -m workbench.kernels.triton_mla`; the fuller table with
# copy bandwidth, TFLOP/s and FlashInfer is `workbench bench-kernels`.

if __name__ == "__main__":
    from workbench.kernels.reference import mla_attention_torch

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU; see workbench/kernels/bench.py")

    @triton.testing.perf_report([
        triton.testing.Benchmark(
            x_names=["context"], x_vals=[512, 1024, 2048, 4096, 8192, 16384],
            line_arg="provider", line_vals=["triton", "torch"], line_names=["Triton", "Torch twin"],
            styles=[("red", "-"), ("blue", "-")], ylabel="GB/s",
            plot_name=f"mla-attention-B{batch}-Sq{q_len}-H64-bf16",
            args={"batch": batch, "q_len": q_len})
        for batch in (1, 32) for q_len in (1, 4)
    ])
    def bench_mla(context: int, provider: str, batch: int, q_len: int):
        heads, kv_lora, rope, dev = 64, 512, 64, "cuda"
        q_lat = torch.randn(batch, q_len, heads, kv_lora, device=dev, dtype=torch.bfloat16)
        q_pe = torch.randn(batch, q_len, heads, rope, device=dev, dtype=torch.bfloat16)
        cache = torch.randn(batch, context, kv_lora + rope, device=dev, dtype=torch.bfloat16)
        seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
        fn = mla_attention_triton if provider == "triton" else mla_attention_torch
        ms, lo, hi = triton.testing.do_bench(lambda: fn(q_lat, q_pe, cache, seq_lens, 0.1),
                                             quantiles=[0.5, 0.2, 0.8])
        gbps = lambda t: mla_bytes(batch, context, q_len, heads, kv_lora, rope) / (t * 1e-3) / 1e9
        return gbps(ms), gbps(hi), gbps(lo)

    bench_mla.run(print_data=True)
