"""apps/chat.py and apps/chat_app/: the rendering and turn logic as plain functions, two apps in one
process with state of their own, the API through gradio_client, four users at once, and what a
person sees in a real headless Chromium.

Everything runs on the embedded pair in fp32 with short answers; with random weights nearly every
proposal is rejected, so most steps end in a correction (the prefill token is a bonus).
"""
import math
import socket
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("gradio")
pytest.importorskip("plotly")

import workbench as wb  # noqa: E402
from workbench import compute_stats, detect_loop  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "apps"))
import chat  # noqa: E402
from chat_app import render, session, ui  # noqa: E402

NEW = 24  # max_new_tokens everywhere: short answers keep the file fast on a shared CPU
LONG = 2000  # the answer the browser test stops midway: at 1,000-1,400 tokens/s it must outlast the click
STOP_PROMPT = "x = [1, 2, 3, 4, 5, 6, 7, 8,"  # a list to continue: no code model ends it within a few tokens
PROMPT = 'def add(a, b):\n    """Return the sum of a and b."""\n'


class _Spans(HTMLParser):
    """Every element's tag, attributes and the text directly inside it, parsed like a browser would."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict, list[str]]] = []
        self.stack: list[list[str]] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs), []))
        self.stack.append(self.elements[-1][2])

    def handle_endtag(self, tag):
        self.stack.pop()

    def handle_data(self, data):
        if self.stack:
            self.stack[-1].append(data)

    @classmethod
    def of(cls, markup: str) -> "_Spans":
        p = cls()
        p.feed(markup)
        p.close()
        return p

    def spans(self) -> list[tuple[dict, str]]:
        return [(attrs, "".join(text)) for tag, attrs, text in self.elements if tag == "span"]


def _events() -> list[wb.StepEvent]:
    """A prefill with markup in it, and a step that accepted 1 of 3 proposals, all whitespace-heavy."""
    prefill = wb.StepEvent(step=0, kind="prefill", emitted=[5], emitted_text=["<script>alert(1)</script>"],
                           emitted_status=["bonus"], emitted_verifier_probs=[0.5])
    spec = wb.StepEvent(step=1, kind="spec", proposed=[7, 8, 9], proposed_text=["  a", "\n\tb", "c & d"],
                        draft_probs=[0.9, 0.25, 0.125], verifier_probs=[0.8, 0.0625, 0.03125], num_accepted=1,
                        emitted=[7, 11], emitted_text=["  a", "\n    x"], emitted_status=["accepted", "corrected"],
                        emitted_verifier_probs=[0.8, 0.375])
    return [prefill, spec]


# ---- pure functions --------------------------------------------------------------------------


def test_render_tokens_escapes_markup_and_keeps_whitespace():
    markup = render.render_tokens(_events())
    assert "<script>" not in markup and "&lt;script&gt;" in markup
    spans = _Spans.of(markup).spans()
    assert [t for _, t in spans] == ["<script>alert(1)</script>", "  a", "\n    x"]  # exact, whitespace kept
    assert [a["data-status"] for a, _ in spans] == ["bonus", "accepted", "corrected"]
    assert [a["data-step"] for a, _ in spans] == ["0", "1", "1"]
    titles = [a["title"] for a, _ in spans]
    assert "q (draft) = 0.9" in titles[1] and "p (verifier) = 0.8" in titles[1] and "step 1" in titles[1]
    assert "q (draft) = n/a" in titles[2] and "p (verifier) = 0.375" in titles[2]
    answer = render.render_answer("x < y\n  ", _events())
    assert 'class="wb-answer" style="white-space: pre-wrap"' in answer
    assert "<kbd class=\"wb-prompt\">x &lt; y\n  </kbd>" in answer


def test_history_is_exact_escaped_text():
    history = [{"role": "user", "content": "<b>{{x}}</b>\n  ${y}"}, {"role": "assistant", "content": " a &\n\tb"}]
    elements = _Spans.of(render.history_html(history)).elements
    assert [("".join(t)) for tag, _, t in elements if tag == "pre"] == [m["content"] for m in history]
    assert not any(tag == "b" for tag, _, _ in elements)


def test_rejected_spans_only_when_asked():
    assert all(a["data-status"] != "rejected" for a, _ in _Spans.of(render.render_tokens(_events())).spans())
    spans = _Spans.of(render.render_tokens(_events(), show_rejected=True)).spans()
    # the rejected proposals proposed[num_accepted:] sit between the accepted run and the correction
    assert [(a["data-status"], t) for a, t in spans] == [
        ("bonus", "<script>alert(1)</script>"), ("accepted", "  a"), ("rejected", "\n\tb"), ("rejected", "c & d"),
        ("corrected", "\n    x")]
    assert "q (draft) = 0.125" in spans[3][0]["title"] and "p (verifier) = 0.0312" in spans[3][0]["title"]


def _steps(tokens: list[int], accepted: int = 2, k: int = 3) -> list[wb.StepEvent]:
    """A prefill, then spec steps that each accept `accepted` of k proposals and add a correction, over `tokens`."""
    events = [wb.StepEvent(step=0, kind="prefill", emitted=tokens[:1], emitted_text=[f"<{tokens[0]}>"],
                           emitted_status=["bonus"], emitted_verifier_probs=[1.0])]
    at = 1
    while at < len(tokens):
        out = tokens[at:at + accepted + 1]
        status = ["accepted"] * (len(out) - 1) + ["corrected"]
        events.append(wb.StepEvent(step=len(events), kind="spec", proposed=out[:-1] + [0] * (k - len(out) + 1),
                                   proposed_text=["?"] * k, draft_probs=[0.5] * k, verifier_probs=[0.5] * k,
                                   num_accepted=len(out) - 1, emitted=out, emitted_text=[f"<{t}>" for t in out],
                                   emitted_status=status, emitted_verifier_probs=[0.5] * len(out)))
        at += len(out)
    return events


LOOPING = list(range(100, 110)) + [20, 21, 22, 23] * 10  # the loop rule: 31 of 45 6-grams repeat, from token 14
CLEAN = list(range(200, 261))  # a prefill and 30 steps of 2 tokens


def test_an_answer_that_loops_is_marked_where_the_loop_starts():
    spans = _Spans.of(render.render_tokens(_steps(LOOPING), show_rejected=True)).spans()
    emitted = [(a, t) for a, t in spans if a["data-status"] != "rejected"]
    assert [t for _, t in emitted] == [f"<{t}>" for t in LOOPING]  # the marker adds no text
    marks = [a.get("data-loop") for a, _ in emitted]
    assert marks == [None] * 14 + ["start"] + ["in"] * 35
    assert render.LOOP_NOTE in emitted[14][0]["title"] and render.LOOP_NOTE not in emitted[13][0]["title"]
    assert all("data-loop" not in a for a, _ in spans if a["data-status"] == "rejected")
    assert '.tok[data-loop="start"]::before' in render.TOKEN_CSS
    clean = _Spans.of(render.render_tokens(_steps(CLEAN))).spans()
    assert all("data-loop" not in a for a, _ in clean)


def test_stats_show_the_clean_accept_length_and_the_loops():
    s = session.make_settings(3, 0, 1, NEW, 0, True)
    loop, clean = session.Answer("a", s, _steps(LOOPING, accepted=3)), session.Answer("b", s, _steps(CLEAN, accepted=1))
    conv = session.Conversation(answers=[clean, loop])
    pooled = compute_stats(loop.events + clean.events).accept_length
    row = (f"<td>accept length (bonus incl.)</td><td>{compute_stats(loop.events).accept_length:.2f} "
           f"(clean n/a, every continuation loops, 1 of 1 loop)</td><td>{pooled:.2f} (clean 2.00, 1 of 2 loop)</td>")
    assert row in render.stats_html(conv, loop)


@pytest.fixture(scope="module")
def app():
    """The chat app every test here drives (the embedded pair in fp32, loaded as the app loads it),
    so the app and the tests load the pair once."""
    app = session.ChatApp(session.PairSpec(), session.Settings(k=2, max_new_tokens=NEW), max_concurrency=4)
    yield app
    app.close()


@pytest.fixture(scope="module")
def pair(app):
    return app.pair()


_REFERENCES: dict[tuple, wb.GenerationResult] = {}


def _turn(pair: wb.ModelPair, prompt: str) -> str:
    """One user turn as the chat sends it: through the pair's chat template (the text itself without one)."""
    return pair.tokenizer.format_prompt([{"role": "user", "content": prompt}])


