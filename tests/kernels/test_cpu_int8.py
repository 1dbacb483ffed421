"""int8 weights on the CPU kernels (`load_pair(..., weights="int8")`, or "int8-b32").

The linear is checked against a float64 computation of the same math (int8 weights times their
scales, against the activations, summed in fp32) within fp32's rounding, row by row and thread
count by thread count bit for bit; the packing's quantisation error against half a scale; an
"int8-b32" pair, whose kernels form each weight as q * scale in fp32, against the fp32 kernels
over those dequantised weights, bit for bit through every block and the draft's chain (which
checks each plan's scales and the experts' offsets); an AVX2 build against this CPU's; and whole
pairs: speculative decoding equals plain decoding with the same int8 weights (losslessness), and
agrees with the fp32 pair on most tokens.
"""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.kernels.test_cpu_kernels import NATIVE_ISA, build, load_build
from tests.kernels.test_cpu_threads import assert_same, by_threads, model_outputs, pool  # noqa: F401 (fixture)
from workbench.kernels import cpu
from workbench.kernels.cpu_modules import KernelEagle3Draft, KernelLinear, KernelMLAttention, KernelMLP, KernelMoE

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels: {cpu.status()}")
WEIGHTS = ("int8", "int8-b32")
DTYPES = (torch.float32, torch.bfloat16)
U = 2.0 ** -24  # fp32's unit roundoff
# (N, K): N past a multiple of 16, K past a multiple of 32 (a short last block), odd K, a 1 x 2
SHAPES = [(192, 256), (100, 96), (33, 70), (17, 10), (40, 7), (1, 2), (2048, 256)]
PROMPTS = ['def parse_header(line):\n    """Split a header line into a name and a value."""',
           'class Stack:\n    """A last-in first-out stack."""']


