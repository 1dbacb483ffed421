"""Sweeps over the batch size: the measured points, the crossover, the schedule for vLLM, the cache
bytes against the configs, adaptive k against static k, and the command line."""
from __future__ import annotations

import json

import pytest
from tests.helpers import REPO

import workbench as wb
from workbench.analysis.batching import BatchPoint, BatchSweepResult, compare_policies, default_policies, run_batch_sweep
from workbench.analysis.protocol import Interval
from workbench.cli import main
from workbench.batch_schedule import read_schedule

PROMPTS = [json.loads(line)["prompt"] for line in (REPO / "assets/prompts/code.jsonl").read_text().splitlines()[:4]]


@pytest.fixture(scope="module")
def pair():
    return wb.load_pair(dtype="bfloat16")


@pytest.fixture(scope="module")
def sweep(pair):
    return run_batch_sweep(pair, PROMPTS, [1, 2, 4], [1, 2], max_new_tokens=8, repeats=1)


def test_every_batch_size_and_k_is_measured_against_its_own_baseline(sweep, pair):
    assert [(p.batch_size, p.k) for p in sweep.points] == [(b, k) for b in (1, 2, 4) for k in (0, 1, 2)]
    for p in sweep.points:
        assert p.tokens_per_s.median > 0 and p.per_request_tokens_per_s > 0 and p.step_ms > 0
        assert 1 <= p.occupancy <= p.batch_size
        # every continuation judged by the loop rule; without loops the clean figure is the pooled one
        assert p.num_requests == 4 and 0 <= p.degenerate <= 4 and p.row()["degenerate"] == p.degenerate
        if p.degenerate == 0:
            assert p.accept_length_clean == pytest.approx(p.accept_length)
        if p.k:
            assert p.matches_baseline == 4  # greedy: every request's tokens equal the batched baseline's
            assert 1 < p.accept_length <= p.k + 1 and p.error is None and p.cost > 0
        else:
            assert p.speedup.pooled == 1 and p.accept_length == 1
    # the cache bytes each batch size allocated are the configs' figure, and grow with B
    for p in sweep.points:
        assert p.cache_bytes == p.cache_bytes_hand and (p.cache_bytes["draft"] > 0) == (p.k > 0)
    assert sweep.point(4, 1).cache_bytes["verifier"] == 2 * sweep.point(2, 1).cache_bytes["verifier"]
    costs = sweep.step_costs()
    assert costs(2, 1) == pytest.approx(sweep.point(2, 1).cost)
    d = sweep.to_dict()
    assert read_schedule(d["num_speculative_tokens_per_batch_size"], 2).to_list() == d["schedule_list"]
    assert d["speculative_config"]["num_speculative_tokens_per_batch_size"] == d["num_speculative_tokens_per_batch_size"]
    assert d["gpu_model"]["summary"].startswith("Roofline MODEL") and d["crossover"] == sweep.crossover()
    assert "num_speculative_tokens_per_batch_size" in sweep.summary() and "MODEL" in sweep.summary()


def _result(speedups: dict[tuple[int, int], float]) -> BatchSweepResult:
    """A sweep with given pooled speedups (the decision logic alone)."""
    def iv(x: float) -> Interval:
        return Interval(x, x, x, x, x, x)

    sizes = sorted({b for b, _ in speedups})
    ks = sorted({k for _, k in speedups})
    points = [BatchPoint(b, k, iv(100.0), 10.0, iv(speedups[b, k] if k else 1.0), 2.0, b, 1.0, 1.0, {}, {}, None)
              for b in sizes for k in [0, *ks]]
    return BatchSweepResult(sizes, ks, 16, 1, 8, points)


