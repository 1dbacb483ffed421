"""torch.compile for the forwards that run once per token: gpt-fast's recipe, on the CPU too.

At the tiny pair's size a decode step is a few hundred small ops and each costs more in
dispatch than in arithmetic (measured here, one thread: a 1x256 @ 256x256 matmul takes ~8 us
in fp32 and ~40 us in bf16, where the arithmetic is well under 1 us). Compiling the verifier's
decode/verify forward (1 to `ABSORB_MAX_TOKENS` new tokens over the cache) and the draft's
greedy chain (first pass + k-1 steps + their lm_heads, one graph) fuses the elementwise work
into generated C++; inductor's `freezing` makes every weight a constant; `max_autotune` with
the CPP GEMM backend generates each linear as C++ over weights packed once, where oneDNN's
prepacked linear cost 40-80 us a call at these sizes (profiled on the embedded pair: a 1-token
verifier step went from 3.2-4.3 ms to 1.8-2.5 ms, medians of 200 calls); and the C++ wrapper
calls the kernels without Python in between. `compile_function` compiles the same way a step
that spans two models (the fused greedy step's acceptance and drafting, workbench.decoding.fused).
Prefill and training stay eager: they are not per-token costs (and the prefill's expert loop is
data-dependent; compiled, a prompt's prefill took 4-7 ms against 13-19 eager, but its graphs
added 133 s of compiling to every process, so it was not kept).

One graph per model serves every number of new tokens, 1 included: shapes are dynamic and
size-oblivious (torch would otherwise specialise T = 1 into a graph of its own), and where a
matmul's kernel would depend on T the models use plain reductions when compiling, and the
attention reads its keys in whole blocks (`workbench.kernels.reference.keys_in_blocks`: a sum
over exactly n keys put a row's last keys in a scalar tail where n said, and a verify's n is not
its rows' decode n). So a 1-token decode and a k+1-token verify run the same kernels and round
each row identically, in bf16 (64 of 64 embedded-pair bench prompts equal at 128 and at 512
tokens) and in fp32 (tests/test_compiled.py checks both, logits and cache rows). A guard on
T = 1 anywhere in the graph breaks this silently, as a second graph for the verify: in fp32 one
came from a strided view that bf16's casts had hidden (models/mla.py, q_lat), and the tests
count graphs for that reason. With oneDNN's linears one dependency remained,
weights prepacked for the batch size of a graph's first call; the CPP GEMMs have none measured:
compiled 1-token-first on the embedded pair, 1-row and 4-row verifier logits were identical on
all 576 rows checked (12 prompts x 48 tokens). Compiled and eager bf16 round differently from
each other: compare like with like.
Inductor's on-disk graph cache (`TORCHINDUCTOR_CACHE_DIR`) keeps the compiled graphs, so only a
machine's first start with a pair pays the whole compile. The embedded pair, 2 cores: the first
`SpecDecoder` generation of a process took 307 s with an empty cache and 71-80 s with a warm one
(fp32, AVX2); the bench's warm-up, 287 s and then 68 s in a second process, the same tokens
(bf16, AVX512-BF16). Dynamo still traces and freezes every graph; inductor's lowering, code
generation and C++ compilation are what the cache saves. Two things stood in its way, and `_graph_cache_key`
and `_cacheable_onednn_weights` remove them for our compiles only:
- Inductor refused every graph holding oneDNN-packed weights (freezing packs each linear's weight
  so, before the C++ GEMMs repack it), as such tensors cannot be pickled. With freezing, the cache
  never pickles frozen weights: it stores their names and takes their values from the graph being
  compiled on a hit, so such a weight needs only a cache key, its shape and dtype.
- The cache keys frozen weights by shape and dtype alone, while the C++ GEMMs' packed copies of
  them are stored in the entry: another checkpoint of the same shapes would run this one's weights.
  A digest of every tensor the models hold (`weights_digest`) therefore joins each graph's key.
The cache unpickles its entries as it loads the C++ it compiled: files this machine's torch wrote,
not weights from elsewhere. `TORCHINDUCTOR_FX_GRAPH_CACHE=0` turns it off.

After each of our compiles the garbage collector is told to leave the objects alive then alone
(`_freeze_heap`): otherwise its full collections walk the compiler's heap during decoding.

Weights become constants of the compiled graphs: a model whose weights change after
`compile_model` must be compiled again (training never uses this path).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import hashlib
import inspect
import threading
import types

import torch
import torch.fx.experimental._config as fx_config

from workbench.models.mla import ABSORB_MAX_TOKENS

__all__ = ["CompiledForward", "compile_function", "compile_model", "gemm_backends", "is_compiled", "weights_digest"]


# What our graphs compile with. `freezing` must be set while inductor compiles (torch.compile's
# `options` do not reach it); the GEMM backend (per model dtype, `gemm_backends`), the C++
# wrapper and the shape settings are compile-time choices too (module docstring). Floats are
# specialised: otherwise dynamo makes a float of the frame a graph input, fails to keep it one
# and restarts the whole trace (103 of 355 s of the embedded pair's warm-up). All of these are
# applied from dynamo's compile-start callback, only for compiles inside a CompiledForward call:
# patching the configs around every call instead cost ~60 us a call, a few percent of a decode
# step.
_SETTINGS = ({"freezing": True, "cpp_wrapper": True, "max_autotune": True},
             {"backed_size_oblivious": True, "use_duck_shape": False},
             {"specialize_float": True})
_inside = threading.local()
_patches: list[contextlib.ExitStack] = []


def gemm_backends(dtype: torch.dtype) -> str:
    """Where a graph's matmuls come from: inductor's C++ GEMMs (module docstring), except bf16 on
    a CPU without native bf16 arithmetic. There (AVX2, no AVX-512) the C++ GEMM template offers no
    bf16 kernel at all and the compile fails ("NoValidChoicesError"), so those graphs call ATen's
    matmuls; the 1-row and 4-row logits still agree bit for bit (tests/test_compiled.py)."""
    from workbench.machine import machine

    return "ATEN" if dtype == torch.bfloat16 and not machine()["fast_bf16"] else "CPP"


def _on_compile_start(_args=None) -> None:
    if getattr(_inside, "active", False):
        stack = contextlib.ExitStack()
        # set with `active`: the models' GEMM backend (per dtype) and their weights (module docstring)
        per_call = {"max_autotune_gemm_backends": _inside.backends,
                    "post_grad_custom_pre_pass": _graph_cache_key(weights_digest(*_inside.models))}
        stack.enter_context(torch._inductor.config.patch({**_SETTINGS[0], **per_call}))
        stack.enter_context(fx_config.patch(_SETTINGS[1]))
        stack.enter_context(torch._dynamo.config.patch(_SETTINGS[2]))
        _patches.append(stack)


def _on_compile_end(_args=None) -> None:
    # Dynamo runs the callbacks for the outermost of overlapping compiles only (one counter for
    # every thread), so the end may come on another thread than the start: close what was opened.
    if _patches:
        _patches.pop().close()
        _freeze_heap()


def _freeze_heap() -> None:
    """Move every object alive now out of the cyclic garbage collector's reach (`gc.freeze`).

    After the embedded pair's warm-up the process holds ~650k tracked objects (~300k before its
    graphs compiled: graphs, guards and generated code are the rest), and each full collection
    walked them all again: before this, 21% of a speculative run's main-thread samples were in
    the collector (py-spy), and freezing after the warm-up made both decoders faster in one
    process (speculative 711-800 -> 944 tok/s, autoregressive 552-575 -> 641). vLLM freezes after
    its warm-up for the same reason. Objects alive now are still freed by reference counting;
    garbage cycles among them wait for the process's exit (`_register_callbacks` unfreezes then).
    """
    gc.collect()
    gc.freeze()


def weights_digest(*models: torch.nn.Module) -> str:
    """A digest of every tensor that compiled graphs of `models` may freeze into constants.

    Parameters, buffers, plain tensor attributes (RoPE's frequencies) and the modules a draft
    borrows from its verifier (its embedding and lm_head): names, dtypes, shapes and bytes.
    """
    h = hashlib.blake2b(digest_size=20)
    seen: set[int] = set()
    for top in models:
        for owner in (top, *getattr(top, "_shared", {}).values()):
            for name, module in owner.named_modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                tensors = {**module._parameters, **module._buffers,
                           **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
                for attr in sorted(tensors):
                    t = tensors[attr]
                    if t is None:
                        continue
                    h.update(f"{name}.{attr}:{t.dtype}:{tuple(t.shape)};".encode())
                    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _graph_cache_key(digest: str):
    """A post-grad pass that changes nothing: inductor puts a custom pass's `uuid()` in each
    graph's cache key, which is how the weights' digest gets there (module docstring)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class WeightsKey(CustomGraphPass):
        def __call__(self, graph) -> None:
            pass

        def uuid(self) -> str:
            return f"workbench weights {digest}"

    return WeightsKey()


def _cacheable_onednn_weights() -> None:
    """Let inductor's graph cache hold our graphs' frozen oneDNN-packed weights (module docstring).

    Only while one of our compiles runs (`_inside.active`), whose keys carry the weights' digest;
    any other compile in the process keeps inductor's own rules. On a torch without these
    internals nothing changes: such graphs are then compiled afresh in every process, as before.
    """
    try:
        from torch._inductor import codecache
        from torch._inductor.freezing_utils import is_frozen_param

        validator, pickler, ident = codecache.CacheabilityValidator, codecache.FxGraphCachePickler, codecache._ident
        check, reduce = validator.check_tensor, pickler._reduce_tensor
    except (ImportError, AttributeError):
        return
    if getattr(check, "workbench", False):
        return

    def ours(t: torch.Tensor) -> bool:
        return getattr(_inside, "active", False) and t.is_mkldnn and is_frozen_param(t)

    def check_tensor(t: torch.Tensor) -> None:
        if not ours(t):
            check(t)

    def reduce_tensor(self, t: torch.Tensor):
        if ours(t):  # keyed like any frozen weight, by its metadata; its values are in the digest
            return ident, (("frozen oneDNN weight", tuple(t.shape), str(t.dtype)),)
        return reduce(self, t)

    check_tensor.workbench = True
    validator.check_tensor = staticmethod(check_tensor)
    pickler._reduce_tensor = reduce_tensor


def _register_callbacks() -> None:
    from torch._dynamo.callback import callback_handler

    _cacheable_onednn_weights()

    if _on_compile_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_compile_start)
        callback_handler.register_end_callback(_on_compile_end)
        atexit.register(gc.unfreeze)  # the interpreter's last collection then frees what _freeze_heap froze


