"""The Streamlit dashboard, page by page, headless (AppTest) on the real embedded pair, plus one real browser run.

The Live vLLM page is driven against a real local HTTP server that serves prometheus_client
output under vLLM's metric names, against a server without spec-decode metrics, and against
a closed port.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from streamlit.testing.v1 import AppTest

from tests.helpers import REPO

APP = str(REPO / "apps" / "dashboard.py")
SCREENSHOT = REPO / "assets" / "screenshots" / "dashboard.png"
CHROMIUM = "/usr/bin/chromium"
TIMEOUT = 300  # seconds per script run: generation on a shared 2-core CPU


@pytest.fixture
def app():
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def on(at: AppTest, page: str) -> AppTest:
    at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def charts(at: AppTest) -> list:
    return list(at.get("plotly_chart"))


def test_frame_and_tuning_page(app):
    assert app.title[0].value == "Tuning: which k?"
    assert app.text_input(key="verifier_dir").value == "" and app.slider(key="k_range").value == (1, 4)
    assert "aux ids" in app.sidebar.caption[0].value
    assert not charts(app) and "Run sweep" in app.info[0].value
    app.number_input(key="tune_n").set_value(2)
    app.number_input(key="tune_max_new").set_value(8)
    app.number_input(key="tune_repeats").set_value(1)
    app.slider(key="k_range").set_value((1, 2))
    app.button(key="tune_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert len(charts(app)) == 5  # accept length, tokens/s, speedup + model band + bound, per-position, histogram
    assert [m.label for m in app.metric][1:] == ["Its speedup [95%]", "Step-cost model's best k",
                                                 "Autoregressive (decode)", "Its accept length"]
    result = app.session_state["tune_result"][1]
    best = result.point(0.0, result.recommendation(0.0).k)
    clean = "n/a" if best.accept_length_clean is None else f"{best.accept_length_clean:.2f}"
    assert app.metric[4].value == f"{best.accept_length:.2f}"  # the raw figure with its clean one and the loops
    assert f"clean {clean}, {best.degenerate} of 2 loop" in str(app.metric[4].proto.delta)
    shown = app.table[0].value
    assert list(shown["loops"]) == [f"{p.degenerate}/2" for p in result.points] and "clean accept length" in shown
    verdict = [e.value for e in [*app.success, *app.warning]]
    # 2 prompts x 1 repeat rarely separates neighbouring ks: the page says so before any recommendation
    assert any(v.startswith("Recommended k =") or v.startswith("Too few samples to decide:") for v in verdict)
    assert [b.label for b in app.get("download_button")] == ["Download CSV", "Download JSON"]
    table = app.dataframe[0].value
    assert list(table["k"]) == [0, 1, 2] and list(table["temperature"]) == [0.0] * 3
    assert list(app.table[0].value["k"]) == [0, 1, 2]
    codes = [c.value for c in app.code]  # the vLLM outputs, whichever k won
    assert '"num_speculative_tokens"' in codes[0] and '"rejection_sample_method": "synthetic"' in codes[1]
    assert '"acceptance_histogram"' in codes[2]
    app.selectbox(key="tune_show_k").set_value(1).run()
    assert not app.exception and len(charts(app)) == 5
    app.button(key="tune_run").click().run()  # the same inputs again: a cache hit replays the progress bar
    assert not app.exception, [e.value for e in app.exception]
    assert len(charts(app)) == 5 and list(app.dataframe[0].value["k"]) == [0, 1, 2]


def test_synthetic_acceptance_and_bad_rates(app):
    app.number_input(key="tune_n").set_value(1)
    app.number_input(key="tune_max_new").set_value(8)
    app.number_input(key="tune_repeats").set_value(1)
    app.slider(key="k_range").set_value((1, 2))
    app.radio(key="tune_acceptance").set_value("Synthetic rates").run()
    app.text_input(key="tune_rates").set_value("0.9,1.5").run()
    app.button(key="tune_run").click().run()
    assert not app.exception and "expected a rate in [0, 1]" in app.error[0].value
    app.text_input(key="tune_rates").set_value("0.9,0.8,0.7").run()
    app.button(key="tune_run").click().run()
    assert not app.exception and "at most num_speculative_tokens = 2" in app.error[0].value
    app.text_input(key="tune_rates").set_value("1,1").run()
    app.button(key="tune_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("acceptance: synthetic [1.0, 1.0]" in c.value and "not lossless" in c.value for c in app.caption)


def test_random_looking_prompts_are_warned_about(app):
    app.radio(key="tune_source").set_value("Type prompts").run()
    app.text_area(key="tune_typed").set_value("def fibonacci(n):\n---\nqZ8#vR!x0@Lk$2mW^pT&7yN*cJ(4bH)5gF_9dS+e").run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("1 of 2 prompts look random" in w.value for w in app.warning)


def test_typed_and_bad_uploaded_prompts(app):
    app.radio(key="tune_source").set_value("Type prompts").run()
    assert not app.exception and app.number_input(key="tune_n").label == "Prompts to use (of 2)"
    app.text_area(key="tune_typed").set_value("   \n---\n").run()
    assert "Choose a prompt set" in app.info[0].value


def test_fusion_page(app):
    at = on(app, "views/fusion.py")
    assert at.title[0].value == "Fusion layer inspector" and "entering" in at.caption[0].value
    at.number_input(key="fusion_k").set_value(2)
    at.number_input(key="fusion_max_new").set_value(6)
    at.button(key="fusion_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(charts(at)) == 4  # shares, block norms, RMS, cosine
    assert [m.label for m in at.metric][0] == "Accept length" and len(at.metric) == 4
    report = at.session_state["fusion_report"][1]  # the accept length never without its loop verdict
    assert str(at.metric[0].proto.delta).startswith("loops from token" if report.loop["degenerate"] else "clean ")
    assert list(at.dataframe[0].value["source"])[0].startswith("low (layer ")
    at.multiselect(key="fusion_modes").set_value(["zero"])
    at.number_input(key="fusion_max_new").set_value(4)
    at.button(key="fusion_ablate").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "ablation at k=2" in at.text[0].value and "loop)" in at.text[0].value
    assert len(charts(at)) == 1  # the inspection was for other settings


def test_doctor_page(app):
    at = on(app, "views/doctor.py")
    checks = at.dataframe[0].value
    assert "aux layer ids in range" in list(checks["check"])
    at.number_input(key="doctor_n").set_value(1)
    at.number_input(key="doctor_k").set_value(2)
    at.number_input(key="doctor_max_new").set_value(5)
    at.button(key="doctor_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(charts(at)) == 1
    probes = at.dataframe[1].value
    assert list(probes["probe"])[0] == "configured" and len(probes) == 6
    report = at.session_state["doctor_report"][1]
    assert list(probes["loops"])[0] == f"{report.configured.degenerate}/1" and "clean accept length" in probes
    verdict = [*at.success, *at.error]
    assert len(verdict) == 1 and ("No problems" in verdict[0].value or "Problems found" in verdict[0].value)
    assert at.get("download_button")[0].label == "Download JSON"


def test_kv_cache_page(app):
    at = on(app, "views/kv_cache.py")
    assert [m.label for m in at.metric] == ["Verifier, per token", "MLA draft, per token", "MHA draft, per token"]
    assert at.metric[0].value == "68.62 KiB"  # 61 layers x 576 values x 2 bytes
    assert at.metric[1].value == "1.12 KiB" and at.metric[2].value == "28.00 KiB"  # 576 vs 2 x 7168 values
    assert len(at.dataframe[0].value) == 9 and len(charts(at)) == 1
    measured = at.dataframe[1].value
    assert list(measured["cache"]) == ["verifier", "MLA draft (loaded)", "MHA twin (assets/tiny-kimi/draft-mha)"]
    assert all(measured["matches"]) and list(measured["dtype"]) == ["float32"] * 3
    at.selectbox(key="kv_preset").set_value("Loaded pair").run()
    assert not at.exception and at.metric[0].value == "1.25 KiB"  # 8 layers x (64 + 16) values x 2 bytes


def test_pd_panel(app):
    """Bytes per request by mode and draft kind (Kimi-K2 at a 4K prompt, bf16), acceptance by mode on the
    embedded pair and its MHA twin, and the check that both roles run the same speculative config."""
    from workbench.analysis.kvcache import KIMI_K2_MLA_DRAFT, KIMI_K2_VERIFIER, handover_bytes, mha_equivalent

    at = on(app, "views/kv_cache.py")
    table = at.table[0].value
    assert list(table["mode"]) == ["full", "recompute", "cold"] * 2
    full = handover_bytes(KIMI_K2_VERIFIER, KIMI_K2_MLA_DRAFT, 4096, "full")
    mha = handover_bytes(KIMI_K2_VERIFIER, mha_equivalent(KIMI_K2_MLA_DRAFT), 4096, "full")
    assert list(table["page layouts"]) == [1, 1, 1, 2, 2, 2]
    assert table["draft KV"][0] == f"{full['draft_kv'] / 2**20:.2f} MiB" and table["draft KV"][3] == \
        f"{mha['draft_kv'] / 2**20:.2f} MiB"
    assert "Both roles run the same speculative config" in at.success[0].value
    cfg = json.loads(at.text_area(key="pd_decode_cfg").value)
    at.text_area(key="pd_decode_cfg").set_value(json.dumps(dict(cfg, num_speculative_tokens=2))).run()
    assert "num_speculative_tokens: prefill 3, decode 2" in at.error[0].value
    at.text_area(key="pd_decode_cfg").set_value("{not json").run()
    assert "Could not read a role's config" in at.error[0].value
    at.number_input(key="pd_n").set_value(1)
    at.number_input(key="pd_long").set_value(128)
    at.number_input(key="pd_new").set_value(8)
    at.button(key="pd_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    measured = at.dataframe[1].value  # after the memory table
    assert len(measured) == 2 * 2 * 3 and all(measured["identical"] == measured["num_prompts"])
    assert list(measured["mode"])[:3] == ["full", "recompute", "cold"] and len(charts(at)) == 2


# ---- Live vLLM ------------------------------------------------------------------------------


@pytest.fixture
def metrics_server():
    state = {"body": b""}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.end_headers()
            self.wfile.write(state["body"])

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    yield state
    httpd.shutdown()
    httpd.server_close()


def vllm_body(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int], spec: bool = True) -> bytes:
    reg = CollectorRegistry()
    Counter("vllm:prompt_tokens", "prompt tokens", ["model_name", "engine"], registry=reg).labels("kimi", "0").inc(99)
    if spec:
        for name, v in (("num_drafts", drafts), ("num_draft_tokens", draft_tokens), ("num_accepted_tokens", accepted)):
            Counter(f"vllm:spec_decode_{name}", name, ["model_name", "engine"], registry=reg).labels("kimi", "0").inc(v)
        c = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos", ["model_name", "engine", "position"],
                    registry=reg)
        for i, v in enumerate(per_pos):
            c.labels("kimi", "0", str(i)).inc(v)
    return generate_latest(reg)


def live_page(app, url: str) -> AppTest:
    at = on(app, "views/live_vllm.py")
    at.toggle(key="live_auto").set_value(False)
    at.text_input(key="live_url").set_value(url).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_live_vllm_real_server(app, metrics_server):
    metrics_server["body"] = vllm_body(10, 30, 17, [8, 6, 3])
    at = live_page(app, metrics_server["url"])
    assert "First sample" in at.info[0].value and not charts(at)
    assert at.metric[0].value == "2.700"  # 1 + 17 / 10 since the server started
    assert "clean: unknown" in str(at.metric[0].proto.delta)  # counters carry no text: loops cannot be set apart
    metrics_server["body"] = vllm_body(18, 54, 30, [14, 10, 6])
    at.button(key="live_poll").click().run()
    assert not at.exception, [e.value for e in at.exception]
    figs = charts(at)
    assert len(figs) == 4
    assert "8 drafts, 13 accepted of 24 drafted" in at.main.caption[-1].value  # the interval's deltas
    assert at.metric[0].value == f"{1 + 30 / 18:.3f}"


def test_live_page_reads_an_sglang_server(app, metrics_server):
    """SGLang's names (tests/test_sglang.py builds its body): the same charts from its counters."""
    from tests.test_sglang import sglang_body

    metrics_server["body"] = sglang_body(verify=10, generated=31, requests=4)
    at = live_page(app, metrics_server["url"])
    assert at.metric[0].value == "2.700" and at.metric[3].value == "SGLANG"  # 1 + 17 / 10
    assert "sglang:spec_accept_length (its last logged batch): 2.600" in at.main.caption[-1].value
    metrics_server["body"] = sglang_body(verify=16, generated=53, requests=6)
    at.button(key="live_poll").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(charts(at)) == 4
    assert "6 drafts, 14 accepted of 18 drafted" in at.main.caption[-1].value


