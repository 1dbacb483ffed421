"""The verifier's whole decoder stack in one kernel call (`KernelVerifier`, `cpu.DecoderStack`).

Its forward must equal the per-module kernel path's (the same pair accelerated with `stack=False`:
each layer's twins called one by one, residual adds in torch) bit for bit: logits, aux states,
normed hidden states and cache rows, in fp32 and bf16, native and int8 weights, for a prefill, a
decode, a verify of k+1 tokens and a ragged batch, at 1 and 2 threads; greedy plain and
speculative decoding give the same tokens; the calls it does not serve (a prompt over
`cpu.MAX_ROWS` tokens, no cache, autograd) go to the per-module path, and so do every call of a
pair accelerated with the stack switched off.
"""
from __future__ import annotations

import copy

import pytest
import torch

import workbench as wb
from tests.kernels.test_cpu_kernels import PROMPTS
from tests.kernels.test_cpu_threads import pool  # noqa: F401 (fixture)
from workbench.kernels import cpu, cpu_modules
from workbench.kernels.cpu_modules import KernelVerifier, StaleWeightsError, accelerate
from workbench.models.verifier import Verifier

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels: {cpu.status()}")
WEIGHTS = ("native", "int8", "int8-b32", "bf16")


class Counting:
    """A DecoderStack that counts its calls (so a test knows the stack, not a fallback, ran)."""

    def __init__(self, stack: cpu.DecoderStack) -> None:
        self.inner, self.calls = stack, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.fixture(scope="module")
def plains(tmp_path_factory):
    """Plain (verifier, draft) pairs: the embedded pair and a random one with q_lora, a dense first
    layer and every layer an aux layer, each in fp32 and bf16."""
    from tests.helpers import make_random_pair

    vdir, ddir = make_random_pair(tmp_path_factory.mktemp("stack"), seed=5, layers=3, aux_layer_ids=(0, 1, 2))
    out = {}
    for dt in ("float32", "bfloat16"):
        out[f"embedded-{dt}"] = wb.load_pair(dtype=dt).plain
        out[f"random-{dt}"] = wb.load_pair(vdir, ddir, dtype=dt).plain
    return out


def both(plain, weights="native"):
    """The verifier accelerated with the stack (counting its calls) and without it."""
    on = accelerate(*plain, weights=weights)[0]
    off = accelerate(*plain, weights=weights, stack=False)[0]
    assert isinstance(on, KernelVerifier) and type(off) is Verifier
    on.stack = Counting(on.stack)
    return on, off


def scenario(v) -> list[torch.Tensor]:
    """A prompt's prefill, a decode, a verify of k+1 = 4 tokens (all logits, and the last only), a
    ragged batch of four sequences (each prefilled alone into its slot) verifying 4 tokens each, and
    a batch decode: every output, and the cache rows and lengths after each."""
    outs = []

    def take(out, cache):
        outs.extend([out.logits, *out.aux_hidden_states, out.hidden_states, cache.rows.clone(),
                     torch.tensor(cache.lengths)])

    with torch.inference_mode():
        cache = v.new_cache(64)
        take(v(torch.tensor([[5, 9, 200, 31, 7, 77, 3]]), cache), cache)
        take(v(torch.tensor([[42]]), cache, logits_to_keep=1), cache)
        take(v(torch.tensor([[11, 12, 13, 14]]), cache), cache)
        take(v(torch.tensor([[15, 16, 17, 18]]), cache, logits_to_keep=1), cache)
        big = v.new_cache(96, batch=len(PROMPTS))
        for b, ids in enumerate(PROMPTS):
            take(v(torch.tensor([ids]), big.view(b)), big)
        assert len(set(big.lengths)) > 1
        batch = torch.tensor([[11, 12, 13, 14]] * 2 + [[90, 91, 92, 93], [2, 3, 5, 7]])
        take(v(batch, big), big)
        take(v(batch[:, :1], big, logits_to_keep=1), big)
        take(v(batch[:, :2], big, positions=torch.tensor([[50, 51]])), big)  # given positions, one for all rows
    return outs


