"""torch.compile for the forwards that run once per token: gpt-fast's recipe, on the CPU too.

At the tiny pair's size a decode step is a few hundred small ops and each costs more in
dispatch than in arithmetic (measured here, one thread: a 1x256 @ 256x256 matmul takes ~8 us
in fp32 and ~40 us in bf16, where the arithmetic is well under 1 us). Compiling the verifier's decode/verify forward (1 to
`ABSORB_MAX_TOKENS` new tokens over the cache) and the draft's steps fuses the elementwise
work into generated C++, and inductor's `freezing` prepacks every weight once, so a token
costs a fraction of its eager time. Prefill and training stay eager: they are not per-token
costs (and the prefill's expert loop is data-dependent).

Shapes are dynamic (the cache length and the number of new tokens change every step), so a
model compiles a handful of graphs once, not one per length: torch specialises sizes of 1,
so decode (T = 1) and verify / draft first pass (T > 1) are separate graphs, as are "logits
for the last token" and "logits for all". Inductor caches generated code on disk
(`TORCHINDUCTOR_CACHE_DIR`), but tracing and freezing run again in every process, so a later
start is shorter, not instant (minutes on a 2-core CPU for the embedded pair either way).
float32 only: `ModelPair.compile` says why.

Weights become constants of the compiled graphs: a model whose weights change after
`compile_model` must be compiled again (training never uses this path).
"""
from __future__ import annotations

import inspect

import torch
import torch._inductor.config  # noqa: F401  (the `freezing` switch below)

from workbench.models.mla import ABSORB_MAX_TOKENS

__all__ = ["CompiledForward", "compile_model", "is_compiled"]


class CompiledForward:
    """Stands in for `model.forward`: the compiled graph for small cached inference steps, eager otherwise."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.eager = model.forward
        self.signature = inspect.signature(self.eager)
        # Module attributes never change under this wrapper (weights are frozen into the graph),
        # so dynamo's per-parameter guards are skipped: they cost more than a decode step's kernels.
        self.compiled = torch.compile(self.eager, dynamic=True, options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.calls = {"compiled": 0, "eager": 0}

    def usable(self, args: tuple, kwargs: dict) -> bool:
        # A cache holding fewer than 2 tokens is a prefill (or the step after a 1-token prompt):
        # eager, since torch specialises lengths 0 and 1 and would compile extra graphs for them.
        bound = self.signature.bind(*args, **kwargs).arguments
        cache = bound.get("cache")
        return (cache is not None and cache.length >= 2 and args[0].shape[1] <= ABSORB_MAX_TOKENS
                and bound.get("attention", "torch") == "torch" and bound.get("path", "auto") != "naive"
                and not torch.is_grad_enabled())

    def __call__(self, *args, **kwargs):
        if self.usable(args, kwargs):
            self.calls["compiled"] += 1
            # `freezing` must be set while inductor compiles (torch.compile's `options` do not
            # reach it): weights become constants and linears get oneDNN-prepacked weights.
            with torch._inductor.config.patch(freezing=True):
                return self.compiled(*args, **kwargs)
        self.calls["eager"] += 1
        return self.eager(*args, **kwargs)


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """Route `model`'s small cached inference steps through torch.compile (in place; returns it).

    Compilation itself happens lazily, on the first call of each shape family; see the module
    docstring for what is compiled and what stays eager. Calling it twice is a no-op.
    """
    if not is_compiled(model):
        model.forward = CompiledForward(model)
    return model


def is_compiled(model: torch.nn.Module) -> bool:
    return isinstance(model.__dict__.get("forward"), CompiledForward)