def _library(pair: wb.ModelPair, prompt: str, k: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             acceptor: str | None = None) -> wb.GenerationResult:
    """What `workbench generate --chat --json --heal --k K --seed S` returns for `prompt` (computed once per
    file): one user turn through the pair's chat template (the text itself without one), healed as the
    chat heals by default."""
    key = (id(pair), prompt, k, temperature, top_p, seed, acceptor)
    if key not in _REFERENCES:
        dec = wb.SpecDecoder(pair, k, temperature, top_p, seed=seed, acceptor=acceptor)
        _REFERENCES[key] = dec.generate(_turn(pair, prompt), NEW, heal=True)
    return _REFERENCES[key]


def test_real_stream_renders_every_emitted_token(pair):
    res = _library(pair, PROMPT, 3)
    spans = _Spans.of(render.render_tokens(res.events, show_rejected=True)).spans()
    shown = [(a["data-status"], int(a["data-step"]), t) for a, t in spans if a["data-status"] != "rejected"]
    expected = [(s, e.step, t) for e in res.events for s, t in zip(e.emitted_status, e.emitted_text)]
    assert shown == expected
    assert "".join(t for _, _, t in shown) == res.text
    rejected = sum(1 for a, _ in spans if a["data-status"] == "rejected")
    assert rejected == sum(e.k - e.num_accepted for e in res.events if e.kind == "spec" and e.correction is not None)


