"""Ahead-of-time compiles of the Triton MLA kernels for GPUs that are not on this machine.

A kernel that is exact in Triton's interpreter can still fail on a real GPU: tile shapes
`tl.dot` refuses, shared memory over the SM's budget, register spills in the KV loop. Triton's
wheel ships `ptxas` (and the Blackwell `ptxas-blackwell`), so `triton.compile` with a
`GPUTarget` builds the real cubin for sm_80, sm_90 (sm_90a) and sm_100 (sm_100a) on a CPU.

For every variant the wrapper can launch (`variant_grid`: dtype, paged or not, query tokens,
heads, one KV split or several, per target) this builds the launch with the wrapper's own
`triton_mla.plan_launch` on CPU tensors of the real layout (so strides, alignment and the
integer arguments Triton specialises on are those of a real call), compiles the first stage-1
config of the list and the merge kernel, and reads:
* shared memory from the compiled kernel's metadata (`metadata.shared`, what the launcher
  compares with the device's limit);
* registers, stack frame and spill stores/loads from the `ptxas -v` log of the compile itself
  (Triton only learns `n_regs`/`n_spills` when a driver loads the cubin, which needs a GPU).
`check` holds each result to `triton_mla.config_budget`, the claim beside the config lists.

Triton picks the interpreter when it is imported, and the test process imports it interpreted
(tests/conftest.py), so the compiles run in child processes started with TRITON_INTERPRET=0,
each with a fresh Triton cache so that ptxas runs and its log is there to read.

`python -m workbench.kernels.aot` (or `workbench bench-kernels --aot`) prints the table.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TARGETS = (80, 90, 100)  # Ampere (A100), Hopper (H100/H200), Blackwell (B200)
DTYPES = ("bfloat16", "float16", "float32")
KV_LORA, ROPE = 512, 64  # DeepSeek-V3 / Kimi-K2
HEADS = (16, 64, 128)  # a tensor-parallel slice, Kimi-K2, DeepSeek-V3
QUERY_TOKENS = (1, 4)  # decode, and verification of k = 3 drafts (k + 1 tokens)
# One split: stage 1 writes the output in its dtype. Several: fp32 partials + the merge kernel.
# 4 stands for any count > 1 (a count divisible by 16 only changes an alignment hint).
SPLITS = (1, 4)
CONTEXT = 4096  # cache capacity of the compiled calls (a multiple of 16, like real caches)
PAGE_SIZE = 64
REGISTERS_PER_BLOCK = 65536  # every target here: 64K 32-bit registers per SM and per block
WORKER_TIMEOUT_S = 1800

_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class Variant:
    """One launch the wrapper can make, on one target."""
    arch: int  # 80, 90, 100: sm_XY
    dtype: str
    paged: bool
    q_len: int
    heads: int
    num_kv_splits: int
    kv_lora: int = KV_LORA
    rope: int = ROPE
    # stage-1 block sizes as (name, value) pairs instead of the list's first: what would
    # another tile cost? (`check` then reports that the list's first was not compiled)
    config: tuple = ()

    @classmethod
    def from_dict(cls, d: dict) -> "Variant":
        """Inverse of `dataclasses.asdict` (JSON turns the config pairs into lists)."""
        return cls(**{**d, "config": tuple(tuple(pair) for pair in d.get("config", ()))})

    @property
    def capability(self) -> tuple[int, int]:
        return self.arch // 10, self.arch % 10

    def label(self) -> str:
        tiles = "".join(f"-{k}{v}" for k, v in self.config)
        return (f"sm_{self.arch}-{self.dtype}-{'paged' if self.paged else 'contig'}-Sq{self.q_len}"
                f"-H{self.heads}-splits{self.num_kv_splits}{tiles}")


def variant_grid(archs: tuple[int, ...] = TARGETS, dtypes: tuple[str, ...] = DTYPES,
                 paged: tuple[bool, ...] = (False, True),
                 query_tokens: tuple[int, ...] = QUERY_TOKENS, heads: tuple[int, ...] = HEADS,
                 splits: tuple[int, ...] = SPLITS) -> list[Variant]:
    """Every combination of the axes (the issue's grid is the default)."""
    return [Variant(a, d, p, q, h, s) for a in archs for d in dtypes for p in paged
            for q in query_tokens for h in heads for s in splits]


# %%
# The child process: build each launch, compile it, read the ptxas log.


def _launch_tensors(v: Variant) -> dict:
    """CPU tensors with the layout of a real call (batch 1, CONTEXT tokens of cache)."""
    import torch

    dtype = getattr(torch, v.dtype)
    width = v.kv_lora + v.rope
    t = dict(q_lat=torch.empty(1, v.q_len, v.heads, v.kv_lora, dtype=dtype),
             q_pe=torch.empty(1, v.q_len, v.heads, v.rope, dtype=dtype),
             seq_lens=torch.full((1,), CONTEXT, dtype=torch.int32), block_table=None)
    if v.paged:
        pages = CONTEXT // PAGE_SIZE
        t["cache"] = torch.empty(pages, PAGE_SIZE, width, dtype=dtype)
        t["block_table"] = torch.arange(pages, dtype=torch.int32).view(1, pages)
    else:
        t["cache"] = torch.empty(1, CONTEXT, width, dtype=dtype)
    return t


def _ptxas_figures(log: str) -> dict:
    regs, spills = _PTXAS_REGS.search(log), _PTXAS_SPILLS.search(log)
    if regs is None or spills is None:
        raise RuntimeError(f"workbench/kernels/aot.py: no register/spill line in the ptxas log:\n{log}")
    return dict(registers=int(regs.group(1)), stack_bytes=int(spills.group(1)),
                spill_store_bytes=int(spills.group(2)), spill_load_bytes=int(spills.group(3)))


class _Compiler:
    """Compiles launches for GPUTargets, each distinct specialisation once per process."""

    def __init__(self) -> None:
        self._done: dict[str, dict] = {}

    def compile(self, kernel, args: tuple, kwargs: dict, arch: int) -> dict:
        import triton
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature

        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        # Triton's own launch path (JITFunction.run) without a driver: bind the arguments,
        # specialise them (constant 1s, 16-byte alignment, divisibility) and pack the options.
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                                  specialization, options)
        key = repr((kernel.fn.__name__, arch, signature, constexprs, attrs, options))
        if key in self._done:
            return dict(self._done[key], reused=True)
        log = io.StringIO()
        start = time.perf_counter()
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v's report
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                      target=target, options=options.__dict__)
        result = dict(kernel=kernel.fn.__name__, shared_bytes=int(compiled.metadata.shared),
                      num_warps=int(compiled.metadata.num_warps),
                      num_stages=int(compiled.metadata.num_stages),
                      compile_s=round(time.perf_counter() - start, 2),
                      **_ptxas_figures(log.getvalue()))
        self._done[key] = result
        return dict(result, reused=False)


