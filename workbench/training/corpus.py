"""The Python-stdlib corpus of the embedded pair and its fixed train/eval split.

Why the stdlib: it ships with every interpreter, so the corpus needs no download, and it is
real, varied, well-documented code. Test packages, IDLE and site-packages are left out so the
corpus is the library itself, not fixtures or third-party code.

Why split by a hash of the relative path: a file's split never depends on which other files
exist or in what order they are listed, so the split is the same on every machine that has
the same file, and adding a file never moves another one.

The chat verifier's corpus (issue 42: this stdlib split plus permissively licensed PyPI
packages, held out by package) is built by `corpus_build.py`:
`workbench build-corpus --out DIR`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

EVAL_FRACTION = 0.05
SPLITS = ("train", "eval")

# Directory names pruned anywhere in the tree: test packages, IDLE, third-party code, caches.
_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__",
     "lib-dynload"}
)


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory (the base install, not a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded_dir(name: str) -> bool:
    # `config-3.11-x86_64-linux-gnu` holds build-specific helpers, not library code.
    return name in _EXCLUDED_DIRS or name.startswith("config-")


def _excluded_file(name: str) -> bool:
    # `_sysconfigdata_*.py` is generated per build, so it would differ between machines.
    return (not name.endswith(".py") or name.startswith("test_")
            or name.startswith("_sysconfigdata"))


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Every corpus file under `root` (default: the stdlib), sorted by relative posix path."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory (expected a stdlib tree)")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _excluded_dir(d)]
        for name in filenames:
            if not _excluded_file(name):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


def split_of(relpath: str, eval_fraction: float = EVAL_FRACTION) -> str:
    """"eval" when the first 8 bytes of sha1(relpath), read big-endian, fall below
    eval_fraction * 2**64, else "train". `relpath` is posix, relative to the stdlib root."""
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must lie in [0, 1], got {eval_fraction}")
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") < eval_fraction * 2**64 else "train"


def iter_documents(split: str, root: str | Path | None = None) -> Iterator[tuple[str, str]]:
    """(relpath, text) of each file in `split`, in sorted order; undecodable files skipped."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(root) if root is not None else stdlib_root()
    for path in stdlib_files(root):
        relpath = path.relative_to(root).as_posix()
        if split_of(relpath) != split:
            continue
        try:
            yield relpath, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def load_split(split: str, root: str | Path | None = None,
               max_bytes: int | None = None) -> list[str]:
    """Texts of `split`; with `max_bytes`, stops before the UTF-8 total would exceed it."""
    texts: list[str] = []
    total = 0
    for _, text in iter_documents(split, root):
        size = len(text.encode("utf-8"))
        if max_bytes is not None and total + size > max_bytes:
            break
        texts.append(text)
        total += size
    return texts


def _docstring_cuts(text: str) -> list[tuple[int, str]]:
    """(lineno, source) for each function whose source from its `def` line through the closing
    quotes of its docstring can be cut cleanly (nothing else on the closing line)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    cuts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if ast.get_docstring(node, clean=False) is None:
            continue
        doc = node.body[0]
        closing = lines[doc.end_lineno - 1].encode("utf-8")
        if closing[doc.end_col_offset:].strip():  # e.g. `"""doc"""; x = 1` or a comment
            continue
        source = "".join(lines[node.lineno - 1:doc.end_lineno])
        if source.endswith("\n"):
            cuts.append((node.lineno, source))
    return sorted(cuts)


def docstring_prompts(split: str = "eval", root: str | Path | None = None,
                      limit: int = 64, max_chars: int = 400) -> list[dict[str, str]]:
    """Code-continuation prompts: a function's `def` line(s) and docstring, cut from `split`.

    Chosen round-robin over the split's files (each file's first eligible function, then each
    file's second, ...) so the set spans many modules; deterministic for a given stdlib.
    """
    per_file = []
    for relpath, text in iter_documents(split, root):
        cuts = [(n, s) for n, s in _docstring_cuts(text) if len(s) < max_chars]
        if cuts:
            per_file.append((relpath, cuts))
    prompts: list[dict[str, str]] = []
    for rank in range(max((len(c) for _, c in per_file), default=0)):
        for relpath, cuts in per_file:
            if rank < len(cuts) and len(prompts) < limit:
                lineno, source = cuts[rank]
                # Without its final newline: this tokenizer merges a newline with the next line's
                # indentation, so a prompt ending in a bare "\n" token looks like the end of a file
                # and the model's likeliest continuation is <|eos|>.
                prompts.append({"prompt": source[:-1], "source": f"{relpath}:{lineno}"})
    return prompts


if __name__ == "__main__":
    # python -m workbench.training.corpus assets/prompts/code.jsonl (the PyPI corpus: corpus_build)
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        for row in docstring_prompts():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
