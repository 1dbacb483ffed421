"""Instruction pairs mined from source, and Kimi's chat layout they are rendered in."""

import json
import shutil
import textwrap
from pathlib import Path

from workbench.tokenizer import Tokenizer
from workbench.training import chat_pairs as cp
from workbench.training.tokenizer import KIMI_CHAT_TEMPLATE, KIMI_DEFAULT_SYSTEM

VERIFIER = Path(__file__).resolve().parents[1] / "assets" / "tiny-kimi-v1" / "verifier"  # the stdlib tokenizer

SOURCE = textwrap.dedent('''\
    import os


    def area(width, height=1.0) -> float:
        """Return the area of a width x height rectangle.

        Both sides must be non-negative.
        """
        return width * height


    # Sum the areas of several rectangles, given as (width, height) pairs.
    def total_area(pairs):
        total = 0.0
        for w, h in pairs:
            total += area(w, h)
        return total


    def undocumented(x):
        y = x + 1
        return y


    def short():
        """Too short to be a pair."""


    class Box(object):
        """A box that can hold a number of items."""

        def __init__(self, size):
            """Make an empty box of `size` slots."""
            self.size = size
            self.items = []

        def put(self, item):
            # noqa: E501
            self.items.append(item)
            return len(self.items)
    ''')


def test_mine_items_finds_documented_functions_methods_and_classes():
    items = {it.name: it for it in cp.mine_items(SOURCE)}
    assert set(items) == {"area", "total_area", "Box", "Box.__init__"}
    area = items["area"]
    assert area.kind == "function" and area.lineno == 4
    assert area.signature == "area(width, height=1.0) -> float"
    assert area.doc == ("Return the area of a width x height rectangle.\n\n"
                        "Both sides must be non-negative.")
    assert area.code.startswith("def area(") and area.code.endswith("return width * height\n")
    # A leading comment stands in for a docstring; the call to `area` is recorded.
    assert items["total_area"].doc.startswith("Sum the areas of several rectangles")
    assert "area" in items["total_area"].calls
    assert items["Box"].kind == "class" and items["Box"].signature == "Box(object)"
    method = items["Box.__init__"]
    assert method.kind == "method" and method.code.startswith("def __init__(self, size):")
    assert cp.mine_items("def broken(:\n") == []


def test_requests_and_answers():
    items = {it.name: it for it in cp.mine_items(SOURCE)}
    for it in items.values():
        request = cp.request_text(it, "pkg/geometry.py")
        assert cp._summary(it.doc) in request or it.doc in request
        answer = cp.answer_text(it, "pkg/geometry.py")
        assert answer.endswith("```python\n" + it.code + "```")
    assert cp._summary(items["area"].doc) == "Return the area of a width x height rectangle."
    assert cp._module("pkg/sub/__init__.py") == "pkg.sub"


def test_conversations_are_deterministic_and_a_second_turn_calls_the_first(monkeypatch):
    first = cp.conversations(SOURCE, "pkg/geometry.py")
    assert first == cp.conversations(SOURCE, "pkg/geometry.py")
    assert 1 <= len(first) <= cp.MAX_PAIRS_PER_FILE
    for conv in first:
        assert [m["role"] for m in conv] in (["user", "assistant"], ["user", "assistant"] * 2)
    monkeypatch.setattr(cp, "TWO_TURN_FRACTION", 1.0)
    convs = cp.conversations(SOURCE, "pkg/geometry.py")
    by_first = {c[1]["content"].split("def ", 1)[1].split("(")[0]: c for c in convs}
    if "area" in by_first:  # `total_area` calls `area`, so it is area's follow-up
        conv = by_first["area"]
        assert len(conv) == 4 and "total_area" in conv[2]["content"]
        assert "def total_area(" in conv[3]["content"]
        assert "Using that" in conv[2]["content"] or "which uses `area`" in conv[2]["content"]
    for conv in convs:  # a follow-up that does not call the first never claims it does
        if len(conv) == 4 and "Using that" not in conv[2]["content"]:
            assert "which uses" not in conv[2]["content"]
    names = [n for c in convs for m in c[1::2] for n in [m["content"]]]
    assert len(names) == len(set(names))  # no item answered twice