def _compile_variant(v: Variant, compiler: _Compiler) -> dict:
    from workbench.kernels import triton_mla
    from workbench.kernels.reference import check_mla_inputs

    if triton_mla.INTERPRETED:
        raise RuntimeError("workbench/kernels/aot.py: compiles need TRITON_INTERPRET unset or 0 "
                           "before triton is imported (use compile_variants, which sees to it)")
    t = _launch_tensors(v)
    shapes = check_mla_inputs(t["q_lat"], t["q_pe"], t["cache"], t["seq_lens"], t["block_table"])
    plan = triton_mla.plan_launch(t["q_lat"], t["q_pe"], t["cache"], t["seq_lens"], 0.1,
                                  t["block_table"], v.num_kv_splits, shapes,
                                  num_sms=132,  # only picks a split count; the variant names one
                                  capability=v.capability)
    config = dict(v.config) if v.config else plan.configs[0]
    stage1 = compiler.compile(triton_mla._mla_split_kernel, plan.stage1_args,
                              {**plan.stage1_meta, **config}, v.arch)
    kernels = [dict(stage1, config=config)]
    if plan.merge_grid is not None:
        kernels.append(dict(compiler.compile(triton_mla._mla_merge_kernel, plan.merge_args,
                                             plan.merge_meta, v.arch),
                            config=dict(BLOCK_M=plan.merge_meta["BLOCK_M"],
                                        num_warps=plan.merge_meta["num_warps"])))
    return dict(kernels=kernels, configs=plan.configs)


def _worker(in_path: str, out_path: str) -> None:
    variants = [Variant.from_dict(v) for v in json.loads(Path(in_path).read_text())]
    compiler = _Compiler()
    results = []
    for v in variants:
        try:
            results.append(dict(variant=asdict(v), **_compile_variant(v, compiler)))
        except Exception as err:  # one variant failing is a finding, not the end of the run
            results.append(dict(variant=asdict(v), error=f"{type(err).__name__}: {err}"[:4000]))
    Path(out_path).write_text(json.dumps(results))