def test_stats_figures_show_the_library_numbers(pair):
    events = wb.SpecDecoder(pair, 4, proposer="ngram").generate("a = 1\nb = 1\na = 1\nb = 1\na =", NEW).events
    s = compute_stats(events)
    bars, hist = render.stats_figures(events)
    assert list(bars.data[0].y) == s.per_position_acceptance and list(bars.data[1].y) == s.conditional_acceptance
    assert list(hist.data[0].y) == s.accepted_length_histogram and sum(hist.data[0].y) == s.num_drafts
    empty_bars, _ = render.stats_figures([])
    assert len(empty_bars.data[0].y) == 0 and empty_bars.layout.annotations  # "no speculative steps yet"


@pytest.mark.parametrize("args, field", [
    ((9, 0, 1, 10, 0), "num_speculative_tokens"), ((0, 0, 1, 10, 0), "num_speculative_tokens"),
    ((2.5, 0, 1, 10, 0), "num_speculative_tokens"), ((2, math.nan, 1, 10, 0), "temperature"),
    ((2, -1, 1, 10, 0), "temperature"), ((2, 0, 0, 10, 0), "top_p"), ((2, 0, 1, 0, 0), "max_new_tokens"),
    ((2, 0, 1, 10, -3), "seed")])
def test_bad_settings_name_the_field(args, field):
    with pytest.raises(wb.RequestError, match=field):
        session.make_settings(*args)


def test_the_acceptance_rule_is_chosen_and_named(app, pair):
    with pytest.raises(wb.RequestError, match="acceptor = 'typical'; expected one of auto, rejection, block"):
        session.make_settings(2, 0.8, 1, 8, 0, acceptor="typical")
    conv = session.Conversation(history=[{"role": "user", "content": "x = ["}])
    s = session.make_settings(2, 0.8, 1, 8, 3, acceptor="block")
    answer = list(app.run_turn(conv, s))[-1]
    ref = wb.SpecDecoder(pair, 2, 0.8, 1.0, seed=3, acceptor="block").generate(_turn(pair, "x = ["), 8, heal=True)
    assert answer.rule == ref.acceptance_rule == "block (greedy draft, one-hot q)" and answer.text == ref.text


