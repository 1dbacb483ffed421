"""The CPU kernels' thread pool: every output has the same bits at 1, 2 and 3 threads, the workers
are started once and reused, one thread means the caller alone, and the count follows torch's.

Most checks also run with `set_min_work(1)`, which splits every call that has more than one unit
of work (a linear's columns of 64 outputs, attention's heads, the MoE's experts), so that the
small matrices of these tests are split as the large ones are; the pool's job counter shows the
splits happened.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.decoding.drafters import greedy_chain
from workbench.decoding.fused import accept_and_draft
from tests.kernels.test_cpu_kernels import PROMPTS, _ragged_batch, build, load_build
from workbench.analysis.doctor import path_check
from workbench.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels: {cpu.status()}")
DTYPES = (torch.float32, torch.bfloat16)
COUNTS = (1, 2, 3)
REPO = Path(__file__).resolve().parents[2]
# (N, K): the verifier's and the draft's lm_heads, the hidden size, and N past a multiple of 64
SHAPES = [(8192, 256), (2048, 256), (256, 256), (200, 96), (100, 10), (33, 8)]


@pytest.fixture
def pool():
    """The library with the thread count, minimum work and steal wait put back after the test. The
    caller waits 10 s before it runs a late worker's part: where each part runs is then as planned
    even on a busy machine, and the tests that trace it do not depend on the scheduler."""
    lib = cpu._lib()
    before = cpu.set_min_work(1)
    cpu.set_min_work(before)
    steal = lib.wb_set_steal_micros(10_000_000)
    yield lib
    cpu.set_threads(None)
    cpu.set_min_work(before)
    lib.wb_set_steal_micros(steal)


def by_threads(fn, counts=COUNTS, lib=None) -> dict:
    """fn() at each thread count (through cpu.set_threads, or `lib`'s own pool)."""
    out = {}
    for n in counts:
        if lib is None:
            cpu.set_threads(n)
        else:
            lib.wb_set_threads(n)
        out[n] = fn()
    return out


def assert_same(runs: dict, what) -> None:
    """Every run's tensors equal the first count's, bit for bit."""
    first, *rest = runs
    for n in rest:
        for i, (a, b) in enumerate(zip(runs[first], runs[n], strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), (what, n, i)


def linear_outputs(dtype) -> list:
    gen = torch.Generator().manual_seed(7)
    outs = []
    for N, K in SHAPES:
        packed = cpu.PackedLinear(torch.randn(N, K, generator=gen).to(dtype))
        for M in (1, 2, 3, 4, 5, 9, 17):
            x = torch.randn(M, K, generator=gen).to(dtype)
            outs += [packed(x), packed(x, residual=torch.randn(M, N, generator=gen).to(dtype))]
    return outs


@pytest.mark.parametrize("min_work", [None, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linears_give_the_same_bits_at_any_thread_count(pool, dtype, min_work):
    if min_work:
        pool.wb_set_min_work(min_work)
    jobs = pool.wb_pool_jobs()
    runs = by_threads(lambda: linear_outputs(dtype))
    assert_same(runs, dtype)
    assert pool.wb_pool_jobs() > jobs  # the lm_heads split even at the default minimum


def test_attention_over_heads_gives_the_same_bits_at_any_thread_count(pool):
    pool.wb_set_min_work(1)
    gen = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        cases = [(rand(T, 4, 64), rand(T, 4, 16), rand(start + T, 80), start) for T, start in ((1, 0), (1, 40), (5, 13))]
        jobs = pool.wb_pool_jobs()
        assert_same(by_threads(lambda: [cpu.attention(q, pe, rows, start, 0.3) for q, pe, rows, start in cases]), dtype)
        assert pool.wb_pool_jobs() >= jobs + 2 * len(cases)


@pytest.fixture(scope="module")
def bf16_pair():
    return wb.load_pair(dtype="bfloat16")


def model_outputs(pair) -> list:
    """A prefill and a 4-token verify (logits, aux states, cache rows), a ragged batch of four
    sequences in one call per layer, the draft's one-call greedy chain and the fused step's call
    after the verify."""
    v, d = pair.verifier, pair.draft
    with torch.inference_mode():
        cache = v.new_cache(64)
        first = v(torch.tensor([[5, 9, 200, 31, 7, 77, 3]]), cache)
        verify = v(torch.tensor([[11, 12, 13, 14]]), cache)
        big, _ = _ragged_batch(v, PROMPTS)
        batch = v(torch.tensor([[11, 12, 13, 14]] * 2 + [[90, 91, 92, 93], [2, 3, 5, 7]]), big)
        dcache = d.new_cache(64)
        run = getattr(d, "run_greedy_chain", lambda chain, *a: chain(d, *a))  # as the engine runs it (drafters.py)
        chain = run(greedy_chain, torch.tensor([[9, 200, 31, 7, 77, 3, 42]]), first.aux_hidden_states, dcache, 4)
        fcache = d.new_cache(64)  # the fused step's call after the verify (the kernels' one call where the draft has it)
        d(torch.tensor([[9, 200, 31, 7, 77, 3, 42]]), d.combine_hidden_states(first.aux_hidden_states), fcache)
        fuse = getattr(d, "run_accept_and_draft", lambda f, *a: f(d, *a))
        ints, floats, _ = fuse(accept_and_draft, verify.logits, verify.aux_hidden_states,
                               torch.tensor([[11, 12, 13, 14]]), torch.tensor([3]), fcache, 3)
    return [first.logits, *first.aux_hidden_states, verify.logits, cache.valid(), batch.logits, big.rows,
            *chain, dcache.valid(), ints, floats, fcache.valid()]


@pytest.mark.parametrize("min_work", [None, 1])
def test_the_kernel_backed_pair_gives_the_same_bits_at_any_thread_count(pool, embedded_pair, bf16_pair, min_work):
    """The accelerated embedded pair in fp32 and bf16: verifier forwards (single and batched),
    cache rows and the draft's chain, bit for bit whatever the thread count."""
    if min_work:
        pool.wb_set_min_work(min_work)
    for pair in (embedded_pair, bf16_pair):
        assert pair.path.name == "cpu", pair.status()
        jobs = pool.wb_pool_jobs()
        assert_same(by_threads(lambda: model_outputs(pair)), pair.status())
        assert pool.wb_pool_jobs() > jobs


def test_greedy_decoding_gives_the_same_tokens_at_any_thread_count(pool, bf16_pair):
    pool.wb_set_min_work(1)
    prompt = 'def parse_header(line):\n    """Split a header line into a name and a value."""'

    def tokens():
        ar = wb.generate_autoregressive(bf16_pair, prompt, 24).tokens
        spec = wb.SpecDecoder(bf16_pair, 3).generate(prompt, 24).tokens
        assert spec == ar
        return [torch.tensor(ar)]

    assert_same(by_threads(tokens), "tokens")


def trace(lib, n: int = 12) -> list[int]:
    ids = (ctypes.c_ulong * n)()
    lib.wb_pool_trace(n, ids)
    return list(ids)


def test_the_workers_are_started_once_and_reused(pool):
    pool.wb_set_min_work(1)
    cpu.set_threads(3)
    created = pool.wb_threads_created()
    seen = trace(pool)
    assert len(set(seen)) == 3 and seen[0] == threading.get_ident()  # the caller takes the first part
    assert sum(a != b for a, b in zip(seen, seen[1:])) == 2  # contiguous ranges: a thread's items together
    packed = cpu.PackedLinear(torch.randn(8192, 256))
    x = torch.randn(2, 256)
    jobs = pool.wb_pool_jobs()
    for _ in range(100):
        packed(x)
        assert trace(pool) == seen
    assert pool.wb_pool_jobs() >= jobs + 200
    for n in (1, 2, 3, 1, 3):  # a lower count parks the extra workers, a higher one wakes them again
        cpu.set_threads(n)
        packed(x)
    assert pool.wb_threads_created() == created and trace(pool) == seen


def test_the_caller_runs_the_parts_of_workers_not_yet_running(pool):
    """A worker not scheduled in time (a busy machine) does not hold the call up: the caller claims
    its part and runs it. With no wait at all the caller races the workers for every part; each
    part runs once either way (contiguous ranges, each on one thread), and the bits do not move."""
    pool.wb_set_min_work(1)
    cpu.set_threads(3)
    packed = cpu.PackedLinear(torch.randn(1000, 96))
    x = torch.randn(3, 96)
    want = packed(x)
    pool.wb_set_steal_micros(0)
    me, stolen = threading.get_ident(), 0
    for _ in range(300):
        seen = trace(pool)
        assert seen[:4] == [me] * 4  # the caller's own part
        assert all(len(set(seen[i:i + 4])) == 1 for i in (4, 8))  # each part on one thread
        stolen += seen[-1] == me
        assert torch.equal(packed(x), want)
    assert stolen > 0
    pool.wb_set_steal_micros(10_000_000)
    assert len(set(trace(pool))) == 3  # the workers still take their parts when they come in time


def test_one_thread_runs_every_call_on_the_caller(pool):
    pool.wb_set_min_work(1)
    cpu.set_threads(1)
    assert trace(pool) == [threading.get_ident()] * 12
    jobs = pool.wb_pool_jobs()
    linear_outputs(torch.float32)
    assert pool.wb_pool_jobs() == jobs


def test_small_calls_stay_on_the_caller(pool):
    """At the default minimum work, a decode row through a 256 x 256 linear is not split."""
    cpu.set_threads(3)
    packed = cpu.PackedLinear(torch.randn(256, 256))
    jobs = pool.wb_pool_jobs()
    packed(torch.randn(1, 256))
    assert pool.wb_pool_jobs() == jobs
    cpu.PackedLinear(torch.randn(8192, 256))(torch.randn(1, 256))
    assert pool.wb_pool_jobs() == jobs + 1


def test_concurrent_callers_each_get_their_own_bits(pool):
    """Calls from two Python threads (ctypes lets go of the GIL): one has the pool, the other runs
    on its own thread, and both give the one-thread bits."""
    pool.wb_set_min_work(1)
    packed = cpu.PackedLinear(torch.randn(1000, 96))
    xs = [torch.randn(3, 96) for _ in range(2)]
    cpu.set_threads(1)
    want = [packed(x) for x in xs]
    cpu.set_threads(3)
    bad = []

    def loop(i):
        for _ in range(200):
            if not torch.equal(packed(xs[i]), want[i]):
                bad.append(i)

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not bad


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_workers(pool):
    pool.wb_set_min_work(1)
    cpu.set_threads(3)
    packed = cpu.PackedLinear(torch.randn(1000, 96))
    x = torch.randn(3, 96)
    want = packed(x)
    pid = os.fork()
    if pid == 0:  # the child: the parent's workers are not here; the pool must start its own
        ok = torch.equal(packed(x), want) and len(set(trace(pool))) == 3
        os._exit(0 if ok else 1)
    _, code = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(code) == 0


def test_the_count_follows_torch_until_set_and_is_reported(pool, embedded_pair):
    before = torch.get_num_threads()
    try:
        cpu.set_threads(None)
        torch.set_num_threads(2)
        with torch.inference_mode():
            assert cpu.serves(torch.zeros(1, 8)) and pool.wb_get_threads() == 2  # a kernel call reads torch's again
        assert cpu.threads() == 2 and cpu.status().endswith(", 2 threads")
        cpu.set_threads(3)
        torch.set_num_threads(1)
        with torch.inference_mode():
            assert cpu.serves(torch.zeros(1, 8)) and pool.wb_get_threads() == 3  # pinned: torch's is not read
        assert cpu.threads() == 3
        assert "CPU kernels on 3 threads" in embedded_pair.status()
        check = path_check(embedded_pair)
        assert check.name == "fast path" and "on 3 threads" in check.detail
        cpu.set_threads(None)
        assert cpu.threads() == 1 and cpu.status().endswith(", 1 thread")
        with pytest.raises(ValueError, match="positive integer"):
            cpu.set_threads(0)
    finally:
        torch.set_num_threads(before)


def test_workbench_cpu_threads_pins_the_count():
    code = "import torch; torch.set_num_threads(1); from workbench.kernels import cpu; print(cpu.threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "WORKBENCH_CPU_THREADS": "2"}, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["2"], out.stderr


@pytest.mark.parametrize("target, flags", [("avx2", ("-march=x86-64-v3",)), ("no_bf16", ("-mno-avx512bf16",))])
def test_each_isa_build_gives_the_same_bits_at_any_thread_count(tmp_path, monkeypatch, target, flags):
    """The AVX2 build (and AVX-512 without AVX512-BF16 where this CPU has it) tiles a linear its own
    way; split over threads, each still gives its one-thread bits."""
    from workbench.machine import cpu_info

    if target == "avx2" and not {"avx2", "fma"} <= cpu_info()[1]:
        pytest.skip("this CPU cannot run an AVX2 build")
    lib = load_build(build(tmp_path, target, *flags), monkeypatch)
    lib.wb_set_min_work(1)
    lib.wb_set_steal_micros(10_000_000)  # each part where it was planned, as in `pool`
    with monkeypatch.context() as m:
        m.setitem(cpu._state, "lib", lib)
        for dtype in DTYPES:
            assert_same(by_threads(lambda: linear_outputs(dtype), lib=lib), (target, dtype))
        assert len(set(trace(lib))) == 3
