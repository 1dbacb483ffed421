"""torch.compile as a transform of a plain model: `compile_models(verifier, draft)`.

gpt-fast's recipe, on the CPU too: the forwards that run once per token (a decode or a verify of
up to `ABSORB_MAX_TOKENS` over the cache, and the engine's greedy chain over the draft with its
fc: `CompiledChain`) run compiled graphs, with inductor's `freezing` (every weight a constant),
its C++ GEMMs over weights packed once (`gemm_backends`) and its C++ wrapper; prefill and
training stay eager.

One graph per model serves every number of new tokens, 1 included (dynamic, size-oblivious
shapes), so a 1-token decode and a k+1-token verify run the same kernels and round each row alike,
in bf16 too. Two twins of the models' modules make that so inside the graphs (eager calls of the
compiled copy run the models' own code): `RowInvariantLatentAttention` (reductions where a
matmul's kernel would depend on T, keys read in whole blocks) and `GatheredMoE` (the chosen
experts' weights gathered in the graph, where the models' loop over experts would break it).
A guard on T = 1 anywhere in the graph would break it silently, as a second graph for the verify;
the tests count graphs for that reason. Measurements: docs/PERFORMANCE.md.

Weights become constants of the graphs: after a weight changes, compile the plain model again.
Nothing of torch's is replaced and no module is re-classed (the twins are new instances over the
models' tensors). Inductor's settings go through torch.compile's `options`; the few that dynamo
reads while tracing have no public API in torch 2.13 and are set, privately, around our calls
only (`_TRACING`; a torch without them raises). Our graphs stay out of inductor's on-disk cache,
which keys frozen weights by shape alone, so each process compiles them again (docs/PERFORMANCE.md).
"""
from __future__ import annotations

import atexit
import contextvars
import dataclasses
import gc
import importlib
import inspect
import types

import torch
from torch import Tensor, nn

from workbench.models.mla import ABSORB_MAX_TOKENS, LatentAttention
from workbench.models.moe import MoE
from workbench.variants import copy_modules

__all__ = ["CompiledChain", "CompiledForward", "compile_function", "compile_models", "gemm_backends", "graphs_serve",
           "is_compiled"]


# Settings our graphs need while dynamo traces them, which torch 2.13 takes from private config
# modules only (torch.compile's `options` reach inductor after dynamo has traced): inductor's
# `freezing`, which dynamo reads to make the weights constants of the graph rather than its inputs
# (pytorch/pytorch#139272); sizes of 0 and 1 left symbolic ("size-oblivious"), so one graph serves
# T = 1 and T = k+1, and no two sizes merged for being equal when traced ("duck shapes"); floats
# specialised, otherwise dynamo restarts whole traces on the frame's floats. `_traced_with_settings`.
_TRACING = {"torch._inductor.config": {"freezing": True},
            "torch.fx.experimental._config": {"backed_size_oblivious": True, "use_duck_shape": False},
            "torch._dynamo.config": {"specialize_float": True}}


def _traced_with_settings(fn):
    """`fn`, each call of it run with `_TRACING` set (private: no public API sets it), in a copy of
    the calling thread's context (torch's configs are context variables): the settings reach the
    compiles inside our calls and no other, and nothing to undo after a call (~6 us a call). A
    torch without one of them raises here, naming it, rather than compile graphs that differ."""
    settings = []
    for name, values in _TRACING.items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            module = None
        missing = [key for key in values if module is None or not hasattr(module, key)]
        if missing:
            raise RuntimeError(f"workbench.compiled needs {', '.join(f'{name}.{k}' for k in missing)}, private "
                               f"settings of torch that no public API sets, and torch {torch.__version__} lacks "
                               "them: run eagerly (`--fast off` or `cpu`), or use torch 2.13")
        settings += [(module, key, value) for key, value in values.items()]

    def with_settings(args, kwargs):
        for module, key, value in settings:
            setattr(module, key, value)
        return fn(*args, **kwargs)

    return lambda *args, **kwargs: contextvars.copy_context().run(with_settings, args, kwargs)


