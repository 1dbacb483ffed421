"""Sweeps over k on real pairs: exact pooled counters, timing terms from the same run, physics'
bound, the recommendation and its outputs, the CLI, and a cold process's untimed warm-up."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import workbench as wb
from tests.helpers import REPO, make_random_pair
from tests.test_doctor import PROMPTS, make_copy_pair
from workbench.analysis import sweep as sweep_module
from workbench.decoding.stats import compute_stats
from workbench.analysis.sweep import run_sweep
from workbench.cli import main


@pytest.fixture(scope="module")
def copy_pair(tmp_path_factory):
    return wb.load_pair(*make_copy_pair(tmp_path_factory.mktemp("copy")))


@pytest.fixture(scope="module")
def sweep(copy_pair):
    calls = []
    res = run_sweep(copy_pair, PROMPTS, ks=[3, 1], max_new_tokens=8, repeats=2,
                    progress=lambda i, n, s: calls.append((i, n, s)))
    return res, calls


def test_progress_and_layout(sweep):
    res, calls = sweep
    n = 2 * 2 * 3  # prompts x repeats x (baseline + 2 ks)
    assert [c[:2] for c in calls] == [(i, n) for i in range(n + 1)] and calls[-1][2].endswith("done")
    assert [(p.temperature, p.k) for p in res.points] == [(0.0, 0), (0.0, 1), (0.0, 3)]
    assert res.ks == [1, 3] and res.attention == "torch" and res.repeats == 2 and res.acceptance == "draft"
    m = res.measurements[0.0]
    assert [o[0] for o in m.orders] == ["autoregressive", "k=1", "k=1", "k=3"]  # rotating by prompt and repeat


def test_points_pool_every_prompt_exactly(sweep, copy_pair):
    res, _ = sweep
    for k in (1, 3):
        p = res.point(0.0, k)
        runs = [wb.SpecDecoder(copy_pair, k).generate(q, 8) for q in PROMPTS]  # greedy: the same steps again
        ref = compute_stats([e for r in runs for e in r.events])
        s = p.stats
        assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == \
               (ref.num_drafts, ref.num_draft_tokens, ref.num_accepted_tokens)
        assert s.accepted_per_pos == ref.accepted_per_pos
        assert s.accepted_length_histogram == ref.accepted_length_histogram
        # the copy pair accepts every proposal: conditional and unconditional rates are exactly 1
        assert s.conditional_acceptance == [1.0] * k and s.per_position_acceptance == [1.0] * k
        assert p.per_prompt_accept_length == [r.stats.accept_length for r in runs]
        assert p.matches_baseline == 2  # greedy speculation is lossless
        assert s.num_tokens == sum(len(r.tokens) for r in runs) == 16


def test_timing_terms_come_from_the_cells(sweep):
    res, _ = sweep
    m, model = res.measurements[0.0], res.models[0.0].model
    base = m.cell_timings("autoregressive")
    t_dec = sum(t.decode_s for t in base) / sum(t.decode_tokens for t in base)
    assert model.t_decode == pytest.approx(t_dec)
    for k in (1, 3):
        p, ts = res.point(0.0, k), m.cell_timings(f"k={k}")
        steps = sum(t.steps for t in ts)
        assert p.verify_decodes == pytest.approx(sum(t.verify_s for t in ts) / steps / t_dec)
        assert p.draft_decodes == pytest.approx(sum(t.draft_s for t in ts) / sum(t.draft_forwards for t in ts) / t_dec)
        assert p.tokens_per_s.median == pytest.approx(m.rate(f"k={k}").median)
        assert p.speedup.lo <= p.speedup.median <= p.speedup.hi
        assert p.bound <= p.accept_length + 1e-9 and p.model_speedup == res.models[0.0].speedup[k]
        assert p.prefill_ms > 0


def test_recommendation_outputs_json_and_summary(sweep):
    res, _ = sweep
    rec = res.recommendation(0.0)
    assert rec.k in (0, 1, 3) and set(rec.tied) <= {0, 1, 3} - {rec.k} and rec.decided == (not rec.tied)
    pooled = {p.k: p.speedup.pooled for p in res.points}
    assert pooled[0] == 1.0 and all(math.isfinite(v) for v in pooled.values())  # a NaN baseline always "won"
    assert rec.k == max(pooled, key=lambda k: (pooled[k], -k))  # the fastest pooled speedup
    assert rec.model_k == res.models[0.0].best and rec.agrees == (rec.model_k in [rec.k, *rec.tied])
    if rec.tied:
        assert rec.reason.startswith("Too few samples to decide:") and "cannot be told apart" in rec.reason
    else:
        assert rec.reason.startswith(f"Recommended k = {rec.k}")
    d = json.loads(json.dumps(res.to_dict()))
    assert d["recommendations"]["0.0"]["k"] == rec.k and [p["k"] for p in d["points"]] == [0, 1, 3]
    assert d["points"][1]["accept_length"] == 2.0 and len(d["cells"]["0.0"]) == 4
    assert set(d["points"][1]["speedup"]) == {"median", "lo", "hi", "min", "max", "pooled"}
    text = res.summary()
    assert "autoregressive" in text and "[" in text and "step-cost model" in text
    with pytest.raises(KeyError, match="temperature 0.5"):
        res.recommendation(0.5)


def test_loops_are_counted_and_the_recommendation_says_it_rests_on_them(sweep):
    """The copy pair's verifier repeats the last token forever: every continuation loops, so no clean
    figure exists and the recommendation warns that its evidence is looping text."""
    res, _ = sweep
    for p in res.points:
        assert p.degenerate == 2 and p.accept_length_clean is None and p.split.num_requests == 2
        assert p.row()["degenerate"] == 2 and p.row()["accept_length_clean"] is None
    rec = res.recommendation(0.0)
    assert rec.mostly_loops and "rests mostly on looping text: 2 of 2 continuations loop" in rec.reason
    d = json.loads(json.dumps(res.to_dict()))
    assert d["recommendations"]["0.0"]["mostly_loops"] and d["points"][2]["per_prompt_degenerate"] == [True, True]
    assert list(d["points"][2]["accept_length_by_position"]) == ["0-31", "32-63", "64-127", "128+"]
    header = next(line for line in res.summary().splitlines() if line.lstrip().startswith("k "))
    assert "clean" in header and "loops" in header and " n/a    2/2 " in res.summary()


def test_per_position_rates_never_rank_k(sweep):
    """Rates fall with k by arithmetic alone; the recommendation reads speedups, so rewriting every
    point's per-position rates (here: k=3's to 0, the others' to 1) leaves it as it was."""
    res, _ = sweep
    before = res.recommendation(0.0)
    saved = {p.k: (p.stats.per_position_acceptance, p.stats.conditional_acceptance) for p in res.points}
    try:
        for p in res.points:
            rate = 0.0 if p.k == before.k else 1.0
            p.stats.per_position_acceptance = [rate] * p.k
            p.stats.conditional_acceptance = [rate] * p.k
        after = res.recommendation(0.0)
    finally:
        for p in res.points:
            p.stats.per_position_acceptance, p.stats.conditional_acceptance = saved[p.k]
    assert (after.k, after.tied, after.runner_up) == (before.k, before.tied, before.runner_up)