# %%
# The parent: shard the grid over child processes, then check and print.


def _shards(variants: list[Variant], jobs: int) -> list[list[Variant]]:
    """Groups sharing (target, dtype) stay together: only they can share a specialisation."""
    groups: dict[tuple, list[Variant]] = {}
    for v in variants:
        groups.setdefault((v.arch, v.dtype), []).append(v)
    shards: list[list[Variant]] = [[] for _ in range(max(1, min(jobs, len(groups))))]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(shards, key=len).extend(group)
    return [s for s in shards if s]


def default_jobs() -> int:
    """One child per core (each compile is single-threaded), at most 4."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def compile_variants(variants: list[Variant], jobs: int | None = None) -> list[dict]:
    """Compile every variant in child processes; one result dict per variant, in order.

    A result has `variant`, and either `error` or `kernels` (stage 1, then the merge kernel
    when there are several splits: shared/register/spill figures, the config) and `configs`
    (the whole stage-1 list; the first one is what was compiled).
    """
    jobs = default_jobs() if jobs is None else jobs
    package_root = str(Path(__file__).resolve().parents[2])  # the folder that holds `workbench/`
    with tempfile.TemporaryDirectory(prefix="workbench-aot-") as tmp:
        procs = []
        for i, shard in enumerate(_shards(variants, jobs)):
            in_path, out_path = os.path.join(tmp, f"in{i}.json"), os.path.join(tmp, f"out{i}.json")
            Path(in_path).write_text(json.dumps([asdict(v) for v in shard]))
            env = dict(os.environ, TRITON_INTERPRET="0",
                       TRITON_CACHE_DIR=os.path.join(tmp, f"cache{i}"),  # ptxas runs, logs
                       PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]),
                       OMP_NUM_THREADS="1")
            env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said aloud
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "workbench.kernels.aot", "--worker", in_path, out_path],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out_path))
        by_label = {}
        try:
            for proc, out_path in procs:
                output, _ = proc.communicate(timeout=WORKER_TIMEOUT_S)
                if proc.returncode != 0 or not os.path.exists(out_path):
                    raise RuntimeError(f"workbench/kernels/aot.py: compile worker exited "
                                       f"{proc.returncode}:\n{output[-4000:]}")
                for r in json.loads(Path(out_path).read_text()):
                    by_label[Variant.from_dict(r["variant"]).label()] = r
        finally:  # a failed or timed-out worker must not leave its siblings compiling
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return [by_label[v.label()] for v in variants]


def check(result: dict) -> list[str]:
    """What in one result breaks the config lists' claims (`triton_mla.config_budget`)."""
    from workbench.kernels.triton_mla import config_budget

    v = Variant.from_dict(result["variant"])
    if "error" in result:
        return [f"{v.label()}: does not compile: {result['error']}"]
    budget = config_budget(v.capability)
    problems = []
    if result["kernels"][0]["config"] != result["configs"][0]:
        problems.append(f"{v.label()}: compiled {result['kernels'][0]['config']}, "
                        f"not the list's first {result['configs'][0]}")
    for k in result["kernels"]:
        name = f"{v.label()} {k['kernel']} {k['config']}"
        if k["shared_bytes"] > budget["shared_bytes"]:
            problems.append(f"{name}: {k['shared_bytes']} B of shared memory, over the "
                            f"{budget['shared_bytes']} B budget of sm_{v.capability[0]}x")
        if k["spill_store_bytes"] > budget["spill_bytes"] or k["spill_load_bytes"] > budget["spill_bytes"]:
            problems.append(f"{name}: spills {k['spill_store_bytes']} B stored / "
                            f"{k['spill_load_bytes']} B loaded per thread "
                            f"(claimed at most {budget['spill_bytes']})")
        if k["registers"] * 32 * k["num_warps"] > REGISTERS_PER_BLOCK:
            problems.append(f"{name}: {k['registers']} registers x {32 * k['num_warps']} "
                            f"threads > {REGISTERS_PER_BLOCK}")
    return problems


