"""Instruction pairs mined from the corpus itself, in Kimi's chat format (issue 42).

Each pair is a function, method or class of a corpus file that documents itself: the request
is its docstring (or, without one, the comment block right above it) rewritten into an
instruction by one of a few templates, and the answer is its code, verbatim, in a fenced
```python block. The answer keeps the docstring: the code is then exactly as its authors wrote
it (cutting the docstring out would mean re-rendering or splicing source), and a documented
function is what a good assistant answers with; the request and the docstring overlapping is
also what real chats look like ("write f that does X" -> a def whose docstring says X).

Some conversations have two turns from the same file; the second function is, when the file
has one, a function that calls the first, so the second answer can build on the first.

Every choice (which items, which template, single or two turns) is a function of the file's
path and the item's name through sha1, so the output is the same on every machine.

Conversations are rendered through KIMI_CHAT_TEMPLATE (Kimi-K2-Instruct's layout, with its
default system turn) into `text` for pretraining, and also kept as `messages` lists.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from workbench.training.tokenizer import CHAT_SPECIAL_TOKENS, KIMI_CHAT_TEMPLATE

MIN_LINES = 3  # a def line, a docstring and at least one statement
MAX_LINES = 80
MAX_CODE_CHARS = 3500
MIN_REQUEST_CHARS = 12
MAX_REQUEST_CHARS = 800
MAX_PAIRS_PER_FILE = 4
TWO_TURN_FRACTION = 0.25
CHAT_SHARE = 0.12  # target share of chat text in the training text (bytes, ~ tokens)

_PRAGMA = re.compile(r"^\s*(noqa|type:|pylint|pragma|fmt:|isort|mypy|flake8|-\*-|!|"
                     r"[=\-#*~]{3,}|todo|fixme|xxx)", re.I)


@dataclass(frozen=True)
class Item:
    """A documented function, method or class cut from a source file."""

    kind: str  # "function", "method", "class"
    name: str  # qualified for methods: Class.method
    signature: str  # `name(args) -> ret` / `Name(Base)`
    doc: str  # the cleaned docstring or comment text
    code: str  # the full source, dedented, decorators included
    lineno: int
    calls: frozenset[str]  # simple names called in the body


def _h(*parts: str) -> int:
    return int.from_bytes(hashlib.sha1("\x00".join(parts).encode("utf-8")).digest()[:8], "big")


def _leading_comment(lines: list[str], first: int) -> str | None:
    """The block of `#` lines right above line index `first` (0-based), cleaned."""
    block = []
    i = first - 1
    while i >= 0 and lines[i].strip().startswith("#"):
        block.append(lines[i].strip().lstrip("#").strip())
        i -= 1
    block.reverse()
    block = [b for b in block if not _PRAGMA.match(b)]
    text = " ".join(b for b in block if b)
    return text or None


def _signature(node: ast.AST, qualname: str) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases + node.keywords)
        return f"{qualname}({bases})" if bases else qualname
    args = ast.unparse(node.args)
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{qualname}({args}){ret}"


def _called_names(node: ast.AST) -> frozenset[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            if isinstance(f, ast.Name):
                names.add(f.id)
            elif isinstance(f, ast.Attribute):
                names.add(f.attr)
    return frozenset(names)


def mine_items(source: str) -> list[Item]:
    """Documented top-level functions and classes and their methods, in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    items = []

    def visit(body: list[ast.stmt], owner: str | None) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            is_class = isinstance(node, ast.ClassDef)
            qualname = f"{owner}.{node.name}" if owner else node.name
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            last = node.end_lineno
            doc = ast.get_docstring(node, clean=True)
            if doc is None:
                doc = _leading_comment(lines, first)
            n_lines = last - first
            if doc and MIN_LINES <= n_lines <= MAX_LINES:
                code = textwrap.dedent("\n".join(lines[first:last])) + "\n"
                if len(code) <= MAX_CODE_CHARS and not code.startswith((" ", "\t")):
                    kind = "class" if is_class else ("method" if owner else "function")
                    items.append(Item(kind, qualname, _signature(node, qualname), doc, code,
                                      first + 1, _called_names(node)))
            if is_class and owner is None:
                visit(node.body, node.name)

    visit(tree.body, None)
    return items


