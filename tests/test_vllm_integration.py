"""vLLM hand-off: the serve command, the offline runner's error path, and `/metrics` scraping
against a real local HTTP server that serves prometheus_client output under vLLM's names."""
import json
import shlex
import socket
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from workbench.integrations.vllm import (
    MetricsTracker,
    ScrapeError,
    counters_from_llm_metrics,
    parse_spec_metrics,
    run_offline,
    scrape,
    serve_command,
)

SEED = (
    "vllm serve moonshotai/Kimi-K2.7-Code --tensor-parallel-size 8 --speculative-config "
    """'{"model": "k-l-lambda/kimi-k2.7-code-eagle3-mla", "method": "eagle3", "num_speculative_tokens": 3}' """
    "--trust-remote-code"
)
MODEL = "kimi"


def test_serve_command_is_the_seeds():
    cmd = serve_command("moonshotai/Kimi-K2.7-Code", "k-l-lambda/kimi-k2.7-code-eagle3-mla", k=3, tp=8)
    assert cmd == SEED
    argv = shlex.split(cmd)
    assert argv[:5] == ["vllm", "serve", "moonshotai/Kimi-K2.7-Code", "--tensor-parallel-size", "8"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "model": "k-l-lambda/kimi-k2.7-code-eagle3-mla", "method": "eagle3", "num_speculative_tokens": 3}


def test_serve_command_quotes_awkward_paths():
    cmd = serve_command("/models/my verifier", "/d/it's", k=2, tp=1, port=8001, extra_args=["--max-model-len", "32768"],
                        trust_remote_code=False)
    argv = shlex.split(cmd)
    assert argv[2] == "/models/my verifier"
    assert json.loads(argv[6])["model"] == "/d/it's"
    assert argv[7:] == ["--port", "8001", "--max-model-len", "32768"]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        serve_command("v", "d", k=0)


def test_serve_command_carries_a_batch_size_schedule_in_the_map_syntax():
    """Either syntax in, vLLM's map out, checked against k; `workbench vllm-command --schedule`."""
    from workbench.cli import main
    from workbench.batch_schedule import ScheduleError

    for given in ([[1, 8, 3], [9, 32, 1], [33, 4096, 0]], '{"1-8": 3, "9-32": 1, "33-4096": 0}'):
        argv = shlex.split(serve_command("v", "d", k=3, tp=8, schedule=given))
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        assert spec["num_speculative_tokens_per_batch_size"] == {"1-8": 3, "9-32": 1, "33-4096": 0}
    with pytest.raises(ScheduleError, match="above num_speculative_tokens = 2"):
        serve_command("v", "d", k=2, schedule={"1-8": 3})
    assert main(["vllm-command", "--k", "3", "--schedule", '[[1, 4, 3], [5, 64, 2]]']) == 0
    assert main(["vllm-command", "--k", "3", "--schedule", '{"1-4": 3, "3-64": 2}']) == 2  # overlapping ranges


def test_run_offline_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails, even where it is installed
    with pytest.raises(RuntimeError, match=r"pip install 'workbench\[vllm\]' on a CUDA machine"):
        run_offline("moonshotai/Kimi-K2.7-Code", "k-l-lambda/kimi-k2.7-code-eagle3-mla", ["def f():"])
    with pytest.raises(ValueError, match="prompts"):
        run_offline("v", "d", [])


# ---- LLM.get_metrics() shapes (vllm.v1.metrics.reader) -------------------------------------


@dataclass
class FakeCounter:
    name: str
    labels: dict
    value: int


@dataclass
class FakeVector:
    name: str
    labels: dict
    values: list


@dataclass
class FakeGauge:
    name: str
    labels: dict
    value: float


