"""The chat's look, as pure functions of plain data: CSS, each token's span, the HTML of the
answer, history, run state, race and stats, and the two acceptance plots.

Each token is coloured from its step's own per-token status, never by searching decoded text
(peers.md §1.1); everything shown is HTML-escaped, whitespace kept exactly.
"""
import html

import plotly.graph_objects as go

import workbench as wb
from workbench.analysis.degeneracy import emitted_tokens

from chat_app.session import Answer, Conversation

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
    start = wb.detect_loop(emitted_tokens(events)).loop_start
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
    s = wb.compute_stats(events)
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


def _tps(events: list[wb.StepEvent]) -> float | None:
    """Tokens per second of model time (draft + verify + prefill), so UI overhead never counts."""
    return wb.compute_stats(events).tokens_per_s if events else None


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
    accept = wb.compute_stats(answer.events).accept_length
    noise = (f' · <span class="wb-warn" id="race-noise">{speedup:.2f}× is above the accept length {accept:.2f}: '
             f"the machine's noise between the runs, not speed; rerun</span>" if speedup > accept else "")
    return (f'<div class="wb-race">decode: speculative <b>{spec:.1f}</b> tok/s · autoregressive <b>{ar:.1f}</b> '
            f"tok/s · speedup <b>{speedup:.2f}×</b> (one run each, back to back) · {verdict}{noise}</div>")


def stats_html(conv: Conversation, answer: Answer | None) -> str:
    """Counters and rates for the last answer and the whole conversation, side by side."""
    def column(answers: list[list[wb.StepEvent]], ar: list[wb.StepEvent]) -> list[str]:
        spec = [e for events in answers for e in events]
        s, t_spec, t_ar = wb.compute_stats(spec), _tps(spec), _tps(ar)
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
    split = wb.accept_split(answers)
    return f"{split.pooled:.2f} ({split.clean_text()})"


def prompt_note(pair: wb.ModelPair) -> str:
    """What the prompt is made of for this pair (markdown, above the chat)."""
    if pair.tokenizer.chat_template is None:
        return ("**No chat template:** this pair is a plain code-continuation model, so your message is "
                "continued exactly as typed (earlier turns are not included). Try the start of some Python.")
    return "Prompts use the checkpoint's chat template over the whole conversation."