def _summary(doc: str) -> str:
    """The docstring's first paragraph, on one line."""
    para = doc.strip().split("\n\n", 1)[0]
    return " ".join(para.split())


# Openings of a docstring or comment that say where code came from or why it is odd, not
# what it does ("Copied from transformers.models...", "Skipped because ...", "Returns: ...").
_NOT_A_REQUEST = (":", "..", ">>>", "@", "//", "Args", "Parameters", "Returns", "See ",
                  "see ", "Deprecated", "Alias", "Same as", "Docstring", "Copied from",
                  "copied from", "Adapted from", "adapted from", "Modified from", "Based on",
                  "Skip", "Not used", "Note:", "NOTE", "XXX", "HACK", "TODO", "FIXME",
                  "Override", "Overrid", "Inherit", "pragma", "type:")


def _usable(doc: str) -> bool:
    summary = _summary(doc)
    if any(t in doc for t in CHAT_SPECIAL_TOKENS):
        return False
    if not MIN_REQUEST_CHARS <= len(summary) <= MAX_REQUEST_CHARS:
        return False
    if summary.startswith(_NOT_A_REQUEST):
        return False
    return sum(c.isalpha() for c in summary) >= 0.6 * len(summary)


# ---- requests and answers ------------------------------------------------------------------

_FUNCTION_REQUESTS = (
    "Write a Python function `{sig}` that: {summary}",
    "Implement `{sig}` in Python.\n\n{doc}",
    "{summary}\n\nWrite this as a Python function named `{name}`.",
    "Can you write `{name}` for me? Signature: `{sig}`. It should do this: {summary}",
    "I need a function `{sig}` in the module `{module}`. {doc}",
)
_METHOD_REQUESTS = (
    "Write the method `{sig}` of class `{owner}`: {summary}",
    "Implement `{owner}.{short}` in Python.\n\n{doc}",
    "In class `{owner}`, add a method `{short}`. {summary}",
)
_CLASS_REQUESTS = (
    "Write a Python class `{sig}`: {summary}",
    "Implement a class `{name}` in Python.\n\n{doc}",
    "{summary}\n\nWrite this as a Python class named `{name}`.",
)
_FOLLOW_UPS = (
    "Now write `{sig}`: {summary}",
    "Next, in the same module, implement `{sig}`.\n\n{doc}",
)
# Only for a second function that calls the first: the request then says so truthfully.
_FOLLOW_UPS_USING = (
    "Thanks. Using that, write `{sig}` that: {summary}",
    "Now write `{sig}`, which uses `{uses}`: {summary}",
)
_LEADS = ("", "", "Here is `{name}`:\n\n", "Here is an implementation:\n\n",
          "Sure. Here is `{name}`:\n\n")


def _module(path: str) -> str:
    mod = path[:-3] if path.endswith(".py") else path
    mod = mod.replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def request_text(item: Item, path: str, follow_up: bool = False,
                 uses: str | None = None) -> str:
    """The instruction for `item`, by a template picked from sha1(path, name); a follow-up
    whose code calls the previous answer's function `uses` may say it builds on it."""
    if follow_up:
        templates = _FOLLOW_UPS_USING if uses else _FOLLOW_UPS
    else:
        templates = {"function": _FUNCTION_REQUESTS, "method": _METHOD_REQUESTS,
                     "class": _CLASS_REQUESTS}[item.kind]
    template = templates[_h("request", path, item.name) % len(templates)]
    doc = item.doc.strip()
    if "{doc}" in template and len(doc) > MAX_REQUEST_CHARS:
        template = template.replace("{doc}", "{summary}")
    owner, _, short = item.name.rpartition(".")
    return template.format(sig=item.signature, summary=_summary(doc), doc=doc, name=item.name,
                           owner=owner, short=short, module=_module(path), uses=uses)


def answer_text(item: Item, path: str) -> str:
    lead = _LEADS[_h("lead", path, item.name) % len(_LEADS)].format(name=item.name)
    return f"{lead}```python\n{item.code}```"


# ---- conversations -------------------------------------------------------------------------