class CompiledForward:
    """Stands in for `model.forward`: the compiled graph for small cached inference steps, eager otherwise."""

    def __init__(self, fn) -> None:
        import torch._inductor.config  # noqa: F401  (the `freezing` switch; here, not at import: it pulls in Triton)

        _register_callbacks()
        self.eager = fn
        self.signature = inspect.signature(self.eager)
        # Module attributes never change under this wrapper (weights are frozen into the graph),
        # so dynamo's per-parameter guards are skipped: they cost more than a decode step's kernels.
        # Skipped, nothing tells two modules of one class apart (`self` keeps a type guard only),
        # and dynamo keeps its graphs per code object: a second pair of the same shapes would run
        # the first one's frozen weights. So each wrapper compiles its own copy of the code.
        self.compiled = _compile(types.MethodType(_own_function(fn.__func__), fn.__self__))
        self.backends = gemm_backends(next(fn.__self__.parameters()).dtype)
        self.calls = {"compiled": 0, "eager": 0}

    def usable(self, args: dict) -> bool:
        # A cache holding fewer than 2 tokens is a prefill (or the step after a 1-token prompt): eager.
        cache = args.get("cache")
        return (cache is not None and cache.length >= 2 and args["input_ids"].shape[1] <= ABSORB_MAX_TOKENS
                and args.get("attention", "torch") == "torch" and args.get("path", "auto") != "naive"
                and not torch.is_grad_enabled())

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        if not self.usable(bound.arguments):
            self.calls["eager"] += 1
            return self.eager(*args, **kwargs)
        self.calls["compiled"] += 1
        # One graph for every number of new tokens, so that a 1-token decode and a k+1-token
        # verify run the same kernels and round each row alike (in bf16 a greedy near-tie would
        # otherwise flip): no logits_to_keep variant (its rows are cut here instead), and no
        # specialising T = 1 (size-oblivious shapes, no duck sizing). The model's own code uses
        # reductions where a matmul's kernel would depend on T (models/mla.py).
        keep = bound.arguments.pop("logits_to_keep", 0)
        # dynamo, if it compiles during this call, applies _SETTINGS, this model's GEMM backend and its weights' digest
        _inside.active, _inside.backends, _inside.models = True, self.backends, (self.eager.__self__,)
        try:
            out = self.compiled(**bound.arguments)
        finally:
            _inside.active = False
        if keep:
            out = dataclasses.replace(out, logits=out.logits[:, -keep:], hidden_states=out.hidden_states[:, -keep:])
        return out


