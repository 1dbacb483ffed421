"""bf16 linears on AMX tiles (cpu_kernels.cpp's linear_columns_amx) beside the vdpbf16ps path.

A tile multiply sums 32 k's of products in its own way, so its bits are neither vdpbf16ps's nor
two fmas'. What must hold is what makes speculation lossless: each row's bits do not depend on the
rows, threads or tails of the call, so a one-row decode and a (k+1)-row verify agree, on either
path. The tests that need the tiles are skipped where this CPU or its OS has none.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.kernels import cpu
from workbench.machine import cpu_info

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels: {cpu.status()}")


@pytest.fixture
def tiles():
    """AMX on for the test (skipped where it cannot be), and the setting restored after."""
    before = cpu.amx()
    if not cpu.set_amx(True):
        pytest.skip(f"no AMX tiles here: {cpu.status(with_threads=False)}")
    yield
    cpu.set_amx(before)


def both_paths(packed: cpu.PackedLinear, x: torch.Tensor, residual: torch.Tensor | None = None):
    """The linear on the tiles, then on vdpbf16ps (the setting left on the tiles)."""
    on = packed(x, residual=residual)
    cpu.set_amx(False)
    try:
        off = packed(x, residual=residual)
    finally:
        cpu.set_amx(True)
    return on, off


def test_a_cpu_without_amx_is_never_switched_onto_the_tiles():
    before = cpu.amx()
    try:
        granted = cpu.set_amx(True)
        if not {"amx_tile", "amx_bf16"} <= cpu_info()[1]:
            assert not granted and "AMX" not in cpu.status()
        assert not cpu.set_amx(False) and "AMX" not in cpu.status()
    finally:
        cpu.set_amx(before)


@pytest.mark.parametrize("N, K", [(192, 256), (100, 96), (33, 200), (17, 10), (40, 7), (1, 2)])
def test_tiles_give_each_row_its_own_bits_in_any_batch(tiles, N, K):
    """Rows 1 to 40 (a tile holds 16), K with and without a tail past the last 32, N past the
    last 16 outputs: every row's bits equal its one-row call's, with or without a residual."""
    gen = torch.Generator().manual_seed(N * 1000 + K)
    W = torch.randn(N, K, generator=gen).bfloat16()
    packed = cpu.PackedLinear(W)
    for M in (1, 2, 15, 16, 17, 40):
        x = torch.randn(M, K, generator=gen).bfloat16()
        y = packed(x)
        assert ((y.double() - F.linear(x.double(), W.double())).abs() / (y.double().abs() + 1)).max() < 8e-3
        assert torch.equal(torch.cat([packed(x[i:i + 1]) for i in range(M)]), y), M
        r = torch.randn(M, N, generator=gen).bfloat16()
        assert torch.equal(packed(x, residual=r), y + r)


def test_the_tiles_are_another_path_than_vdpbf16ps_and_agree_with_it(tiles):
    """The switch changes the path (some bits differ at K = 256) and both stay within bf16's
    rounding of the exact product."""
    gen = torch.Generator().manual_seed(7)
    W = torch.randn(512, 256, generator=gen).bfloat16()
    x = torch.randn(8, 256, generator=gen).bfloat16()
    on, off = both_paths(cpu.PackedLinear(W), x)
    exact = F.linear(x.double(), W.double())
    assert not torch.equal(on, off)
    for y in (on, off):
        assert ((y.double() - exact).abs() / (exact.abs() + 1)).max() < 8e-3
    assert (on != off).float().mean() < 0.2  # mostly the same bf16, differing in a last bit at most
    assert ((on.double() - off.double()).abs() <= 2 * on.double().abs() * 2 ** -8 + 1e-30).all()


@pytest.mark.parametrize("amx", [True, False], ids=["tiles", "vdpbf16ps"])
def test_bf16_speculation_equals_plain_decoding_on_either_path(tiles, amx):
    """The whole pair (MoE spans, the lm_head, the draft's chain) on one path: a verify's rows
    are a decode's, so speculation gives plain decoding's tokens bit for bit."""
    cpu.set_amx(amx)
    pair = wb.load_pair(dtype="bfloat16")
    prompt = 'def parse_header(line):\n    """Split a header line into a name and a value."""'
    ar = wb.generate_autoregressive(pair, prompt, 48)
    for k in (1, 3):
        assert wb.SpecDecoder(pair, k).generate(prompt, 48).tokens == ar.tokens, k


def test_workbench_amx_0_serves_vdpbf16ps():
    code = "from workbench.kernels import cpu; print(cpu.available(), cpu.amx(), cpu.status())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "WORKBENCH_AMX": "0"}, timeout=300)
    assert out.returncode == 0, out.stderr
    available, amx, why = out.stdout.split(" ", 2)
    assert available == "True" and amx == "False" and "AMX" not in why, out.stdout
