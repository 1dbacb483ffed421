"""bf16 weights under fp32 activations on the CPU kernels (`load_pair(dtype="float32", weights="bf16")`).

The kernels widen each bf16 weight to fp32 (a 16-bit shift) and fma it with the fp32 activations
as the fp32 kernel does, so the linear is checked bit for bit against the fp32 kernel over the
bf16-rounded weights (and against float64 within fp32 rounding), row by row and at one and two
threads; a whole pair bit for bit against the fp32 kernels over its rounded weights, through every
block and the draft's chain; an AVX2 build against this CPU's; and decoding: speculative greedy
equals plain greedy with these weights, and agrees with the fp32 pair's on most prompts. With bf16
activations "bf16" is the native path.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.kernels.test_cpu_int8 import PROMPTS, SHAPES, U, dequantised_copy, random_pairs, weight  # noqa: F401
from tests.kernels.test_cpu_kernels import NATIVE_ISA, build, load_build
from tests.kernels.test_cpu_threads import assert_same, by_threads, model_outputs, pool  # noqa: F401 (fixture)
from workbench.kernels import cpu
from workbench.kernels.cpu_modules import KernelLinear

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels: {cpu.status()}")


def test_a_bf16_weight_linear_is_the_fp32_kernel_over_the_rounded_weights():
    gen = torch.Generator().manual_seed(13)
    for N, K in SHAPES:
        W = weight(N, K, gen)
        packed = cpu.PackedLinear(W, "bf16", torch.float32)
        rounded = W.bfloat16().float()  # round to nearest even, once
        assert packed.weights == "bf16" and packed.wtype == 4 and packed.dtype == torch.float32
        assert packed.data.dtype == torch.bfloat16 and packed.data.shape == ((N + 15) // 16, K, 16)
        assert torch.equal(packed.dequantised(), rounded)
        assert packed.nbytes == cpu.PackedLinear(W).nbytes // 2
        fp32 = cpu.PackedLinear(rounded)
        for M in (1, 2, 3, 4, 5, 17):
            x = torch.randn(M, K, generator=gen)
            y = packed(x)
            assert y.dtype == torch.float32 and y.shape == (M, N)
            assert torch.equal(y, fp32(x)), (N, K, M)
            xd, wd = x.double(), rounded.double()  # float64, fp32 fmas over K terms then the output's rounding
            err = (y.double() - xd @ wd.T).abs()
            assert (err <= (K + 2) * U * (xd.abs() @ wd.abs().T)).all(), (N, K, M)
            if K > 8:  # the activations were not rounded to bf16 (vdpbf16ps would): that is further off
                assert not torch.equal(y, fp32(x.bfloat16().float())), (N, K, M)
            assert torch.equal(torch.cat([packed(x[i:i + 1]) for i in range(M)]), y)  # each row alone
            r = torch.randn(M, N, generator=gen)
            assert torch.equal(packed(x, residual=r), y + r)


def test_a_bf16_weight_linear_gives_the_same_bits_at_one_and_two_threads(pool):  # noqa: F811 (the fixture)
    pool.wb_set_min_work(1)  # split every call with more than one column of 64 outputs
    gen = torch.Generator().manual_seed(6)
    cases = []
    for N, K in SHAPES:
        packed = cpu.PackedLinear(weight(N, K, gen), "bf16", torch.float32)
        cases += [(packed, torch.randn(M, K, generator=gen)) for M in (1, 3, 5, 17)]
    jobs = pool.wb_pool_jobs()
    assert_same(by_threads(lambda: [p(x) for p, x in cases], counts=(1, 2)), "bf16")
    assert pool.wb_pool_jobs() > jobs


def test_bf16_weights_under_bf16_activations_are_the_native_packing():
    W, x = torch.randn(40, 33), torch.randn(3, 33)
    packed = cpu.PackedLinear(W, "bf16", torch.bfloat16)
    native = cpu.PackedLinear(W.bfloat16())
    assert packed.weights == "native" and packed.wtype == native.wtype == 1
    assert torch.equal(packed(x.bfloat16()), native(x.bfloat16()))
    with pytest.raises(ValueError, match="activations are torch.bfloat16"):
        cpu.PackedLinear(W, "bf16")(x.bfloat16())
    lib, y = cpu._lib(), torch.empty(3, 40)
    bf16 = cpu.PackedLinear(W, "bf16")
    for dtype, wtype in ((1, 4), (0, 1)):  # bf16 weights need fp32 activations; wtype 1 is bf16 activations' own
        assert lib.wb_linear_w(bf16.data.data_ptr(), None, x.data_ptr(), y.data_ptr(), None, 3, 40, 33, dtype,
                               wtype) == -2
    assert lib.wb_linear_w(bf16.data.data_ptr(), None, x.data_ptr(), y.data_ptr(), None, 3, 40, 33, 0, 4) == 0
    assert torch.equal(y, bf16(x))


def test_a_bf16_weight_pair_is_the_fp32_kernels_over_its_rounded_weights(random_pairs):  # noqa: F811
    """Every output of the pair (prefill, verify, a ragged batch, the draft's one-call chain) equals,
    bit for bit, the fp32 kernels' over the same weights rounded to bf16 and back (the absorbed MLA
    products rounded once, from fp32, as packed)."""
    plain = random_pairs["float32"]
    pair = plain.with_weights("bf16")
    assert pair.weights == "bf16" and pair.dtype == torch.float32
    got, want = model_outputs(pair), model_outputs(dequantised_copy(pair))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and torch.equal(g, w), i
    fp32 = model_outputs(plain)
    assert not torch.equal(got[0], fp32[0])
    torch.testing.assert_close(got[0], fp32[0], rtol=0.05, atol=0.05)
    # a copy of the plain models with every linear's weights rounded to bf16: the same to fp32 rounding
    # (the absorbed MLA products are formed from the rounded weights there, rounded after here)
    rounded = wb.load_pair(plain.verifier_dir, plain.draft_dir, dtype="float32", fast="off")
    with torch.no_grad():
        for m in [*rounded.plain[0].modules(), *rounded.plain[1].modules()]:
            if isinstance(m, torch.nn.Linear):  # not the routers (fp32 in both), nor embeddings
                m.weight.copy_(m.weight.bfloat16().float())
    near = model_outputs(rounded.with_weights("native"))
    torch.testing.assert_close(got[0], near[0], rtol=0.02, atol=0.02)
    assert (got[0] - near[0]).abs().max() < (got[0] - fp32[0]).abs().max()


def test_bf16_weight_pairs_give_the_same_bits_at_one_and_two_threads(pool, random_pairs):  # noqa: F811
    pool.wb_set_min_work(1)
    pair = random_pairs["float32"].with_weights("bf16")
    jobs = pool.wb_pool_jobs()
    assert_same(by_threads(lambda: model_outputs(pair), counts=(1, 2)), "bf16")
    assert pool.wb_pool_jobs() > jobs


def test_an_avx2_build_gives_bf16_weights_the_native_builds_bits(tmp_path, monkeypatch, random_pairs):  # noqa: F811
    """The bf16-weight tiles widen each weight exactly and fma over k in order (no vdpbf16ps): an
    AVX2 build and an AVX-512 build without AVX512-BF16 give this CPU's bits."""
    builds = {"avx2": load_build(build(tmp_path, "avx2", "-march=x86-64-v3"), monkeypatch)}
    if NATIVE_ISA == 3:
        builds["no_bf16"] = load_build(build(tmp_path, "no_bf16", "-mno-avx512bf16"), monkeypatch)
    gen = torch.Generator().manual_seed(10)
    linears = [(cpu.PackedLinear(weight(N, K, gen), "bf16"), torch.randn(5, K, generator=gen)) for N, K in SHAPES]
    pair = random_pairs["float32"].with_weights("bf16")

    def outputs(lib):
        with monkeypatch.context() as m:
            m.setitem(cpu._state, "lib", lib)
            return [p(x) for p, x in linears] + model_outputs(pair)

    want = outputs(cpu._lib())
    for name, lib in builds.items():
        assert lib.wb_isa() == (1 if name == "avx2" else 2)
        for i, (g, w) in enumerate(zip(outputs(lib), want, strict=True)):
            assert torch.equal(g, w), (name, i)


