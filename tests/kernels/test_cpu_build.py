"""The CPU kernels' source builds for every x86-64 target cpu.py may meet, whether or not the
kernels serve on this machine (test_cpu_kernels.py is skipped where they do not, so a source that
fails to compile would otherwise go unnoticed: it did, on AVX2, until `status()` was read).
"""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from workbench.kernels import cpu
from workbench.machine import cpu_info

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not shutil.which(cpu._compiler()),
                                reason="needs an x86-64 machine with a C++ compiler")

# a target's flags (after cpu.FLAGS' -march=native: the later -march wins), the flags this CPU
# must have to load the build, and the wb_isa() it must answer
TARGETS = {
    "x86-64": (("-march=x86-64",), (), 0),  # SSE2 only: the kernels are left out, and the library says so
    "avx2": (("-march=x86-64-v3",), ("avx2", "fma"), 1),
    "avx512": (("-march=x86-64-v4",), ("avx512f", "avx512bw", "avx512vl"), 2),
    "avx512-bf16": (("-march=x86-64-v4", "-mavx512bf16"), ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"), 3),
}


def build(tmp_path: Path, target: str) -> Path:
    so = tmp_path / f"{target}.so"
    out = subprocess.run([cpu._compiler(), *cpu.FLAGS, *TARGETS[target][0], str(cpu.SOURCE), "-o", str(so)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{target}:\n{out.stderr[-3000:]}"
    return so


@pytest.mark.parametrize("target", TARGETS)
def test_the_source_builds_for_each_x86_64_target_and_names_its_isa(tmp_path, target):
    so = build(tmp_path, target)
    _, needs, isa = TARGETS[target]
    if not set(needs) <= cpu_info()[1]:
        pytest.skip(f"built; this CPU cannot load a {target} build")
    assert ctypes.CDLL(str(so)).wb_isa() == isa


def test_a_build_without_avx2_declines_and_its_kernels_refuse(tmp_path, monkeypatch):
    """-march=x86-64 (no AVX2): wb_isa() is 0, every kernel returns -1, and cpu.py declines it
    with a reason, so that the models use torch's operations."""
    so = build(tmp_path, "x86-64")
    lib = ctypes.CDLL(str(so))
    assert lib.wb_isa() == 0
    lib.wb_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    assert lib.wb_linear(None, None, None, None, 1, 16, 16, 0) == -1
    monkeypatch.setattr(cpu, "library_path", lambda: so)
    got, why = cpu._load()
    assert got is None and "neither AVX2+FMA nor AVX-512" in why, why


def test_this_machines_own_build_compiles_and_serves_on_avx2_or_avx512(tmp_path, monkeypatch):
    """`-march=native` as cpu.py builds it, into a fresh cache: whatever this CPU is, the source
    compiles, and the kernels serve wherever the CPU has AVX2+FMA or AVX-512."""
    if os.environ.get("WORKBENCH_CPU_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        monkeypatch.delenv("WORKBENCH_CPU_KERNELS")
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    lib, why = cpu._load()
    assert "not built" not in why, why
    flags = cpu_info()[1]
    assert (lib is not None) == ({"avx2", "fma"} <= flags or {"avx512f", "avx512bw", "avx512vl"} <= flags), why


@pytest.mark.parametrize("target", ["avx2", "avx512", "avx512-bf16"])
def test_the_16_lane_helpers_match_the_avx512_instructions_scalar_models(tmp_path, target):
    """lanes_check.cpp holds each build's reductions, exp, bf16 rounding and tail loads and stores
    to one scalar model of the AVX-512 instructions: an AVX2 build and an AVX-512 build of the
    kernels then give the same bits, checked on whichever of them this CPU runs."""
    flags, needs, _ = TARGETS[target]
    if not set(needs) <= cpu_info()[1]:
        pytest.skip(f"this CPU cannot run a {target} build")
    exe = tmp_path / "lanes_check"
    out = subprocess.run([cpu._compiler(), *(f for f in cpu.FLAGS if f not in ("-shared", "-fPIC")), *flags,
                          str(Path(__file__).with_name("lanes_check.cpp")), "-o", str(exe)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and " 0 mismatches" in run.stdout, run.stdout + run.stderr