class _FixedRates:
    """Two arms' tokens/s, as the race's measurements report them."""

    def __init__(self, spec: float, ar: float) -> None:
        self.rates = {"speculative": spec, "autoregressive": ar}

    def rate(self, arm: str):
        return SimpleNamespace(median=self.rates[arm])

    def ratio(self, a: str, b: str):
        return SimpleNamespace(median=self.rates[a] / self.rates[b])


def test_turns_race_and_conversation_stats(app, pair):
    conv = session.Conversation(history=[{"role": "user", "content": PROMPT}])
    s = session.make_settings(3.0, 0, 1, NEW, 0, True)
    phases = [(a.phase, len(a.events)) for a in app.run_turn(conv, s, race=True)]
    answer = conv.answers[-1]
    assert [n for _, n in phases[:-2]] == list(range(1, len(answer.events) + 1))  # one update per step
    assert [p for p, _ in phases] == ["speculative"] * len(answer.events) + ["baseline", "done"]
    assert answer.text == _library(pair, PROMPT, 3).text == conv.history[-1]["content"]
    assert answer.baseline_text == wb.generate_autoregressive(pair, _turn(pair, PROMPT), NEW, heal=True).text
    race = answer.race  # both ways timed back to back under the sweep's protocol
    assert race.results["speculative"][0][0].text == answer.text and race.rate("autoregressive").median > 0
    assert "decode: speculative" in render.race_html(answer)
    verdict = _Spans.of(render.race_html(answer)).spans()[0]
    assert verdict[0]["id"] == "race-verdict" and verdict[1] == "identical"  # greedy is lossless
    accept = wb.compute_stats(answer.events).accept_length
    for spec_rate, flagged in ((100 * (accept + 0.5), True), (100 * max(1.0, accept - 0.5), False)):
        answer.race = _FixedRates(spec_rate, 100.0)  # a busy machine's pair of timings, then a sane one
        assert ('id="race-noise"' in render.race_html(answer)) is flagged
    conv.history.append({"role": "user", "content": "x = ["})
    both_turns = pair.tokenizer.format_prompt(conv.history)  # the second turn sees the first
    off = list(app.run_turn(conv, session.make_settings(3, 0, 1, 8, 0, False)))[-1]
    assert off.text == wb.generate_autoregressive(pair, both_turns, 8, heal=True).text
    spec_steps = [e for e in answer.events if e.kind == "spec"]
    assert conv.spec_events() == answer.events and conv.autoregressive_events() == answer.baseline + off.events
    table = render.stats_html(conv, off)
    assert f"<td>speculative steps</td><td>0</td><td>{len(spec_steps)}</td>" in table


def test_errors_leave_the_conversation_unchanged(app, pair):
    conv = session.Conversation(history=[{"role": "user", "content": " ".join(map(str, range(3000)))}])  # > 2048 tokens
    with pytest.raises(wb.RequestError, match="context"):
        list(app.run_turn(conv, session.Settings(k=2, max_new_tokens=4)))
    assert conv.answers == [] and len(conv.history) == 1


def test_the_chat_is_private_unless_asked():
    """Out of the box the chat listens on loopback only and opens no public link; a user's own
    choices are honoured, and a setting that cannot work is refused at the command line."""
    import ipaddress

    args = chat.parse_args([])
    assert ipaddress.ip_address(args.host).is_loopback and not args.share
    assert args.max_concurrency >= 1 and args.dtype in ("float32", "bfloat16")
    args = chat.parse_args(["--verifier", "v", "--draft", "d", "--device", "cuda", "--dtype", "bfloat16",
                            "--port", "8000", "--host", "0.0.0.0", "--share", "--max-concurrency", "2"])
    assert (args.verifier, args.draft, args.device, args.dtype, args.port, args.host, args.share,
            args.max_concurrency) == ("v", "d", "cuda", "bfloat16", 8000, "0.0.0.0", True, 2)
    with pytest.raises(SystemExit):
        chat.parse_args(["--max-concurrency", "0"])


