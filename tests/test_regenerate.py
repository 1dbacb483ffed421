"""Regenerated draft-training data from a built corpus (`workbench.training.regenerate.regenerate_corpus`):
windows of the train stream at several lengths and chat requests in the template, each continued
by the verifier itself on the engine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench as wb
from tests.helpers import EMBEDDED
from tests.test_pretrain import _corpus
from workbench.training.regenerate import regenerate_corpus

V2 = EMBEDDED / "verifier"  # the chat verifier: its template and context


@pytest.fixture(scope="module")
def pair():
    return wb.load_pair(str(V2), dtype="float32")


def _chat_corpus(tmp: Path, tokenizer) -> Path:
    corpus = _corpus(tmp)
    rows = []
    for i in range(3):
        messages = [{"role": "user", "content": f"Write a Python function `f{i}(x)` that returns x + {i}."},
                    {"role": "assistant", "content": f"```python\ndef f{i}(x):\n    return x + {i}\n```"}]
        if i == 1:  # a second turn: the request then carries the first turn's exchange
            messages += [{"role": "user", "content": "Now add a docstring."},
                         {"role": "assistant", "content": f"```python\ndef f{i}(x):\n    \"\"\"x + {i}.\"\"\"\n```"}]
        rows.append({"package": "demo", "path": f"demo/m{i}.py", "turns": 1, "messages": messages,
                     "text": tokenizer.apply_chat_template(messages)})  # as build-corpus renders it
    (corpus / "chat_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return corpus


def test_windows_and_chat_requests_are_continued_by_the_verifier(pair, tmp_path):
    corpus = _chat_corpus(tmp_path / "corpus", pair.tokenizer)
    kw = dict(sequences=5, lengths=(16, 40), new_tokens=8, chat_share=0.4, temperatures=(0.0, 0.7), batch=3,
              cache=tmp_path / "tokens", log=lambda s: None)
    records = regenerate_corpus(pair, corpus, **kw)
    assert [r["kind"] for r in records] == ["chat", "chat", "code", "code", "code"]
    assert [r["prompt_tokens"] for r in records[2:]] == [16, 40, 16]  # the lengths, cycled
    assert [r["temperature"] for r in records] == [0.0, 0.7, 0.0, 0.7, 0.0]
    for r in records:
        new = len(r["ids"]) - r["prompt_tokens"]
        assert 1 <= new <= 8
    for r in records[:2]:  # the request through the template, without the document's BOS (the trainer adds it)
        text = pair.decode(r["ids"][:r["prompt_tokens"]])
        assert text.startswith("<|im_system|>system") and "<|im_user|>user<|im_middle|>Write a Python function" in text
        assert text.endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>")  # the answer is the verifier's
        assert r["ids"][0] != pair.tokenizer.bos_token_id
    chats = regenerate_corpus(pair, corpus, 3, chat_share=1.0, new_tokens=2, cache=tmp_path / "tokens")
    two = [pair.decode(r["ids"][:r["prompt_tokens"]]) for r in chats if r["source"] == "demo/demo/m1.py"]
    # the two-turn request: its last user turn, with the first exchange before it
    assert len(two) == 1 and "returns x + 1." in two[0] and two[0].count("<|im_user|>") == 2
    assert "Now add a docstring.<|im_end|><|im_assistant|>" in two[0]
    for r in (records[0], records[2], records[4]):  # greedy rows: plain decoding's own continuation
        prompt = r["ids"][:r["prompt_tokens"]]
        if r["kind"] == "chat":
            prompt = [pair.tokenizer.bos_token_id] + prompt
        want = wb.generate_autoregressive(pair, prompt, 8).tokens
        assert r["ids"][r["prompt_tokens"]:] == want
    assert regenerate_corpus(pair, corpus, **kw) == records  # deterministic for a seed


def test_prompt_lengths_must_leave_room_for_the_new_tokens(pair, tmp_path):
    corpus = _chat_corpus(tmp_path / "corpus", pair.tokenizer)
    with pytest.raises(ValueError, match=r"lengths = \[2040\]"):
        regenerate_corpus(pair, corpus, 2, lengths=(2040,), new_tokens=16, cache=tmp_path / "tokens")
    with pytest.raises(ValueError, match="chat_share"):
        regenerate_corpus(pair, corpus, 2, chat_share=1.5, cache=tmp_path / "tokens")


def test_the_command_writes_the_records_as_jsonl(pair, tmp_path):
    from workbench.training.regenerate import main

    corpus = _chat_corpus(tmp_path / "corpus", pair.tokenizer)
    out = tmp_path / "regen.jsonl"
    assert main(["--verifier", str(V2), "--corpus", str(corpus), "--out", str(out), "--sequences", "3",
                 "--lengths", "24", "--new-tokens", "4", "--chat-share", "0.34", "--batch", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["chat", "code", "code"] and rows[1]["prompt_tokens"] == 24
    assert all(len(r["ids"]) > r["prompt_tokens"] for r in rows)
