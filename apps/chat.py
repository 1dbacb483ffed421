"""The workbench chat: every speculation step of the EAGLE-3 draft and its verifier, live.

Each answer streams one `StepEvent` per verifier forward from the batched engine
(`workbench.decoding.serving.BatchServer`): every user's request is a row of one batch that
decodes in a thread of its own, rows joining and leaving between steps. Rows with different k
share a step by padding (per-row k: each verifies its own k + 1 tokens), and each row keeps its
own settings and seed, so a user's answer is what they would get alone. Each token is coloured
from the event's own per-token status, never by searching decoded text
(peers.md §1.1): an accepted draft proposal, the verifier's correction after a rejection, or the
verifier's bonus after a fully accepted step (the prefill token counts as a bonus). Rejected
proposals can be shown struck through. Race mode times the prompt again, speculative and plain
autoregressive decoding back to back under the sweep's protocol (`workbench.analysis.protocol`),
for decode tokens/s, speedup and (greedy) a losslessness check.

    workbench chat [--verifier DIR --draft DIR --device cpu --dtype float32 --port 7860]

The rendering and the turn logic are plain functions (`render_tokens`, `stats_figures`,
`run_turn`, ...), so they are tested without the UI; the handlers only map them to components.
No `from __future__ import annotations` here: `gr.api` reads the endpoint's real type hints.
"""
import argparse
import html
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import gradio as gr
import plotly.graph_objects as go

import workbench as wb
from workbench.analysis.degeneracy import accept_split, detect_loop, emitted_tokens
from workbench.decoding.stats import compute_stats
from workbench.analysis.protocol import Arm, Measurements, measure

MAX_UI_K = 8  # the slider's range; the engine itself allows up to wb.MAX_K
MAX_NEW_TOKENS = 1024
PLOT_EVERY_S = 0.75  # re-send the last answer's plots at most this often while streaming

# ---- the shared model pair -------------------------------------------------------------------


@dataclass(frozen=True)
class PairSpec:
    """Where the pair comes from; None means the embedded tiny-kimi verifier / draft."""

    verifier: str | None = None
    draft: str | None = None
    device: str = "cpu"
    dtype: str = "float32"


if gr.NO_RELOAD:  # hot reload (`gradio apps/chat.py`) keeps the loaded weights and the engine
    _PAIRS: dict = {}
    _SERVERS: dict = {}  # id(pair) -> the batched engine serving it
    _PAIRS_LOCK = threading.Lock()
    MAX_BATCH = {"size": 4}  # rows of the engine's batch: --max-concurrency


def get_pair(spec: PairSpec) -> wb.ModelPair:
    """Load a pair once per process and share it read-only: the engine owns every KV cache, one
    slot per request, so concurrent users never write into one another's rows."""
    with _PAIRS_LOCK:
        if spec not in _PAIRS:
            _PAIRS[spec] = wb.load_pair(spec.verifier, spec.draft, device=spec.device, dtype=spec.dtype)
        return _PAIRS[spec]


def server_for(pair: wb.ModelPair) -> wb.BatchServer:
    """The one batched engine of this pair (started on first use): every answer and API call is a row of it."""
    with _PAIRS_LOCK:
        if id(pair) not in _SERVERS:
            _SERVERS[id(pair)] = wb.BatchServer(pair, MAX_UI_K, MAX_BATCH["size"])
        return _SERVERS[id(pair)]


# ---- settings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """One answer's decoding settings (build them with `make_settings`, which validates)."""

    k: int = 3  # num_speculative_tokens
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    use_draft: bool = True  # False: autoregressive decoding with the verifier alone
    heal: bool = True  # token healing: a prompt that ends in "\n" or a space continues as typed
    acceptor: str = "auto"  # "auto" (greedy at T = 0, rejection sampling above), "rejection" or "block"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


ACCEPTORS = ("auto", "rejection", "block")


def decoder(pair: wb.ModelPair, s: Settings) -> wb.SpecDecoder:
    """The speculative decoder every path of the chat uses for these settings."""
    return wb.SpecDecoder(pair, s.k, s.temperature, s.top_p, seed=s.seed,
                          acceptor=None if s.acceptor == "auto" else s.acceptor)


