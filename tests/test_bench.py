"""`workbench bench`: the report's figures come from the runs, and a divergence is judged by the reference's own logits."""
from __future__ import annotations

import json
import os

import pytest
import torch

import workbench as wb
from workbench.kernels import cpu
from tests.helpers import make_random_pair
from workbench.analysis.bench import divergence, run_bench, step_components, step_cost, tie_tolerance
from workbench.cli import _bench_text, default_dtype

PROMPTS = ["def parse(text):\n    ", "class Stack:\n    def push(self, x):\n        "]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return wb.load_pair(*make_random_pair(tmp_path_factory.mktemp("bench"), seed=5, layers=2,
                                          aux_layer_ids=(0, 1, 1)), dtype="float32")


def test_report_pools_the_runs_it_made(pair):
    r = run_bench(pair, PROMPTS, k=2, max_new_tokens=10, peers=False, progress=False)
    assert (r["k"], r["num_prompts"], r["dtype"], r["compiled"]) == (2, 2, "float32", False)
    runs = [wb.SpecDecoder(pair, 2).generate(p, 10) for p in PROMPTS]  # greedy: the same steps again
    assert [p["spec_tokens"] for p in r["per_prompt"]] == [len(x.tokens) for x in runs]
    assert [p["accept_length"] for p in r["per_prompt"]] == [x.stats.accept_length for x in runs]
    spec = sum(p["spec_tokens"] for p in r["per_prompt"]) / sum(p["spec_s"] for p in r["per_prompt"])
    ar = sum(p["ar_tokens"] for p in r["per_prompt"]) / sum(p["ar_s"] for p in r["per_prompt"])
    assert r["spec_tokens_per_s"] == pytest.approx(spec) and r["ar_tokens_per_s"] == pytest.approx(ar)
    assert r["speedup"] == pytest.approx(spec / ar)
    assert r["lossless"] and r["identical"] and r["ties"] == []  # fp32 greedy: exact
    assert len(r["per_position_acceptance"]) == 2 and r["warmup_s"] > 0
    assert r["graph_cache"] == {"hits": 0, "misses": 0, "bypasses": 0}  # an eager pair compiles nothing
    assert r["spec_steps"] == sum(sum(e.kind == "spec" for e in x.events) for x in runs)
    # the time split covers the speculative runs: steps (draft + verify) and prefills, a little Python besides
    split = r["draft_time_s"] + r["verify_time_s"] + r["prefill_time_s"]
    assert 0 < split <= sum(p["spec_s"] for p in r["per_prompt"]) and r["prefill_time_s"] > 0
    assert 0 < r["ar_prefill_time_s"] < sum(p["ar_s"] for p in r["per_prompt"])
    # the step cost is read from the same runs: time after each prefill, per step and per decoded token
    c, n = r["step_cost"], len(PROMPTS)
    spec_s, ar_s = sum(p["spec_s"] for p in r["per_prompt"]), sum(p["ar_s"] for p in r["per_prompt"])
    spec_tokens, ar_tokens = sum(len(x.tokens) for x in runs), sum(p["ar_tokens"] for p in r["per_prompt"])
    assert c["spec_step_ms"] == pytest.approx((spec_s - r["prefill_time_s"]) / r["spec_steps"] * 1e3)
    assert c["ar_decode_ms"] == pytest.approx((ar_s - r["ar_prefill_time_s"]) / (ar_tokens - n) * 1e3)
    assert c["tokens_per_step"] == pytest.approx((spec_tokens - n) / r["spec_steps"]) and 1 <= c["tokens_per_step"] <= 3
    assert c["decode_speedup"] <= c["speedup_if_all_accepted"] == pytest.approx(3 / c["decodes_per_step"])
    text = _bench_text(r)  # `workbench bench` without --json
    m = r["machine"]  # what the figures were measured on, read from this machine
    assert m["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability() and m["cores"] == os.cpu_count()
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    assert m["fast_bf16"] == ("avx512_bf16" in flags or "amx_bf16" in flags) and m["amx_bf16"] == ("amx_bf16" in flags)
    assert default_dtype("cpu") == ("bfloat16" if m["fast_bf16"] else "float32") and default_dtype("cuda") == "bfloat16"
    machine_line = next(line for line in text.splitlines() if line.startswith("on "))  # after the loops and warnings
    assert f"({m['cores']} cores, {m['torch_cpu_capability']}, fast bf16: {m['fast_bf16']})" in machine_line
    assert r["cpu_kernels"] == cpu.status() and r["fast_path"] == pair.status()
    assert f"models: {pair.status()}" in machine_line
    assert f"a step costs {c['decodes_per_step']:.2f} decodes" in text and f"at most {3 / c['decodes_per_step']:.2f}x" in text


def test_step_cost_leaves_the_prefills_out():
    # 30 tokens after a prefill: autoregressive 1.8 s of decoding (60 ms a token), speculative
    # 10 steps in 0.8 s (80 ms, 1.33 decodes) of 3 tokens each: 2.25x, at most 3x at k = 3
    c = step_cost(3, spec_s=1.0, spec_prefill_s=0.2, spec_tokens=31, spec_steps=10, ar_s=2.0, ar_prefill_s=0.2,
                  ar_tokens=31, num_requests=1)
    assert c["ar_decode_ms"] == pytest.approx(60) and c["spec_step_ms"] == pytest.approx(80)
    assert c["decodes_per_step"] == pytest.approx(4 / 3) and c["tokens_per_step"] == 3
    assert c["decode_speedup"] == pytest.approx(2.25) and c["speedup_if_all_accepted"] == pytest.approx(3.0)
    assert (c["prefill_share_spec"], c["prefill_share_ar"]) == (pytest.approx(0.2), pytest.approx(0.1))
    # a request that ends at its first token has no step to cost
    none = step_cost(3, 0.1, 0.1, 1, 0, 0.1, 0.1, 1, 1)
    assert none["decodes_per_step"] is None and none["speedup_if_all_accepted"] is None
    assert set(none) == set(c) and none["prefill_share_spec"] == 1.0


@pytest.mark.parametrize("fused", [False, True])
def test_step_components_time_each_part_at_one_position(pair, fused):
    dec = wb.SpecDecoder(pair, 2, fused=fused)
    before = dec.generate(PROMPTS[1], 12).tokens
    ar = wb.generate_autoregressive(pair, PROMPTS[1], 12)
    calls = dec.fused.calls if fused else 0
    c = step_components(dec, PROMPTS[1], 12, repeats=3)
    # half-way through the greedy continuation and one step on, every part timed and against a decode
    half = len(ar.prompt_tokens) + (len(ar.tokens) - 1) // 2
    assert half < c["position"] <= half + 1 + 2 and (c["repeats"], c["fused"]) == (3, fused)
    assert all(c[f"{p}_ms"] > 0 for p in ("decode", "verify", "draft", "step", "step_verify", "verify_then_draft"))
    for p in ("verify", "draft", "step", "verify_then_draft"):
        assert c[f"{p}_decodes"] == pytest.approx(c[f"{p}_ms"] / c["decode_ms"])
    assert c["speedup_if_all_accepted"] == pytest.approx(3 / c["step_decodes"])
    assert c["verify_then_draft_ms"] <= c["step_ms"]  # the step's own split, call by call within the step
    # fused: the first proposal after the prefill, the step into the steady state, then each repeat
    if fused:
        assert dec.fused.calls - calls == 1 + 1 + 3
    assert dec.generate(PROMPTS[1], 12).tokens == before == ar.tokens  # the decoder is as it was
    with pytest.raises(ValueError, match="repeats = 0"):
        step_components(dec, PROMPTS[1], 12, repeats=0)
    with pytest.raises(ValueError, match="no room for two steps of k = 2"):  # two positions short of the context
        step_components(dec, [5] * (pair.context_length - 2), 4, repeats=1)


def test_step_components_repeat_a_step_of_any_drafter(pair):
    """The engine puts a step back itself (`BatchDecoder.mark`): a drafter keeps its rows' state on the rows."""

    class Fixed:  # a Drafter of its own
        name, needs_aux = "fixed", False

        def admit(self, slot, row, prefill):
            pass

        def move(self, src, dst):
            pass

        def reserve(self, max_len):
            pass

        def propose(self, rows, ks, stop_below):
            return [wb.Proposal([r.verified[-1]] * k) for r, k in zip(rows, ks)]

    dec = wb.SpecDecoder(pair, 2, proposer=Fixed())
    before = dec.generate(PROMPTS[0], 6).tokens
    assert len(before) == 6 and step_components(dec, PROMPTS[0], 6, repeats=2)["repeats"] == 2
    assert dec.generate(PROMPTS[0], 6).tokens == before


def test_bench_reports_the_components_when_asked(pair):
    r = run_bench(pair, PROMPTS[:1], k=2, max_new_tokens=10, peers=False, progress=False, components=2)
    c = r["components"]
    assert c["repeats"] == 2 and c["fused"] == r["fused"]
    assert {**r["engine"], "drafter": None} == {"loop": "batched", "max_batch_size": 1, "k": 2, "fused": r["fused"],
                                                "drafter": None, "policy": "static", "attention": r["attention"],
                                                "compiled": r["compiled"], "weights": "native",
                                                "acceptance_rule": "greedy"}
    assert "components" not in run_bench(pair, PROMPTS[:1], k=2, max_new_tokens=4, peers=False, progress=False)
    assert r["weights"] == "native" and "agreement_with_fp32" not in r  # figures against fp32 for int8 only
    assert (f"alone at position {c['position']} (medians of 2): a decode {c['decode_ms']:.2f} ms, a verify of 3"
            in _bench_text(r)) and f"at most {c['speedup_if_all_accepted']:.2f}x" in _bench_text(r).splitlines()[-1]
    assert (f"its own verify and drafting {c['verify_then_draft_ms']:.2f} ms ({c['verify_then_draft_decodes']:.2f})"
            in _bench_text(r))


def test_divergence_reads_the_autoregressive_runs_own_margin(pair):
    prompt = pair.encode(PROMPTS[0])
    a = wb.generate_autoregressive(pair, prompt, 12).tokens
    assert divergence(pair, prompt, a, list(a)) is None
    j = 7
    with torch.inference_mode():  # an independent reference: one full forward over the prefix, no cache
        logits = pair.verifier(torch.tensor([prompt + a[:j]])).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    assert int(logits.argmax()) == a[j]
    d = divergence(pair, prompt, a, a[:j] + [second] + a[j + 1:])
    assert (d["position"], d["autoregressive_token"], d["speculative_token"]) == (j, a[j], second)
    assert d["gap"] == pytest.approx(float(logits[a[j]] - logits[second]), abs=1e-4)
    assert d["tolerance"] == tie_tolerance(max(abs(d["logit_ar"]), abs(d["logit_spec"])), torch.float32)
    assert d["tie"] == (d["gap"] <= d["tolerance"]) and not d["tie"]  # random weights: no fp32 tie here


def test_tie_tolerance_is_a_few_units_in_the_last_place():
    assert tie_tolerance(8.0, torch.bfloat16) == 4 * 8.0 / 256
    assert tie_tolerance(0.1, torch.bfloat16) == 4 / 256  # never below the rounding of 1.0
    assert tie_tolerance(8.0, torch.float32) == 4 * 8.0 * 2.0 ** -23


def test_cli_bench_runs_on_the_threads_asked(pair, tmp_path, capsys):
    """`workbench bench --threads N` sets torch's intra-op threads before anything runs (compiled
    graphs keep the count they were generated with) and the report says so; N < 1 is an error."""
    from workbench.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:1]))
    common = ["bench", "--verifier", pair.verifier_dir, "--draft", pair.draft_dir, "--dtype", "float32",
              "--prompts", str(prompts), "--k", "2", "--max-new-tokens", "4", "--no-peers", "--json"]
    before = torch.get_num_threads()
    try:
        assert main(common + ["--threads", "1"]) == 0
        assert json.loads(capsys.readouterr().out)["threads"] == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert main(common + ["--threads", "0"]) == 2
    assert "--threads = 0; expected an integer >= 1" in capsys.readouterr().err
    assert torch.get_num_threads() == before