def format_table(results: list[dict], batch: int = 1, context: int = CONTEXT) -> str:
    """One line per variant: stage-1 config and resources, the merge kernel's, and cost."""
    from workbench.kernels.triton_mla import config_budget, mla_bytes, mla_flops

    lines = [f"Triton MLA kernels compiled ahead of time (L={KV_LORA} R={ROPE}; bytes and FLOPs "
             f"per call at batch {batch}, context {context}, from mla_bytes/mla_flops)",
             f"{'sm':>4} {'dtype':>8} {'paged':>5} {'Sq':>2} {'H':>4} {'splits':>6} "
             f"{'R/N/warps/stages':>16} {'regs':>4} {'spill B':>7} {'smem KB':>7} {'budget':>6} "
             f"{'merge regs/spill':>16} {'MB/call':>8} {'GFLOP':>7} {'FLOP/B':>6} ok"]
    for r in results:
        v = Variant.from_dict(r["variant"])
        head = (f"{v.arch:>4} {v.dtype:>8} {'yes' if v.paged else 'no':>5} {v.q_len:>2} "
                f"{v.heads:>4} {v.num_kv_splits:>6}")
        if "error" in r:
            lines.append(f"{head} does not compile: {r['error'][:80]}")
            continue
        s1 = r["kernels"][0]
        c = s1["config"]
        merge = (f"{r['kernels'][1]['registers']}/{r['kernels'][1]['spill_store_bytes']}"
                 if len(r["kernels"]) > 1 else "-")
        elem = 4 if v.dtype == "float32" else 2
        nbytes = mla_bytes(batch, context, v.q_len, v.heads, v.kv_lora, v.rope, elem)
        flops = mla_flops(batch, context, v.q_len, v.heads, v.kv_lora, v.rope)
        cfg = f"{c['BLOCK_R']}/{c['BLOCK_N']}/{c['num_warps']}/{c['num_stages']}"
        lines.append(
            f"{head} {cfg:>16} {s1['registers']:>4} {s1['spill_store_bytes']:>7} "
            f"{s1['shared_bytes'] / 1024:>7.1f} {config_budget(v.capability)['shared_bytes'] // 1024:>6} "
            f"{merge:>16} {nbytes / 1e6:>8.2f} {flops / 1e9:>7.2f} {flops / nbytes:>6.1f} "
            f"{'yes' if not check(r) else 'NO'}")
    return "\n".join(lines)


def _csv(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x.strip())


def add_grid_arguments(parser: argparse.ArgumentParser, query_tokens: bool = True) -> None:
    """The grid's axes as options (shared by `bench-kernels --aot`, which has its own
    `--query-tokens` and passes query_tokens=False)."""
    parser.add_argument("--archs", type=_csv(int), default=TARGETS, help="e.g. 80,90,100")
    parser.add_argument("--dtypes", type=_csv(str), default=DTYPES, help="e.g. bfloat16,float16")
    parser.add_argument("--paged", choices=("yes", "no", "both"), default="both")
    if query_tokens:
        parser.add_argument("--query-tokens", type=_csv(int), default=QUERY_TOKENS, help="e.g. 1,4")
    parser.add_argument("--heads", type=_csv(int), default=HEADS, help="e.g. 16,64,128")
    parser.add_argument("--splits", type=_csv(int), default=SPLITS, help="KV splits, e.g. 1,4")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: cores, <= 4)")
    parser.add_argument("--batch", type=int, default=1, help="batch for bytes/FLOPs per call")
    parser.add_argument("--context", type=int, default=CONTEXT, help="context for bytes/FLOPs per call")


def run_from_args(args: argparse.Namespace) -> int:
    """Compile the grid the options name, print the table (or JSON); 1 if a claim breaks."""
    paged = {"yes": (True,), "no": (False,), "both": (False, True)}[args.paged]
    variants = variant_grid(args.archs, args.dtypes, paged, args.query_tokens, args.heads,
                            args.splits)
    start = time.perf_counter()
    results = compile_variants(variants, args.jobs)
    problems = [p for r in results for p in check(r)]
    if args.json:
        print(json.dumps(dict(results=results, problems=problems,
                              seconds=round(time.perf_counter() - start, 1))))
    else:
        print(format_table(results, args.batch, args.context))
        print(f"{len(variants)} variants compiled in {time.perf_counter() - start:.0f} s")
        for p in problems:
            print(f"claim broken: {p}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m workbench.kernels.aot [grid options] [--json]`; `--worker IN OUT` is internal."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(prog="python -m workbench.kernels.aot",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_grid_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
