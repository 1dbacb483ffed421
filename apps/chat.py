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

    workbench chat [--verifier DIR --draft DIR --device cpu --dtype float32 --weights native --port 7860]

This file is the entry point (`python apps/chat.py`, `gradio apps/chat.py`, `workbench chat`); the
chat itself is split by concern in `apps/chat_app/`: `session.py` the settings, one app's pair and
engine (`ChatApp`), the conversation, a turn and its race, with no Gradio; `render.py` the CSS, HTML
and plots, pure functions; `ui.py` the layout and wiring (`build_demo(app)`, `launch`). Every piece
of state belongs to a `ChatApp` or to a user's `gr.State`: nothing at module level changes at launch.
"""
import argparse

import gradio as gr

from chat_app.session import ChatApp, PairSpec
from chat_app.ui import build_demo, launch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="workbench chat", description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", help="verifier checkpoint dir (default: embedded tiny-kimi)")
    ap.add_argument("--draft", help="draft checkpoint dir (default: the embedded draft)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    ap.add_argument("--weights", default="native", choices=["native", "int8", "int8-b32", "bf16"],
                    help="the CPU kernels' weights: in --dtype, or int8 (a scale per output channel, or per "
                         "output channel and 32 inputs), or bf16 under fp32 activations")
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
    app = ChatApp(PairSpec(args.verifier, args.draft, args.device, args.dtype, args.weights),
                  max_concurrency=args.max_concurrency)
    app.pair()  # fail before the server starts when the checkpoint is bad
    launch(build_demo(app), args.host, args.port, args.share)
    return 0


if gr.NO_RELOAD:  # hot reload (`gradio apps/chat.py`) keeps this app, so its loaded weights and its engine
    reload_app = ChatApp()
demo = build_demo(reload_app)  # module level, so `gradio apps/chat.py` (reload mode) finds it; loads nothing yet

if __name__ == "__main__":
    raise SystemExit(main())