def _as_int(name: str, value: object, lo: int, hi: int) -> int:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value != int(value) or not lo <= value <= hi:
        raise wb.RequestError(f"{name} = {value!r}; expected an integer in [{lo}, {hi}]")
    return int(value)


def make_settings(k: int | float, temperature: float, top_p: float, max_new_tokens: int | float,
                  seed: int | float | None, use_draft: bool = True, heal: bool = True,
                  acceptor: str = "auto") -> Settings:
    """Settings from raw widget values (sliders may send 3.0 for 3); bad values raise RequestError."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise wb.RequestError(f"temperature = {temperature!r}; expected a finite number >= 0")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise wb.RequestError(f"top_p = {top_p!r}; expected a number in (0, 1]")
    if acceptor not in ACCEPTORS:
        raise wb.RequestError(f"acceptor = {acceptor!r}; expected one of {', '.join(ACCEPTORS)}")
    return Settings(_as_int("num_speculative_tokens", k, 1, MAX_UI_K), float(temperature), float(top_p),
                    _as_int("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS),
                    _as_int("seed", seed, 0, 2**63 - 1), bool(use_draft), bool(heal), acceptor)


# ---- rendering (pure) ------------------------------------------------------------------------

STATUS_LABEL = {"accepted": "accepted draft proposal", "corrected": "verifier correction after a rejection",
                "bonus": "verifier bonus token", "rejected": "rejected draft proposal"}
COLOURS = {"accepted": ("#bfe9c3", "#0d3b14"), "corrected": ("#ffd3a8", "#5b2700"), "bonus": ("#c7d9ff", "#0b2862"),
           "rejected": ("#fbe3e6", "#a3122a")}  # (background, text): dark text on light tints stays legible
_STATUS_CSS = "".join(f'.tok[data-status="{s}"], .wb-legend [data-legend="{s}"] {{ background: {bg}; color: {fg}; }}\n'
                      for s, (bg, fg) in COLOURS.items())
TOKEN_CSS = _STATUS_CSS + """
.tok[data-status="rejected"], .wb-legend [data-legend="rejected"] { text-decoration: line-through; }
.wb-answer { white-space: pre-wrap; word-break: break-word; margin: 0; padding: 10px 12px; min-height: 96px;
  max-height: 460px; overflow-y: auto; background: #fbfbfa; color: #1d1d1d; border: 1px solid #ddd;
  border-radius: 6px; font: 14px/1.6 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.wb-prompt { font: inherit; color: #555; background: #ececec; border: 0; box-shadow: none; padding: 0; }
.tok { border-radius: 3px; box-shadow: inset -1px 0 0 rgba(0, 0, 0, .18); }
.wb-legend span { display: inline-block; margin-right: 8px; padding: 1px 6px; border-radius: 3px; }
.wb-status { padding: 6px 10px; border-radius: 6px; font-size: 14px; }
.wb-status[data-state="error"] { background: #fde2e2; color: #8a0d0d; border: 1px solid #f3b0b0; }
.wb-status[data-state="running"] { background: #eef4ff; color: #0b2862; }
.wb-status[data-state="done"], .wb-status[data-state="stopped"] { background: #f2f2f2; color: #333; }
.wb-verdict { font-weight: 600; padding: 2px 8px; border-radius: 4px; }
.wb-verdict.identical { background: #bfe9c3; color: #0d3b14; }
.wb-verdict.different { background: #fde2e2; color: #8a0d0d; }
.wb-history { max-height: 260px; overflow-y: auto; }
.wb-msg-text { white-space: pre-wrap; word-break: break-word; margin: 2px 0 8px; padding: 4px 8px; border-radius: 4px;
  font: 13px/1.5 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; background: #f4f4f4; color: #1d1d1d; }
.wb-msg[data-role="user"] .wb-msg-text { background: #ececec; color: #555; }
.wb-stats table { border-collapse: collapse; font-size: 13px; width: 100%; }
.wb-stats td, .wb-stats th { padding: 2px 8px; border-bottom: 1px solid #e5e5e5; text-align: right; }
.wb-stats td:first-child, .wb-stats th:first-child { text-align: left; }
.tok[data-loop] { text-decoration: underline wavy #b8860b; text-underline-offset: 3px; }
.tok[data-loop="start"]::before { content: "⟲ loop"; font-size: 11px; margin-right: 3px; padding: 0 4px;
  border-radius: 3px; background: #b8860b; color: #fff; text-decoration: none; display: inline-block; }
"""
LOOP_NOTE = "the answer loops from here: this repeats earlier text"  # the loop-start token's title
LEGEND_HTML = ('<div class="wb-legend">' + "".join(f'<span data-legend="{s}">{STATUS_LABEL[s]}</span>' for s in COLOURS)
               + " (prefill = bonus) · hover a token for its step, position, q and p</div>")


def _fmt_p(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _span(text: str, status: str, step: int, pos: int, q: float | None, p: float | None, how: str = "",
          loop: str | None = None) -> str:
    title = (f"step {step} · position {pos} in the step · {how or STATUS_LABEL[status]} · "
             f"q (draft) = {_fmt_p(q)} · p (verifier) = {_fmt_p(p)}" + (f" · {LOOP_NOTE}" if loop == "start" else ""))
    mark = f' data-loop="{loop}"' if loop else ""
    return (f'<span class="tok" data-status="{status}" data-step="{step}" data-pos="{pos}"{mark} '
            f'title="{html.escape(title)}">{html.escape(text)}</span>')


def _loop_mark(index: int, start: int | None) -> str | None:
    """An emitted token's place in a loop: "start" where the loop starts, "in" after it, None before or without."""
    if start is None or index < start:
        return None
    return "start" if index == start else "in"


def _step_spans(ev: wb.StepEvent, show_rejected: bool, first: int = 0, loop_start: int | None = None) -> list[str]:
    """One step's spans in reading order: accepted proposals, rejected ones, then the verifier's token.
    `first` is the index of the step's first emitted token in the answer, `loop_start` where the answer loops."""
    if ev.kind != "spec":  # prefill, or an autoregressive decode step: one verifier token, no draft
        how = "" if ev.kind == "prefill" else "verifier token (autoregressive, no draft)"
        return [_span(t, s, ev.step, 1, None, p, how, _loop_mark(first + j, loop_start))
                for j, (t, s, p) in enumerate(zip(ev.emitted_text, ev.emitted_status, ev.emitted_verifier_probs))]
    spans = []
    for j, (text, status, p) in enumerate(zip(ev.emitted_text, ev.emitted_status, ev.emitted_verifier_probs)):
        if j == ev.num_accepted and show_rejected:
            spans += [_span(ev.proposed_text[i], "rejected", ev.step, i + 1, ev.draft_probs[i], ev.verifier_probs[i])
                      for i in range(ev.num_accepted, ev.k)]
        q = ev.draft_probs[j] if status == "accepted" else None
        spans.append(_span(text, status, ev.step, j + 1, q, p, loop=_loop_mark(first + j, loop_start)))
    return spans


def render_tokens(events: list[wb.StepEvent], show_rejected: bool = False) -> str:
    """Every emitted token as an HTML-escaped `<span data-status data-step>` (and, when asked,
    each step's rejected proposals proposed[num_accepted:] before its correction). When the answer
    loops (`workbench.analysis.degeneracy`), the token where the loop starts carries data-loop="start"
    (drawn with a marker) and every later one data-loop="in"."""
    start = detect_loop(emitted_tokens(events)).loop_start
    spans, first = [], 0
    for ev in events:
        spans += _step_spans(ev, show_rejected, first, start)
        first += len(ev.emitted)
    return "".join(spans)


def render_answer(prompt: str, events: list[wb.StepEvent], show_rejected: bool = False) -> str:
    """The prompt (grey) and the coloured continuation in a whitespace-exact pre-wrap block."""
    return (f'<pre class="wb-answer" style="white-space: pre-wrap"><kbd class="wb-prompt">{html.escape(prompt)}'
            f"</kbd>{render_tokens(events, show_rejected)}</pre>")


def history_html(history: list[dict]) -> str:
    """The conversation as exact text: each message HTML-escaped in its own pre-wrap block."""
    rows = "".join(f'<div class="wb-msg" data-role="{html.escape(m["role"])}"><small>{html.escape(m["role"])}</small>'
                   f'<pre class="wb-msg-text">{html.escape(m["content"])}</pre></div>' for m in history)
    return f'<div class="wb-history">{rows or "<small>no messages yet</small>"}</div>'


def status_html(state: str, message: str) -> str:
    """The run's state ("running" | "done" | "stopped" | "error") where tests and people can read it."""
    return f'<div class="wb-status" id="run-state" data-state="{state}">{html.escape(message)}</div>'


def stats_figures(events: list[wb.StepEvent]) -> tuple[go.Figure, go.Figure]:
    """(per-position acceptance bars, accepted-length histogram) for any list of steps."""
    s = compute_stats(events)
    pos = [str(i + 1) for i in range(len(s.per_position_acceptance))]
    bars = go.Figure([go.Bar(name="unconditional (vLLM)", x=pos, y=s.per_position_acceptance),
                      go.Bar(name="conditional (EAGLE α)", x=pos, y=s.conditional_acceptance)])
    bars.update_layout(barmode="group", title="acceptance by draft position", yaxis_range=[0, 1],
                       xaxis_title="draft position", legend=dict(orientation="h", y=-0.3))
    lengths = [str(a) for a in range(len(s.accepted_length_histogram))]
    hist = go.Figure(go.Bar(x=lengths, y=s.accepted_length_histogram, marker_color="#4c78a8"))
    hist.update_layout(title="accepted proposals per step", xaxis_title="accepted", yaxis_title="steps")
    for fig in (bars, hist):
        fig.update_layout(height=260, margin=dict(l=40, r=10, t=40, b=40), template="plotly_white")
        if not s.num_drafts:
            fig.add_annotation(text="no speculative steps yet", showarrow=False, x=0.5, y=0.5,
                               xref="paper", yref="paper")
    return bars, hist


# ---- one turn (pure) -------------------------------------------------------------------------


@dataclass
class Answer:
    """One reply: its steps, and in race mode the autoregressive baseline on the same prompt."""

    prompt: str
    settings: Settings
    events: list[wb.StepEvent] = field(default_factory=list)
    baseline: list[wb.StepEvent] | None = None
    race: Measurements | None = None  # race mode: both ways timed back to back
    rule: str = "none (autoregressive)"  # the acceptance rule, as SpecDecoder names it
    phase: str = "speculative"  # "speculative" | "autoregressive" | "baseline" | "done"

    @property
    def text(self) -> str:
        return "".join(t for e in self.events for t in e.emitted_text)

    @property
    def baseline_text(self) -> str | None:
        return None if self.baseline is None else "".join(t for e in self.baseline for t in e.emitted_text)


@dataclass
class Conversation:
    """Per-user state: chat history as {"role", "content"} dicts and every answer's steps."""

    history: list[dict] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)

    def spec_events(self) -> list[wb.StepEvent]:
        return [e for a in self.answers if a.settings.use_draft for e in a.events]

    def autoregressive_events(self) -> list[wb.StepEvent]:
        return [e for a in self.answers for e in (a.baseline or ([] if a.settings.use_draft else a.events))]


def _autoregressive(pair: wb.ModelPair, prompt: str, s: Settings) -> wb.GenerationResult:
    return wb.generate_autoregressive(pair, prompt, s.max_new_tokens, s.temperature, s.top_p, seed=s.seed,
                                      heal=s.heal)


def submit(pair: wb.ModelPair, prompt: str, s: Settings) -> wb.Ticket:
    """One answer as a row of the pair's batched engine: k proposals a step, or none (k = 0:
    plain decoding) without the draft. Bad settings raise here, before anything runs."""
    return server_for(pair).submit(prompt, max_new_tokens=s.max_new_tokens, k=s.k if s.use_draft else 0,
                                   temperature=s.temperature, top_p=s.top_p, seed=s.seed, heal=s.heal,
                                   acceptor=None if s.acceptor == "auto" else s.acceptor)


def run_turn(pair: wb.ModelPair, conv: Conversation, s: Settings, race: bool = False) -> Iterator[Answer]:
    """Answer the last user message; yield the growing answer after every step (and each phase).

    Errors before the first step (bad prompt, too long for the context) leave `conv` unchanged.
    """
    prompt = pair.tokenizer.format_prompt(conv.history)
    answer = Answer(prompt, s, phase="speculative" if s.use_draft else "autoregressive")
    ticket = submit(pair, prompt, s)
    answer.rule = ticket.rule
    for ev in ticket.events():
        if not answer.events:
            conv.answers.append(answer)
            conv.history.append({"role": "assistant", "content": ""})
        answer.events.append(ev)
        conv.history[-1]["content"] = answer.text
        yield answer
    if race and s.use_draft:
        answer.phase = "baseline"
        yield answer
        answer.race = race_arms(pair, prompt, s)
        answer.baseline = answer.race.results["autoregressive"][0][0].events
    answer.phase = "done"
    yield answer


def race_arms(pair: wb.ModelPair, prompt: str, s: Settings) -> Measurements:
    """Both ways on this prompt, timed as the sweep times them (the pair is warm from the answer)."""
    dec = decoder(pair, s)
    arms = [Arm("autoregressive", 0, lambda p: _autoregressive(pair, p, s)),
            Arm("speculative", s.k, lambda p: dec.generate(p, s.max_new_tokens, heal=s.heal))]
    return measure(arms, [prompt], repeats=1, warmup=False)


def _tps(events: list[wb.StepEvent]) -> float | None:
    """Tokens per second of model time (draft + verify + prefill), so UI overhead never counts."""
    return compute_stats(events).tokens_per_s if events else None


def race_html(answer: Answer | None) -> str:
    """tokens/s of both runs, the speedup, and (greedy) whether the texts are identical."""
    if answer is None or answer.baseline is None:
        msg = "running the autoregressive baseline…" if answer is not None and answer.phase == "baseline" else \
            "Race mode reruns each prompt without the draft and compares tokens/s and (greedy) the texts."
        return f'<div class="wb-race">{msg}</div>'
    m = answer.race
    spec, ar = m.rate("speculative").median, m.rate("autoregressive").median
    speedup = m.ratio("speculative", "autoregressive").median
    if answer.settings.greedy:
        same = answer.text == answer.baseline_text
        verdict = (f'<span class="wb-verdict {"identical" if same else "different"}" id="race-verdict">'
                   f'{"identical" if same else "DIFFERENT"}</span> greedy texts')
    else:
        verdict = ('<span class="wb-verdict not-compared" id="race-verdict">not compared</span> (sampling: '
                   "the two runs are different draws from the same distribution)")
    # A step emits at most its accept length's worth of tokens for about a decode's cost or more, so a
    # speedup above the accept length is the machine's noise between the two runs, not speculation.
    accept = compute_stats(answer.events).accept_length
    noise = (f' · <span class="wb-warn" id="race-noise">{speedup:.2f}× is above the accept length {accept:.2f}: '
             f"the machine's noise between the runs, not speed; rerun</span>" if speedup > accept else "")
    return (f'<div class="wb-race">decode: speculative <b>{spec:.1f}</b> tok/s · autoregressive <b>{ar:.1f}</b> '
            f"tok/s · speedup <b>{speedup:.2f}×</b> (one run each, back to back) · {verdict}{noise}</div>")


def stats_html(conv: Conversation, answer: Answer | None) -> str:
    """Counters and rates for the last answer and the whole conversation, side by side."""
    def column(answers: list[list[wb.StepEvent]], ar: list[wb.StepEvent]) -> list[str]:
        spec = [e for events in answers for e in events]
        s, t_spec, t_ar = compute_stats(spec), _tps(spec), _tps(ar)
        rate = s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0
        return [accept_text(answers), f"{rate:.1%}", str(s.num_drafts), str(s.num_tokens),
                "—" if t_spec is None else f"{t_spec:.1f}", "—" if t_ar is None else f"{t_ar:.1f}",
                f"{t_spec / t_ar:.2f}×" if t_spec and t_ar else "—"]

    last = column(*(([answer.events], answer.baseline or []) if answer and answer.settings.use_draft else
                    ([], answer.events if answer else [])))
    whole = column([a.events for a in conv.answers if a.settings.use_draft], conv.autoregressive_events())
    names = ["accept length (bonus incl.)", "draft acceptance rate", "speculative steps", "tokens",
             "tokens/s speculative", "tokens/s autoregressive", "speedup"]
    rows = "".join(f"<tr><td>{n}</td><td>{a}</td><td>{b}</td></tr>" for n, a, b in zip(names, last, whole))
    return ('<div class="wb-stats"><table><tr><th></th><th>last answer</th><th>conversation</th></tr>'
            f"{rows}</table><small>tokens/s count model time only (draft + verify + prefill).</small></div>")


def accept_text(answers: list[list[wb.StepEvent]]) -> str:
    """"2.91 (clean 2.40, 1 of 3 loop)": the raw accept length never without the clean one and the loop count."""
    split = accept_split(answers)
    return f"{split.pooled:.2f} ({split.clean_text()})"


def api_result(pair: wb.ModelPair, prompt: str, s: Settings) -> wb.GenerationResult:
    """The API endpoint's generation: the same prompt formatting and decoder as the chat."""
    text = pair.tokenizer.format_prompt([{"role": "user", "content": prompt}])
    return submit(pair, text, s).result()


# ---- the UI ----------------------------------------------------------------------------------


def _prompt_note(pair: wb.ModelPair) -> str:
    if pair.tokenizer.chat_template is None:
        return ("**No chat template:** this pair is a plain code-continuation model, so your message is "
                "continued exactly as typed (earlier turns are not included). Try the start of some Python.")
    return "Prompts use the checkpoint's chat template over the whole conversation."


def _layout(defaults: Settings) -> SimpleNamespace:
    """Declare the components (inside a `gr.Blocks` context); returns them by name."""
    ui = SimpleNamespace()
    gr.Markdown("## Speculative decoding, step by step\nEach verifier step's tokens appear as the step completes.")
    ui.note = gr.Markdown(elem_id="prompt-note")
    ui.conv = gr.State(Conversation())
    with gr.Row():
        with gr.Column(scale=3):
            gr.HTML(LEGEND_HTML, css_template=TOKEN_CSS, js_on_load=None)
            ui.run_state = gr.HTML(status_html("done", "ready"), css_template=TOKEN_CSS, js_on_load=None)
            ui.tokens = gr.HTML(render_answer("", []), elem_id="tokens", css_template=TOKEN_CSS, js_on_load=None)
            ui.answer_text = gr.Textbox(label="answer (plain text, exactly as generated)", elem_id="answer-text",
                                        lines=4, max_lines=12, interactive=False, buttons=["copy"])
            ui.prompt = gr.Textbox(label="prompt", elem_id="prompt", lines=3, placeholder="def fibonacci(n):")
            with gr.Row():
                ui.send = gr.Button("Send", variant="primary", elem_id="send")
                ui.stop = gr.Button("Stop", variant="stop", elem_id="stop")
                ui.clear = gr.Button("Clear conversation", elem_id="clear")
            ui.race_box = gr.HTML(race_html(None), elem_id="race", css_template=TOKEN_CSS, js_on_load=None)
            with gr.Accordion("conversation", open=True):
                ui.history = gr.HTML(history_html([]), elem_id="history", css_template=TOKEN_CSS, js_on_load=None)
        with gr.Column(scale=2):
            with gr.Accordion("settings", open=True):
                ui.k = gr.Slider(1, MAX_UI_K, value=defaults.k, step=1, label="num_speculative_tokens (k)")
                ui.temperature = gr.Slider(0, 2, value=defaults.temperature, step=0.05,
                                           label="temperature (0 = greedy)")
                ui.top_p = gr.Slider(0.05, 1, value=defaults.top_p, step=0.05, label="top-p")
                ui.max_new = gr.Slider(1, MAX_NEW_TOKENS, value=defaults.max_new_tokens, step=1, label="max new tokens",
                                       elem_id="max-new")
                ui.seed = gr.Number(defaults.seed, precision=0, label="seed", minimum=0)
                ui.acceptor = gr.Dropdown(list(ACCEPTORS), value=defaults.acceptor, elem_id="acceptor",
                                          label="acceptance rule (auto: greedy at T = 0, rejection sampling above)")
                with gr.Row():
                    ui.use_draft = gr.Checkbox(defaults.use_draft, label="draft on", elem_id="use-draft")
                    ui.show_rejected = gr.Checkbox(False, label="show rejected", elem_id="show-rejected")
                    ui.race = gr.Checkbox(False, label="race vs autoregressive", elem_id="race-mode")
            ui.stats = gr.HTML(stats_html(Conversation(), None), elem_id="stats", css_template=TOKEN_CSS,
                               js_on_load=None)
            with gr.Tab("last answer"):
                ui.pos_last, ui.hist_last = gr.Plot(show_label=False), gr.Plot(show_label=False)
            with gr.Tab("conversation"):
                ui.pos_conv, ui.hist_conv = gr.Plot(show_label=False), gr.Plot(show_label=False)
    return ui


def _view(c: Conversation, a: Answer | None, rejected: bool, plots: bool, state: tuple[str, str]) -> tuple:
    """Values for `_outputs(ui)`, in order; plots and an absent answer's views are left as they are."""
    figs = (*stats_figures(a.events if a else []), *stats_figures(c.spec_events())) if plots else (gr.skip(),) * 4
    answer = (render_answer(a.prompt, a.events, rejected), a.text) if a else (gr.skip(), gr.skip())
    return (history_html(c.history), status_html(*state), *answer, stats_html(c, a), *figs, race_html(a), c)


def _outputs(ui: SimpleNamespace) -> list:
    return [ui.history, ui.run_state, ui.tokens, ui.answer_text, ui.stats, ui.pos_last, ui.hist_last, ui.pos_conv,
            ui.hist_conv, ui.race_box, ui.conv]


def build_demo(pair_args: PairSpec = PairSpec(), defaults: Settings = Settings()) -> gr.Blocks:
    """The chat UI for one pair (loaded on the first request, then shared by every user);
    `defaults` sets the controls' initial values."""
    # long: the event wiring of one Blocks app must sit inside its `with` block
    with gr.Blocks(title="workbench · speculative decoding, live", analytics_enabled=False) as demo:
        ui = _layout(defaults)

        def start_turn(message: str, c: Conversation):
            """Echo the user's message at once (not queued); the answer streams in `respond`."""
            if not message.strip():
                raise gr.Error("The prompt is empty; type some text to continue.")
            c.history.append({"role": "user", "content": message})
            return "", history_html(c.history), status_html("running", "generating…"), render_answer("", []), "", c

        def respond(c: Conversation, k, temperature, top_p, max_new, seed, use_draft, rejected, race, acceptor):
            plot_at, answer = 0.0, None
            try:
                s = make_settings(k, temperature, top_p, max_new, seed, use_draft, acceptor=acceptor)
                for answer in run_turn(get_pair(pair_args), c, s, race):
                    done = answer.phase == "done"
                    live = done or time.monotonic() >= plot_at
                    plot_at = time.monotonic() + PLOT_EVERY_S if live else plot_at
                    shared = f" ({answer.events[-1].batch_size} in this step's batch)" if answer.events else ""
                    state = ("done", f"done · acceptance: {answer.rule}") if done else \
                        ("running", f"running: {answer.phase}…{shared}")
                    yield _view(c, answer, rejected, live, state)
            except (ValueError, RuntimeError) as e:  # RequestError, SamplingError, ContextLengthError, torch
                gr.Warning(html.escape(str(e)))
                if c.history and c.history[-1]["role"] == "user":
                    c.history.pop()  # nothing was answered: let the user edit and resend
                yield _view(c, answer, rejected, True, ("error", f"error: {e}"))

        def rerender(c: Conversation, rejected: bool) -> str:
            a = c.answers[-1] if c.answers else None
            return render_answer(a.prompt, a.events, rejected) if a else render_answer("", [])

        def reset() -> tuple:
            out = list(_view(Conversation(), None, False, True, ("done", "ready")))
            out[2:4] = [render_answer("", []), ""]  # tokens, answer_text
            return tuple(out)

        def generate(prompt: str, k: int = 3, temperature: float = 0.0, top_p: float = 1.0,
                     max_new_tokens: int = 64, seed: int = 0, use_draft: bool = True,
                     heal: bool = True, acceptor: str = "auto") -> tuple[str, dict]:
            """Continue `prompt`; returns (text, {finish_reason, num_tokens, k, acceptance_rule, stats, loop (the
            repeated-6-gram rule's verdict and where the loop starts), accept_length_clean (None when the answer
            loops), batch_sizes: the requests in each of its steps' forwards}). k and
            acceptor ("auto", "rejection", "block") are ignored without the draft. The prompt is formatted as
            in the chat (plain text when there is no chat template) and, as there, healed unless `heal` is False."""
            try:
                s = make_settings(k, temperature, top_p, max_new_tokens, seed, use_draft, heal, acceptor)
                res = api_result(get_pair(pair_args), prompt, s)
            except ValueError as e:
                raise gr.Error(str(e)) from e
            loop = detect_loop(res.tokens)
            return res.text, {"finish_reason": res.finish_reason, "num_tokens": len(res.tokens), "k": res.k,
                              "acceptance_rule": res.acceptance_rule, "stats": res.stats.to_dict(),
                              "loop": loop.to_dict(),  # the accept length of a looping answer is not the draft's
                              "accept_length_clean": None if loop.degenerate else res.stats.accept_length,
                              "batch_sizes": [e.batch_size for e in res.events[1:]]}

        hidden = dict(api_visibility="undocumented")  # UI events; the public API is /generate
        inputs = [ui.conv, ui.k, ui.temperature, ui.top_p, ui.max_new, ui.seed, ui.use_draft, ui.show_rejected,
                  ui.race, ui.acceptor]
        echo = [ui.prompt, ui.history, ui.run_state, ui.tokens, ui.answer_text, ui.conv]
        runs = [trigger(start_turn, [ui.prompt, ui.conv], echo, queue=False, **hidden)
                .success(respond, inputs, _outputs(ui), **hidden) for trigger in (ui.send.click, ui.prompt.submit)]
        # mark "stopped" only once the cancel is through, so a step already on its way cannot overwrite it
        ui.stop.click(None, None, None, cancels=runs, queue=False, **hidden).then(
            lambda: status_html("stopped", "stopped"), None, ui.run_state, queue=False, **hidden)
        ui.show_rejected.change(rerender, [ui.conv, ui.show_rejected], ui.tokens, queue=False, **hidden)
        ui.clear.click(reset, None, _outputs(ui), cancels=runs, queue=False, **hidden)
        demo.load(lambda: _prompt_note(get_pair(pair_args)), None, ui.note, **hidden)
        gr.api(generate, api_name="generate")
    return demo


THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                          font_mono=["ui-monospace", "Consolas", "monospace"])  # no web fonts: works offline


LAUNCH_TRIES = 3  # Gradio probes its own URL with a 3 s timeout, which an overloaded machine can miss


def launch(demo: gr.Blocks, host: str = "127.0.0.1", port: int = 7860, share: bool = False,
           max_concurrency: int = 4, block: bool = True) -> str:
    """Queue (each user's handler in its own worker thread, its answer a row of the batched engine,
    which takes up to `max_concurrency` rows) and serve; returns the local URL."""
    MAX_BATCH["size"] = max_concurrency
    demo.queue(default_concurrency_limit=max_concurrency)
    for attempt in range(LAUNCH_TRIES):
        try:
            _, url, _ = demo.launch(server_name=host, server_port=port, share=share, theme=THEME, ssr_mode=False,
                                    prevent_thread_lock=not block, quiet=not block)
            return url
        except ValueError as e:
            if "localhost is not accessible" not in str(e) or attempt == LAUNCH_TRIES - 1:
                raise
            demo.close()
    raise AssertionError("unreachable")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="workbench chat", description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", help="verifier checkpoint dir (default: embedded tiny-kimi)")
    ap.add_argument("--draft", help="draft checkpoint dir (default: the embedded draft)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    ap.add_argument("--port", type=int, default=7860)
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--share", action="store_true", help="open a public Gradio share link (off by default)")
    ap.add_argument("--max-concurrency", type=int, default=4,
                    help="answers decoding at once: the batched engine's batch size")
    args = ap.parse_args(argv)
    if args.max_concurrency < 1:
        ap.error(f"--max-concurrency = {args.max_concurrency}; expected >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = PairSpec(args.verifier, args.draft, args.device, args.dtype)
    get_pair(spec)  # fail before the server starts when the checkpoint is bad
    launch(build_demo(spec), args.host, args.port, args.share, args.max_concurrency)
    return 0


demo = build_demo()  # module level, so `gradio apps/chat.py` (reload mode) finds it; loads nothing yet

if __name__ == "__main__":
    raise SystemExit(main())