def test_render_follows_kimi_layout_exactly():
    messages = [{"role": "user", "content": "Write f."},
                {"role": "assistant", "content": "```python\ndef f():\n    pass\n```"}]
    assert cp.render(messages) == (
        f"<|im_system|>system<|im_middle|>{KIMI_DEFAULT_SYSTEM}<|im_end|>"
        "<|im_user|>user<|im_middle|>Write f.<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>```python\ndef f():\n    pass\n```<|im_end|>")
    with_system = [{"role": "system", "content": "Be terse."}, messages[0]]
    assert cp.render(with_system, add_generation_prompt=True) == (
        "<|im_system|>system<|im_middle|>Be terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>Write f.<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")
    # A message's name replaces its role after the marker; other roles use <|im_system|>.
    named = [{"role": "system", "content": "S"}, {"role": "tool", "content": "42"},
             {"role": "user", "name": "ann", "content": "hi"}]
    assert cp.render(named) == ("<|im_system|>system<|im_middle|>S<|im_end|>"
                                "<|im_system|>tool<|im_middle|>42<|im_end|>"
                                "<|im_user|>ann<|im_middle|>hi<|im_end|>")


def test_render_matches_the_tokenizer_wrapper(tmp_path):
    shutil.copy(VERIFIER / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "chat_template": KIMI_CHAT_TEMPLATE}))
    tok = Tokenizer.from_dir(tmp_path)
    for conv in cp.conversations(SOURCE, "pkg/geometry.py"):
        assert tok.apply_chat_template(conv, add_generation_prompt=False) == cp.render(conv)
        assert tok.apply_chat_template(conv[:1]) == cp.render(conv[:1], True)
        assert cp.render(conv[:1], True).endswith("<|im_assistant|>assistant<|im_middle|>")


def test_build_chat_caps_the_share(tmp_path):
    docs = [{"package": "p", "version": "1", "license": "MIT", "path": f"p/m{i}.py",
             "text": SOURCE} for i in range(40)]
    for split in ("train", "eval"):
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps(d) + "\n" for d in docs[: 40 if split == "train" else 5]))
    figures = cp.build_chat(tmp_path, share=0.2, log=lambda *_: None)
    rows = [json.loads(x) for x in (tmp_path / "chat_train.jsonl").read_text().splitlines()]
    assert len(rows) == figures["train"]["conversations"] > 0
    assert 0 < figures["train"]["share_of_bytes"] <= 0.2
    assert sum(len(r["text"].encode()) for r in rows) == figures["train"]["bytes"]
    assert all(r["text"] == cp.render(r["messages"]) for r in rows)
    assert set(rows[0]) == {"package", "version", "license", "path", "turns", "messages", "text"}


def test_items_spelling_a_special_token_are_not_mined():
    src = SOURCE + textwrap.dedent('''\

        def chatml(text):
            """Wrap text in a ChatML turn for the user."""
            start = "<|im_start|>user\\n"
            return start + text + "<|im_end|>"
        ''')
    assert "chatml" in {it.name for it in cp.mine_items(src)}
    for conv in cp.conversations(src, "pkg/geometry.py", max_per_file=10):
        assert "chatml" not in json.dumps(conv)


def test_a_follow_up_says_it_builds_on_the_first_only_when_it_calls_it(monkeypatch):
    monkeypatch.setattr(cp, "TWO_TURN_FRACTION", 1.0)
    src = SOURCE.split("def undocumented")[0]  # area, then total_area which calls it
    seen = set()
    for path in ("a.py", "b.py", "c.py", "d.py", "e.py", "f.py"):
        (conv,) = cp.conversations(src, path)
        first = conv[1]["content"].split("def ", 1)[1].split("(")[0]
        says = ("Using that" in conv[2]["content"] or "which uses `area`" in conv[2]["content"])
        assert says == (first == "area"), (path, first, conv[2]["content"])
        seen.add(first)
    assert seen == {"area", "total_area"}  # both orders occur over these paths
