"""torch.compile'd per-token forwards (`workbench.compiled`): same tokens, few graphs, eager where it must be.

Compiling is slow on a 2-core CPU, so one module-scoped pair (2 layers, hidden 64) is compiled
once and every check runs on it.
"""
from __future__ import annotations

import re

import pytest
import torch

import workbench as wb
from tests.helpers import make_random_pair
from workbench.compiled import is_compiled

PROMPTS = ["def parse(text):\n    ", "class Stack:\n    def push(self, x):\n        "]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    vdir, ddir = make_random_pair(tmp_path_factory.mktemp("compiled"), seed=3, layers=2,
                                  aux_layer_ids=(0, 1, 1))
    eager = wb.load_pair(vdir, ddir, dtype="float32")
    compiled = wb.load_pair(vdir, ddir, dtype="float32").compile()
    return eager, compiled


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _cache_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}


def test_compiled_tokens_equal_eager_and_lossless(pairs):
    eager, compiled = pairs
    assert is_compiled(compiled.verifier) and is_compiled(compiled.draft) and not eager.compiled
    for prompt in PROMPTS:
        ref = wb.generate_autoregressive(eager, prompt, 24).tokens
        assert wb.generate_autoregressive(compiled, prompt, 24).tokens == ref
        for k in (1, 3):  # fused steps (the default on a compiled pair) and unfused ones
            fused = wb.SpecDecoder(compiled, k)
            assert fused.generate(prompt, 24).tokens == ref and fused.fused.calls > 0, (prompt, k)
            assert wb.SpecDecoder(compiled, k, fused=False).generate(prompt, 24).tokens == ref, (prompt, k)
    assert compiled.verifier.forward.calls["compiled"] > 0 and compiled.draft.run_greedy_chain.calls["compiled"] > 0


def test_a_batch_of_different_lengths_decodes_on_a_compiled_pair(pairs):
    """Rows of different lengths (the batched engine, the chat's server) run on a compiled pair: the
    forwards whose rows differ in length go eager, and each row's tokens are its plain decoding's."""
    eager, compiled = pairs
    out = wb.BatchDecoder(compiled, 3, max_batch_size=2).generate_many(PROMPTS, max_new_tokens=16)
    assert [r.tokens for r in out] == [wb.generate_autoregressive(eager, p, 16).tokens for p in PROMPTS]