def gemm_backends(dtype: torch.dtype) -> str:
    """Where a graph's matmuls come from: inductor's C++ GEMMs (module docstring), except bf16 on
    a CPU without native bf16 arithmetic. There (AVX2, no AVX-512) the C++ GEMM template offers no
    bf16 kernel at all and the compile fails ("NoValidChoicesError"), so those graphs call ATen's
    matmuls; the 1-row and 4-row logits still agree bit for bit (tests/test_compiled.py)."""
    from workbench.machine import machine

    return "ATEN" if dtype == torch.bfloat16 and not machine()["fast_bf16"] else "CPP"


def _freeze_heap() -> None:
    """Keep the objects alive after a compile out of the cyclic collector's reach (`gc.freeze`):
    its full collections otherwise walk the compiler's heap during decoding (vLLM does the same)."""
    global _unfreeze_at_exit
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)  # the interpreter's last collection then frees what was frozen
        _unfreeze_at_exit = True


_unfreeze_at_exit = False


def graphs_serve(cache, num_new: int) -> bool:
    """Whether a compiled graph serves num_new new tokens over `cache`: a decode or a verify (at most
    ABSORB_MAX_TOKENS) without autograd, over rows that all hold one length, at least 2. A prefill,
    the step after a 1-token prompt and a batch of rows of different lengths run eagerly: the graphs
    are traced and tested for one length every row shares (the one place that asks for it)."""
    lens = cache.lengths
    return (lens.count(lens[0]) == len(lens) and lens[0] >= 2 and num_new <= ABSORB_MAX_TOKENS
            and not torch.is_grad_enabled())


class CompiledForward:
    """Stands in for `model.forward` (or a draft's bound greedy chain, `CompiledChain`): the compiled
    graph for small cached inference steps, eager otherwise."""

    def __init__(self, fn) -> None:
        self.eager = fn
        self.signature = inspect.signature(self.eager)
        # Weights are frozen into the graph, so dynamo's per-parameter guards (dearer than a decode's
        # kernels) are skipped; then only a code object of its own keeps a second pair's graphs apart.
        self.compiled = _compile(types.MethodType(_own_function(fn.__func__), fn.__self__),
                                 next(fn.__self__.parameters()).dtype)
        self.calls = {"compiled": 0, "eager": 0}

    def usable(self, args: dict) -> bool:
        cache = args.get("cache")
        return (cache is not None and graphs_serve(cache, args["input_ids"].shape[1])
                and args.get("path", "auto") != "naive")

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        if not self.usable(bound.arguments):
            self.calls["eager"] += 1
            return self.eager(*args, **kwargs)
        self.calls["compiled"] += 1
        # One graph for every number of new tokens: no logits_to_keep variant (rows are cut here instead).
        keep = bound.arguments.pop("logits_to_keep", 0)
        for name, value in bound.arguments.items():  # a slice's strides would fail the graph's stride guards
            bound.arguments[name] = _contiguous(value)
        out = self.compiled(**bound.arguments)
        if keep:
            out = dataclasses.replace(out, logits=out.logits[:, -keep:], hidden_states=out.hidden_states[:, -keep:])
        return out


class CompiledChain:
    """A compiled draft's way to run the engine's greedy chain (`workbench.decoding.drafters.greedy_chain`,
    handed in with its arguments after the draft): one graph where `graphs_serve`, eagerly elsewhere.
    The graph is compiled on first use, one per draft copy (its weights are the graph's constants)."""

    def __init__(self, draft: nn.Module) -> None:
        self.draft, self.graphs = draft, {}

    def __call__(self, chain, *args):
        if chain not in self.graphs:  # the chain as a method of this draft, as a model's forward is compiled
            self.graphs[chain] = CompiledForward(types.MethodType(chain, self.draft))
        return self.graphs[chain](*args)

    @property
    def calls(self) -> dict[str, int]:
        return {kind: sum(g.calls[kind] for g in self.graphs.values()) for kind in ("compiled", "eager")}