def assert_equal(got: list, want: list, what) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (what, i)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_the_stack_equals_the_per_module_path_bit_for_bit(pool, plains, weights, threads):
    cpu.set_threads(threads)
    if threads > 1:
        pool.wb_set_min_work(1)  # split every call that can be, as large models' are
    for name, plain in plains.items():
        on, off = both(plain, weights)
        want = scenario(off)
        got = scenario(on)
        assert on.stack.calls == 11, name
        assert_equal(got, want, (name, weights, threads))


def test_aux_ids_repeated_first_and_last_layer(plains):
    """Aux id 0 is the embeddings, the last layer's the stream entering it; a repeated id gives the
    same values twice."""
    for name in ("embedded-bfloat16", "random-float32"):
        on, off = both(plains[name])
        n = on.config.num_hidden_layers
        on.aux_layer_ids = off.aux_layer_ids = (n - 1, 0, 1, 1)
        got, want = scenario(on), scenario(off)
        assert on.stack.calls == 11
        assert_equal(got, want, name)


def test_calls_the_stack_does_not_serve_run_the_per_module_path(plains):
    """A prompt over cpu.MAX_ROWS tokens, no cache, path "naive", autograd: each the per-module
    path's outputs, the stack not called."""
    on, off = both(plains["embedded-float32"])
    long = torch.arange(cpu.MAX_ROWS + 3)[None] % 300 + 1
    outs = {}
    for v in (on, off):
        with torch.inference_mode():
            cache = v.new_cache(256)
            first = v(long, cache)
            then = v(torch.tensor([[7]]), cache)  # the stack serves this one (after the long prompt)
            plain = v(long[:, :9])
            naive = v(long[:, :5], v.new_cache(16), path="naive")
        with torch.enable_grad():
            grad = v(long[:, :6], v.new_cache(16))
        outs[v] = [first.logits, *first.aux_hidden_states, then.logits, cache.rows, plain.logits, naive.logits,
                   grad.logits.detach()]
        if v is on:
            assert on.stack.calls == 1
            assert grad.logits.requires_grad == any(p.requires_grad for p in v.parameters())
    assert_equal(outs[on], outs[off], "fallbacks")


def test_greedy_decoding_gives_the_same_tokens(plains):
    """Plain and speculative greedy decoding through the engine: the same tokens with the stack as
    without it (and speculative equals plain: lossless)."""
    prompt = 'def parse_header(line):\n    """Split a header line into a name and a value."""'
    pair = wb.load_pair(dtype="bfloat16")
    tokens = {}
    for stack in (True, False):
        v, d = accelerate(*pair.plain, stack=stack)
        p = wb.ModelPair(v, d, pair.tokenizer, pair.verifier_dir, pair.draft_dir, dict(pair.info), pair.path,
                         pair.plain)
        if stack:
            v.stack = Counting(v.stack)
        tokens[stack] = (wb.generate_autoregressive(p, prompt, 32).tokens, wb.SpecDecoder(p, 3).generate(prompt, 32).tokens)
        if stack:
            assert v.stack.calls > 32
    assert tokens[True] == tokens[False]
    assert tokens[True][0] == tokens[True][1]


def test_a_weight_changed_in_place_makes_the_stack_raise(plains):
    plain = copy.deepcopy(plains["random-float32"])
    on, _ = both(plain)
    with torch.inference_mode():
        on(torch.tensor([[1, 2, 3]]), on.new_cache(16))
    with torch.no_grad():
        plain[0].model.layers[1].mlp.experts[0].up_proj.weight.add_(0.0)  # a new version, the same values
    with pytest.raises(StaleWeightsError), torch.inference_mode():
        on(torch.tensor([[1, 2, 3]]), on.new_cache(16))


def test_the_switch_and_the_docs(monkeypatch, plains):
    plain = plains["embedded-float32"]
    monkeypatch.setenv("WORKBENCH_CPU_STACK", "0")
    assert type(accelerate(*plain)[0]) is Verifier
    monkeypatch.setenv("WORKBENCH_CPU_STACK", "1")
    assert type(accelerate(*plain)[0]) is KernelVerifier
    assert type(accelerate(*plain, stack=False)[0]) is Verifier
    assert "KernelVerifier" in cpu_modules.__doc__ and "WORKBENCH_CPU_STACK" in cpu_modules.__doc__
    # a verifier with a layer the kernels do not run stays a Verifier over its twins
    v = copy.copy(plain[0])
    assert KernelVerifier.of(v) is None and type(v) is Verifier