def compile_function(fn, dtype: torch.dtype = torch.float32):
    """torch.compile a plain function of models and caches, as CompiledForward compiles a forward.

    For a step that spans more than one model call (`workbench.decoding.fused`); `fn` takes its
    models as arguments (their weights key its graphs in inductor's cache). Each call of this
    compiles its own copy of `fn`'s code, so keep one per pair: module guards are skipped as in
    CompiledForward, so two pairs sharing a copy would run the first pair's frozen weights.
    `dtype` is the models' (it picks the GEMMs, `gemm_backends`).
    """
    import torch._inductor.config  # noqa: F401  (as in CompiledForward)

    _register_callbacks()
    compiled = _compile(_own_function(fn))
    backends = gemm_backends(dtype)

    def call(*args, **kwargs):
        # dynamo, if it compiles during this call, applies _SETTINGS, the models' GEMM backend and
        # their weights' digest; the models are the arguments that are modules
        models = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.nn.Module))
        _inside.active, _inside.backends, _inside.models = True, backends, models
        try:
            return compiled(*args, **kwargs)
        finally:
            _inside.active = False

    return call


def _compile(fn):
    # Module guards skipped: see CompiledForward.__init__.
    return torch.compile(fn, dynamic=True, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


def _own_function(func):
    """`func` over a distinct copy of its code object, so dynamo's cache for it is its own."""
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__, own.__qualname__, own.__doc__ = func.__kwdefaults__, func.__qualname__, func.__doc__
    return own


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """Route `model`'s small cached inference steps through torch.compile (in place; returns it).

    Compilation itself happens lazily, on the first call of each shape family; see the module
    docstring for what is compiled and what stays eager. Calling it twice is a no-op.
    """
    if not is_compiled(model):
        model.forward = CompiledForward(model.forward)
        if hasattr(model, "greedy_chain"):  # a draft's k greedy steps, one graph (models/draft.py)
            model.greedy_chain = CompiledForward(model.greedy_chain)
    return model


def is_compiled(model: torch.nn.Module) -> bool:
    return isinstance(model.__dict__.get("forward"), CompiledForward)
