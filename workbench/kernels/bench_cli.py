"""`workbench bench-kernels`: the bench on a CUDA GPU (`bench.py`), `--aot` with no GPU (the kernels
compiled for sm_80/90/100, their registers, spills and shared memory: `aot.py`), and `--gpu-report
OUT.json` (the kernel parity tests and the bench in one file: `gpu_check.py`). Apart from `bench.py`
so the bench itself imports neither of the modules that use it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from workbench.kernels import aot, bench, gpu_check


def build_parser() -> argparse.ArgumentParser:
    """`workbench bench-kernels`'s options (the CLI hands its argv to this parser)."""
    parser = argparse.ArgumentParser(prog="workbench bench-kernels", description=bench.__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--batches", type=bench.int_list, default=(1, 8, 32, 64), help="e.g. 1,8,32,64")
    parser.add_argument("--contexts", type=bench.int_list, default=(1024, 4096, 16384), help="tokens")
    parser.add_argument("--query-tokens", type=bench.int_list, default=(1, 4), help="e.g. 1,4")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--aot", action="store_true",
                      help="no GPU needed: compile the kernels for sm_80/90/100 and print registers, "
                           "spills, shared memory, bytes and FLOPs per call (workbench/kernels/aot.py)")
    mode.add_argument("--gpu-report", metavar="OUT.json", default=None,
                      help="CUDA: run the kernel parity tests, then this bench; write one JSON "
                           "(workbench/kernels/gpu_check.py)")
    grid = parser.add_argument_group("--aot grid (with --query-tokens)")
    aot.add_grid_arguments(grid, query_tokens=False)
    gpu_check.add_arguments(parser.add_argument_group("--gpu-report"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point for `workbench bench-kernels`; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.aot:
        return aot.run_from_args(args)
    if args.gpu_report:
        return gpu_check.run_from_args(Path(args.gpu_report), args.pytest_args, args.batches,
                                       args.contexts, args.query_tokens)
    if not torch.cuda.is_available():
        print(bench.NEEDS_GPU, file=sys.stderr)
        return 2
    from workbench.kernels import triton_available

    if not triton_available():
        print("workbench bench-kernels: triton does not import here; install triton>=3.6",
              file=sys.stderr)
        return 2
    result = bench.run(batches=args.batches, contexts=args.contexts, query_tokens=args.query_tokens)
    print(json.dumps(result) if args.json else bench.format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