def test_live_vllm_without_spec_metrics(app, metrics_server):
    metrics_server["body"] = vllm_body(0, 0, 0, [], spec=False)
    at = live_page(app, metrics_server["url"])
    assert "exposes no vllm:spec_decode_* counters" in at.warning[0].value and not charts(at)


def test_live_vllm_closed_port(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
    sock.close()
    at = live_page(app, url)
    assert f"{url}: cannot reach the server" in at.error[0].value and not charts(at)


# ---- a real browser -------------------------------------------------------------------------


@contextlib.contextmanager
def streamlit_server(env: dict):
    """The dashboard served by a real `streamlit run` on a free port, until the block ends."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", APP, "--server.headless", "true", "--server.port", str(port),
         "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                pytest.fail(f"streamlit did not start: {server.stdout.read().decode()[-2000:]}")
            time.sleep(0.5)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SMOKE = ["--prompts", str(REPO / "assets" / "prompts" / "smoke.jsonl"), "--limit", "2", "--ks", "1,2,3,4",
         "--max-new-tokens", "16", "--repeats", "2", "--seed", "0", "--dtype", "float32"]  # the page's defaults, 16 tokens


def _interval(text: str) -> tuple[float, float, float]:
    """'1.53 [0.993, 2.18]' -> (1.53, 0.993, 2.18)."""
    median, rest = text.split(" [")
    lo, hi = rest.rstrip("]").split(", ")
    return float(median), float(lo), float(hi)


@pytest.mark.browser
def test_browser_tuning_page_matches_the_cli(tmp_path):
    """What a person sees on the Tuning page: the same figures as `workbench sweep --json` on the same prompts
    and seed (acceptance exactly, speedups within each other's intervals), a verdict, and the outputs for
    vLLM; the screenshot is kept."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing")
    sync_api = pytest.importorskip("playwright.sync_api")
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one thread, as conftest sets in-process: the server shares the 2 cores too
    cli = subprocess.run([sys.executable, "-m", "workbench.cli", "sweep", *SMOKE, "--json"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr
    want = {p["k"]: p for p in json.loads(cli.stdout)["points"]}
    with streamlit_server(env) as port:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/", timeout=TIMEOUT * 1000)
            page.get_by_role("button", name="Run sweep").wait_for(timeout=TIMEOUT * 1000)  # the pair is loaded
            assert page.get_by_text("Live vLLM").count() == 1  # the navigation lists the pages
            box = page.get_by_label("max_new_tokens")
            box.fill("16")
            box.press("Enter")
            page.wait_for_timeout(1000)
            page.get_by_role("button", name="Run sweep").click()
            page.get_by_text("For vLLM").wait_for(timeout=2 * TIMEOUT * 1000)
            page.get_by_test_id("stPlotlyChart").nth(4).wait_for(timeout=TIMEOUT * 1000)
            # the vLLM outputs render after their heading: on a loaded machine, seconds after it
            page.get_by_test_id("stCode").nth(2).wait_for(timeout=TIMEOUT * 1000)
            rows = page.locator('[data-testid="stTable"] tbody tr').evaluate_all(
                "rows => rows.map(r => [...r.querySelectorAll('th, td')].map(c => c.textContent.trim()))")
            verdict = page.locator('[data-testid="stAlert"]').first.text_content()
            codes = page.locator('[data-testid="stCode"]').evaluate_all("els => els.map(e => e.textContent)")
            page.set_viewport_size({"width": 1400, "height": 2900})  # the app scrolls inside its own frame
            page.wait_for_timeout(2000)  # let plotly redraw at the new size
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot))
            browser.close()
        assert [r[0] for r in rows] == ["0", "1", "2", "3", "4"]  # k = 0 is the autoregressive baseline
        for r in rows:  # k, accept length, its clean figure, loops, tokens/s, speedup, ...
            k, accept, clean, loops, speedup = int(r[0]), r[1], r[2], r[3], _interval(r[5])
            assert accept == f"{want[k]['accept_length']:.3f}"  # greedy: the same steps, exactly
            want_clean = want[k]["accept_length_clean"]
            assert clean == ("n/a" if want_clean is None else f"{want_clean:.3f}")
            assert loops == f"{want[k]['degenerate']}/2"  # each figure beside its loop count, as the CLI has it
            cli_s = want[k]["speedup"]
            assert speedup[1] <= cli_s["hi"] * 1.001 and cli_s["lo"] <= speedup[2] * 1.001, (k, speedup, cli_s)
        assert verdict.startswith("Recommended k =") or verdict.startswith("Too few samples to decide:")
        assert '"num_speculative_tokens"' in codes[0] and '"synthetic_acceptance_rates"' in codes[1]
        assert '"acceptance_histogram"' in codes[2]
        assert shot.stat().st_size > 20_000
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, SCREENSHOT)