def test_a_bf16_weight_pair_holds_bf16_beside_its_fp32_models():
    pair = wb.load_pair(dtype="float32", weights="bf16")
    assert pair.weights == "bf16" and pair.path.name == "cpu" and pair.dtype == torch.float32
    assert "bf16 weights, fp32 activations" in pair.status()
    v = pair.verifier
    head, attn, moe = v.lm_head, v.model.layers[0].self_attn, v.model.layers[1].mlp
    assert isinstance(head, KernelLinear) and head.packed.data.dtype == torch.bfloat16
    assert head.weight is pair.plain[0].lm_head.weight and head.weight.dtype == torch.float32
    assert attn.block.a.weights == attn.block.o.weights == "bf16" and attn.block.dtype == torch.float32
    assert moe.block.gate_up.weights == moe.block.down.weights == "bf16" and moe.block.dtype == torch.float32
    assert moe.block.router[0].dtype == torch.float32 and v.model.norm.weight.dtype == torch.float32
    assert pair.draft.part("lm_head").packed.weights == "bf16" and pair.draft.fc.packed.weights == "bf16"
    assert pair.with_weights("native").weights == "native" and pair.reference().weights == "native"
    # a bf16 pair's weights are bf16 already: "bf16" is its native path
    bf = wb.load_pair(dtype="bfloat16", weights="bf16")
    assert bf.weights == "native" and "bf16 weights" not in bf.status()
    assert bf.verifier.lm_head.packed.wtype == 1


