"""The workbench dashboard: tune k, inspect the fusion layer, check a pairing, size KV caches, watch vLLM.

    workbench dashboard                     # the embedded tiny-kimi pair
    streamlit run apps/dashboard.py -- --verifier DIR --draft DIR

This file is the router and the frame (Streamlit's `st.navigation` entrypoint): it draws the
shared sidebar, loads the pair once per process and hands it to the page in `st.session_state`.
The pair is shared by every session. Nothing changes it (each request has its own caches, and
the doctor's and fusion probes run on weight-sharing variants), so pages use it freely; the Tuning
page alone takes a lock, so that two sessions' timings do not slow each other.

The pages live in `apps/views/`, not `apps/pages/`: a `pages/` folder beside the entrypoint
switches Streamlit to its legacy multipage mode whenever the navigation flag is reset (every
AppTest run, a server's first run), which then runs a page without this frame and lists the
helper modules as pages.
"""
from __future__ import annotations

import argparse
import sys
import threading

import streamlit as st

import workbench as wb


def _cli_dirs() -> tuple[str, str]:
    """--verifier / --draft given after `--` on the streamlit command line (unknown args ignored)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--verifier", default="")
    ap.add_argument("--draft", default="")
    args, _ = ap.parse_known_args(sys.argv[1:])
    return args.verifier, args.draft


@st.cache_resource(show_spinner="Loading the model pair (fp32, CPU) ...")
def load(verifier: str, draft: str) -> tuple[wb.ModelPair, threading.Lock]:
    """One pair (and the Tuning page's timing lock) per process and per pair of directories."""
    pair = wb.load_pair(verifier=verifier or None, draft=draft or None, device="cpu", dtype="float32")
    return pair, threading.Lock()


st.set_page_config(page_title="EAGLE-3 MLA workbench", layout="wide")
cli_verifier, cli_draft = _cli_dirs()
with st.sidebar:
    st.subheader("Model pair")
    verifier = st.text_input("Verifier dir", cli_verifier, placeholder="embedded tiny-kimi verifier",
                             key="verifier_dir").strip()
    draft = st.text_input("Draft dir", cli_draft, placeholder="embedded draft (or none with a verifier dir)",
                          key="draft_dir").strip()
    # pages read the bounds from "k_bounds", a plain key that outlives the widget's cleanup on page switches
    st.session_state["k_bounds"] = st.slider("k range", 1, 8, (1, 4), key="k_range",
                                             help="num_speculative_tokens swept on the Tuning page")

st.session_state["pair_key"] = f"{verifier or 'embedded'}|{draft or 'default'}"
try:
    st.session_state["pair"], st.session_state["timing_lock"] = load(verifier, draft)
    st.session_state["pair_error"] = None
except (ValueError, OSError, RuntimeError) as e:  # ConfigError, CheckpointError, PairingError are ValueErrors
    st.session_state["pair"], st.session_state["timing_lock"], st.session_state["pair_error"] = None, None, str(e)

with st.sidebar:
    pair = st.session_state["pair"]
    if pair is None:
        st.error(f"Could not load the pair: {st.session_state['pair_error']}")
    else:
        d = pair.draft
        st.caption(f"verifier: {pair.verifier_dir}  \ndraft: {pair.draft_dir or 'none'}"
                   + (f" ({d.attention_kind.upper()}, aux ids {list(d.config.aux_layer_ids)})" if d else ""))

st.navigation([
    st.Page("views/tuning.py", title="Tuning", icon=":material/tune:", default=True),
    st.Page("views/batching.py", title="Batching", icon=":material/stacks:"),
    st.Page("views/fusion.py", title="Fusion", icon=":material/merge:"),
    st.Page("views/doctor.py", title="Doctor", icon=":material/stethoscope:"),
    st.Page("views/kv_cache.py", title="KV cache", icon=":material/memory:"),
    st.Page("views/live_vllm.py", title="Live vLLM", icon=":material/monitoring:"),
]).run()