def test_counters_from_llm_metrics():
    labels = {"model_name": MODEL, "engine": "0"}
    metrics = [
        FakeGauge("vllm:num_requests_running", labels, 2.0),
        FakeCounter("vllm:spec_decode_num_drafts", labels, 10),
        FakeCounter("vllm:spec_decode_num_draft_tokens", labels, 30),
        FakeCounter("vllm:spec_decode_num_accepted_tokens", labels, 14),
        FakeVector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, [7, 4, 3]),
        FakeCounter("vllm:spec_decode_num_drafts", {"model_name": MODEL, "engine": "1"}, 5),
        FakeVector("vllm:spec_decode_num_accepted_tokens_per_pos", {"model_name": MODEL, "engine": "1"}, [2, 1, 0]),
        FakeCounter("vllm:spec_decode_num_drafts", {"model_name": "other", "engine": "0"}, 99),
    ]
    c = counters_from_llm_metrics(metrics, model_name=MODEL)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (15, 30, 14, [9, 5, 3])
    r = c.rates()
    assert r["accept_length"] == pytest.approx(1 + 14 / 15)
    assert r["draft_acceptance_rate"] == pytest.approx(14 / 30)
    assert r["per_position_acceptance"] == pytest.approx([9 / 15, 5 / 15, 3 / 15])
    assert r["conditional_acceptance"] == pytest.approx([9 / 15, 5 / 9, 3 / 5])
    assert counters_from_llm_metrics(metrics).num_drafts == 15 + 99
    assert not counters_from_llm_metrics([metrics[0]]).has_spec


# ---- a real /metrics endpoint -------------------------------------------------------------


def vllm_registry(counts: dict[str, dict[str, int]], per_pos: dict[str, list[int]], model: str = MODEL):
    """A registry holding vLLM's spec-decode counters; counts[name][engine] = value."""
    reg = CollectorRegistry()
    Gauge("vllm:num_requests_running", "running", ["model_name", "engine"], registry=reg).labels(model, "0").set(3)
    for name, by_engine in counts.items():
        c = Counter(f"vllm:spec_decode_{name}", name, ["model_name", "engine"], registry=reg)
        for engine, v in by_engine.items():
            c.labels(model, engine).inc(v)
    c = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos", ["model_name", "engine", "position"], registry=reg)
    for engine, values in per_pos.items():
        for i, v in enumerate(values):
            c.labels(model, engine, str(i)).inc(v)
    return reg


@pytest.fixture
def server():
    state = {"body": b"", "status": 200, "type": CONTENT_TYPE_LATEST}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(state["status"] if self.path == "/metrics" else 404)
            self.send_header("Content-Type", state["type"])
            self.end_headers()
            self.wfile.write(state["body"])

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{httpd.server_address[1]}"

    def serve(registry=None, body: bytes | None = None, status: int = 200):
        state["body"] = generate_latest(registry) if registry is not None else body
        state["status"] = status

    state["serve"] = serve
    yield state
    httpd.shutdown()
    httpd.server_close()


def test_scrape_deltas_over_two_engines(server):
    counts = {"num_drafts": {"0": 10, "1": 6}, "num_draft_tokens": {"0": 30, "1": 18}, "num_accepted_tokens": {"0": 17, "1": 9}}
    server["serve"](vllm_registry(counts, {"0": [8, 6, 3], "1": [5, 3, 1]}))
    first = scrape(server["url"])  # a bare address means its /metrics
    assert first.version == "v1" and first.has_spec
    assert (first.num_drafts, first.num_draft_tokens, first.num_accepted_tokens) == (16, 48, 26)
    assert first.accepted_per_pos == [13, 9, 4]

    counts = {"num_drafts": {"0": 14, "1": 10}, "num_draft_tokens": {"0": 42, "1": 30}, "num_accepted_tokens": {"0": 25, "1": 14}}
    server["serve"](vllm_registry(counts, {"0": [11, 9, 5], "1": [8, 4, 2]}))
    second = scrape(server["url"] + "/metrics")

    tracker = MetricsTracker()
    assert tracker.add(first, t=100.0) is None
    iv = tracker.add(second, t=102.0)
    assert (iv.num_drafts, iv.num_draft_tokens, iv.num_accepted_tokens) == (8, 24, 13)
    assert iv.accepted_per_pos == [6, 4, 3] and not iv.reset
    assert iv.dt == 2.0
    assert iv.accept_length == pytest.approx(1 + 13 / 8)
    assert iv.draft_acceptance_rate == pytest.approx(13 / 24)
    assert iv.per_position_acceptance == pytest.approx([6 / 8, 4 / 8, 3 / 8])
    assert iv.conditional_acceptance == pytest.approx([6 / 8, 4 / 6, 3 / 4])
    assert iv.accepted_throughput == pytest.approx(13 / 2) and iv.drafted_throughput == pytest.approx(24 / 2)
    assert tracker.latest is iv

    # The server restarts: a fresh registry with smaller values. They are the deltas.
    server["serve"](vllm_registry({"num_drafts": {"0": 3}, "num_draft_tokens": {"0": 9}, "num_accepted_tokens": {"0": 4}},
                                  {"0": [2, 1, 1]}))
    iv = tracker.add(scrape(server["url"]), t=104.0)
    assert iv.reset and (iv.num_drafts, iv.num_draft_tokens, iv.num_accepted_tokens) == (3, 9, 4)
    assert iv.accepted_per_pos == [2, 1, 1] and iv.accept_length == pytest.approx(1 + 4 / 3)
    with pytest.raises(ValueError, match="not after"):
        tracker.add(second, t=104.0)

    live = MetricsTracker()  # polling on the wall clock: nothing happened between the polls
    assert live.poll(server["url"]) is None
    idle = live.poll(server["url"])
    assert idle.num_drafts == 0 and idle.accept_length == 1.0 and not idle.reset and idle.dt > 0


