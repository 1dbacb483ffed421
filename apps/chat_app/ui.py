"""The chat's layout and wiring: `build_demo(app)` declares the components and maps the turn
logic (`chat_app.session`) and the rendering (`chat_app.render`) onto them; `launch` serves it.

Handlers only map plain functions to components; every piece of state is the `ChatApp` passed in
(the pair, its engine, the defaults) or a user's `gr.State` (the conversation).
No `from __future__ import annotations` here: `gr.api` reads the endpoint's real type hints.
"""
import html
import time
from types import SimpleNamespace

import gradio as gr

import workbench as wb

from chat_app.render import (LEGEND_HTML, TOKEN_CSS, history_html, prompt_note, race_html, render_answer,
                             stats_figures, stats_html, status_html)
from chat_app.session import ACCEPTORS, MAX_NEW_TOKENS, MAX_UI_K, Answer, ChatApp, Conversation, Settings, make_settings

PLOT_EVERY_S = 0.75  # re-send the last answer's plots at most this often while streaming


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


def build_demo(app: ChatApp) -> gr.Blocks:
    """The chat UI of one `ChatApp`: its pair (loaded on the first request, then shared by every
    user), its engine, its defaults as the controls' initial values. Each user's handler runs in a
    worker thread of its own, up to the app's `max_concurrency` at once (the engine's rows)."""
    # long: the event wiring of one Blocks app must sit inside its `with` block
    with gr.Blocks(title="workbench · speculative decoding, live", analytics_enabled=False) as demo:
        ui = _layout(app.defaults)

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
                for answer in app.run_turn(c, s, race):
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
                res = app.api_result(prompt, s)
            except ValueError as e:
                raise gr.Error(str(e)) from e
            loop = wb.detect_loop(res.tokens)
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
        demo.load(lambda: prompt_note(app.pair()), None, ui.note, **hidden)
        gr.api(generate, api_name="generate")
    demo.queue(default_concurrency_limit=app.max_concurrency)  # each answer a row of the app's engine
    return demo


THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                          font_mono=["ui-monospace", "Consolas", "monospace"])  # no web fonts: works offline


LAUNCH_TRIES = 3  # Gradio probes its own URL with a 3 s timeout, which an overloaded machine can miss


def launch(demo: gr.Blocks, host: str = "127.0.0.1", port: int = 7860, share: bool = False,
           block: bool = True) -> str:
    """Serve a `build_demo` app; returns the local URL."""
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
