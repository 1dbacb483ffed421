"""Where the pages' prompts come from: a bundled set, an uploaded JSONL file, or typed text.

Not a page (the dashboard lists its pages explicitly); imported by the pages that generate.
"""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from workbench.analysis.degeneracy import random_prompt_warning
from workbench.cli import parse_prompts as parse_jsonl

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "assets" / "prompts"
SEPARATOR = "---"  # a line holding only this separates typed prompts (prompts are multi-line code)


def bundled_sets() -> list[str]:
    return sorted(p.name for p in PROMPTS_DIR.glob("*.jsonl"))


def pick_prompts(key: str, default_n: int = 2, default_set: str = "smoke.jsonl") -> list[str]:
    """Prompt-source widgets (keys prefixed with `key`); stops the page with a message if none are usable."""
    sets = bundled_sets()
    source = st.radio("Prompts", ["Bundled set", "Upload JSONL", "Type prompts"], horizontal=True,
                      key=f"{key}_source")
    try:
        if source == "Bundled set":
            default = sets.index(default_set) if default_set in sets else 0
            name = st.selectbox("Prompt set (assets/prompts)", sets, index=default, key=f"{key}_set")
            prompts = parse_jsonl((PROMPTS_DIR / name).read_text(), f"assets/prompts/{name}") if name else []
        elif source == "Upload JSONL":
            up = st.file_uploader('JSONL, one {"prompt": ...} per line', type=["jsonl", "json", "txt"],
                                  key=f"{key}_upload")
            prompts = parse_jsonl(up.getvalue().decode("utf-8"), up.name) if up else []
        else:
            text = st.text_area(f"Prompts (separate them with a line holding only {SEPARATOR})",
                                "def fibonacci(n):\n\n---\nimport os\n\n\ndef main(", key=f"{key}_typed")
            blocks, cur = [], []
            for line in text.splitlines():
                if line.strip() == SEPARATOR:
                    blocks.append("\n".join(cur)), cur.clear()
                else:
                    cur.append(line)
            blocks.append("\n".join(cur))
            prompts = [b for b in blocks if b.strip()]
    except (ValueError, UnicodeDecodeError) as e:
        st.error(str(e))
        st.stop()
    if not prompts:
        st.info("Choose a prompt set, upload a JSONL file or type a prompt.")
        st.stop()
    # no max_value: the widget outlives a switch to a smaller set, so the count is clamped instead
    n = st.number_input(f"Prompts to use (of {len(prompts)})", min_value=1, value=default_n, key=f"{key}_n")
    chosen = prompts[: min(int(n), len(prompts))]
    pair = st.session_state.get("pair")
    if pair is not None and (warning := random_prompt_warning(chosen, pair.encode)):
        st.warning(warning)  # acceptance on random text says nothing about serving: said before any figure
    return chosen
