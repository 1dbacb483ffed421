"""Which fast path runs a pair's models, chosen in one place, with the reason.

A pair's models are plain PyTorch (`workbench.models`, the reference). A fast path is a transform
that returns weight-sharing copies of them:

- "cpu":     `workbench.kernels.cpu_modules.accelerate`, the CPU kernels (eager, one call a block);
- "compile": `workbench.compiled.compile_models`, torch.compile'd per-token graphs;
- "off":     the plain models themselves, with the absorbed attention on `attention` ("torch", or
             "triton": `workbench.kernels.with_attention`).

"auto" is "cpu" where the kernels run (a CPU with AVX2 or AVX-512 and a C++ compiler, fp32 or
bf16), else "off"; compiling is never chosen for you (its first start takes minutes). The
Triton attention replaces the CPU kernels' and the compiled graphs' own attention, so asking for
it means the plain path.

`weights` is how the CPU kernels hold the linears' weights: "native" (the models' dtype), or
int8 ("int8": a scale per output channel; "int8-b32": a scale per output channel and 32 inputs),
quantised once when the pair is accelerated, the activations staying in the models' dtype
(`workbench.kernels.cpu`); or "bf16" for fp32 models: the weights rounded to bf16 once, the
activations, norms, attention and sums staying fp32 (for bf16 models "bf16" is their own weights,
"native"). Packed weights exist only on the CPU kernels: asking for them elsewhere is an error,
never a silent fall back to the plain weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FAST = ("auto", "cpu", "compile", "off")
WEIGHTS = ("native", "int8", "int8-b32", "bf16")  # = workbench.kernels.cpu.WEIGHTS (imported lazily there)
_WEIGHTS_TEXT = {"int8": "int8 weights (a scale per output channel)",
                 "int8-b32": "int8 weights (a scale per output channel and 32 inputs)",
                 "bf16": "bf16 weights, fp32 activations"}


@dataclass(frozen=True)
class FastPath:
    name: str  # "cpu" | "compile" | "off"
    attention: str  # the absorbed attention's backend where the plain modules run: "torch" | "triton"
    why: str
    weights: str = "native"  # the CPU kernels' weights: "native" | "int8" | "int8-b32" | "bf16"

    def describe(self) -> str:
        what = {"cpu": "CPU kernels", "compile": "torch.compile", "off": "plain PyTorch"}[self.name]
        if self.name == "cpu":  # the count now: it follows torch's and cpu.set_threads
            from workbench.kernels import cpu

            what += f" on {cpu.threads_text()}"
        if self.weights != "native":
            what += f", {_WEIGHTS_TEXT[self.weights]}"
        return f"{what}, attention {self.attention}: {self.why}"


def choose(fast: str, device: torch.device | str, dtype: torch.dtype, attention: str = "auto",
           weights: str = "native") -> FastPath:
    """The path for models on `device` in `dtype`, their linears' weights as `weights` says; an
    impossible request is an error saying why."""
    from workbench.kernels import cpu, resolve_backend

    if fast not in FAST:
        raise ValueError(f"fast = {fast!r}; expected one of {', '.join(FAST)}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights = {weights!r}; expected one of {', '.join(WEIGHTS)}")
    device = torch.device(device)
    attention = resolve_backend(attention, device)
    if weights == "bf16" and dtype == torch.bfloat16:
        weights = "native"  # a bf16 model's weights are bf16 already: its native path
    if weights != "native":
        return _quantised(fast, device, dtype, attention, weights)
    if attention == "triton":
        if fast in ("cpu", "compile"):
            raise ValueError(f"fast = {fast!r} runs its own attention; attention 'triton' needs fast 'off' or 'auto'")
        return FastPath("off", "triton", "the Triton MLA kernel serves the absorbed attention")
    if fast == "off":
        return FastPath("off", "torch", "asked for (fast='off')")
    if fast == "compile":
        return FastPath("compile", "torch", "asked for (fast='compile')")
    usable = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if fast == "cpu":
        if not usable or not cpu.available():
            why = cpu.status() if usable else f"they take fp32 or bf16 on the CPU, not {dtype} on {device}"
            raise RuntimeError(f"fast = 'cpu': the CPU kernels cannot run these models: {why}")
        return FastPath("cpu", "torch", f"asked for; {cpu.status(with_threads=False)}")
    if usable and cpu.available():
        return FastPath("cpu", "torch", f"auto: {cpu.status(with_threads=False)}")
    why = cpu.status() if usable else f"the CPU kernels take fp32 or bf16 on the CPU, not {dtype} on {device}"
    return FastPath("off", "torch", f"auto: {why}")


def _quantised(fast: str, device: torch.device, dtype: torch.dtype, attention: str, weights: str) -> FastPath:
    """The CPU kernels with packed weights (int8, bf16), or why they cannot be had (no other path holds them)."""
    from workbench.kernels import cpu

    asked = f"weights = {weights!r} needs the CPU kernels"
    if fast in ("compile", "off"):
        raise ValueError(f"{asked}; fast = {fast!r} runs the plain weights: use fast 'cpu' or 'auto'")
    if attention == "triton":
        raise ValueError(f"{asked}, which run their own attention; attention 'triton' runs the plain weights")
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError(f"{asked}: they take fp32 or bf16 activations on the CPU, not {dtype} on {device}")
    if weights == "bf16" and dtype != torch.float32:
        raise RuntimeError(f"{asked} and fp32 activations, not {dtype}")
    if not cpu.available():
        raise RuntimeError(f"{asked}: they cannot run here: {cpu.status()}")
    return FastPath("cpu", "torch", f"asked for (weights {weights!r}); {cpu.status(with_threads=False)}", weights)


def apply(path: FastPath, *models: torch.nn.Module, memo: dict | None = None) -> tuple[torch.nn.Module, ...]:
    """`models` (a verifier, then its draft) as `path` runs them: copies, or the models themselves."""
    if path.name == "cpu":
        from workbench.kernels.cpu_modules import accelerate

        return accelerate(*models, memo=memo, weights=path.weights)
    if path.name == "compile":
        from workbench.compiled import compile_models

        return compile_models(*models, memo=memo)
    if path.attention == "triton":
        from workbench.kernels import with_attention

        return with_attention("triton", *models, memo=memo)
    return models
