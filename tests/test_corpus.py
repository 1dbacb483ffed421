"""The stdlib corpus: which files, which split, and the prompt set cut from it."""

import ast
import hashlib
import json
import platform
import random
import textwrap
from pathlib import Path

import pytest

from workbench.training import corpus

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def test_split_of_matches_the_written_rule_on_known_paths():
    # Rule: eval iff int(sha1(path)[:8 bytes], big-endian) < 0.05 * 2**64.
    # sha1 prefixes: os.py f7cf9ebd.. (0.968), json/decoder.py bc8c91ce.. (0.737),
    # copy.py 0864ab97.. (0.0328).
    expected = {"os.py": "train", "json/decoder.py": "train", "copy.py": "eval"}
    assert {p: corpus.split_of(p) for p in expected} == expected
    # copy.py moves to train when the eval fraction drops below its hash value.
    assert corpus.split_of("copy.py", eval_fraction=0.03) == "train"
    assert corpus.split_of("os.py", eval_fraction=1.0) == "eval"


def test_split_is_a_function_of_the_path_alone():
    paths = [f"pkg{i % 7}/mod_{i}.py" for i in range(500)]
    first = {p: corpus.split_of(p) for p in paths}
    random.Random(0).shuffle(paths)
    assert {p: corpus.split_of(p) for p in paths} == first
    for p in paths[:50]:
        value = int.from_bytes(hashlib.sha1(p.encode()).digest()[:8], "big") / 2**64
        assert first[p] == ("eval" if value < 0.05 else "train")


def test_eval_fraction_is_near_five_percent():
    paths = [f"synthetic/dir{i // 100}/file{i}.py" for i in range(20000)]
    frac = sum(corpus.split_of(p) == "eval" for p in paths) / len(paths)
    assert 0.045 < frac < 0.055  # binomial sd is 0.0015 at n=20000
    rel = [p.relative_to(corpus.stdlib_root()).as_posix() for p in corpus.stdlib_files()]
    real = sum(corpus.split_of(p) == "eval" for p in rel) / len(rel)
    assert 0.02 < real < 0.08, real


def test_split_of_rejects_a_bad_fraction():
    with pytest.raises(ValueError, match="eval_fraction"):
        corpus.split_of("os.py", eval_fraction=1.5)
    with pytest.raises(ValueError, match="split must be one of"):
        next(corpus.iter_documents("validation"))


def _write(root: Path, rel: str, data: str | bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def test_stdlib_files_filters_and_sorts_a_fake_tree(tmp_path):
    kept = ["a.py", "pkg/__init__.py", "pkg/sub/z.py", "zz.py"]
    dropped = ["test/x.py", "pkg/tests/y.py", "idlelib/run.py", "site-packages/np/core.py",
               "__pycache__/a.cpython-311.py", "pkg/test_thing.py", "README.txt", "a.pyc",
               "_sysconfigdata__linux.py", "config-3.11-x86_64/python-config.py",
               "idlelib/idle_test/t.py", "lib2to3/tests/data/bom.py"]
    for rel in random.Random(1).sample(kept + dropped, len(kept + dropped)):
        _write(tmp_path, rel, "x = 1\n")
    rel = [p.relative_to(tmp_path).as_posix() for p in corpus.stdlib_files(tmp_path)]
    assert rel == kept


def test_real_stdlib_has_no_tests_idle_or_site_packages():
    root = corpus.stdlib_root()
    rel = [p.relative_to(root).as_posix() for p in corpus.stdlib_files()]
    assert len(rel) > 300 and rel == sorted(rel)
    for r in rel:
        parts = r.split("/")
        assert r.endswith(".py")
        assert not {"test", "tests", "idle_test", "idlelib", "site-packages"} & set(parts), r
        assert not parts[-1].startswith("test_"), r
    assert "os.py" in rel and "json/decoder.py" in rel


def test_train_and_eval_are_disjoint_and_cover_the_corpus():
    root = corpus.stdlib_root()
    rel = [p.relative_to(root).as_posix() for p in corpus.stdlib_files()]
    train = {r for r, _ in corpus.iter_documents("train")}
    evals = {r for r, _ in corpus.iter_documents("eval")}
    assert not train & evals
    assert train | evals <= set(rel) and len(train | evals) >= len(rel) - 5  # a few may not decode
    assert "copy.py" in evals and "os.py" in train


def test_load_split_skips_undecodable_files_and_caps_bytes(tmp_path):
    # Names chosen so that all three fall in train (checked below).
    _write(tmp_path, "a.py", "x = 1\n")
    _write(tmp_path, "b.py", b"\xff\xfe not utf-8\n")
    _write(tmp_path, "c.py", "y = 'é'\n")
    assert [corpus.split_of(p) for p in ("a.py", "b.py", "c.py")] == ["train"] * 3
    assert corpus.load_split("train", tmp_path) == ["x = 1\n", "y = 'é'\n"]
    assert corpus.load_split("train", tmp_path, max_bytes=7) == ["x = 1\n"]
    assert corpus.load_split("eval", tmp_path) == []


def test_docstring_prompts_cut_def_through_closing_quotes(tmp_path):
    src = textwrap.dedent('''\
        import os

        def first(a,
                  b):
            """Two-line signature."""
            return a

        class K:
            @property
            def method(self):
                """Multi
                line."""
                return 1

            def commented(self):
                """Doc"""  # a comment after the quotes: not a clean cut

        def nodoc():
            return 2
        ''')
    _write(tmp_path, "copy.py", src)  # copy.py is in the eval split
    prompts = corpus.docstring_prompts("eval", tmp_path)
    assert prompts == [
        {"prompt": 'def first(a,\n          b):\n    """Two-line signature."""',
         "source": "copy.py:3"},
        {"prompt": '    def method(self):\n        """Multi\n        line."""',
         "source": "copy.py:10"},
    ]
    # The two prompts are 57 and 56 characters long; max_chars is exclusive.
    assert corpus.docstring_prompts("eval", tmp_path, max_chars=57) == prompts[1:]


def _shipped(name: str) -> list[dict]:
    return [json.loads(line) for line in (ASSETS / "prompts" / name).read_text().splitlines()]


def test_shipped_code_prompts_are_clean_def_docstring_cuts_from_eval():
    rows = _shipped("code.jsonl")
    assert len(rows) >= 60
    assert len({r["source"] for r in rows}) == len(rows)
    assert len({r["source"].split(":")[0] for r in rows}) >= 10
    for row in rows:
        prompt, (rel, lineno) = row["prompt"], row["source"].rsplit(":", 1)
        assert corpus.split_of(rel) == "eval" and int(lineno) > 0
        assert len(prompt) < 400 and not prompt.endswith("\n")
        body = textwrap.dedent(prompt)
        last = body.splitlines()[-1]
        indent = last[: len(last) - len(last.lstrip())]
        tree = ast.parse(body + "\n" + indent + "pass\n")  # a def whose body so far is its docstring
        fn = tree.body[0]
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        assert ast.get_docstring(fn) is not None and len(fn.body) == 2


@pytest.mark.skipif(platform.python_version() != "3.11.7",
                    reason="assets/prompts/code.jsonl was cut from CPython 3.11.7's stdlib")
def test_shipped_code_prompts_regenerate_exactly():
    assert corpus.docstring_prompts() == _shipped("code.jsonl")


def test_shipped_smoke_prompts():
    rows = _shipped("smoke.jsonl")
    assert len(rows) == 4
    assert all(isinstance(r["prompt"], str) and 0 < len(r["prompt"]) < 200 for r in rows)
