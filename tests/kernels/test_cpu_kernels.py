"""The CPU kernels (`workbench.kernels.cpu`) against the models' own PyTorch code.

Each kernel is checked against the reference it replaces (fp32 to ~1e-6, bf16 bit for bit where
the kernel rounds at the same points as torch does), every kernel that takes several rows must give
each row the same bits as a call on that row alone (the property that makes a verify round as a
decode does), and the cached, packed weights must follow the models' weights and switches.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.helpers import CHAIN_IDS, draft_chain_runs
from workbench.decoding.drafters import greedy_chain
from workbench.kernels import cpu
from workbench.kernels.cpu_modules import RopeTables, rope_rows
from workbench.kernels.reference import mla_attention_torch
from workbench.models.norm import RMSNorm
from workbench.models.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels: {cpu.status()}")
DTYPES = (torch.float32, torch.bfloat16)
REPO = Path(__file__).resolve().parents[2]
NATIVE_ISA = cpu._lib().wb_isa() if cpu.available() else 0  # 1 AVX2+FMA, 2 AVX-512, 3 AVX-512 + AVX512-BF16


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs() / (want.double().abs() + 1)).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K", [(192, 256), (100, 96), (33, 8), (17, 10), (1, 2)])
def test_linear_is_a_matmul_whose_rows_do_not_depend_on_each_other(dtype, N, K):
    gen = torch.Generator().manual_seed(N * K)
    W = torch.randn(N, K, generator=gen).to(dtype)
    packed = cpu.PackedLinear(W)
    for M in (1, 3, 4, 5, 16):
        x = torch.randn(M, K, generator=gen).to(dtype)
        y = packed(x)
        assert y.dtype == dtype and y.shape == (M, N)
        # fp32: one rounding per fma; bf16: products exact in fp32, one rounding of the sum
        assert rel_err(y, F.linear(x.double(), W.double())) < (5e-5 if dtype == torch.float32 else 8e-3)
        assert torch.equal(torch.cat([packed(x[i:i + 1]) for i in range(M)]), y)
        r = torch.randn(M, N, generator=gen).to(dtype)
        assert torch.equal(packed(x, residual=r), y + r)  # rounded, then added and rounded, as `r + linear(x)`


def test_linear_handles_an_odd_width_in_bf16_and_refuses_a_dtype_mismatch():
    W = torch.randn(40, 7).bfloat16()
    x = torch.randn(2, 7).bfloat16()
    assert rel_err(cpu.PackedLinear(W)(x), F.linear(x.double(), W.double())) < 8e-3
    with pytest.raises(ValueError, match="activations are torch.float32"):
        cpu.PackedLinear(W)(x.float())


def build(tmp_path: Path, name: str, *flags: str) -> Path:
    """The kernels' source compiled with cpu.FLAGS and then `flags` (a later -march wins)."""
    so = tmp_path / f"{name}.so"
    out = subprocess.run([cpu._compiler(), *cpu.FLAGS, *flags, str(cpu.SOURCE), "-o", str(so)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return so


def load_build(so: Path, monkeypatch) -> ctypes.CDLL:
    """A build at `so`, loaded and declared as cpu.py loads its own."""
    with monkeypatch.context() as m:
        m.setattr(cpu, "library_path", lambda: so)
        lib, why = cpu._load()
    assert lib is not None, why
    return lib


def test_the_bf16_fallback_without_avx512_bf16_instructions_agrees(tmp_path):
    """CPUs without AVX512-BF16 (AVX-512 without it, or AVX2) build the same source without
    `vdpbf16ps`: pairs of products as two fmas. Compiled so here and called directly, it must
    agree with the reference."""
    so = build(tmp_path, "no_bf16", "-mno-avx512bf16")
    lib = ctypes.CDLL(str(so))
    assert lib.wb_isa() == min(NATIVE_ISA, 2)  # AVX-512 without BF16 (2), or this AVX2 CPU's own build (1)
    W, x = torch.randn(50, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    packed = cpu.PackedLinear(W)
    y = torch.empty(3, 50, dtype=torch.bfloat16)
    lib.wb_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    assert lib.wb_linear(packed.data.data_ptr(), x.data_ptr(), y.data_ptr(), None, 3, 50, 64, 1) == 0
    assert rel_err(y, F.linear(x.double(), W.double())) < 8e-3


def kernel_outputs(pair, seed: int = 0) -> list:
    """Every kernel on random inputs (odd sizes, so that the tails are used), through cpu.py's
    wrappers and through the models' blocks and the draft's one-call chain, in the pair's dtype."""
    dtype = pair.verifier.model.embed_tokens.weight.dtype
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    outs = []
    for N, K, M in ((192, 256, 1), (100, 96, 4), (33, 10, 5), (17, 2, 3)):
        packed = cpu.PackedLinear(rand(N, K))
        x = rand(M, K)
        outs += [packed(x), packed(x, residual=rand(M, N))]
    outs.append(cpu.rms_norm(rand(5, 72, scale=3), rand(72), 1e-6))
    a, b = rand(4, 3, 16), rand(4, 3, 16)
    outs.append(cpu.rope(a, b, rand(4, 16), rand(4, 16)))
    for T, heads, L, R, start in ((4, 4, 64, 16, 40), (3, 2, 20, 6, 13)):
        rows = rand(start + T, L + R)
        outs.append(cpu.attention(rand(T, heads, L), rand(T, heads, R), rows, start, 0.3))
    h = rand(3, 5 * 2 * 40, scale=3)
    w = torch.rand(3, 5, generator=gen)
    w[:, 0] = 0.0
    outs += [cpu.swiglu(h, 5, w), cpu.swiglu(h[:, :80], 1)]
    outs += [torch.tensor(v) for v in cpu.row_stats(rand(4, 1000, scale=3))]
    logits = rand(4, 1000, scale=3)  # the training loss's cross-entropy: losses, and the gradient in place
    outs += [cpu.xent_grad_(logits, torch.tensor([0, 5, 999, 500]), 0.25), logits]
    target = torch.softmax(torch.randn(4, 1000, generator=gen), -1)  # the draft's TTT loss (fp32 only)
    outs += list(cpu.soft_xent_grad(logits.float() * 2, target, torch.tensor([1.0, 0.5, 0.0, 2.0])))
    router = pair.verifier.model.layers[-1].mlp.gate
    outs.append(cpu.moe_route(rand(6, router.weight.shape[1]), router, extra=1))
    v, d = pair.verifier, pair.draft
    with torch.inference_mode():
        cache = v.new_cache(64)
        out = v(torch.tensor([[5, 9, 200, 31, 7, 77, 3]]), cache)
        outs += [out.logits, v(torch.tensor([[11, 12, 13, 14]]), cache).logits, cache.valid()]
        dcache = d.new_cache(64)
        outs += list(d.run_greedy_chain(greedy_chain, torch.tensor([[9, 200, 31, 7, 77, 3, 42]]), out.aux_hidden_states,
                                        dcache, 4))
        outs.append(dcache.valid())
    return [t.detach().clone() for t in outs]


def test_an_avx2_build_gives_the_native_builds_bits(tmp_path, monkeypatch, pairs):
    """The kernels are written once over 16 lanes (one zmm, or two ymm): an AVX2+FMA build must
    give every output the same bits as this CPU's own build. On an AVX2 CPU that is the native
    build compiled for x86-64-v3; on an AVX-512 CPU the AVX2 build against the AVX-512 one, and
    in bf16, where vdpbf16ps adds a pair's products in its own order, against the AVX-512 build
    without AVX512-BF16 (and close to the native one)."""
    native = cpu._lib()
    avx2 = load_build(build(tmp_path, "avx2", "-march=x86-64-v3"), monkeypatch)
    assert avx2.wb_isa() == 1
    no_bf16 = native if NATIVE_ISA < 3 else load_build(build(tmp_path, "no_bf16", "-mno-avx512bf16"), monkeypatch)

    def outputs(lib, pair):
        with monkeypatch.context() as m:
            m.setitem(cpu._state, "lib", lib)
            return kernel_outputs(pair)

    for dt, pair in pairs.items():
        want = outputs(no_bf16 if dt == "bfloat16" else native, pair)
        got = outputs(avx2, pair)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.dtype == w.dtype and torch.equal(g, w), (dt, i)
        if no_bf16 is not native and dt == "bfloat16":
            for g, w in zip(got, outputs(native, pair)):
                torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_the_models_rmsnorm(dtype):
    norm = RMSNorm(72, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(5, 72) * 3).to(dtype)
    with torch.enable_grad():  # the module's own torch arithmetic
        want = norm(x).detach()
    got = cpu.rms_norm(x, norm.weight.detach(), 1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    out = torch.full((5, 100), float("nan"), dtype=dtype)  # strided rows in and out: a cache row's slice
    cpu.rms_norm(x, norm.weight.detach(), 1e-6, out=out[:, 10:82])
    assert torch.equal(out[:, 10:82], got) and out[:, :10].isnan().all() and out[:, 82:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_from_two_projection_rows_is_the_rotary_embedding(dtype, interleave):
    rot = RotaryEmbedding(16, 50000.0, {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}, interleave)
    w = torch.randn(3 * 16, 24)  # three heads' rope rows of a projection
    x = torch.randn(4, 24)
    pos = torch.tensor([[3, 4, 5, 90]])
    cos, sin = rot.cos_sin(pos, dtype)
    want = rot(F.linear(x, w).to(dtype).view(1, 4, 3, 16), cos, sin)[0]
    halves = [rope_rows(rot, w[16 * h:16 * (h + 1)]) for h in range(3)]
    a = F.linear(x, torch.cat([p for p, _ in halves])).to(dtype).view(4, 3, 16)
    b = F.linear(x, torch.cat([q for _, q in halves])).to(dtype).view(4, 3, 16)
    cos2, sin2 = RopeTables(rot).at(pos[0], dtype, 128)
    assert torch.equal(cpu.rope(a, b, cos2, sin2), want)  # the same products and sums


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, heads, L, R, start", [(1, 4, 64, 16, 30), (4, 4, 64, 16, 100), (4, 2, 32, 8, 7),
                                                    (3, 1, 20, 6, 0)])
def test_attention_is_the_reference_twin_row_by_row(dtype, T, heads, L, R, start):
    gen = torch.Generator().manual_seed(start + T)
    rows = torch.full((start + T + 9, L + R), float("nan")).to(dtype)  # slots past the sequence: NaN
    rows[:start + T] = torch.randn(start + T, L + R, generator=gen).to(dtype)
    q_lat = torch.randn(T, heads, L, generator=gen).to(dtype)
    q_pe = torch.randn(T, heads, R, generator=gen).to(dtype)
    got = cpu.attention(q_lat, q_pe, rows, start, 0.3)
    want, _ = mla_attention_torch(q_lat[None], q_pe[None], rows[None], torch.tensor([start + T], dtype=torch.int32),
                                  0.3, max_seq_len=start + T)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want[0].float(), rtol=tol, atol=tol)
    alone = torch.cat([cpu.attention(q_lat[t:t + 1], q_pe[t:t + 1], rows, start + t, 0.3) for t in range(T)])
    assert torch.equal(alone, got)


def test_moe_route_is_the_router():
    pair = wb.load_pair(dtype="float32")
    gen = torch.Generator().manual_seed(0)
    for layer in pair.verifier.model.layers[1:4]:
        router = layer.mlp.gate
        x = torch.randn(6, 256, generator=gen)
        weights, ids = router(x)
        dense = torch.zeros(6, 8).scatter(1, ids, weights)
        got = cpu.moe_route(x, router, extra=1)
        torch.testing.assert_close(got[:, :8], dense, rtol=1e-6, atol=1e-6)
        assert torch.equal(got[:, :8] > 0, dense > 0) and torch.equal(got[:, 8], torch.ones(6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_weights_each_group_and_zero_weights_give_exact_zeros(dtype):
    h = (torch.randn(3, 5 * 2 * 40) * 3).to(dtype)
    h[0, 0] = float("inf")  # in a group whose weight is 0: must not leak a NaN
    w = torch.rand(3, 5)
    w[:, 0] = 0.0
    g = h.view(3, 5, 2, 40)
    act = F.silu(g[:, :, 0]) * g[:, :, 1]
    want = torch.where(w[:, :, None] > 0, act.float() * w[:, :, None], 0.0).to(dtype).view(3, -1)
    got = cpu.swiglu(h, 5, w)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=3e-6, atol=3e-6)
    torch.testing.assert_close(cpu.swiglu(h[:, :80], 1).float(), (F.silu(h[:, :40]) * h[:, 40:80]).float(),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_stats_are_max_first_argmax_and_logsumexp(dtype):
    x = (torch.randn(4, 1000) * 3).to(dtype)
    x[2, 700] = x[2, 100] = x[2].max() + 1  # a tie: the first index, as ATen's argmax
    mx, arg, lse = cpu.row_stats(x)
    ref = x.float()
    assert arg == ref.argmax(-1).tolist() and arg[2] == 100 and mx == ref.amax(-1).tolist()
    torch.testing.assert_close(torch.tensor(lse), torch.logsumexp(ref, -1), rtol=1e-6, atol=1e-6)
    y = x.clone()
    y[1, 7], y[3, 9] = float("nan"), float("inf")
    mx = cpu.row_stats(y, lse=False)[0]
    assert mx[1] != mx[1] and mx[3] == float("inf")  # NaN and +inf surface in the max
    assert cpu.row_stats(torch.full((1, 10), float("-inf"), dtype=dtype)) == ([float("-inf")], [0], [float("-inf")])
    at = [3, 999, 100, 0]  # each row's logit at an index too (a greedy acceptance's proposals), in the same call
    *stats, picked = cpu.row_stats(x, at=at)
    assert stats == list(cpu.row_stats(x)) and picked == x.gather(-1, torch.tensor(at)[:, None])[:, 0].float().tolist()
    with pytest.raises(IndexError):
        cpu.row_stats(x, at=[0, 1000, 0, 0])


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from tests.helpers import make_random_pair

    vdir, ddir = make_random_pair(tmp_path_factory.mktemp("cpu"), seed=4, layers=3, aux_layer_ids=(0, 1, 2))
    return {dt: wb.load_pair(vdir, ddir, dtype=dt) for dt in ("float32", "bfloat16")}


def reference(fn):
    """fn() on the models' torch path: grad on (the kernels never serve autograd), outputs detached."""
    with torch.enable_grad():
        out = fn()
    return out


def test_verifier_steps_equal_the_torch_path_and_rows_do_not_depend_on_the_call(pairs):
    """fp32: a prefill, a decode and a 4-token verify through the kernels equal the torch path's
    logits and cache rows (1e-5); bf16: the verify's rows equal four decodes' bit for bit."""
    pair = pairs["float32"]
    v = pair.verifier
    prompt = torch.tensor([[5, 9, 200, 31, 7, 77, 3]])
    new = torch.tensor([[11, 12, 13, 14]])
    outs = []
    for path in ("kernels", "torch"):
        cache = v.new_cache(64)
        run = (lambda f: reference(f)) if path == "torch" else (lambda f: torch.inference_mode()(f)())
        a = run(lambda: v(prompt, cache).logits.detach())
        b = run(lambda: v(new, cache).logits.detach())
        outs.append((a, b, cache.valid().detach().clone()))
    for got, want in zip(outs[0], outs[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    v16 = pairs["bfloat16"].verifier
    with torch.inference_mode():
        c1, c4 = v16.new_cache(64), v16.new_cache(64)
        v16(prompt, c1), v16(prompt, c4)
        four = v16(new, c4).logits[0]
        ones = torch.cat([v16(new[:, i:i + 1], c1).logits[0] for i in range(4)])
    assert torch.equal(four, ones) and torch.equal(c4.valid(), c1.valid())


def test_the_draft_chain_in_one_call_equals_its_passes_and_the_plain_model(pairs):
    """The kernel twin's one-call chain (`wb_eagle_chain`), the engine's Python chain pass by pass
    through the twins' kernels (`greedy_chain` over the accelerated modules), and the Python chain
    over the plain draft: equal (bit for bit between the two kernel runs, fp32 to 1e-5 against the
    plain model)."""
    from workbench.models.draft import Eagle3Draft

    for dt, pair in pairs.items():
        d, plain = pair.draft, pair.reference().draft
        assert type(d).__name__ == "KernelEagle3Draft" and type(plain) is Eagle3Draft
        ids = CHAIN_IDS
        runs = draft_chain_runs(pair)
        (t1, p1, c1), (t2, p2, c2), (t3, p3, c3) = runs["chain"], runs["passes"], runs["plain"]
        assert torch.equal(t1, t2) and torch.equal(p1, p2) and torch.equal(c1.valid(), c2.valid()), dt
        assert c1.length == c3.length == len(ids) + 3
        if dt == "float32":
            assert torch.equal(t1, t3)
            torch.testing.assert_close(p1, p3, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(c1.valid(), c3.valid(), rtol=1e-5, atol=1e-5)


def _ragged_batch(v, prompts):
    """A cache of len(prompts) sequences, each holding its own prompt (prefilled alone into its slot),
    and B = 1 caches holding the same."""
    big, singles = v.new_cache(96, batch=len(prompts)), []
    for b, ids in enumerate(prompts):
        single = v.new_cache(96)
        v(torch.tensor([ids]), single)
        v(torch.tensor([ids]), big.view(b))
        singles.append(single)
    return big, singles


PROMPTS = [[5, 9, 200, 31, 7, 77, 3], [8, 1], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71], [4, 4, 4, 4]]


def test_a_batch_of_ragged_sequences_gives_each_its_own_bits(pairs):
    """B sequences of different lengths, k+1 new tokens each, in one call per layer (B x (k+1) rows):
    each sequence's logits, aux states and cache rows equal its call alone, bit for bit in both
    dtypes; the batched MLA block wrote each sequence's rows at its own length."""
    for dt, pair in pairs.items():
        v = pair.verifier
        with torch.inference_mode():
            big, singles = _ragged_batch(v, PROMPTS)
            new = torch.tensor([[11, 12, 13, 14]] * 2 + [[90, 91, 92, 93], [2, 3, 5, 7]])
            out = v(new, big)
            for b, single in enumerate(singles):
                one = v(new[b:b + 1], single)
                assert torch.equal(out.logits[b], one.logits[0]), (dt, b)
                assert all(torch.equal(x[b], y[0]) for x, y in zip(out.aux_hidden_states, one.aux_hidden_states))
                n = single.length
                assert big.lengths[b] == n and torch.equal(big.rows[:, b, :n], single.rows[:, 0, :n])
    with torch.inference_mode():
        assert cpu.serves(torch.zeros(64, 5, 8)) and not cpu.serves(torch.zeros(1, cpu.MAX_ROWS + 1, 8))
        assert not cpu.serves(torch.zeros(cpu.MAX_BATCH_ROWS // 4 + 1, 4, 8))  # too many rows in all


def test_the_fused_steps_kernel_call_drafts_what_the_unfused_chain_drafts(pairs):
    """`run_accept_and_draft` (`wb_accept_and_draft`: the fused step's greedy acceptance, then a first
    pass over every verified position continued from the accepted count's row) after a verify of
    [last verified token] + 3 proposals, 0 to 3 of them right: its accepted count and argmaxes are
    the logits', and its proposals, their probabilities and the draft rows of the accepted
    positions and the chain are the unfused one-call chain's over the accepted positions, bit for
    bit; the Python fused step over the plain draft proposes the same tokens (fp32)."""
    from workbench.decoding.drafters import greedy_chain
    from workbench.decoding.fused import accept_and_draft

    prompt = [5, 9, 200, 31, 7, 77, 3, 12]
    P = len(prompt)
    for dt, pair in pairs.items():
        v, d, plain = pair.verifier, pair.draft, pair.reference().draft
        with torch.inference_mode():
            vc = v.new_cache(64)
            out = v(torch.tensor([prompt]), vc)
            truth = [int(out.logits[0, -1].float().argmax())]
            for _ in range(3):  # the verifier's greedy continuation
                truth.append(int(v(torch.tensor([truth[-1:]]), vc).logits[0, -1].float().argmax()))
            vc.truncate(P)
            base = d.new_cache(64)  # the draft's rows of the prompt's positions (position j: token j + 1)
            d(torch.tensor([prompt[1:] + truth[:1]]), d.combine_hidden_states(out.aux_hidden_states), base)

            def copy(cache):
                new = cache.view(0)
                new.rows = cache.rows.clone()
                return new

            for right in range(4):  # the first `right` proposals the verifier's own tokens, then a wrong one
                x = torch.tensor([truth[:1] + [t if i < right else (t + 1) % 100 for i, t in enumerate(truth[1:])]])
                vcache = copy(vc)
                ver = v(x, vcache)
                vcache.truncate(P)
                fused, unfused = copy(base), copy(base)
                fused._lens, unfused._lens = [P], [P]
                ints, floats, finite = (t[0] for t in d.run_accept_and_draft(
                    accept_and_draft, ver.logits, ver.aux_hidden_states, x, torch.tensor([3]), fused, 3))
                a = int(ints[0])
                assert bool(finite.all()) and a == right and ints[1:5].tolist() == ver.logits[0].float().argmax(-1).tolist()
                assert fused.length == P + 4  # as the Python fused step's first pass leaves it
                tokens, probs = d.run_greedy_chain(greedy_chain, ints[None, 1:2 + a],
                                                   tuple(h[:, :a + 1] for h in ver.aux_hidden_states), unfused, 3,
                                                   [a + 1])
                assert torch.equal(ints[5:], tokens[0]) and torch.equal(floats[7:], probs[0]), (dt, a)
                n = P + a + 3  # the accepted positions' rows, then the chain's
                assert unfused.length == n and torch.equal(fused.rows[0, 0, :n], unfused.rows[0, 0, :n]), (dt, a)
                if dt == "float32":
                    on_plain = copy(base)
                    on_plain._lens = [P]
                    p_ints, _, _ = accept_and_draft(plain, ver.logits, ver.aux_hidden_states, x, torch.tensor([3]),
                                                    on_plain, 3)
                    assert torch.equal(p_ints[0], ints), (dt, a)


def test_a_ragged_draft_chain_of_a_batch_equals_each_sequences_chain(pairs):
    """The one-call chain over B sequences, each with its own number of new positions (padded) and
    cache length: each sequence's proposals, probabilities and draft rows equal its chain alone (bit
    for bit), and equal the engine's Python chain with the same `counts` through the twins (bit for
    bit: `wb_eagle_chain` is its transform); stopped early below a probability, both stop where each
    sequence's own chain would, as the Python chain over the plain model does (fp32: its tokens)."""
    for dt, pair in pairs.items():
        v, d, plain = pair.verifier, pair.draft, pair.reference().draft
        with torch.inference_mode():
            outs = [v(torch.tensor([ids]), v.new_cache(96)) for ids in PROMPTS]
            counts = [3, 1, 2, 4]
            T = max(counts)
            ids = torch.tensor([p[-n:] + [0] * (T - n) for p, n in zip(PROMPTS, counts)])
            aux = tuple(torch.cat([F.pad(o.aux_hidden_states[i][:, -n:], (0, 0, 0, T - n)) for o, n in zip(outs, counts)])
                        for i in range(3))
            starts = [len(p) - n for p, n in zip(PROMPTS, counts)]

            def run(draft, chain, stop_below=None):
                cache = draft.new_cache(96, batch=4)
                cache.set_lengths(starts)
                return (*chain(draft, ids, aux, cache, 4, counts, stop_below), cache)

            def kernel(draft, *args):
                return draft.run_greedy_chain(greedy_chain, *args)

            tokens, probs, cache = run(d, kernel)
            for b, (n, s) in enumerate(zip(counts, starts)):
                one = d.new_cache(96)
                one.length = s
                t1, p1 = d.run_greedy_chain(greedy_chain, ids[b:b + 1, :n], tuple(a[b:b + 1, :n] for a in aux), one, 4)
                assert torch.equal(tokens[b], t1[0]) and torch.equal(probs[b], p1[0]), (dt, b)
                assert cache.lengths[b] == one.length == s + n + 3
                assert torch.equal(cache.rows[0, b, :one.length], one.rows[0, 0, :one.length])
            t_py, p_py, c_py = run(d, greedy_chain)  # the Python chain through the twins
            assert torch.equal(t_py, tokens) and torch.equal(p_py, probs) and c_py.lengths == cache.lengths, dt
            assert all(torch.equal(c_py.rows[0, b, :n], cache.rows[0, b, :n]) for b, n in enumerate(cache.lengths))
            if dt == "float32":
                t_plain, p_plain, _ = run(plain, greedy_chain)
                assert torch.equal(t_plain, tokens)
                torch.testing.assert_close(p_plain, probs, rtol=1e-5, atol=1e-6)
            threshold = float(probs[:, 1:].max()) + 1e-6  # every sequence unsure by its second proposal
            t_e, p_e, early = run(d, kernel, threshold)
            t_q, p_q, python = run(d, greedy_chain, threshold)
            t_p, _, on_plain = run(plain, greedy_chain, threshold)
            assert t_e.shape[1] == t_q.shape[1] == t_p.shape[1] <= 2 and torch.equal(t_e, tokens[:, :t_e.shape[1]])
            assert torch.equal(t_q, t_e) and torch.equal(p_q, p_e)
            assert early.lengths == python.lengths == on_plain.lengths == [s + n + t_e.shape[1] - 1
                                                                            for s, n in zip(starts, counts)]


def test_packed_weights_are_checked_and_variants_are_repacked(pairs, tmp_path):
    """A weight changed in place after `accelerate` makes the next kernel call an error naming the
    fix; accelerated again, the twins equal the plain model. The doctor's variants (RoPE pairing,
    fed-back state, an embedding of the draft's own) are packed afresh and equal their plain twins."""
    from tests.helpers import make_random_pair
    from workbench.kernels.cpu_modules import StaleWeightsError

    vdir, ddir = make_random_pair(tmp_path, seed=4, layers=3, aux_layer_ids=(0, 1, 2))
    pair = wb.load_pair(vdir, ddir, dtype="float32")  # its own: the weights change below
    v, plain = pair.verifier, pair.reference()
    prompt = torch.tensor([[5, 9, 200, 31]])

    def logits(model):
        with torch.inference_mode():
            return model(prompt, model.new_cache(16)).logits

    before = logits(v)
    torch.testing.assert_close(before, logits(plain.verifier), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        plain.verifier.model.layers[1].mlp.experts[0].up_proj.weight.mul_(3.0)
        plain.verifier.model.layers[1].self_attn.o_proj.weight.mul_(-1.0)
    with pytest.raises(StaleWeightsError, match="accelerate the plain model again"):
        logits(v)
    again = plain.with_path("cpu")
    assert not torch.allclose(logits(again.verifier), before)
    torch.testing.assert_close(logits(again.verifier), logits(plain.verifier), rtol=1e-5, atol=1e-5)

    ids = torch.tensor([[9, 200, 31, 42]])
    with torch.inference_mode():
        aux = again.verifier(prompt, again.verifier.new_cache(16)).aux_hidden_states
    d = again.plain[1]
    own = torch.nn.Embedding(*d.part("embed_tokens").weight.shape)
    with torch.no_grad():
        own.weight.normal_()
    for change in ({"layers.0.self_attn.rotary.interleave": not d.layers[0].self_attn.rotary.interleave},
                   {"norm_output": not d.norm_output}, {"embed_tokens": own}):
        fast, slow = again.variant(draft=change).draft, again.reference().variant(draft=change).draft
        assert type(fast).__name__ == "KernelEagle3Draft", change
        with torch.inference_mode():
            got = fast.run_greedy_chain(greedy_chain, ids, aux, fast.new_cache(16), 3)
            want = greedy_chain(slow, ids, aux, slow.new_cache(16), 3)
        assert torch.equal(got[0], want[0]), change
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


def test_bf16_speculation_equals_plain_decoding_bit_for_bit_on_the_embedded_pair():
    """Every kernel computes a row alone, so a verify's rows are a decode's: no near-tie can flip."""
    pair = wb.load_pair(dtype="bfloat16")
    prompts = ['def parse_header(line):\n    """Split a header line into a name and a value."""',
               'class Stack:\n    """A last-in first-out stack."""']
    for prompt in prompts:
        ar = wb.generate_autoregressive(pair, prompt, 48)
        for k in (1, 3, 5):
            assert wb.SpecDecoder(pair, k).generate(prompt, 48).tokens == ar.tokens, (prompt, k)


def test_switched_off_or_unbuildable_the_models_use_torch(tmp_path):
    """WORKBENCH_CPU_KERNELS=0, or no compiler: `serves` is False, `status` says why, and decoding works."""
    code = ("import torch, workbench as wb; from workbench.kernels import cpu; "
            "pair = wb.load_pair(dtype='float32'); "
            "r = wb.generate_autoregressive(pair, 'import os\\n\\n\\ndef f(x):\\n', 6); "
            "print(cpu.available(), len(r.tokens), cpu.status())")
    for env in ({"WORKBENCH_CPU_KERNELS": "0"}, {"CXX": "/nonexistent/c++", "WORKBENCH_CACHE_DIR": str(tmp_path)}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, **env}, timeout=300)
        assert out.returncode == 0, out.stderr
        available, n, why = out.stdout.split(" ", 2)
        assert available == "False" and n == "6", out.stdout
        assert ("WORKBENCH_CPU_KERNELS=0" in why) if "WORKBENCH_CPU_KERNELS" in env else ("not built" in why), why
