"""The Triton MLA kernel against its PyTorch twin, and the twin against a brute-force loop.

On CPU the kernel runs under the Triton interpreter, so shapes are tiny (B <= 3, L = 64,
S <= 200). Unused cache slots and block-table entries are poisoned (NaN rows, page ids far
out of range), so any read past a sequence's length shows up as NaN or an indexing error.
"""
import os

import torch

if not torch.cuda.is_available():  # must precede the first `import triton` anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

import workbench.kernels as kernels  # noqa: E402
from workbench.kernels import mla_attention, resolve_backend, triton_available  # noqa: E402
from workbench.kernels.reference import mla_attention_torch  # noqa: E402

SM_SCALE = 0.3  # arbitrary; the model's 1/sqrt(192)*mscale^2 is just another number here
POISON_PAGE = 10**6  # block-table filler past a sequence's pages: out of range if ever used

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton does not import here")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_case(seq_lens, q_len, heads, kv_lora=64, rope=16, dtype=torch.float32, paged=False,
              page=16, s_max=200, device="cpu", seed=0):
    """Random MLA inputs with every slot past seq_lens poisoned."""
    gen = torch.Generator().manual_seed(seed)
    batch, width = len(seq_lens), kv_lora + rope

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    case = dict(q_lat=randn(batch, q_len, heads, kv_lora), q_pe=randn(batch, q_len, heads, rope),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=None)
    if not paged:
        cache = torch.full((batch, s_max, width), float("nan"), dtype=dtype)
        for b, n in enumerate(seq_lens):
            cache[b, :n] = randn(n, width)
    else:
        pages_per_seq = -(-s_max // page)
        num_blocks = batch * pages_per_seq + 3  # a few pages nobody owns
        cache = torch.full((num_blocks, page, width), float("nan"), dtype=dtype)
        owner = torch.randperm(num_blocks, generator=gen)[: batch * pages_per_seq]
        table = owner.view(batch, pages_per_seq).to(torch.int32)
        for b, n in enumerate(seq_lens):
            used = -(-n // page)
            for j in range(used):
                rows = min(page, n - j * page)
                cache[table[b, j], :rows] = randn(rows, width)
            table[b, used:] = POISON_PAGE
        case["block_table"] = table
    case["cache"] = cache
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in case.items()}


def brute_force(case, sm_scale):
    """The math written out per (b, s, h) in fp64, straight from the docstring's rule."""
    q_lat, q_pe, cache = case["q_lat"].double(), case["q_pe"].double(), case["cache"].double()
    batch, q_len, heads, kv_lora = q_lat.shape
    out = torch.zeros(batch, q_len, heads, kv_lora, dtype=torch.float64)
    lse = torch.full((batch, q_len, heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        n = int(case["seq_lens"][b])
        if case["block_table"] is None:
            rows = cache[b, :n]
        else:
            page = cache.shape[1]
            rows = torch.stack([cache[int(case["block_table"][b, t // page]), t % page]
                                for t in range(n)]) if n else cache[:0, 0]
        for s in range(q_len):
            visible = n - (q_len - 1 - s)  # this token sees positions [0, visible)
            for h in range(heads):
                if visible <= 0:
                    continue
                keys = rows[:visible]
                scores = sm_scale * (keys[:, :kv_lora] @ q_lat[b, s, h]
                                     + keys[:, kv_lora:] @ q_pe[b, s, h])
                lse[b, s, h] = torch.logsumexp(scores, 0)
                out[b, s, h] = torch.softmax(scores, 0) @ keys[:, :kv_lora]
    return out, lse


def call(fn, case, **kw):
    return fn(case["q_lat"], case["q_pe"], case["cache"], case["seq_lens"], SM_SCALE,
              block_table=case["block_table"], **kw)


# %%
# The twin is the oracle, so check it first.


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_twin_matches_brute_force(paged, q_len):
    case = make_case([1, 37, 70], q_len, heads=4, paged=paged, s_max=80)
    out, lse = call(mla_attention_torch, case)
    ref_out, ref_lse = brute_force(case, SM_SCALE)
    # fp32 twin vs fp64 loop: sums of ~80 products of O(1) values, errors ~1e-6
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    if q_len == 3:  # seq_len 1 < Sq: its first two query tokens see nothing
        assert torch.isinf(lse[0, :2]).all() and (out[0, :2] == 0).all()


def test_twin_keeps_dtype_and_handles_empty_batch():
    case = make_case([0, 0], 2, heads=4, dtype=torch.float16)
    out, lse = call(mla_attention_torch, case)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("bad, match", [
    (dict(q_pe=torch.zeros(3, 1, 4, 16)), "q_pe"),
    (dict(cache=torch.zeros(3, 200, 70)), "cache"),
    (dict(seq_lens=torch.tensor([1, 2, 201], dtype=torch.int32)), "seq_lens"),
    (dict(seq_lens=torch.tensor([1.0, 2.0, 3.0])), "seq_lens"),
    (dict(q_pe=torch.zeros(3, 2, 4, 16, dtype=torch.float16)), "dtype"),
])
def test_bad_inputs_name_the_tensor(bad, match):
    case = {**make_case([1, 2, 3], 2, heads=4), **bad}
    with pytest.raises(ValueError, match=match):
        call(mla_attention_torch, case)


def test_bad_block_table_entry_is_reported():
    case = make_case([20, 5], 1, heads=4, paged=True, s_max=32)
    case["block_table"][0, 1] = case["cache"].shape[0]  # in use (tokens 16..19), out of range
    with pytest.raises(ValueError, match="block_table"):
        call(mla_attention_torch, case)


# %%
# The Triton kernel against the twin (CPU: interpreter).

# fp32: the interpreter does true fp32 math, same as the twin; only summation order differs.
# fp16: inputs identical, math fp32 in both; the outputs differ by at most one fp16 rounding
# step (2^-10 relative), so 2e-3 absolute on O(1) values. lse stays fp32 in both.
TOL = {torch.float32: dict(out=1e-5, lse=1e-5), torch.float16: dict(out=2e-3, lse=1e-4)}

KERNEL_CASES = [  # (dtype, q_len, heads, rope, paged, num_kv_splits)
    (torch.float32, 1, 16, 16, False, None),
    (torch.float32, 1, 4, 32, True, 3),
    (torch.float32, 2, 16, 16, True, 7),
    (torch.float32, 4, 16, 32, False, 2),
    (torch.float32, 4, 4, 16, True, None),
    (torch.float32, 3, 16, 16, True, 4),  # 48 rows: a full and a half-empty row block
    (torch.float16, 1, 16, 32, True, None),
    (torch.float16, 2, 4, 16, False, 3),
    (torch.float16, 4, 16, 16, True, 5),
    (torch.float16, 4, 4, 32, False, None),
]


@needs_triton
@pytest.mark.parametrize("dtype, q_len, heads, rope, paged, splits", KERNEL_CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_kernel_matches_twin(dtype, q_len, heads, rope, paged, splits):
    from workbench.kernels.triton_mla import mla_attention_triton

    # 1 and 2 are shorter than q_len for some rows; 77 and 200 are not multiples of the tile
    case = make_case([1, 77, 200] if q_len != 2 else [2, 131], q_len, heads, rope=rope,
                     dtype=dtype, paged=paged, seed=q_len * 100 + heads)
    out, lse = call(mla_attention_triton, case, num_kv_splits=splits)
    ref_out, ref_lse = call(mla_attention_torch, case)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype]["out"], rtol=TOL[dtype]["out"])
    torch.testing.assert_close(lse, ref_lse, atol=TOL[dtype]["lse"], rtol=TOL[dtype]["lse"])


@needs_triton
@pytest.mark.parametrize("splits", [1, 2])  # 1: stage 1 stores bf16; 2: the merge does
def test_kernel_bf16_matches_twin(splits):
    """Under the interpreter bf16 is raw bits; without the fp32 upcast this is garbage."""
    from workbench.kernels.triton_mla import mla_attention_triton

    case = make_case([5, 100], 2, heads=4, dtype=torch.bfloat16, paged=True, s_max=112)
    out, lse = call(mla_attention_triton, case, num_kv_splits=splits)
    ref_out, ref_lse = call(mla_attention_torch, case)
    # one bf16 rounding step (2^-7 relative) on outputs up to ~3
    torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@needs_triton
def test_split_count_does_not_change_the_result():
    from workbench.kernels.triton_mla import mla_attention_triton

    case = make_case([150, 9], 2, heads=4, paged=True, s_max=160)
    outs = [call(mla_attention_triton, case, num_kv_splits=n) for n in (1, 2, 6)]
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, outs[0][1], atol=1e-5, rtol=1e-5)


# %%
# Dispatch.


def test_resolve_backend(monkeypatch):
    assert resolve_backend("torch", "cpu") == "torch"
    assert resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")


@needs_triton
def test_dispatch_runs_both_backends(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = make_case([9, 30], 2, heads=4, s_max=32)
    twin = call(mla_attention, case, backend="torch")
    kern = call(mla_attention, case, backend="triton")
    torch.testing.assert_close(kern[0], twin[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kern[1], twin[1], atol=1e-5, rtol=1e-5)
    # importing the kernel module must not shadow the dispatcher of the same idea
    assert callable(kernels.mla_attention) and kernels.mla_attention is mla_attention


def test_package_imports_without_triton():
    code = ("import sys; import workbench.kernels as k; "
            "assert 'triton' not in sys.modules, 'workbench.kernels imported triton eagerly'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# %%
# Benchmark CLI and the GPU-only check.


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_without_gpu_says_so(capsys):
    from workbench.kernels.bench_cli import main

    assert main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@needs_cuda
@needs_triton
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_kernel_bf16_kimi_shape_on_gpu(paged, q_len):
    from workbench.kernels.triton_mla import mla_attention_triton

    case = make_case([1000, 333, 3], q_len, heads=64, kv_lora=512, rope=64, dtype=torch.bfloat16,
                     paged=paged, page=64, s_max=1024, device="cuda")
    case["q_lat"], case["q_pe"] = case["q_lat"] / 4, case["q_pe"] / 4  # O(1) logits
    out, lse = call(mla_attention_triton, case)
    ref_out, ref_lse = call(mla_attention_torch, case)
    # bf16 tensor-core dots (p rounded to bf16 before P@V) against fp32 math on bf16 inputs
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)