def test_report_sets_the_loops_apart_and_warns(pair):
    """Each continuation is judged by the loop rule on its own token ids; the clean, per-request and
    by-position accept lengths are read from the same runs; random prompts and a dead draft are called out."""
    import random

    from workbench.analysis.degeneracy import detect_loop
    from workbench.decoding.stats import compute_stats

    rng = random.Random(1)
    noise = "".join(chr(rng.randrange(33, 127)) for _ in range(120))  # printable characters, drawn
    prompts = [*PROMPTS, noise]
    r = run_bench(pair, prompts, k=2, max_new_tokens=40, peers=False, progress=False)
    runs = [wb.SpecDecoder(pair, 2).generate(p, 40) for p in prompts]
    assert [p["token_ids"] for p in r["per_prompt"]] == [x.tokens for x in runs]
    loops = [detect_loop(x.tokens) for x in runs]
    assert [p["degenerate"] for p in r["per_prompt"]] == [d.degenerate for d in loops]
    assert r["degenerate_prompts"] == sum(d.degenerate for d in loops)
    clean = [e for x, d in zip(runs, loops) if not d.degenerate for e in x.events]
    assert r["accept_length_clean"] == (compute_stats(clean).accept_length if clean else None)
    assert r["accept_length_per_request"] == pytest.approx(sum(x.stats.accept_length for x in runs) / len(runs))
    by_pos = r["accept_length_by_position"]
    assert list(by_pos) == ["0-31", "32-63", "64-127", "128+"] and by_pos["64-127"]["steps"] == 0
    assert sum(b["steps"] for b in by_pos.values()) == r["spec_steps"]
    assert any(w.startswith("1 of 3 prompts look random") for w in r["warnings"])  # the noise, not the code
    assert r["dead_draft"] == (r["accept_length"] < 1.2)  # a random draft: accepted about never
    assert any("the draft is dead" in w for w in r["warnings"]) == r["dead_draft"]
    first = _bench_text(r).splitlines()[0]  # the loop count and the clean figure come first
    assert first.startswith(f"{r['degenerate_prompts']} of 3 continuations loop")
    clean_text = "n/a" if r["accept_length_clean"] is None else f"{r['accept_length_clean']:.3f}"
    assert f"accept length over the clean ones {clean_text}" in first
    json.dumps(r)  # --json prints it


