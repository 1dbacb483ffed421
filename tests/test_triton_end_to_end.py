"""`workbench generate --attention triton` (Triton interpreter on CPU) gives the torch path's greedy tokens."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROMPT = "import os\n\n\ndef add(a, b):\n"  # continued past 10 tokens (a bare signature ends the turn)


def generate(attention: str) -> list[int]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "generate", "--prompt", PROMPT,
                          "--k", "3", "--max-new-tokens", "10", "--attention", attention, "--json"],
                         capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["tokens"]


def test_triton_attention_matches_torch_on_the_embedded_pair():
    pytest.importorskip("triton")
    torch_tokens = generate("torch")
    assert len(torch_tokens) == 10
    assert generate("triton") == torch_tokens