def test_outputs_for_vllm(copy_pair):
    res = run_sweep(copy_pair, PROMPTS, ks=[2], max_new_tokens=8, repeats=1, draft_name="org/draft")
    o = sweep_module._outputs(res, 0.0, 2)
    assert o["k"] == 2 and o["note"] is None
    assert o["speculative_config"] == {"model": "org/draft", "method": "eagle3", "num_speculative_tokens": 2}
    assert o["synthetic_acceptance"]["synthetic_acceptance_rates"] == [1.0, 1.0]  # the copy pair accepts all
    p = res.point(0.0, 2)  # under 3: the budget's last step proposes fewer
    assert o["synthetic_acceptance_length"]["synthetic_acceptance_length"] == round(p.accept_length, 4) <= 3.0
    block = o["spec_decode_metrics"]
    assert sum(block["acceptance_histogram"]) == block["num_spec_steps"]
    assert block["num_accepted_draft_tokens"] == block["num_draft_tokens"] and block["draft_acceptance_rate"] == 1.0
    assert len(o["per_request_spec_decode_metrics"]) == len(PROMPTS)


def test_a_baseline_slower_than_its_own_forwards_is_a_measurement_error(copy_pair, monkeypatch):
    """A baseline whose wall time is inflated 20x past its forwards (a stalled, cold or preempted run) makes
    every speedup exceed accept_length x t_decode / t_verify: the points are set aside, not reported. (20x,
    not less: on a loaded machine the speculative arm's own runs can stall a few times over too.)"""
    real = sweep_module.generate_autoregressive

    def stalled(*args, **kwargs):
        res = real(*args, **kwargs)
        prefill = sum(e.verify_time for e in res.events if e.kind == "prefill")
        res.stats.elapsed = prefill + 20 * (res.stats.elapsed - prefill)
        return res

    monkeypatch.setattr(sweep_module, "generate_autoregressive", stalled)
    res = run_sweep(copy_pair, PROMPTS, ks=[1, 2], max_new_tokens=12, repeats=2)
    for k in (1, 2):
        p = res.point(0.0, k)
        assert p.speedup.lo > p.bound and "exceeds accept_length x t_decode / t_verify" in p.error
    rec = res.recommendation(0.0)
    assert rec.set_aside == [1, 2] and rec.k == 0 and "Set aside as measurement errors" in rec.reason
    assert rec.outputs["k"] in (1, 2) and "did not pay" in rec.outputs["note"]
    assert "MEASUREMENT ERROR" in res.summary()


