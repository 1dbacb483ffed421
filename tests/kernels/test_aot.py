"""The Triton MLA kernels compiled ahead of time for sm_80, sm_90 and sm_100, on a CPU.

Every variant the wrapper can launch (`aot.variant_grid`) is compiled once per session, with the
pinned Triton and its bundled ptxas, in child processes (this process runs Triton interpreted).
Each target's variants must compile, stay within the shared memory and spill budget that
`triton_mla.config_budget` claims for the config lists, and use the list's first config.
"""
import os
import re

import torch

if not torch.cuda.is_available():  # must precede the first `import triton` anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from workbench.kernels import aot, triton_available  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton does not import here")

GRID = aot.variant_grid()
# sm_90, bf16, paged, 64 heads: the tile the config list used before these tests (BLOCK_R 64).
SPILLING = aot.Variant(90, "bfloat16", True, 1, 64, 4,
                       config=(("BLOCK_R", 64), ("BLOCK_N", 64), ("num_warps", 8), ("num_stages", 2)))


@pytest.fixture(scope="module")
def aot_results() -> dict[str, dict]:
    """The whole grid (plus one known-spilling tile), compiled once: about 70 distinct kernels."""
    variants = GRID + [SPILLING]
    return {v.label(): r for v, r in zip(variants, aot.compile_variants(variants))}


def test_aot_grid_is_every_launch_the_issue_names():
    """3 targets x bf16/fp16/fp32 x paged or not x Sq 1/4 x 16/64/128 heads x 1 or 4 splits."""
    assert len(GRID) == 3 * 3 * 2 * 2 * 3 * 2 == len({v.label() for v in GRID})
    assert {v.arch for v in GRID} == {80, 90, 100} and {v.kv_lora for v in GRID} == {512}
    assert {v.rope for v in GRID} == {64} and {v.q_len for v in GRID} == {1, 4}


@pytest.mark.slow
@pytest.mark.parametrize("arch", aot.TARGETS)
def test_aot_every_variant_compiles_within_its_claims(aot_results, arch):
    mine = {label: r for label, r in aot_results.items() if label.startswith(f"sm_{arch}-")
            and r["variant"]["config"] == []}
    assert len(mine) == len(GRID) // 3
    problems = [p for r in mine.values() for p in aot.check(r)]
    assert not problems, "\n".join(problems)
    for r in mine.values():
        stage1 = r["kernels"][0]
        # the first config is the one compiled, and it is the one that fits (checked above)
        assert stage1["kernel"] == "_mla_split_kernel" and stage1["config"] == r["configs"][0]
        assert 0 < stage1["shared_bytes"] and 32 <= stage1["registers"] <= 255
        assert [k["kernel"] for k in r["kernels"][1:]] == (
            ["_mla_merge_kernel"] if r["variant"]["num_kv_splits"] > 1 else [])


@pytest.mark.slow
def test_aot_figures_come_from_the_compiles(aot_results):
    """Different tiles give different figures, and a tile known to spill is caught."""
    def stage1(arch):
        return aot_results[aot.Variant(arch, "bfloat16", True, 1, 64, 4).label()]["kernels"][0]

    assert stage1(80)["config"]["BLOCK_N"] == 32 and stage1(90)["config"]["BLOCK_N"] == 64
    assert stage1(80)["shared_bytes"] < stage1(90)["shared_bytes"]  # half the KV tile
    spilling = aot_results[SPILLING.label()]
    assert spilling["kernels"][0]["spill_store_bytes"] > 0
    problems = aot.check(spilling)
    assert any("spills" in p for p in problems) and any("not the list's first" in p for p in problems)


def test_aot_check_reports_each_broken_claim():
    ok = dict(kernel="_mla_split_kernel", shared_bytes=1024, registers=128, num_warps=8,
              spill_store_bytes=0, spill_load_bytes=0, stack_bytes=0,
              config=dict(BLOCK_R=32, BLOCK_N=32, num_warps=8, num_stages=2))
    result = dict(variant=aot.Variant(80, "bfloat16", True, 1, 64, 4).__dict__, kernels=[ok],
                  configs=[ok["config"]])
    assert aot.check(result) == []
    too_big = dict(ok, shared_bytes=100 * 1024)  # sm_8x's budget is 99 KB (sm_86/sm_89)
    assert "shared memory" in " ".join(aot.check(dict(result, kernels=[too_big])))
    spills = dict(ok, spill_store_bytes=4, spill_load_bytes=4)
    assert "spills 4 B" in " ".join(aot.check(dict(result, kernels=[spills])))
    regs = dict(ok, registers=255, num_warps=16)
    assert "registers" in " ".join(aot.check(dict(result, kernels=[regs])))
    later = dict(ok, config=dict(ok["config"], BLOCK_N=16))
    assert "not the list's first" in " ".join(aot.check(dict(result, kernels=[later])))
    failed = dict(variant=result["variant"], error="CompilationError: tl.dot K < 16")
    assert "does not compile" in aot.check(failed)[0]


def test_aot_reads_registers_and_spills_from_the_ptxas_log():
    log = ("ptxas info    : Compiling entry function '_mla_split_kernel' for 'sm_90a'\n"
           "ptxas info    : Function properties for _mla_split_kernel\n"
           "    288 bytes stack frame, 280 bytes spill stores, 276 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 288 bytes cumulative stack size\n")
    assert aot._ptxas_figures(log) == dict(registers=255, stack_bytes=288, spill_store_bytes=280,
                                           spill_load_bytes=276)
    with pytest.raises(RuntimeError, match="ptxas log"):
        aot._ptxas_figures("ptxas info    : 0 bytes gmem\n")


def test_aot_shards_keep_a_target_and_dtype_together():
    shards = aot._shards(GRID, jobs=2)
    assert len(shards) == 2 and sorted(v.label() for s in shards for v in s) == sorted(
        v.label() for v in GRID)
    for shard in shards:
        others = [v for s in shards if s is not shard for v in s]
        assert not {(v.arch, v.dtype) for v in shard} & {(v.arch, v.dtype) for v in others}


@pytest.mark.slow
def test_bench_kernels_aot_prints_the_table(aot_results, capsys, monkeypatch):
    """`workbench bench-kernels --aot` on a small grid: one line per variant, bytes and FLOPs."""
    from workbench.kernels import bench_cli
    from workbench.kernels.triton_mla import mla_bytes

    # the table is the module's job; reuse the fixture's compiles instead of compiling again
    monkeypatch.setattr(aot, "compile_variants",
                        lambda variants, jobs=None: [aot_results[v.label()] for v in variants])
    assert bench_cli.main(["--aot", "--archs", "90", "--dtypes", "bfloat16", "--paged", "yes",
                       "--heads", "64", "--query-tokens", "1,4", "--batch", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln for ln in lines if re.match(r"\s+90 bfloat16", ln)]
    assert len(rows) == 4 and all(ln.endswith("yes") for ln in rows)
    mb = mla_bytes(8, aot.CONTEXT, 1, 64, 512, 64, 2) / 1e6
    assert f"{mb:.2f}" in rows[0] and "32/64/8/2" in rows[0]