def _contiguous(value):
    if isinstance(value, Tensor):
        return value.contiguous()
    if isinstance(value, tuple) and all(isinstance(v, Tensor) for v in value):
        return tuple(v.contiguous() for v in value)
    return value


def compile_function(fn, dtype: torch.dtype = torch.float32):
    """torch.compile a plain function of models and caches, as CompiledForward compiles a forward.

    For a step that spans more than one model call (`workbench.decoding.fused`); `fn` takes its
    models as arguments. Each call of this compiles its own copy of `fn`'s code, so keep one per
    pair: module guards are skipped as in CompiledForward, so two pairs sharing a copy would run the
    first pair's frozen weights. `dtype` is the models' (it picks the GEMMs, `gemm_backends`).
    """
    return _compile(_own_function(fn), dtype)


def _compile(fn, dtype: torch.dtype):
    """`fn` compiled with our settings: inductor's as torch.compile's options, the ones dynamo reads
    while tracing around each call (`_traced_with_settings`); the heap frozen after the first call."""
    options = {"cpp_wrapper": True, "max_autotune": True, "max_autotune_gemm_backends": gemm_backends(dtype),
               "post_grad_custom_pre_pass": _keep_out_of_graph_cache,
               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}  # see CompiledForward.__init__
    compiled, first = _traced_with_settings(torch.compile(fn, dynamic=True, options=options)), [True]

    def call(*args, **kwargs):
        out = compiled(*args, **kwargs)
        if first:  # the call that compiled its graph (one per function: the tests count graphs)
            first.clear()
            _freeze_heap()
        return out

    return call


def _keep_out_of_graph_cache(graph) -> None:
    """A post-grad pass that changes nothing: inductor's on-disk graph cache refuses ("bypass") a
    graph compiled with a custom pass that cannot name itself in the cache's key, which keeps ours
    out of it. The cache keys frozen weights by shape alone, so a second model of the same shape
    (another pair, another process) would otherwise load the first one's weights."""


def _own_function(func):
    """`func` over a distinct copy of its code object, so dynamo's cache for it is its own."""
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__, own.__qualname__, own.__doc__ = func.__kwdefaults__, func.__qualname__, func.__doc__
    return own


