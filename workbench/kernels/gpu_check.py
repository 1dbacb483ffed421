"""One command for a CUDA machine: the kernel parity tests, then `bench-kernels`, in one JSON.

    python -m workbench.kernels.gpu_check --out gpu-report.json
    workbench bench-kernels --gpu-report gpu-report.json        (the same)

On a GPU, tests/kernels runs the Triton kernels for real against their PyTorch twin (on CPU
the same tests use the interpreter), and the bench times them against the device's copy
bandwidth. The JSON holds the device, the versions, every test's outcome and the bench's
rows, so one file carries both "is it right" and "how fast" from a machine we rarely get.
The AOT compile tests are left out by default: they need no GPU and CI runs them.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from workbench.kernels.bench import NEEDS_GPU

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTEST_ARGS = (str(REPO / "tests" / "kernels"), "-q", "-k", "not aot", "-p", "no:cacheprovider")


class _Outcomes:
    """pytest plugin: one record per test (its call phase, or the phase that failed or skipped)."""

    def __init__(self) -> None:
        self.tests: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":  # setup errors, skips
            rec = self.tests.setdefault(report.nodeid, dict(nodeid=report.nodeid, duration_s=0.0))
            if rec.get("outcome") in (None, "passed"):
                rec["outcome"] = report.outcome if report.when == "call" else (
                    "skipped" if report.skipped else "error")
            rec["duration_s"] = round(rec["duration_s"] + report.duration, 3)
            if report.outcome == "failed":
                rec["message"] = str(report.longrepr)[-2000:]


def collect_test_outcomes(pytest_args: list[str] | tuple[str, ...] = DEFAULT_PYTEST_ARGS) -> dict:
    """Run pytest in this process; returns the exit code, counts by outcome and every test."""
    import pytest

    plugin = _Outcomes()
    start = time.perf_counter()
    exit_code = int(pytest.main(list(pytest_args), plugins=[plugin]))
    tests = list(plugin.tests.values())
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return dict(args=list(pytest_args), exit_code=exit_code, counts=counts,
                seconds=round(time.perf_counter() - start, 1), tests=tests)


def environment() -> dict:
    """Device, driver-side and library versions: what a figure needs beside it."""
    import triton

    env = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    return env


def run(out: Path, pytest_args: list[str] | tuple[str, ...] = DEFAULT_PYTEST_ARGS,
        **bench_kwargs) -> dict:
    """Tests, then the bench; writes and returns the report. Needs a CUDA GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError(NEEDS_GPU)
    from workbench.kernels import bench

    report = dict(environment=environment(), tests=collect_test_outcomes(pytest_args))
    try:
        report["bench"] = bench.run(**bench_kwargs)
    except Exception as err:  # keep the test outcomes even when the bench dies (OOM, driver)
        report["bench"] = dict(error=f"{type(err).__name__}: {err}")
    rows = report["bench"].get("rows", [])
    report["summary"] = dict(
        tests_ok=report["tests"]["exit_code"] == 0, counts=report["tests"]["counts"],
        copy_bandwidth_gbps=report["bench"].get("copy_bandwidth_gbps"),
        best_gbps=max((r["gbps"] for r in rows), default=None),
        best_copy_bw_fraction=max((r["copy_bw_fraction"] for r in rows), default=None))
    out.write_text(json.dumps(report, indent=1))
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--pytest-args` (shared by `bench-kernels --gpu-report`)."""
    parser.add_argument("--pytest-args", default=None,
                        help="what pytest runs, one shell-quoted string (default: tests/kernels "
                             "-q -k 'not aot': the parity tests, not the CPU-only compiles)")


def main(argv: list[str] | None = None) -> int:
    """`python -m workbench.kernels.gpu_check --out X.json`; 2 without a CUDA GPU."""
    from workbench.kernels.bench import int_list

    parser = argparse.ArgumentParser(prog="python -m workbench.kernels.gpu_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON report to write")
    add_arguments(parser)
    parser.add_argument("--batches", type=int_list, default=(1, 8, 32, 64))
    parser.add_argument("--contexts", type=int_list, default=(1024, 4096, 16384))
    parser.add_argument("--query-tokens", type=int_list, default=(1, 4))
    args = parser.parse_args(argv)
    return run_from_args(Path(args.out), args.pytest_args, args.batches, args.contexts,
                         args.query_tokens)


def run_from_args(out: Path, pytest_args: str | None, batches: tuple[int, ...],
                  contexts: tuple[int, ...], query_tokens: tuple[int, ...]) -> int:
    """Shared by `main` and `workbench bench-kernels --gpu-report`; 0 when every test passed."""
    if not torch.cuda.is_available():
        print(NEEDS_GPU, file=sys.stderr)
        return 2
    report = run(out, shlex.split(pytest_args) if pytest_args else DEFAULT_PYTEST_ARGS,
                 batches=batches, contexts=contexts, query_tokens=query_tokens)
    s = report["summary"]
    print(f"{out}: tests {s['counts']}, copy bandwidth {s['copy_bandwidth_gbps']} GB/s, "
          f"best {s['best_gbps']} GB/s")
    return 0 if s["tests_ok"] and "error" not in report["bench"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