def test_synthetic_sweep_names_its_rule(copy_pair):
    res = run_sweep(copy_pair, PROMPTS[:1], ks=[1, 2], max_new_tokens=10, repeats=1, synthetic_rates=[0.0, 0.0])
    assert res.acceptance == "synthetic [0.0, 0.0]" and "not lossless" in res.acceptance_rules[0.0]
    assert res.point(0.0, 2).accept_length == 1.0  # rates of 0 reject every proposal of a perfect draft


def test_temperatures_and_validation(tmp_path):
    pair = wb.load_pair(*make_random_pair(tmp_path, layers=3, aux_layer_ids=(0, 1, 2)))
    res = run_sweep(pair, ["def f(x):"], ks=[2], temperatures=[0.0, 0.8], max_new_tokens=5, seed=3, repeats=1)
    assert [(p.temperature, p.k) for p in res.points] == [(0.0, 0), (0.0, 2), (0.8, 0), (0.8, 2)]
    assert res.point(0.8, 2).matches_baseline is None and res.point(0.0, 2).matches_baseline in (0, 1)
    assert "rejection (greedy draft, one-hot q)" == res.acceptance_rules[0.8] and res.acceptance_rules[0.0] == "greedy"
    assert "temperature 0.8" in res.summary()
    block = run_sweep(pair, ["def f(x):"], ks=[2], temperatures=[0.8], max_new_tokens=5, repeats=1, acceptor="block",
                      draft_sampling="sample")
    assert block.acceptance_rules[0.8] == "block (sampled draft, its real q)"
    with pytest.raises(ValueError, match="expected one of them"):
        run_sweep(pair, ["x"], ks=[2], acceptor="block", synthetic_rates=[0.5])
    for bad, match in [(dict(ks=[0]), "ks"), (dict(ks=[17]), "ks"), (dict(ks=[]), "ks"),
                       (dict(ks=[1, 1]), "each k once"), (dict(ks=[1], temperatures=[-1.0]), "temperatures"),
                       (dict(ks=[1], max_new_tokens=1), "max_new_tokens"), (dict(ks=[1], repeats=0), "repeats = 0"),
                       (dict(ks=[2], synthetic_rates=[1.5]), r"expected a rate in \[0, 1\]"),
                       (dict(ks=[2], synthetic_rates=[0.9, 0.8, 0.7]), "at most num_speculative_tokens = 2"),
                       (dict(ks=[2], k_max=1), "k_max")]:
        with pytest.raises(ValueError, match=match):
            run_sweep(pair, ["x"], **bad)
    with pytest.raises(ValueError, match="empty prompt set"):
        run_sweep(pair, [], ks=[1])
    with pytest.raises(wb.RequestError, match="no draft"):
        run_sweep(pair.with_draft(None), ["x"], ks=[1])
    assert torch.get_num_threads() == 1