def test_bf16_weights_exist_only_on_the_cpu_kernels():
    from workbench.fast import WEIGHTS as FAST_WEIGHTS
    from workbench.fast import choose

    assert FAST_WEIGHTS == cpu.WEIGHTS and "bf16" in FAST_WEIGHTS
    for fast in ("off", "compile"):
        with pytest.raises(ValueError, match=f"weights = 'bf16' needs the CPU kernels; fast = '{fast}'"):
            choose(fast, "cpu", torch.float32, weights="bf16")
    with pytest.raises(RuntimeError, match="not torch.float16 on cpu"):
        choose("cpu", "cpu", torch.float16, weights="bf16")
    assert choose("auto", "cpu", torch.float32, weights="bf16").weights == "bf16"
    assert choose("off", "cpu", torch.bfloat16, weights="bf16").name == "off"  # native: any path


def test_a_bf16_weight_pair_decodes_speculatively_as_it_decodes_plainly():
    pair = wb.load_pair(dtype="float32", weights="bf16")
    for prompt in PROMPTS:
        ar = wb.generate_autoregressive(pair, prompt, 40)
        assert len(ar.tokens) == 40
        for k in (1, 3):
            assert wb.SpecDecoder(pair, k).generate(prompt, 40).tokens == ar.tokens, (prompt, k)


def test_a_bf16_weight_pair_agrees_with_the_fp32_pair_on_most_prompts(embedded_pair):
    """On eight of the bench's prompts, 48 tokens each: most continuations identical to the fp32
    pair's, and nearly every token picked alike when fed its text. (Loose bounds: measured here
    8 of 8 identical, 100% of tokens; the bf16 pair, whose activations round too, 1 of 8 and 42%
    of the fp32 tokens before the first difference. The embedded checkpoint is stored in bf16, so
    here only the absorbed MLA products round; the random pairs above test weights that do.)"""
    from workbench.analysis.bench import greedy_agreement
    from workbench.cli import REPO, read_prompts

    prompts = read_prompts(REPO / "assets/prompts/code.jsonl", 8)
    a = greedy_agreement(wb.load_pair(dtype="float32", weights="bf16"), prompts, 48, reference=embedded_pair)
    assert a["reference_tokens"] == 8 * 48 and (a["weights"], a["dtype"]) == ("bf16", "float32")
    assert a["same_tokens"] >= 6, a
    assert a["prefix_share"] >= 0.8 and a["token_agreement"] >= 0.98, a


def test_the_weights_flag_takes_bf16(monkeypatch):
    from workbench import cli

    pair = cli._load(cli.build_parser().parse_args(["generate", "--prompt", "x", "--weights", "bf16", "--dtype",
                                                    "float32"]))
    assert pair.weights == "bf16" and pair.dtype == torch.float32
    assert cli._load(cli.build_parser().parse_args(["bench", "--weights", "bf16", "--dtype",
                                                    "bfloat16"])).weights == "native"