def test_compiled_graphs_do_not_grow_with_length(pairs):
    _, compiled = pairs
    dec = wb.SpecDecoder(compiled, 3)
    dec.generate(PROMPTS[0], 16), wb.generate_autoregressive(compiled, PROMPTS[0], 16)  # every shape family
    before = _graphs()
    for n in (9, 31, 57):  # new cache lengths, new prompt lengths, new requests
        dec.generate(PROMPTS[1] + "x = 1\n" * (n // 9), n)
        wb.generate_autoregressive(compiled, PROMPTS[1] * 2, n)
    for prompt in ([5], [5, 6], "def"):  # prompts of 1, 2 and a few tokens: prefill stays eager
        dec.generate(prompt, 12), wb.generate_autoregressive(compiled, prompt, 12)
    assert _graphs() == before


def test_a_long_prompt_keeps_the_draft_chain_compiled(pairs):
    """The first pass after a prefill covers the prompt (more tokens than the compiled chain takes):
    its prefix runs eagerly, like the prefill, and every step's chain is still one compiled call."""
    from workbench.models.mla import ABSORB_MAX_TOKENS

    eager, compiled = pairs
    prompt = PROMPTS[1] + "x = 1\n" * 6
    assert len(compiled.encode(prompt)) > ABSORB_MAX_TOKENS + 1
    want = wb.generate_autoregressive(eager, prompt, 24).tokens
    dec = wb.SpecDecoder(compiled, 3, fused=False)
    dec.generate(PROMPTS[0], 8)
    before, verifier_before = dict(compiled.draft.run_greedy_chain.calls), dict(compiled.verifier.forward.calls)
    out = dec.generate(prompt, 24)  # called with grad enabled, as the bench and the chat call it
    steps = sum(e.kind == "spec" for e in out.events)
    calls = compiled.draft.run_greedy_chain.calls
    assert calls["eager"] == before["eager"] and calls["compiled"] == before["compiled"] + steps
    # the prefill eagerly, every step's verify through the graph (a graph runs only without grad)
    verifier_calls = compiled.verifier.forward.calls
    assert verifier_calls == {"eager": verifier_before["eager"] + 1, "compiled": verifier_before["compiled"] + steps}
    assert out.tokens == want
    fused = wb.SpecDecoder(compiled, 3)  # fused: one call of its graph per step, and one for the prompt's last position
    before, fused_before = dict(compiled.draft.run_greedy_chain.calls), fused.fused.calls
    out = fused.generate(prompt, 24)
    assert fused.fused.calls == fused_before + 1 + sum(e.kind == "spec" for e in out.events)
    assert compiled.draft.run_greedy_chain.calls == before and out.tokens == want


def test_compiled_pair_keeps_eager_for_training_and_prefill(pairs):
    eager, compiled = pairs
    ids = torch.tensor([compiled.encode(PROMPTS[1])])
    calls = dict(compiled.verifier.forward.calls)
    out = compiled.verifier(ids)  # no cache: the eager naive path
    torch.testing.assert_close(out.logits, eager.verifier(ids).logits, rtol=0, atol=0)
    long = ids.repeat(1, 3)  # a prefill longer than ABSORB_MAX_TOKENS: eager, over the cache
    cache_c, cache_e = compiled.verifier.new_cache(64), eager.verifier.new_cache(64)
    torch.testing.assert_close(compiled.verifier(long, cache_c).logits, eager.verifier(long, cache_e).logits,
                               rtol=0, atol=0)
    assert compiled.verifier.forward.calls["eager"] == calls["eager"] + 2
    assert compiled.verifier.forward.calls["compiled"] == calls["compiled"]
    with torch.enable_grad():  # training: eager even for one token over a cache
        compiled.verifier(ids[:, :1], cache_c)
    assert compiled.verifier.forward.calls["eager"] == calls["eager"] + 3


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    vdir, ddir = make_random_pair(tmp_path_factory.mktemp("compiled-bf16"), seed=4, layers=2,
                                  aux_layer_ids=(0, 1, 1))
    return wb.load_pair(vdir, ddir, dtype="bfloat16").compile()


def _rows_one_and_four_at_a_time(pair, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's logits for 12 tokens teacher-forced one at a time and four at a time, after
    checking that these calls compiled no new graph and wrote the same cache rows."""
    graphs = _graphs()
    with torch.inference_mode():
        c1, c4 = pair.verifier_cache(64), pair.verifier_cache(64)
        for c in (c1, c4):
            pair.verifier(torch.tensor([prompt]), c, logits_to_keep=1)
        one = [pair.verifier(torch.tensor([[t]]), c1, logits_to_keep=1).logits[0, -1] for t in tokens[:12]]
        four = [pair.verifier(torch.tensor([tokens[i:i + 4]]), c4).logits[0] for i in range(0, 12, 4)]
    assert _graphs() == graphs
    torch.testing.assert_close(c1.valid(), c4.valid(), rtol=0, atol=0)  # and the cache rows they wrote
    return torch.stack(one), torch.cat(four)


def test_compiled_bf16_rounds_decode_and_verify_alike(bf16_pair):
    """One graph for 1 and for k+1 new tokens: each row's logits are bit-identical, so bf16 stays lossless.
    On a CPU without native bf16 (AVX2) the graphs' matmuls are ATen's, the C++ GEMM template
    having no bf16 kernel there (it failed to compile before): the same holds with them."""
    from workbench.compiled import gemm_backends
    from workbench.machine import machine

    assert gemm_backends(torch.bfloat16) == ("CPP" if machine()["fast_bf16"] else "ATEN")
    assert gemm_backends(torch.float32) == "CPP"
    pair = bf16_pair
    prompt = pair.encode(PROMPTS[1])
    ar = wb.generate_autoregressive(pair, prompt, 16)  # compiles the verifier's graph with T = 1
    one, four = _rows_one_and_four_at_a_time(pair, prompt, ar.tokens)
    torch.testing.assert_close(one, four, rtol=0, atol=0)
    for k in (1, 3):  # fused steps verify with this same graph; unfused ones too
        assert wb.SpecDecoder(pair, k).generate(prompt, 16).tokens == ar.tokens, k
        assert wb.SpecDecoder(pair, k, fused=False).generate(prompt, 16).tokens == ar.tokens, k


def test_compiled_fp32_rounds_decode_and_verify_alike(pairs):
    """fp32 too. There `.float()` is a no-op, and a strided view of T = 1 rows once let inductor
    specialise the 1-token graph (models/mla.py's q_lat): a verify then ran a second graph."""
    _, pair = pairs
    prompt = pair.encode(PROMPTS[0])
    ar = wb.generate_autoregressive(pair, prompt, 16)
    one, four = _rows_one_and_four_at_a_time(pair, prompt, ar.tokens)
    torch.testing.assert_close(one, four, rtol=0, atol=0)


def test_compiled_attention_rounds_a_row_alike_in_any_call():
    """A query row gets the same bits from the compiled attention twin alone (a decode, over its
    position + 1 keys) or among four (a verify, over start + 4 keys for every row), at every key
    count: why is in `keys_in_blocks`."""
    from workbench.compiled import compile_function, row_invariant_attention
    from workbench.kernels.reference import mla_attention_torch

    def attend(q_lat, q_pe, cache, n: int):
        return row_invariant_attention(q_lat, q_pe, cache, torch.full((1,), n, dtype=torch.int32), n, 0.125)

    attend = compile_function(attend)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(1, 100, 40, generator=g)  # a buffer that is not a whole number of key blocks
    q_lat, q_pe = torch.randn(1, 4, 4, 32, generator=g), torch.randn(1, 4, 4, 8, generator=g)
    for end in range(5, 101):
        four = attend(q_lat, q_pe, cache, end)
        for t in range(4):
            one = attend(q_lat[:, t:t + 1], q_pe[:, t:t + 1], cache, end - 3 + t)
            assert torch.equal(one[0, 0], four[0, t]), (end, t)
    want = mla_attention_torch(q_lat, q_pe, cache, torch.tensor([70], dtype=torch.int32), 0.125)[0]
    torch.testing.assert_close(attend(q_lat, q_pe, cache, 70), want, rtol=1e-5, atol=1e-6)  # and it is the same math


def test_with_draft_keeps_a_compiled_pair_compiled(pairs):
    eager, compiled = pairs
    swapped = compiled.with_draft(compiled.draft_dir)
    assert swapped.verifier is compiled.verifier and is_compiled(swapped.draft) and swapped.draft is not compiled.draft
    assert not is_compiled(eager.with_draft(eager.draft_dir).draft)


def test_two_compiled_pairs_of_one_shape_keep_their_own_weights(pairs, tmp_path, monkeypatch):
    """Weights are frozen into the graphs and module guards are skipped: a second pair of the same
    architecture must get graphs of its own, not run the first pair's weights (nor load them from
    inductor's on-disk cache, which keys frozen weights by shape alone: our graphs stay out of it)."""
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    import workbench.compiled

    eager, compiled = pairs
    vdir, ddir = make_random_pair(tmp_path, seed=5, layers=2, aux_layer_ids=(0, 1, 1))
    other_eager = wb.load_pair(vdir, ddir, dtype="float32")
    seen = []  # the settings each compile ran under, read by its post-grad pass (inside inductor's compile)
    monkeypatch.setattr(workbench.compiled, "_keep_out_of_graph_cache", lambda graph: seen.append(
        (inductor_config.freezing, inductor_config.cpp_wrapper, inductor_config.max_autotune,
         fx_config.backed_size_oblivious, fx_config.use_duck_shape, torch._dynamo.config.specialize_float,
         inductor_config.max_autotune_gemm_backends)))
    other = wb.load_pair(vdir, ddir, dtype="float32").compile()
    before = _cache_counts()
    wb.SpecDecoder(other, 3).generate(PROMPTS[0], 4)  # compiles the new pair's verifier and fused step
    assert len(seen) >= 2 and set(seen) == {(True, True, True, True, False, True, "CPP")}, seen  # fp32: C++ GEMMs
    after = _cache_counts()
    assert after["fxgraph_cache_hit"] == before["fxgraph_cache_hit"]
    assert after["fxgraph_cache_bypass"] >= before["fxgraph_cache_bypass"] + 2  # refused, so never stored either
    assert after["fxgraph_cache_miss"] == before["fxgraph_cache_miss"]
    assert not inductor_config.freezing and not fx_config.backed_size_oblivious  # nothing leaks past a call
    assert fx_config.use_duck_shape and not torch._dynamo.config.specialize_float
    for prompt in PROMPTS:
        first = wb.generate_autoregressive(compiled, prompt, 12).tokens
        second = wb.generate_autoregressive(other, prompt, 12).tokens
        assert first == wb.generate_autoregressive(eager, prompt, 12).tokens
        assert second == wb.generate_autoregressive(other_eager, prompt, 12).tokens
        assert first[1:] != second[1:]  # two different models (the first token comes from an eager prefill)
        dec = wb.SpecDecoder(other, 3)
        assert dec.generate(prompt, 12).tokens == second and dec.fused.calls > 0
    assert other.verifier.forward.calls["compiled"] > 0


def test_a_compile_leaves_the_heap_frozen():
    """After one of our compiles the collector leaves the compiler's objects alone (`_freeze_heap`):
    otherwise its full collections walk them while decoding."""
    import gc

    from workbench.compiled import compile_function

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    x = torch.arange(6.0)
    assert torch.equal(compile_function(lambda t: t * 2 + 1)(x), x * 2 + 1)
    assert gc.get_freeze_count() > 10_000


def test_a_second_start_decodes_alike_whatever_inductors_cache_holds(pairs):
    """The same checkpoints compiled again (as in a new process: new code objects, so dynamo traces
    anew) decode exactly as before. Inductor's on-disk cache refuses our graphs (it keys frozen
    weights by shape alone; `workbench.compiled._keep_out_of_graph_cache`), so the bench counts them
    as bypasses and compiles them again; none is loaded or stored (docs/PERFORMANCE.md, issue 40)."""
    from workbench.analysis.bench import run_bench
    from workbench.cli import _bench_text

    eager, compiled = pairs
    wb.SpecDecoder(compiled, 3).generate(PROMPTS[0], 8)  # the first copy's graphs compile (stored if cacheable)
    before = _cache_counts()
    again = wb.load_pair(compiled.verifier_dir, compiled.draft_dir, dtype="float32").compile()
    report = run_bench(again, PROMPTS, k=3, max_new_tokens=12, peers=False, progress=False)  # its warm-up compiles
    cache = report["graph_cache"]
    assert cache["bypasses"] >= 2 and cache["hits"] == cache["misses"] == 0, cache  # the verifier's, the fused step's
    assert "graphs: " in _bench_text(report) and report["lossless"]
    spec = wb.SpecDecoder(again, 3).generate(PROMPTS[1], 24).tokens
    assert _cache_counts()["fxgraph_cache_miss"] == before["fxgraph_cache_miss"]
    assert again.verifier.forward.calls["compiled"] > 0
    want = wb.generate_autoregressive(eager, PROMPTS[1], 24).tokens
    assert spec == want and wb.generate_autoregressive(again, PROMPTS[1], 24).tokens == want


def test_a_torch_without_a_private_setting_refuses_to_compile(monkeypatch):
    """What dynamo must see while tracing our graphs has no public API in torch 2.13
    (`workbench.compiled._TRACING`): on a torch without one of those settings, compiling raises and
    names it, rather than compiling graphs that would silently differ."""
    import workbench.compiled

    for tracing, missing in (({"torch.fx.experimental._config": {"backed_size_oblivious": True, "no_such": True}},
                              "torch.fx.experimental._config.no_such"),
                             ({"torch._no_such_config": {"freezing": True}}, "torch._no_such_config.freezing")):
        monkeypatch.setattr(workbench.compiled, "_TRACING", tracing)
        with pytest.raises(RuntimeError, match=f"needs {re.escape(missing)}, private settings of torch"):
            workbench.compiled.compile_function(lambda t: t + 1)