def test_cli_generate_names_its_acceptance_rule(capsys):
    assert main(["generate", "--prompt", "def f(x):", "--k", "2", "--temperature", "0.9", "--acceptor", "block",
                 "--max-new-tokens", "6", "--repetition-penalty", "1.3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["acceptance_rule"] == "block (greedy draft, one-hot q)"


def test_cli_generate_gives_the_loop_verdict_beside_the_accept_length(capsys):
    from workbench.analysis.degeneracy import detect_loop

    assert main(["generate", "--prompt", "def f(x):", "--k", "2", "--max-new-tokens", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    loop = detect_loop(out["tokens"])
    assert out["loop"] == loop.to_dict()
    assert out["accept_length_clean"] == (None if loop.degenerate else out["accept_length"])
    assert main(["generate", "--prompt", "def f(x):", "--k", "2", "--max-new-tokens", "40"]) == 0
    err = capsys.readouterr().err
    assert (f"loops from token {loop.loop_start}" if loop.degenerate else "no loop") in err
    assert main(["generate", "--prompt", "x", "--presence-penalty", "3"]) == 2
    assert "presence_penalty = 3.0" in capsys.readouterr().err


def test_cli_bad_input_names_the_flag(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for argv, match in [(["--ks", "1,x"], "--ks = '1,x'"), (["--synthetic-rates", "0.9,high"], "--synthetic-rates"),
                        (["--prompts", str(empty)], "no prompts"), (["--repeats", "0"], "repeats = 0"),
                        (["--ks", "1,1"], "each k once")]:
        assert main(["sweep", *argv]) == 2
        assert match in capsys.readouterr().err


def test_cli_json_records_each_arms_untimed_warm_up():
    """A fresh process warms every arm once, untimed, before the first timed generation, and the JSON says
    so; `--no-warmup` times the cold generations too. (Whether the warm-up makes the first arm's speed
    comparable is a timing question: `workbench sweep` reports it, no unit test times it.)"""
    def run(*extra):
        out = subprocess.run([sys.executable, "-m", "workbench.cli", "sweep", "--prompts",
                              str(REPO / "assets" / "prompts" / "smoke.jsonl"), "--limit", "2", "--ks", "2",
                              "--max-new-tokens", "8", "--repeats", "1", "--json", *extra],
                             capture_output=True, text=True, timeout=600, cwd=REPO)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    warm = run()["warmup_s"]["0.0"]
    assert set(warm) == {"autoregressive", "k=2"} and all(s > 0 for s in warm.values()), warm
    assert run("--no-warmup")["warmup_s"]["0.0"] == {}


def test_cli_generate_chat_sends_a_user_turn_through_the_template(capsys):
    """`generate --chat` renders the prompt as one user turn with the checkpoint's chat template (the
    embedded verifier's is Kimi's); a checkpoint without one is refused by name, and plain completion
    stays the default."""
    from tests.helpers import EMBEDDED
    from workbench.tokenizer import Tokenizer
    from workbench.training.tokenizer import KIMI_CHAT_TEMPLATE

    first = EMBEDDED.parent / "tiny-kimi-v1"  # the stdlib pair: no chat template
    assert main(["generate", "--verifier", str(first / "verifier"), "--draft", str(first / "draft"), "--chat",
                 "--prompt", "Write f.", "--max-new-tokens", "4"]) == 2
    assert "--chat needs a chat template" in capsys.readouterr().err
    argv = ["generate", "--prompt", "Write f.", "--max-new-tokens", "4", "--json"]
    assert main([*argv, "--chat"]) == 0
    chat = json.loads(capsys.readouterr().out)
    tok = Tokenizer.from_dir(EMBEDDED / "verifier")
    assert tok.chat_template == KIMI_CHAT_TEMPLATE
    rendered = tok.format_prompt([{"role": "user", "content": "Write f."}])
    assert "<|im_user|>user<|im_middle|>Write f.<|im_end|>" in rendered
    assert chat["prompt_tokens"] == tok.encode(rendered, add_bos=True) or chat["prompt_tokens"] == tok.encode(rendered)
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] in (tok.encode("Write f."), tok.encode("Write f.", add_bos=True))