def keys_in_blocks(rows: Tensor, seq_lens: Tensor, n: int) -> tuple[Tensor, int]:
    """The first n of rows [B, S, L+R] as [B, n', L+R] for n' = n rounded up to whole KEY_BLOCKs,
    zeroed past each sequence's length, and n'. Inductor's C++ sums a reduction over n keys as whole
    16-lane vectors and a scalar tail, and a verify's n is not its rows' decode n; over zero-padded
    whole blocks every row gets the same vectors whichever call computes it (the extra terms are
    exact zeros). An index read, not a slice: a slice of a traced length has an unbacked size."""
    n = (n + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK
    pos = torch.arange(n, device=rows.device)
    kv = rows[:, pos.clamp(max=rows.shape[1] - 1)]
    return torch.where((pos[None, :] < seq_lens[:, None])[..., None], kv, torch.zeros_like(kv)), n


KEY_BLOCK = 64  # keys_in_blocks


def row_invariant_attention(q_lat: Tensor, q_pe: Tensor, rows: Tensor, seq_lens: Tensor, bound: int,
                            scale: float) -> Tensor:
    """`latent_attention`'s output in plain reductions over whole key blocks (`keys_in_blocks`): in a
    graph, the same code for each row whatever the number of new tokens (a matmul's would depend on T)."""
    T, L = q_lat.shape[1], q_lat.shape[-1]
    kv, n = keys_in_blocks(rows, seq_lens, bound)
    kv = kv.float()
    q = torch.cat([q_lat, q_pe.contiguous()], dim=-1).float()
    scores = (q[:, :, :, None, :] * kv[:, None, None]).sum(-1) * scale  # [B, T, N, n]
    limit = seq_lens[:, None] - (T - 1 - torch.arange(T, device=rows.device))[None, :]
    visible = torch.arange(n, device=rows.device)[None, None, :] < limit[:, :, None]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return (probs[..., None] * kv[:, None, None, :, :L]).sum(-2).to(q_lat.dtype)


class RowInvariantLatentAttention(LatentAttention):
    """`LatentAttention` in plain reductions inside a compiled graph; eager, the models' own."""

    def forward(self, q_nope: Tensor, q_pe: Tensor, rows: Tensor, seq_lens: Tensor, bound: int, w_uk: Tensor,
                w_uv: Tensor, scale: float) -> Tensor:
        if not torch.compiler.is_compiling():
            return super().forward(q_nope, q_pe, rows, seq_lens, bound, w_uk, w_uv, scale)
        B, T = q_nope.shape[:2]
        # contiguous(): in fp32 `.float()` is a no-op, and inductor specialised T = 1 on this split's strides
        q_lat = (q_nope.float().contiguous()[..., None] * w_uk.float()).sum(-2).to(q_nope.dtype)
        seq_lens = seq_lens.to(torch.int32).reshape(-1).expand(B)  # [B], or 0-d for every sequence
        o_lat = row_invariant_attention(q_lat, q_pe, rows, seq_lens, bound, scale)
        return (o_lat.float()[:, :, :, None, :] * w_uv.float()).sum(-1).to(o_lat.dtype).reshape(B, T, -1)


class GatheredMoE(nn.Module):
    """A `MoE`'s twin over the MoE's own gate and experts (the same tensors, under the same names):
    the chosen experts' weights gathered for a few tokens inside a compiled graph, stacked from the
    parameters there (freezing folds the stack into constants); eager, the models' own loop."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.gate, self.experts, self.shared_experts = moe.gate, moe.experts, moe.shared_experts
        self.train(moe.training)

    forward = MoE.forward  # the model's own: routing, then `routed_experts` below, then the shared experts

    def routed_experts(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        if not torch.compiler.is_compiling() or x.shape[0] > 32:
            return MoE.routed_experts(self, x, weights, ids)
        gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
        down = torch.stack([e.down_proj.weight for e in self.experts])
        n, k = ids.shape
        h = torch.bmm(gate_up[ids.flatten()], x.repeat_interleave(k, 0)[:, :, None])  # [n*k, 2I, 1]
        g, u = h.squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(down[ids.flatten()], (torch.nn.functional.silu(g) * u)[:, :, None]).squeeze(-1)  # [n*k, H]
        return (y.view(n, k, -1) * weights[:, :, None].to(x.dtype)).sum(1)


def _compile_twin(module: nn.Module, name: str) -> nn.Module | None:
    """The compiled copy's stand-in for `module`, a new instance of its twin over the same tensors."""
    if type(module) is LatentAttention:  # no weights of its own: they come in as arguments
        return RowInvariantLatentAttention().train(module.training)
    if type(module) is MoE:
        return GatheredMoE(module)
    return None


def compile_models(*models: torch.nn.Module, memo: dict | None = None) -> tuple[torch.nn.Module, ...]:
    """Copies of plain `models` (a verifier, then its draft) whose small cached inference steps run
    torch.compile'd graphs; the models given are unchanged. Each graph compiles on its first call.
    `memo` as in `workbench.variants.copy_modules`."""
    memo = {} if memo is None else memo
    out = tuple(copy_modules(m, _compile_twin, memo) for m in models)
    for model in out:
        model.forward = CompiledForward(model.forward)
        if hasattr(model, "draft_pass"):  # a draft: the engine's greedy chain, k passes and argmaxes in one graph
            model.run_greedy_chain = CompiledChain(model)
    return out


def is_compiled(model: torch.nn.Module) -> bool:
    return isinstance(model.__dict__.get("forward"), CompiledForward)