@pytest.mark.browser
def test_browser_pd_panel(tmp_path):
    """The KV-cache page's prefill/decode panel in a real browser: bytes by mode, a measured run, the role
    check flagging a mismatch; the screenshot is kept."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing")
    sync_api = pytest.importorskip("playwright.sync_api")
    with streamlit_server(dict(os.environ, OMP_NUM_THREADS="1")) as port:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/kv_cache", timeout=TIMEOUT * 1000)
            page.get_by_text("Prefill/decode disaggregation").wait_for(timeout=TIMEOUT * 1000)
            for label, value in (("Prompts", "2"), ("Long prompt tokens", "256"), ("New tokens", "16")):
                box = page.get_by_label(label, exact=True)
                box.fill(value)
                box.press("Enter")
                page.wait_for_timeout(500)
            page.get_by_role("button", name="Measure acceptance by mode").click()
            page.get_by_text("Accept length by hand-over mode").wait_for(timeout=2 * TIMEOUT * 1000)
            decode = page.get_by_label("Decode role")
            decode.fill(decode.input_value().replace('"num_speculative_tokens": 3', '"num_speculative_tokens": 2'))
            decode.press("Control+Enter")
            page.get_by_text("Mismatch between the roles").wait_for(timeout=TIMEOUT * 1000)
            modes = page.locator('[data-testid="stTable"] tbody tr').evaluate_all(
                "rows => rows.map(r => r.querySelectorAll('td')[1].textContent.trim())")
            page.get_by_text("Prefill/decode disaggregation").scroll_into_view_if_needed()
            page.set_viewport_size({"width": 1400, "height": 2600})
            page.wait_for_timeout(2000)
            shot = tmp_path / "pd.png"
            page.screenshot(path=str(shot))
            browser.close()
    assert modes == ["full", "recompute", "cold"] * 2 and shot.stat().st_size > 20_000
    shutil.copy(shot, SCREENSHOT.parent / "pd.png")


# ---- Batching -------------------------------------------------------------------------------


def batch_sweep_page(app) -> AppTest:
    """The Batching page after a tiny sweep: 2 prompts, B in {1, 2}, k = 1..2, 4 tokens, 1 repeat."""
    at = on(app, "views/batching.py")
    assert at.title[0].value.startswith("Batching") and "Run batch sweep" in at.info[0].value and not charts(at)
    at.slider(key="k_range").set_value((1, 2))
    at.number_input(key="batch_n").set_value(2)
    at.multiselect(key="batch_sizes").set_value([1, 2])
    at.number_input(key="batch_max_new").set_value(4)
    at.number_input(key="batch_repeats").set_value(1)
    at.button(key="batch_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_batching_page_sweep(app):
    from workbench.batch_schedule import read_schedule

    at = batch_sweep_page(app)
    result = at.session_state["batch_result"][1]
    assert result.batch_sizes == [1, 2] and result.ks == [1, 2]
    figs = charts(at)
    assert len(figs) == 3  # measured heatmap, tokens/s over B, the model's heatmap
    heat = json.loads(figs[0].proto.spec)["data"][0]
    assert heat["type"] == "heatmap" and heat["text"][0][0] == "1.00x"  # k = 0 over itself
    cross, best = result.crossover()["overall"], result.best_k()
    labels = {m.label: m for m in at.metric}
    assert labels["Crossover"].value == (f"B = {cross}" if cross else "none")
    assert [labels[f"Best k at B = {b}"].value for b in (1, 2)] == [str(best[b]) for b in (1, 2)]
    table = at.dataframe[0].value
    assert list(zip(table["B"], table["k"])) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert list(table["loops"]) == [f"{p.degenerate}/2" for p in result.points] and "clean accept length" in table
    assert bool(result.rests_on_loops()) == any("mostly looping" in w.value for w in at.warning)
    assert list(table["identical outputs"])[:2] == ["baseline", "2/2"]
    codes = [c.value for c in at.code]
    assert read_schedule(codes[0], 2) == result.schedule() == read_schedule(codes[1], 2)
    assert json.loads(codes[0]) == result.schedule().to_map()
    assert any("model" in c.value and "not a measurement" in c.value for c in at.caption)
    assert labels["Model's crossover"].value == "none"  # Kimi-K2 on H200 x8: pays at every feasible B
    assert list(at.table[0].value["B"]) == list(range(1, result.gpu["max_batch"] + 1))  # every feasible B
    assert [b.label for b in at.get("download_button")] == ["Download CSV", "Download JSON"]
    at.button(key="batch_run").click().run()  # the same inputs: a cache hit replays the progress bar
    assert not at.exception and len(charts(at)) == 3
    assert json.dumps(at.session_state["batch_result"][1].to_dict()) == json.dumps(result.to_dict())  # not re-measured
    at.multiselect(key="batch_sizes").set_value([1, 4])
    at.button(key="batch_run").click().run()  # 2 prompts cannot fill a batch of 4: the library's message
    assert not at.exception and "2 prompts for batch size 4" in at.error[0].value and not charts(at)


def _box_errors(at) -> list[str]:
    """The page's errors but a measured point's own ("B = b, k = k: speedup beats the accept length"),
    which a busy machine's noise can raise and the page shows beside the box, as it should."""
    return [e.value for e in at.error if not e.value.startswith("B = ")]


