"""SGLang: the launch command as its ServerArgs name the flags, and its /metrics (names from its
metrics/collector.py) read as vLLM's counters: accepted = generated - requests - verify calls."""
from __future__ import annotations

import shlex

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from workbench.integrations.sglang import serve_command, speculative_args
from workbench.integrations.vllm import MetricsTracker, parse_spec_metrics

LABELS = ["model_name", "engine_type", "tp_rank", "dp_rank"]


def test_serve_command_chain_flags():
    cmd = serve_command("moonshotai/Kimi-K2.7-Code", "out/draft x", k=4, tp=8, port=30000)
    argv = shlex.split(cmd)
    assert argv[:6] == ["python", "-m", "sglang.launch_server", "--model-path", "moonshotai/Kimi-K2.7-Code", "--tp"]
    flags = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert flags["--tp"] == "8" and flags["--speculative-algorithm"] == "EAGLE3"
    assert flags["--speculative-draft-model-path"] == "out/draft x"  # quoted for the shell
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"],
            flags["--speculative-num-draft-tokens"]) == ("4", "1", "5")  # chain: steps + 1 draft tokens
    assert "--trust-remote-code" in argv and "--enable-metrics" in argv and flags["--port"] == "30000"
    assert "--enable-metrics" not in serve_command("v", "d", metrics=False)


@pytest.mark.parametrize("call, message", [
    (lambda: serve_command("", "d"), "verifier: empty"),
    (lambda: serve_command("v", "d", tp=0), r"tp = 0; expected --tp >= 1"),
    (lambda: speculative_args("", 3), "draft: empty"),
    (lambda: speculative_args("d", 0), r"k = 0; expected --speculative-num-steps >= 1"),
    (lambda: speculative_args("d", 3, "MEDUSA"), r"algorithm = 'MEDUSA'; expected 'EAGLE3'"),
])
def test_bad_arguments_name_the_flag(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def sglang_body(verify: int, generated: int, requests: int, accept_length: float = 2.5, ranks: int = 2,
                steps: int = 3) -> bytes:
    """What an SGLang server with `ranks` schedulers serves: counters split over the ranks."""
    reg = CollectorRegistry()
    counters = {n: Counter(f"sglang:{n}", n, LABELS, registry=reg)
                for n in ("spec_verify_calls", "generation_tokens", "num_requests", "prompt_tokens")}
    gauges = {n: Gauge(f"sglang:{n}", n, LABELS, registry=reg)
              for n in ("spec_accept_length", "spec_accept_rate", "spec_num_steps", "spec_num_draft_tokens")}
    for r in range(ranks):
        lab = ("kimi", "unified", "0", str(r))
        share = lambda x: x // ranks + (x % ranks if r == 0 else 0)  # noqa: E731
        counters["spec_verify_calls"].labels(*lab).inc(share(verify))
        counters["generation_tokens"].labels(*lab).inc(share(generated))
        counters["num_requests"].labels(*lab).inc(share(requests))
        counters["prompt_tokens"].labels(*lab).inc(999)
        gauges["spec_accept_length"].labels(*lab).set(accept_length + r * 0.2)
        gauges["spec_accept_rate"].labels(*lab).set(0.5)
        gauges["spec_num_steps"].labels(*lab).set(steps)
        gauges["spec_num_draft_tokens"].labels(*lab).set(steps + 1)
    return generate_latest(reg)


def test_sglang_metrics_read_as_counters():
    # 4 requests, 10 verifies: 4 first tokens + 10 verifies x (accepted + 1) = 4 + 10 + 17 = 31 tokens
    c = parse_spec_metrics(sglang_body(verify=10, generated=31, requests=4).decode())
    assert c.version == "sglang" and c.has_spec
    assert (c.num_drafts, c.num_accepted_tokens, c.num_draft_tokens) == (10, 17, 30)
    assert c.rates()["accept_length"] == pytest.approx(2.7) and c.accepted_per_pos == []
    assert c.engine_accept_length == pytest.approx(2.6)  # the gauge, mean over the two ranks
    assert parse_spec_metrics(sglang_body(10, 31, 4).decode(), model_name="other").version == ""


def test_sglang_intervals_and_vllm_first():
    tracker = MetricsTracker()
    tracker.add(parse_spec_metrics(sglang_body(10, 31, 4).decode()), t=0.0)
    iv = tracker.add(parse_spec_metrics(sglang_body(16, 53, 6).decode()), t=2.0)
    assert (iv.num_drafts, iv.num_accepted_tokens, iv.num_draft_tokens) == (6, 14, 18)
    assert iv.accept_length == pytest.approx(1 + 14 / 6) and iv.accepted_throughput == 7.0
    # a body with vLLM's spec counters is read as vLLM's, whatever else it holds
    vllm = b"# TYPE vllm:spec_decode_num_drafts counter\nvllm:spec_decode_num_drafts_total 5\n"
    assert parse_spec_metrics((vllm + sglang_body(10, 31, 4)).decode()).version == "v1"
    assert parse_spec_metrics("# TYPE sglang:prompt_tokens counter\nsglang:prompt_tokens_total 3\n").version == ""