def _control(demo, label: str):
    return next(b for b in demo.blocks.values() if getattr(b, "label", None) == label)


def _endpoint(demo, name: str):
    return next(f.fn for f in demo.fns.values() if f.api_name == name)


def test_two_apps_in_one_process_keep_their_own_state(app, pair, embedded_pair):
    """Each demo owns the `ChatApp` it was built from: its pair, its engine, its defaults. Two in one
    process, with different pairs and settings, answer from their own, and no module global changes."""
    modules = [chat, session, render, ui]
    before = [dict(vars(m)) for m in modules]
    first = session.ChatApp(session.PairSpec(), session.Settings(k=5, temperature=0.5, seed=9), max_concurrency=2)
    second = session.ChatApp(defaults=session.Settings(use_draft=False, max_new_tokens=7), pair=embedded_pair)
    try:
        demos = ui.build_demo(first), ui.build_demo(second)
        assert [_control(d, "num_speculative_tokens (k)").value for d in demos] == [5, 3]
        assert [_control(d, "seed").value for d in demos] == [9, 0]
        assert [_control(d, "draft on").value for d in demos] == [True, False]
        text, info = _endpoint(demos[1], "generate")(PROMPT, 2, max_new_tokens=NEW)
        assert text == _library(embedded_pair, PROMPT, 2).text and info["k"] == 2
        assert second.pair() is embedded_pair and first.pair() not in (embedded_pair, pair)  # loaded from its spec
        assert second.server().batch_sizes and not first.server().batch_sizes  # one engine each, only one used
        assert first.server() is not second.server() and app.server() not in (first.server(), second.server())
        assert first.max_concurrency == 2 and second.max_concurrency == app.max_concurrency == 4
    finally:
        first.close()
        second.close()
    for m, old in zip(modules, before):
        now = vars(m)
        assert now.keys() == old.keys() and all(now[k] is old[k] for k in old), m.__name__


def test_the_turn_logic_imports_without_gradio():
    """`chat_app.session` (settings, pair, conversation, turn, race) is plain Python over workbench."""
    code = ("import sys; import chat_app.session; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('gradio', 'plotly', 'chat_app')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO / "apps", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['chat_app',", "'chat_app.session']"]


# ---- the running app -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(app):
    demo = ui.build_demo(app)
    url = ui.launch(demo, host="127.0.0.1", port=_free_port(), block=False)
    yield url
    demo.close()


def _client(url: str):
    """A gradio_client with room for a loaded machine (httpx's default read timeout is 5 s)."""
    from gradio_client import Client

    return Client(url, verbose=False, httpx_kwargs={"timeout": 120})


def test_api_matches_the_library(app_url, pair):
    client = _client(app_url)
    for k, temperature, top_p, seed, acceptor in [(3, 0.0, 1.0, 0, "auto"), (2, 0.9, 0.95, 7, "auto"),
                                                  (2, 0.9, 0.95, 7, "block")]:
        text, info = client.predict(PROMPT, k, temperature, top_p, NEW, seed, True, True, acceptor,
                                    api_name="/generate")
        ref = _library(pair, PROMPT, k, temperature, top_p, seed, None if acceptor == "auto" else acceptor)
        assert text == ref.text and info["k"] == k and info["num_tokens"] == len(ref.tokens)
        assert info["stats"]["num_draft_tokens"] == ref.stats.num_draft_tokens
        assert info["acceptance_rule"] == ref.acceptance_rule
        loop = detect_loop(ref.tokens)
        assert info["loop"] == loop.to_dict()
        assert info["accept_length_clean"] == (None if loop.degenerate else ref.stats.accept_length)
    assert info["acceptance_rule"].startswith("block (greedy draft, one-hot q)")
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="num_speculative_tokens"):
        client.predict(PROMPT, 9, 0.0, 1.0, NEW, 0, True, api_name="/generate")


