"""Sweeps over k: exact pooled counters, the timing terms, the recommendation and its agreement check."""
from __future__ import annotations

import csv
import io
import json

import pytest
import torch

import workbench as wb
from tests.helpers import make_random_pair
from tests.test_doctor import PROMPTS, make_copy_pair
from workbench.analysis.metrics import merge_stats
from workbench.analysis.sweep import run_sweep


@pytest.fixture(scope="module")
def copy_pair(tmp_path_factory):
    return wb.load_pair(*make_copy_pair(tmp_path_factory.mktemp("copy")))


@pytest.fixture(scope="module")
def sweep(copy_pair):
    calls = []
    res = run_sweep(copy_pair, PROMPTS, ks=[3, 1], max_new_tokens=8, progress=lambda i, n, s: calls.append((i, n, s)))
    return res, calls


def test_progress_and_layout(sweep):
    res, calls = sweep
    n = 2 * 3  # prompts x (baseline + 2 ks)
    assert [c[:2] for c in calls] == [(i, n) for i in range(n + 1)] and calls[-1][2] == "done"
    assert [(p.temperature, p.k) for p in res.points] == [(0.0, 0), (0.0, 1), (0.0, 3)]
    assert res.ks == [1, 3] and res.attention == "torch"


def test_points_pool_every_prompt_exactly(sweep, copy_pair):
    res, _ = sweep
    for k in (1, 3):
        p = res.point(0.0, k)
        runs = [wb.SpecDecoder(copy_pair, k).generate(q, 8) for q in PROMPTS]  # greedy: the same steps again
        ref = merge_stats([r.stats for r in runs])
        s = p.stats
        assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == \
               (ref.num_drafts, ref.num_draft_tokens, ref.num_accepted_tokens)
        assert s.accepted_per_pos == ref.accepted_per_pos
        assert s.accepted_length_histogram == ref.accepted_length_histogram
        # the copy pair accepts every proposal: conditional and unconditional rates are exactly 1
        assert s.num_accepted_tokens == s.num_draft_tokens
        assert s.conditional_acceptance == [1.0] * k and s.per_position_acceptance == [1.0] * k
        assert p.per_prompt_accept_length == [r.stats.accept_length for r in runs]
        assert p.matches_baseline == 2  # greedy speculation is lossless
        assert s.num_tokens == sum(len(r.tokens) for r in runs) == 16
        events = [e for r in runs for e in r.events if e.kind == "spec"]
        assert p.draft_forwards == sum(max(e.k, 1) for e in events) and p.verify_forwards == len(events)
        assert p.draft_forward_time == pytest.approx(s.draft_time / p.draft_forwards)
        assert p.verify_forward_time == pytest.approx(s.verify_time / p.verify_forwards)
        assert p.c == pytest.approx(p.draft_forward_time / p.verify_forward_time)
        assert p.tokens_per_s == pytest.approx(s.num_tokens / s.elapsed)
        assert p.speedup == pytest.approx(p.tokens_per_s / res.point(0.0, 0).tokens_per_s)
    base = res.point(0.0, 0)
    assert base.speedup == 1.0 and base.c == 0.0 and base.verify_forwards == 2 * 7  # 8 tokens: 1 prefill + 7 decodes


def test_pooled_c_and_recommendation(sweep):
    res, _ = sweep
    spec = [res.point(0.0, k) for k in res.ks]
    draft = sum(p.stats.draft_time for p in spec) / sum(p.draft_forwards for p in spec)
    verify = sum(p.stats.verify_time for p in spec) / sum(p.verify_forwards for p in spec)
    assert res.c(0.0) == pytest.approx(draft / verify)
    rec = res.recommendation(0.0)
    assert rec.expected_lengths == {k: k + 1.0 for k in range(4)}  # alpha = 1 at every position
    measured = {p.k: p.tokens_per_s for p in res.points}
    assert rec.measured_best_k == max(measured, key=measured.get)
    if rec.agrees:
        assert rec.k == rec.measured_best_k and "the sweep agrees" in rec.reason
    else:  # the result must say why the model and the measurement differ
        assert f"k={rec.measured_best_k}" in rec.reason and "sweep" in rec.reason
    with pytest.raises(KeyError, match="temperature 0.5"):
        res.recommendation(0.5)


def test_rows_json_and_summary(sweep):
    res, _ = sweep
    rows = res.rows()
    assert [(r["temperature"], r["k"]) for r in rows] == [(0.0, 0), (0.0, 1), (0.0, 3)]
    assert rows[2]["stats_per_position_acceptance_2"] == 1.0 and "stats_per_position_acceptance_0" not in rows[0]
    out = io.StringIO()
    fields = list(dict.fromkeys(f for r in rows for f in r))
    csv.DictWriter(out, fields).writeheader()
    d = json.loads(json.dumps(res.to_dict()))
    assert d["recommendations"]["0.0"]["k"] == res.recommendation(0.0).k
    assert [p["k"] for p in d["points"]] == [0, 1, 3] and d["points"][1]["accept_length"] == 2.0
    text = res.summary()
    assert "recommended k =" in text and "autoregressive" in text


def test_temperatures_and_validation(tmp_path):
    pair = wb.load_pair(*make_random_pair(tmp_path, layers=3, aux_layer_ids=(0, 1, 2)))
    res = run_sweep(pair, ["def f(x):"], ks=[2], temperatures=[0.0, 0.8], max_new_tokens=5, seed=3)
    assert [(p.temperature, p.k) for p in res.points] == [(0.0, 0), (0.0, 2), (0.8, 0), (0.8, 2)]
    assert res.point(0.8, 2).matches_baseline is None and res.point(0.0, 2).matches_baseline in (0, 1)
    assert set(res.pooled) == {0.0, 0.8}
    assert "temperature 0.8" in res.summary()
    for bad, match in [(dict(ks=[0]), "ks"), (dict(ks=[]), "ks"), (dict(ks=[1, 1]), "each k once"),
                       (dict(ks=[1], temperatures=[-1.0]), "temperatures"), (dict(ks=[1], max_new_tokens=0),
                                                                            "max_new_tokens")]:
        with pytest.raises(ValueError, match=match):
            run_sweep(pair, ["x"], **bad)
    with pytest.raises(ValueError, match="prompts"):
        run_sweep(pair, [], ks=[1])
    with pytest.raises(wb.RequestError, match="no draft"):
        run_sweep(pair.with_draft(None), ["x"], ks=[1])
    assert torch.get_num_threads() == 1