def weight(N: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of different magnitudes, and an outlier in a row: what the scales are for."""
    w = torch.randn(N, K, generator=gen) * torch.randn(N, 1, generator=gen).exp()
    w[N // 2, K // 3] *= 20
    return w


def same_math(packed: cpu.PackedLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 linear in float64, and how far fp32 rounding may take the kernel from it: "int8"
    multiplies each output's sum of q * x by its scale, "int8-b32" sums (q * scale rounded to fp32)
    * x (`PackedLinear.dequantised`); fp32 fmas over K terms, then the output's rounding."""
    q, s = packed.int8()
    xd = x.double()
    if packed.weights == "int8":
        terms = xd.abs() @ q.double().abs().T * s.double().T
        want = xd @ q.double().T * s.double().T
    else:
        w = packed.dequantised().double()
        terms, want = xd.abs() @ w.abs().T, xd @ w.T
    bound = (x.shape[1] + 2) * U * terms + U * want.abs()
    if packed.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (want.abs() + bound)
    return want, bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_int8_linear_is_its_dequantised_matmul_to_fp32_rounding(weights, dtype):
    gen = torch.Generator().manual_seed(11)
    for N, K in SHAPES:
        W = weight(N, K, gen)
        packed = cpu.PackedLinear(W, weights, dtype)
        S = 1 if weights == "int8" else (K + 31) // 32
        assert packed.data.dtype == torch.int8 and packed.data.shape == ((N + 15) // 16, K, 16)
        assert packed.scale.dtype == torch.float32 and packed.scale.shape == ((N + 15) // 16, S, 16)
        wide = cpu.PackedLinear(W, weights, torch.float32)
        for M in (1, 2, 3, 4, 5, 17):
            x = torch.randn(M, K, generator=gen).to(dtype)
            y = packed(x)
            assert y.dtype == dtype and y.shape == (M, N)
            want, bound = same_math(packed, x)
            err = (y.double() - want).abs()
            assert (err <= bound).all(), (weights, dtype, N, K, M, float((err / bound).max()))
            torch_fp32 = F.linear(x.float(), packed.dequantised()).double()  # torch's own rounding of it
            assert ((y.double() - torch_fp32).abs() <= 2 * bound).all()
            assert torch.equal(torch.cat([packed(x[i:i + 1]) for i in range(M)]), y)  # each row alone
            r = torch.randn(M, N, generator=gen).to(dtype)
            assert torch.equal(packed(x, residual=r), y + r)  # rounded, then added and rounded
            if dtype == torch.bfloat16:  # bf16 activations are widened exactly: the fp32 sums, rounded once
                assert torch.equal(y, wide(x.float()).bfloat16())


@pytest.mark.parametrize("weights", WEIGHTS)
def test_int8_linear_gives_the_same_bits_at_one_and_two_threads(pool, weights):  # noqa: F811 (the fixture)
    pool.wb_set_min_work(1)  # split every call with more than one column of 64 outputs
    gen = torch.Generator().manual_seed(5)
    cases = []
    for N, K in SHAPES:
        W = weight(N, K, gen)
        for dtype in DTYPES:
            packed = cpu.PackedLinear(W, weights, dtype)
            cases += [(packed, torch.randn(M, K, generator=gen).to(dtype)) for M in (1, 3, 5, 17)]
    jobs = pool.wb_pool_jobs()
    assert_same(by_threads(lambda: [p(x) for p, x in cases], counts=(1, 2)), weights)
    assert pool.wb_pool_jobs() > jobs


@pytest.mark.parametrize("weights", WEIGHTS)
def test_the_packed_weights_are_within_half_a_scale(weights):
    gen = torch.Generator().manual_seed(2)
    N, K = 37, 70  # 3 blocks of 16 outputs (11 rows of padding), 3 blocks of 32 inputs (the last of 6)
    W = weight(N, K, gen)
    W[5] = 0.0  # a row of zeros: scale 0, q 0
    packed = cpu.PackedLinear(W, weights)
    q, s = packed.int8()
    g = K if weights == "int8" else 32
    groups = F.pad(W, (0, -K % g)).view(N, -1, g)
    assert torch.equal(s, groups.abs().amax(-1) / 127)  # the largest |w| of each group over 127
    per_weight = s.repeat_interleave(g, 1)[:, :K]
    err = (W.double() - q.double() * per_weight.double()).abs()
    assert (err <= per_weight.double() / 2 * (1 + 1e-6)).all()
    assert torch.equal(F.pad(q, (0, -K % g)).view(N, -1, g).abs().amax(-1)[s > 0], torch.full_like(s[s > 0], 127,
                                                                                                       dtype=torch.int8))
    assert not q[5].any() and not s[5].any() and not packed(torch.randn(2, K))[:, 5].any()
    assert not packed.data[2, :, 5:].any() and not packed.scale[2, :, 5:].any()  # padded rows: zeros
    assert torch.equal(packed.dequantised(), q.float() * per_weight)
    if weights == "int8-b32":  # the outlier coarsens its own block of 32 only
        row, col = N // 2, K // 3
        assert s[row, col // 32] > 5 * s[row].min()
    assert packed.nbytes < cpu.PackedLinear(W).nbytes / 3  # a byte a weight, and a few scales, against fp32's 4


def test_bad_weight_types_and_calls_refuse():
    W, x = torch.randn(40, 32), torch.randn(2, 32)
    with pytest.raises(ValueError, match="weights = 'int4'; expected one of native, int8, int8-b32, bf16"):
        cpu.PackedLinear(W, "int4")
    with pytest.raises(ValueError, match="activations are torch.bfloat16"):
        cpu.PackedLinear(W, "int8")(x.bfloat16())
    with pytest.raises(ValueError, match="finite"):
        cpu.PackedLinear(torch.full((16, 4), float("inf")), "int8")
    packed, y = cpu.PackedLinear(W, "int8"), torch.empty(2, 40)
    lib = cpu._lib()
    assert lib.wb_linear_w(packed.data.data_ptr(), None, x.data_ptr(), y.data_ptr(), None, 2, 40, 32, 0, 2) == -2
    assert lib.wb_linear_w(packed.data.data_ptr(), packed.scale_ptr, x.data_ptr(), y.data_ptr(), None, 2, 40, 32, 0,
                           1) == -2  # bf16 weights under fp32 activations
    assert lib.wb_linear_w(packed.data.data_ptr(), packed.scale_ptr, x.data_ptr(), y.data_ptr(), None, 2, 40, 32, 0,
                           2) == 0 and torch.equal(y, packed(x))


# ---- pairs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_pairs(tmp_path_factory):
    from tests.helpers import make_random_pair

    vdir, ddir = make_random_pair(tmp_path_factory.mktemp("int8"), seed=4, layers=3, aux_layer_ids=(0, 1, 2))
    return {dt: wb.load_pair(vdir, ddir, dtype=dt, fast="off") for dt in ("float32", "bfloat16")}


def dequantised_copy(pair: wb.ModelPair) -> wb.ModelPair:
    """`pair` (int8 weights) with every packed weight replaced by fp32 native packing of its
    dequantised values, through the same blocks and plans (the draft's chain rebuilt from them)."""
    fast = pair._on(pair.path)  # fresh twins, not shared with `pair`
    seen = set()
    for m in [*fast.verifier.modules(), *fast.draft.modules()]:
        if id(m) in seen:
            continue
        seen.add(id(m))
        if isinstance(m, KernelLinear):
            m.packed = cpu.PackedLinear(m.packed.dequantised())
        elif isinstance(m, KernelMLAttention):
            b, p = m.block, m.block.plan
            m.block = cpu.MlaBlock(b.a.dequantised(), b.q.dequantised() if b.q else None, b.o.dequantised(),
                                   (b.norms[0], p.q_eps) if b.q else None, (b.norms[1], p.kv_eps), p.scale, p.N, p.L,
                                   p.R)
        elif isinstance(m, KernelMoE):
            b = m.block
            m.block = cpu.FfnBlock(b.gate_up.dequantised(), b.down.dequantised(), b.plan.groups, router=m.gate)
        elif isinstance(m, KernelMLP):
            b = m.block  # packed on first use
            m._block = cpu.FfnBlock(b.gate_up.dequantised(), b.down.dequantised(), 1)
        elif isinstance(m, KernelEagle3Draft):
            m.chain = None
    return fast


def test_an_int8_b32_pair_is_the_fp32_kernels_over_its_dequantised_weights(random_pairs):
    """"int8-b32" forms each weight as q * scale in fp32 and sums as the fp32 kernels do: every
    output of the pair (prefill, verify, a ragged batch, the draft's one-call chain) equals, bit for
    bit, the fp32 kernels' over the dequantised weights. A wrong scale pointer, an expert's weights
    or scales read at another's offset, or the chain's head packed apart would show here."""
    pair = random_pairs["float32"].with_weights("int8-b32")
    assert pair.weights == "int8-b32" and type(pair.draft) is KernelEagle3Draft
    got, want = model_outputs(pair), model_outputs(dequantised_copy(pair))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), i
    plain = model_outputs(random_pairs["float32"])  # the unquantised models: close, not equal
    assert not torch.equal(got[0], plain[0])
    torch.testing.assert_close(got[0], plain[0], rtol=0.1, atol=0.1)
    # "int8" applies its scale to each output's sum: the same to fp32 rounding
    per_channel = pair.with_weights("int8")
    for g, w in zip(model_outputs(per_channel), model_outputs(dequantised_copy(per_channel)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_int8_pairs_give_the_same_bits_at_one_and_two_threads(pool, random_pairs, weights):  # noqa: F811
    pool.wb_set_min_work(1)
    for dt, plain in random_pairs.items():
        pair = plain.with_weights(weights)
        jobs = pool.wb_pool_jobs()
        assert_same(by_threads(lambda: model_outputs(pair), counts=(1, 2)), (weights, dt))
        assert pool.wb_pool_jobs() > jobs


def test_an_avx2_build_gives_int8_the_native_builds_bits(tmp_path, monkeypatch, random_pairs):
    """The int8 tiles widen each weight exactly and fma over k in order on 16 lanes, in either ISA's
    registers, and no vdpbf16ps: an AVX2 build (and an AVX-512 build without AVX512-BF16) gives
    this CPU's own bits for int8 linears and int8 pairs, fp32 and bf16 activations alike."""
    builds = {"avx2": load_build(build(tmp_path, "avx2", "-march=x86-64-v3"), monkeypatch)}
    if NATIVE_ISA == 3:
        builds["no_bf16"] = load_build(build(tmp_path, "no_bf16", "-mno-avx512bf16"), monkeypatch)
    gen = torch.Generator().manual_seed(9)
    linears = [(cpu.PackedLinear(weight(N, K, gen), w, dt), torch.randn(5, K, generator=gen).to(dt))
               for N, K in SHAPES for w in WEIGHTS for dt in DTYPES]
    pairs = [p.with_weights(w) for p in random_pairs.values() for w in WEIGHTS]

    def outputs(lib):
        with monkeypatch.context() as m:
            m.setitem(cpu._state, "lib", lib)
            return [p(x) for p, x in linears] + [t for pair in pairs for t in model_outputs(pair)]

    want = outputs(cpu._lib())
    for name, lib in builds.items():
        assert lib.wb_isa() == (1 if name == "avx2" else 2)
        for i, (g, w) in enumerate(zip(outputs(lib), want, strict=True)):
            assert g.dtype == w.dtype and torch.equal(g, w), (name, i)


def test_an_int8_pair_holds_int8_beside_its_plain_models():
    pair = wb.load_pair(dtype="bfloat16", weights="int8")
    assert pair.weights == "int8" and pair.path.name == "cpu"
    assert "int8 weights (a scale per output channel)" in pair.status()
    v = pair.verifier
    head, attn = v.lm_head, v.model.layers[0].self_attn
    assert isinstance(head, KernelLinear) and head.packed.data.dtype == torch.int8
    assert head.weight is pair.plain[0].lm_head.weight and head.weight.dtype == torch.bfloat16  # the plain weight stays
    assert attn.block.a.weights == attn.block.o.weights == "int8" and attn.block.dtype == torch.bfloat16
    moe = v.model.layers[1].mlp
    assert moe.block.gate_up.weights == "int8" and moe.block.router[0].dtype == torch.float32  # the router stays fp32
    assert type(v.model.embed_tokens) is torch.nn.Embedding  # embeddings stay
    assert pair.draft.part("lm_head").packed.weights == "int8" and pair.draft.fc.packed.weights == "int8"
    assert pair.reference().weights == "native" and pair.with_weights("native").weights == "native"
    assert pair.variant(draft={"norm_output": not pair.plain[1].norm_output}).weights == "int8"
    assert pair.with_weights("int8-b32").status().count("per output channel and 32 inputs") == 1


def test_int8_weights_exist_only_on_the_cpu_kernels():
    from workbench.fast import WEIGHTS as FAST_WEIGHTS
    from workbench.fast import choose

    assert FAST_WEIGHTS == cpu.WEIGHTS
    for fast in ("off", "compile"):
        with pytest.raises(ValueError, match=f"weights = 'int8' needs the CPU kernels; fast = '{fast}'"):
            choose(fast, "cpu", torch.float32, weights="int8")
    with pytest.raises(ValueError, match="attention 'triton' runs the plain weights"):
        choose("auto", "cpu", torch.float32, "triton", weights="int8")
    with pytest.raises(RuntimeError, match="not torch.float16 on cpu"):
        choose("cpu", "cpu", torch.float16, weights="int8-b32")
    with pytest.raises(ValueError, match="weights = 'q4'"):
        choose("auto", "cpu", torch.float32, weights="q4")
    assert choose("auto", "cpu", torch.float32, weights="int8").weights == "int8"
    pair = wb.load_pair(dtype="float32", weights="int8-b32")
    with pytest.raises(ValueError, match="needs the CPU kernels"):
        pair.compile()


@pytest.mark.parametrize("dtype, weights", [("float32", "int8"), ("bfloat16", "int8-b32"), ("bfloat16", "int8"),
                                            ("float32", "int8-b32")])
def test_an_int8_pair_decodes_speculatively_as_it_decodes_plainly(dtype, weights):
    """Losslessness with int8 weights: every kernel computes a row alone, so a verify's rows are a
    decode's, and greedy speculative output equals plain decoding with the same weights exactly."""
    pair = wb.load_pair(dtype=dtype, weights=weights)
    for prompt in PROMPTS:
        ar = wb.generate_autoregressive(pair, prompt, 40)
        assert len(ar.tokens) == 40
        for k in (1, 3):
            assert wb.SpecDecoder(pair, k).generate(prompt, 40).tokens == ar.tokens, (prompt, k)


@pytest.mark.parametrize("dtype, weights", [("float32", "int8"), ("float32", "int8-b32"), ("bfloat16", "int8")])
def test_an_int8_pair_agrees_with_the_fp32_pair_on_most_tokens(embedded_pair, dtype, weights):
    """On four of the bench's prompts: fed the fp32 pair's greedy text, the int8 pair picks the same
    next token at >= 90% of the positions (>= 85% with bf16 activations, whose own rounding moves
    near-ties); with fp32 activations at least half of the fp32 tokens come before the first
    difference. (Loose bounds: measured here 99% and 70-80%; a wrong scale or packing gives noise.)"""
    from workbench.analysis.bench import greedy_agreement
    from workbench.cli import REPO, read_prompts

    prompts = read_prompts(REPO / "assets/prompts/code.jsonl", 4)
    pair = wb.load_pair(dtype=dtype, weights=weights)
    a = greedy_agreement(pair, prompts, 48, reference=embedded_pair)
    assert a["reference_tokens"] == 4 * 48 and a["weights"] == weights
    assert a["token_agreement"] >= (0.9 if dtype == "float32" else 0.85), a
    if dtype == "float32":
        assert a["prefix_share"] >= 0.5, a
    same = greedy_agreement(embedded_pair, prompts[:2], 24, reference=embedded_pair)  # the figures' own scale
    assert (same["same_tokens"], same["prefix_share"], same["token_agreement"]) == (2, 1.0, 1.0)


def test_the_weights_flag_reaches_the_pair(monkeypatch):
    import sys

    from workbench import cli

    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--weights", "int8", "--dtype", "bfloat16"])
    pair = cli._load(args)
    assert pair.weights == "int8" and pair.dtype == torch.bfloat16
    seen = []
    monkeypatch.setattr(wb, "load_pair", lambda **kw: seen.append(kw["weights"]))
    for cmd in (["bench"], ["sweep"], ["doctor"], ["generate", "--prompt", "x"]):
        cli._load(cli.build_parser().parse_args([*cmd, "--weights", "int8-b32"]))
    cli._load(cli.build_parser().parse_args(["bench"]))
    assert seen == ["int8-b32"] * 4 + ["native"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--weights", "int4"])
    monkeypatch.undo()
    sys.path.insert(0, str(cli.APPS))
    try:
        from chat_app.session import ChatApp, PairSpec

        assert ChatApp(PairSpec(weights="int8")).pair().weights == "int8"
        pytest.importorskip("gradio")
        import chat

        assert chat.parse_args(["--weights", "int8-b32"]).weights == "int8-b32"
    finally:
        sys.path.remove(str(cli.APPS))