def test_crossover_best_k_and_schedule_follow_the_measurement():
    r = _result({(1, 1): 1.3, (1, 3): 1.6, (2, 1): 1.2, (2, 3): 1.1, (4, 1): 0.95, (4, 3): 0.9,
                 (8, 1): 1.01, (8, 3): 0.8, (16, 1): 0.9, (16, 3): 0.7})
    assert r.best_k() == {1: 3, 2: 1, 4: 0, 8: 1, 16: 0}
    assert r.crossover() == {"overall": 16, "per_k": {1: 16, 3: 4}}  # k=1 pays again at 8: not crossed until 16
    sched = r.schedule(3)
    assert sched.to_map() == {"1-1": 3, "2-3": 1, "4-7": 0, "8-15": 1, "16-16": 0}
    assert [sched.k_for(b) for b in (1, 2, 4, 8, 16, 64)] == [3, 1, 0, 1, 0, 0]  # past 16: vLLM's tail inherits
    assert _result({(1, 2): 1.5, (8, 2): 1.2}).crossover()["overall"] is None  # still pays at the largest B


def test_a_best_k_measured_on_loops_is_called_out():
    r = _result({(1, 1): 1.3, (1, 3): 1.6, (2, 1): 1.2, (2, 3): 1.1})
    r.point(1, 3).degenerate, r.point(1, 3).num_requests = 3, 4  # B = 1's best: 3 of 4 loop
    r.point(2, 1).degenerate, r.point(2, 1).num_requests = 2, 4  # B = 2's best: half, not most
    r.point(2, 3).degenerate, r.point(2, 3).num_requests = 4, 4  # loops, but not the best at B = 2
    assert r.best_k() == {1: 3, 2: 1} and r.rests_on_loops() == [1]
    assert "CAUTION: at B = [1] the best k was measured on mostly looping continuations" in r.summary()
    assert r.to_dict()["best_k_rests_on_loops"] == [1]
    assert "CAUTION" not in _result({(1, 1): 1.3}).summary()


def test_bad_sweeps_are_refused(pair):
    with pytest.raises(ValueError, match="batch sizes"):
        run_batch_sweep(pair, PROMPTS, [0, 2], [1])
    with pytest.raises(ValueError, match="4 prompts for batch size 8"):
        run_batch_sweep(pair, PROMPTS, [1, 8], [1])
    with pytest.raises(ValueError, match="ks"):
        run_batch_sweep(pair, PROMPTS, [1], [wb.MAX_K + 1])


def test_adaptive_policies_against_every_static_k(pair, sweep):
    out = compare_policies(pair, PROMPTS, default_policies(sweep.step_costs(), 2), [1, 2], batch_size=2,
                           max_new_tokens=8, repeats=1)
    assert set(out["results"]) == {"autoregressive", "k=1", "k=2", "confidence 0.5", "goodput EMA"}
    assert out["best_static"] in ("k=1", "k=2")
    for name, r in out["results"].items():
        assert r.matches_baseline == 4, name  # every policy is lossless
        assert (r.vs_best_static is None) == (name == "autoregressive")
        assert 0 <= r.degenerate <= 4 and (r.accept_length_clean is None) == (r.degenerate == 4)
    assert out["results"][out["best_static"]].vs_best_static.pooled == 0


def test_the_command_line_sweeps_batch_sizes_and_compares_policies(capsys):
    prompts = str(REPO / "assets/prompts/smoke.jsonl")
    assert main(["sweep", "--prompts", prompts, "--batch-sizes", "1,2", "--ks", "0,1", "--max-new-tokens", "4",
                 "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(p["batch_size"], p["k"]) for p in out["points"]] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    read_schedule(out["num_speculative_tokens_per_batch_size"], 1)
    assert main(["adaptive", "--prompts", prompts, "--ks", "1,2", "--max-new-tokens", "4", "--repeats", "1",
                 "--batch-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["results"]) == {"autoregressive", "k=1", "k=2", "confidence 0.5", "goodput EMA"}
    assert main(["sweep", "--prompts", prompts, "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes = '1,x'" in capsys.readouterr().err