def test_batching_page_schedule_box(app):
    at = batch_sweep_page(app)
    at.text_area(key="batch_schedule_in").set_value('{"1-4": 2, "3-8": 1}').run()
    errors = _box_errors(at)
    assert not at.exception and len(errors) == 1
    assert "'1-4'" in errors[0] and "'3-8'" in errors[0] and "overlap" in errors[0]
    assert len(charts(at)) == 3  # the page stays up
    at.text_area(key="batch_schedule_in").set_value("[[1, 1, 2], [2, 8, 0]]").run()
    assert not at.exception and not _box_errors(at)
    yours = at.table[0].value
    assert list(yours["B"]) == [1, 2] and list(yours["your k"]) == [2, 0]
    at.text_area(key="batch_schedule_in").set_value('{"1-4": 3}').run()
    assert "above num_speculative_tokens = 2" in _box_errors(at)[0]


def test_batching_page_adaptive(app):
    at = batch_sweep_page(app)
    at.button(key="batch_adaptive_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    policies = at.dataframe[1].value
    assert list(policies["name"]) == ["autoregressive", "k=1", "k=2", "confidence 0.5", "goodput EMA"]
    assert list(policies["identical outputs"]) == ["2/2"] * 5
    assert policies["minus best static [95%]"][0] == ""