def test_model_filter_and_created_samples(server):
    reg = vllm_registry({"num_drafts": {"0": 4}, "num_accepted_tokens": {"0": 2}}, {"0": [2]})
    text = generate_latest(reg).decode()
    assert "_created" in text  # prometheus_client emits them; they must not be summed
    other = generate_latest(vllm_registry({"num_drafts": {"0": 50}}, {"0": [40]}, model="other")).decode()
    both = parse_spec_metrics(text + other)
    assert both.num_drafts == 54 and both.accepted_per_pos == [42]
    only = parse_spec_metrics(text + other, model_name=MODEL)
    assert only.num_drafts == 4 and only.accepted_per_pos == [2]


def test_legacy_v0_names():
    text = (
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 30\n'
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 60\n'
        'vllm:spec_decode_num_emitted_tokens_total{model_name="m"} 50\n'
        'vllm:spec_decode_draft_acceptance_rate{model_name="m"} 0.5\n'
    )
    c = parse_spec_metrics(text)
    assert c.version == "v0" and c.has_spec and c.drafts_derived
    assert (c.num_accepted_tokens, c.num_draft_tokens, c.num_emitted_tokens) == (30, 60, 50)
    assert c.num_drafts == 20  # one verifier token per step: emitted - accepted
    assert c.rates()["accept_length"] == pytest.approx(50 / 20)
    assert c.rates()["draft_acceptance_rate"] == pytest.approx(0.5)
    assert c.accepted_per_pos == []


def test_bad_position_label():
    with pytest.raises(ValueError, match="label 'position'"):
        parse_spec_metrics('vllm:spec_decode_num_accepted_tokens_per_pos_total{position="x"} 1\n')


def test_server_without_spec_metrics(server):
    reg = CollectorRegistry()
    Counter("vllm:prompt_tokens", "prompt tokens", ["model_name"], registry=reg).labels(MODEL).inc(100)
    server["serve"](reg)
    c = scrape(server["url"])
    assert not c.has_spec and c.version == "" and c.rates()["accept_length"] == 1.0


def test_scrape_errors_name_the_url(server):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
    sock.close()
    with pytest.raises(ScrapeError, match=rf"{closed}: cannot reach the server"):
        scrape(closed, timeout=1.0)

    server["serve"](body=b"<html><body>Not here</body></html>")
    with pytest.raises(ScrapeError, match=r"/metrics: the body is not Prometheus text format"):
        scrape(server["url"])
    server["serve"](body=b"oops", status=500)
    with pytest.raises(ScrapeError, match=r"/metrics: HTTP 500"):
        scrape(server["url"])
    with pytest.raises(ScrapeError, match="HTTP 404"):
        scrape(server["url"] + "/elsewhere")
    with pytest.raises(ScrapeError, match="not an http"):
        scrape("127.0.0.1:8000")