def conversations(source: str, path: str,
                  max_per_file: int = MAX_PAIRS_PER_FILE) -> list[list[dict]]:
    """Single- and two-turn conversations mined from one file (`path` seeds the choices)."""
    items = [it for it in mine_items(source)
             if _usable(it.doc) and not any(t in it.code for t in CHAT_SPECIAL_TOKENS)]
    if not items:
        return []
    items.sort(key=lambda it: _h("order", path, it.name))
    chosen = items[:max_per_file]
    used: set[str] = set()
    convs = []
    for item in chosen:
        if item.name in used:
            continue
        used.add(item.name)
        messages = [{"role": "user", "content": request_text(item, path)},
                    {"role": "assistant", "content": answer_text(item, path)}]
        if _h("turns", path, item.name) % 10_000 < TWO_TURN_FRACTION * 10_000:
            short = item.name.rpartition(".")[2]
            rest = [it for it in items if it.name not in used and it.kind != "class"]
            callers = [it for it in rest if short in it.calls]
            second = (callers or rest or [None])[0]
            if second is not None:
                used.add(second.name)
                uses = short if callers else None
                messages += [{"role": "user", "content": request_text(second, path, True, uses)},
                             {"role": "assistant", "content": answer_text(second, path)}]
        convs.append(messages)
    return convs


@lru_cache(maxsize=1)
def _template():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # The same environment as transformers' apply_chat_template (and workbench.tokenizer).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    return env.from_string(KIMI_CHAT_TEMPLATE)


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """`messages` through KIMI_CHAT_TEMPLATE: the text a pretraining document holds."""
    return _template().render(messages=messages, add_generation_prompt=add_generation_prompt)


# ---- over the corpus -----------------------------------------------------------------------

def iter_chat_documents(docs: Iterable[dict]) -> Iterator[dict]:
    """Chat documents (package, version, license, path, messages, text) from corpus documents,
    in a deterministic order spread over files: sha1(package, path)."""
    for doc in docs:
        for i, messages in enumerate(conversations(doc["text"], doc["path"])):
            yield {"package": doc["package"], "version": doc["version"],
                   "license": doc["license"], "path": doc["path"], "turns": len(messages) // 2,
                   "messages": messages, "text": render(messages)}


def build_chat(corpus_dir: str | Path, share: float = CHAT_SHARE, log=print) -> dict:
    """Write chat_train.jsonl / chat_eval.jsonl next to train.jsonl / eval.jsonl, each capped
    so chat text is `share` of (code + chat) bytes of its split; returns the figures."""
    corpus_dir = Path(corpus_dir)
    figures = {}
    for split in ("train", "eval"):
        src = corpus_dir / f"{split}.jsonl"
        with open(src, encoding="utf-8") as f:
            docs = [json.loads(line) for line in f]
        code_bytes = sum(len(d["text"].encode("utf-8")) for d in docs)
        budget = share / (1 - share) * code_bytes
        docs.sort(key=lambda d: _h("file", d["package"], d["path"]))
        n = n_bytes = two = 0
        out = corpus_dir / f"chat_{split}.jsonl"
        with open(out.with_suffix(".jsonl.tmp"), "w", encoding="utf-8") as w:
            for chat in iter_chat_documents(docs):
                size = len(chat["text"].encode("utf-8"))
                if n_bytes + size > budget:
                    break
                w.write(json.dumps(chat, ensure_ascii=False) + "\n")
                n += 1
                n_bytes += size
                two += chat["turns"] == 2
        out.with_suffix(".jsonl.tmp").replace(out)
        figures[split] = {"conversations": n, "two_turn": two, "bytes": n_bytes,
                          "code_bytes": code_bytes,
                          "share_of_bytes": round(n_bytes / (n_bytes + code_bytes), 4)}
        log(f"chat_{split}.jsonl: {figures[split]}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.training.chat_pairs")
    parser.add_argument("--corpus", default="data/corpus")
    parser.add_argument("--share", type=float, default=CHAT_SHARE)
    args = parser.parse_args(argv)
    figures = build_chat(args.corpus, args.share)
    manifest = Path(args.corpus) / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text(encoding="utf-8"))
        data["chat"] = figures
        manifest.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n",
                            encoding="utf-8")
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