OVERLAP = 1024  # tokens per answer: long enough that four requests overlap in the batch


def test_four_users_at_once_each_get_their_own_answer(app_url, pair):
    """Four API users at once, each with its own k and prompt: each answer is that user's batch-1
    answer, and the engine really decoded them together (rows of one forward)."""
    prompts = {1: PROMPT, 2: "import os\n\n\ndef walk(", 3: "class Stack:\n", 4: PROMPT}
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    clients = {k: _client(app_url) for k in prompts}  # connected first: the four requests go out together
    start = threading.Barrier(len(prompts))

    def user(k: int) -> None:
        try:
            start.wait(timeout=60)
            results[k] = clients[k].predict(prompts[k], k, 0.0, 1.0, OVERLAP, 0, True, api_name="/generate")
        except BaseException as e:  # surfaced below; a thread's exception would be lost otherwise
            errors.append(e)

    threads = [threading.Thread(target=user, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors and sorted(results) == [1, 2, 3, 4]
    for k, (text, info) in results.items():
        ref = wb.SpecDecoder(pair, k).generate(_turn(pair, prompts[k]), OVERLAP, heal=True)
        assert text == ref.text and info["k"] == k
        assert info["stats"]["num_draft_tokens"] == ref.stats.num_draft_tokens  # this user's k, not another's
    assert results[1][0] == results[4][0]  # greedy is lossless: the same prompt, the same text at any k
    shared = [max(info["batch_sizes"]) for _, info in results.values()]
    assert max(shared) >= 3 and min(shared) >= 2, shared  # they shared the engine's forwards


# ---- a real browser --------------------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")


_PROGRESS = """() => [document.querySelectorAll('#tokens span[data-status]').length,
                      document.querySelector('#run-state').dataset.state]"""


def _send(page, prompt: str) -> None:
    page.locator("#prompt textarea").fill(prompt)
    page.locator("#send").click()


def _answer(page, prompt: str, answers_before: int) -> None:
    """Send `prompt` and wait until its answer is complete (one more assistant message, state done)."""
    _send(page, prompt)
    page.wait_for_function(f"""() => document.querySelectorAll('#history [data-role="assistant"]').length
                                     === {answers_before + 1} && document.querySelector('#run-state')
                                     .dataset.state === 'done'""")


def _stream_then_stop(page, server) -> None:
    """Tokens arrive step by step (two span counts seen while the run is going), and Stop cancels
    the run: the state says so, no more tokens arrive, and the engine's row is freed."""
    _set_max_new(page, LONG)  # long enough that the answer cannot finish before Stop lands
    _send(page, STOP_PROMPT)
    page.wait_for_selector('#run-state[data-state="running"]')
    seen: set[int] = set()
    while len(seen) < 2:
        n, state = page.evaluate(_PROGRESS)
        assert state == "running", f"the answer ended before two updates were seen (span counts {seen})"
        seen |= {n} - {0}
        time.sleep(0.01)
    page.locator("#stop").click()
    page.wait_for_selector('#run-state[data-state="stopped"]')
    n = page.locator("#tokens span[data-status]").count()
    time.sleep(2.0)  # a run that kept going would have added steps by now
    assert page.locator("#tokens span[data-status]").count() == n < LONG
    assert server.live == 0  # the request left the batch: its slot is free for the next user
    assert page.locator("#run-state").get_attribute("data-state") == "stopped"
    _set_max_new(page, NEW)


def _set_max_new(page, n: int) -> None:
    box = page.locator("#max-new input[type=number]")
    box.fill(str(n))
    box.press("Enter")
    box.blur()
    assert box.input_value() == str(n)


def _error_is_shown(page) -> None:
    """A prompt over the context is reported in the page (and the app keeps serving)."""
    _send(page, " ".join(map(str, range(3000))))
    page.wait_for_selector('#run-state[data-state="error"]')
    assert "context" in page.locator("#run-state").text_content()


@pytest.mark.browser
def test_browser_streams_colours_and_matches_generate(app_url, app, pair):
    """What a person sees: streaming, Stop, an error, colours, exact text, a race verdict; a screenshot."""
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium on this machine")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    prompts = ["<b>{{x}}</b> ${y} & `z`\n\t  ", PROMPT]  # markup first; the screenshot shows the code
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(120_000)  # a loaded shared CPU can take a while to start Gradio's frontend
        page.goto(app_url)
        page.wait_for_selector("#prompt textarea")
        _stream_then_stop(page, app.server())
        roles = page.locator("#history [data-role]").evaluate_all("els => els.map(e => e.dataset.role)")
        assert roles == ["user", "assistant"]  # the stopped answer stays in the conversation
        _error_is_shown(page)
        # a fresh conversation: the stopped answer may fill most of the context at 1,000+ tokens/s
        page.locator("#clear").click()
        page.wait_for_function("() => document.querySelectorAll('#history [data-role]').length === 0")
        statuses: set[str] = set()
        for i, prompt in enumerate(prompts):
            if i == 1:
                page.locator("#show-rejected input").check()
                page.locator("#race-mode input").check()
            _answer(page, prompt, answers_before=i)
            assert "acceptance: greedy" in page.locator("#run-state").text_content()  # the run names its rule
            shown = page.locator("#history [data-role]").evaluate_all(
                "els => els.map(e => ({role: e.dataset.role, content: e.querySelector('pre').textContent}))")
            assert shown[-2:][0] == {"role": "user", "content": prompt} and len(shown) == 2 * (i + 1)  # earlier turns
            sent = pair.tokenizer.format_prompt(shown[:-1])  # the conversation in the chat template
            ref = wb.SpecDecoder(pair, 2).generate(sent, NEW, heal=True)
            assert page.locator("#answer-text textarea").input_value() == ref.text
            assert page.locator("#tokens kbd").text_content() == sent  # markup shown as text, never executed
            assert sent.endswith(prompt + "<|im_end|><|im_assistant|>assistant<|im_middle|>")
            assert page.locator("#tokens b").count() == 0 and page.locator("#history b").count() == 0
            messages = page.locator("#history pre").evaluate_all("els => els.map(e => e.textContent)")
            assert messages[-2:] == [prompt, ref.text]  # the conversation keeps both, exactly
            spans = page.locator("#tokens span[data-status]")
            got = spans.evaluate_all("els => els.map(e => [e.dataset.status, e.dataset.step, e.textContent])")
            statuses |= {s for s, _, _ in got}
            assert "".join(t for s, _, t in got if s != "rejected") == ref.text
            want_rejected = sum(e.k - e.num_accepted for e in ref.events if e.correction is not None) if i else 0
            assert sum(s == "rejected" for s, _, _ in got) == want_rejected
            # a looping answer is marked where the loop starts (a drawn marker, no text); the stats say it
            marks = page.locator('#tokens span[data-loop="start"]').evaluate_all(
                "els => els.map(e => getComputedStyle(e, '::before').content)")
            assert len(marks) == int(detect_loop(ref.tokens).degenerate) and all("loop" in m for m in marks)
            assert "(clean " in page.locator("#stats").text_content()
        assert page.locator("#race-verdict").text_content() == "identical"  # greedy race: same text both ways
        assert len(statuses) >= 2 and statuses <= {"accepted", "corrected", "bonus", "rejected"}
        page.wait_for_function("document.querySelectorAll('.toast-close').length === 0")  # the warning fades
        shot = REPO / "assets" / "screenshots" / "chat.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
