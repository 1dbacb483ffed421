"""Token healing: prompts that end in a newline, indentation or a space, as editors send them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import workbench as wb
from tests.helpers import REPO
from workbench.decoding.healing import first_piece, heal

# code prompts that end as an editor sends them: after a newline, or inside the new line's indentation
BODIES = ['import json\n\ndef load_config(path):\n    """Read a JSON config file and return a dict."""',
          "import os\n\n\ndef add(a, b):", 'class Stack:\n    """A last-in first-out stack."""\n\n    def push(self, item):']
ENDINGS = ["\n", "\n    "]
# ... and after a space in the middle of a line
MIDLINE = ["def add(a, b):\n    return", "import os\n\nPATH =", "for i in range(10):\n    if i %"]


def indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def keeps_indentation(prompt: str, text: str) -> bool:
    """After a newline (or inside the new line's indentation): the first line of code the text
    writes has the indentation the code needs (the last code line's, one level deeper after a
    colon). After a space mid-line: the text goes on with that line."""
    head, _, last = prompt.rpartition("\n")
    if last.strip():
        return bool(text.split("\n")[0].strip())
    code = [ln for ln in head.splitlines() if ln.strip()][-1]
    want = indent(code) + (4 if code.rstrip().endswith(":") else 0)
    lines = [ln for ln in (last + text).split("\n") if ln.strip()]
    return bool(lines) and indent(lines[0]) == want


def test_heal_backs_off_one_extendable_token(embedded_pair):
    tok = embedded_pair.tokenizer
    ids = embedded_pair.encode("def add(a, b):\n")
    h = heal(tok, ids, set(embedded_pair.eos_token_ids))
    assert h.prompt_ids == ids[:-1] and h.prefix == tok.token_bytes(ids[-1]) == b"\n"
    assert ids[-1] in h.allowed.tolist() and len(h.allowed) > 1
    assert all(tok.token_bytes(i).startswith(b"\n") for i in h.allowed.tolist())
    logits = torch.randn(tok.vocab_size)
    kept = h.constrain(logits)
    assert torch.equal(kept[h.allowed], logits[h.allowed]) and torch.isinf(kept).sum() == tok.vocab_size - len(h.allowed)
    four = next(i for i in h.allowed.tolist() if tok.token_bytes(i) == b"\n    ")
    assert first_piece(tok, h, four) == "    "  # the newline is the user's already
    assert heal(tok, ids[-1:], set()) is None  # a one-token prompt keeps its token
    assert heal(tok, ids[:-1] + [embedded_pair.eos_token_ids[0]], set(embedded_pair.eos_token_ids)) is None


@pytest.mark.parametrize("ending", [*ENDINGS, " "])
def test_healed_prompts_continue_the_code_and_speculation_stays_lossless(embedded_pair, ending):
    for body in (MIDLINE if ending == " " else BODIES):
        prompt = body + ending
        spec = wb.SpecDecoder(embedded_pair, 3).generate(prompt, 32, heal=True)
        ar = wb.generate_autoregressive(embedded_pair, prompt, 32, heal=True)
        assert spec.tokens == ar.tokens and spec.text == ar.text, prompt
        assert spec.text.strip(), prompt
        assert keeps_indentation(prompt, spec.text), (prompt, spec.text)
        assert embedded_pair.decode(spec.prompt_tokens + spec.tokens).endswith(prompt + spec.text)  # after a BOS


def test_without_healing_a_trailing_newline_derails_the_continuation(embedded_pair):
    """The failure healing fixes, on this pair: the same prompts unhealed lose the indentation or end at once."""
    broken = [body for body in BODIES
              if not keeps_indentation(body + "\n", wb.generate_autoregressive(embedded_pair, body + "\n", 32).text)]
    assert broken, "every unhealed prompt kept its indentation: the embedded pair no longer shows the problem"


def test_the_cli_heals_when_asked():
    prompt = BODIES[1] + "\n"
    outs = {}
    for flag in ([], ["--heal"]):
        out = subprocess.run([sys.executable, "-m", "workbench.cli", "generate", "--prompt", prompt, "--k", "3",
                              "--max-new-tokens", "24", "--json", *flag], capture_output=True, text=True, cwd=REPO,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        outs[bool(flag)] = json.loads(out.stdout)["text"]
    assert outs[True].strip() and keeps_indentation(prompt, outs[True]), outs
    assert outs[True] != outs[False]


def test_the_chat_heals():
    """A pair without a chat template (the first, stdlib pair) continues the user's text, healed."""
    sys.path.insert(0, str(REPO / "apps"))
    from chat_app.session import ChatApp, Conversation, Settings

    first = REPO / "assets" / "tiny-kimi-v1"
    app = ChatApp(pair=wb.load_pair(first / "verifier", first / "draft", dtype="float32"))
    try:
        for ending in ENDINGS[:2]:
            conv = Conversation(history=[{"role": "user", "content": BODIES[0] + ending}])
            answer = list(app.run_turn(conv, Settings(max_new_tokens=32), race=True))[-1]
            assert answer.settings.heal and answer.text.strip() and answer.text == answer.baseline_text
            assert keeps_indentation(BODIES[0] + ending, answer.text), answer.text
    finally:
        app.close()