def test_bench_heals_the_prompts_when_asked(pair):
    r = run_bench(pair, PROMPTS, k=2, max_new_tokens=8, peers=False, progress=False, heal=True)
    healed = [wb.SpecDecoder(pair, 2).generate(p, 8, heal=True).tokens for p in PROMPTS]
    assert r["heal"] and [p["token_ids"] for p in r["per_prompt"]] == healed and r["identical"]


@pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels: {cpu.status()}")
def test_cli_bench_with_int8_weights_reports_them_and_their_agreement_with_fp32(pair, tmp_path, capsys):
    """`workbench bench --weights int8`: the pair, the engine and the report say int8, the run is
    lossless against plain decoding with the same weights, and the greedy agreement with the fp32
    pair (its own continuations against the fp32 pair's, and what it picks fed the fp32 text) comes
    with the speed; `--fast off` cannot hold int8 weights."""
    from workbench.analysis.bench import agreement_text, greedy_agreement
    from workbench.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    common = ["bench", "--verifier", pair.verifier_dir, "--draft", pair.draft_dir, "--dtype", "float32",
              "--prompts", str(prompts), "--k", "2", "--max-new-tokens", "8", "--no-peers"]
    assert main(common + ["--weights", "int8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["weights"] == r["engine"]["weights"] == "int8" and "int8 weights" in r["fast_path"]
    assert r["lossless"] and r["identical"]
    a = r["agreement_with_fp32"]
    assert (a["weights"], a["dtype"], a["num_prompts"], a["max_new_tokens"]) == ("int8", "float32", 2, 8)
    assert a["reference"].startswith("float32, native weights (CPU kernels")
    int8 = pair.with_weights("int8")
    assert a == greedy_agreement(int8, PROMPTS, 8)  # the same figures again, from the pair itself
    assert main(common + ["--weights", "int8-b32", "--agreement", "off", "--json"]) == 0
    assert "agreement_with_fp32" not in json.loads(capsys.readouterr().out)
    assert main(common + ["--weights", "int8"]) == 0
    text = capsys.readouterr().out
    assert agreement_text(a) in text and " weights=int8 " in text
    assert main(common + ["--weights", "int8", "--fast", "off"]) == 2
    assert "weights = 'int8' needs the CPU kernels; fast = 'off'" in capsys.readouterr().err
    # bf16 weights under fp32 activations report themselves and their agreement alike
    assert main(common + ["--weights", "bf16", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["weights"] == r["engine"]["weights"] == "bf16" and "bf16 weights, fp32 activations" in r["fast_path"]
    assert r["lossless"] and r["identical"]
    assert (r["agreement_with_fp32"]["weights"], r["agreement_with_fp32"]["dtype"]) == ("bf16", "float32")
