"""The stdlib corpus (which files, which split, the prompt set cut from it) and the PyPI corpus
build of issue 42 (licences, filters, dedup, split by package), offline on constructed inputs."""

import ast
import hashlib
import io
import json
import platform
import random
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from workbench.training import corpus
from workbench.training import corpus_build as cb

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


# ---- the PyPI corpus (corpus_build): licences, filters, dedup, split -------------------------


def _metadata(*headers: str, body: str = "") -> str:
    return "Metadata-Version: 2.4\nName: pkg\nVersion: 1.0\n" + "".join(
        h + "\n" for h in headers) + "\n" + body


@pytest.mark.parametrize("headers, expected, field", [
    (["License-Expression: MIT"], "MIT", "License-Expression"),
    (["License-Expression: BSD-3-Clause"], "BSD", "License-Expression"),
    (["License-Expression: MIT OR Apache-2.0"], "MIT", "License-Expression"),
    (["License-Expression: GPL-3.0-or-later OR Apache-2.0"], "Apache-2.0", "License-Expression"),
    (["License-Expression: BSD-3-Clause AND 0BSD AND MIT AND Zlib"], "BSD", "License-Expression"),
    (["Classifier: License :: OSI Approved :: Apache Software License"], "Apache-2.0",
     "Classifier"),
    (["Classifier: License :: OSI Approved :: BSD License",
      "Classifier: Programming Language :: Python"], "BSD", "Classifier"),
    (["Classifier: License :: OSI Approved :: Python Software Foundation License"], "PSF",
     "Classifier"),
    (["Classifier: License :: OSI Approved :: Apache Software License",
      "Classifier: License :: OSI Approved :: BSD License"], "Apache-2.0", "Classifier"),
    (["License: Apache 2.0"], "Apache-2.0", "License"),
    (["License: BSD-3-Clause"], "BSD", "License"),
    (["Classifier: License :: OSI Approved", "License: MIT"], "MIT", "License"),
    # License-Expression wins over a contradicting classifier.
    (["License-Expression: MIT", "Classifier: License :: OSI Approved :: BSD License"], "MIT",
     "License-Expression"),
])
def test_permissive_licences_are_read_from_metadata(headers, expected, field):
    info = cb.normalize_license(_metadata(*headers))
    assert (info.license, info.field, info.reason) == (expected, field, "")


def test_full_licence_text_in_the_license_field():
    mit = ("License: MIT License\n        \n        Copyright (c) 2020 Someone\n        \n"
           "        Permission is hereby granted, free of charge, to any person obtaining a copy\n"
           "        of this software")
    assert cb.normalize_license(_metadata(mit)).license == "MIT"
    bsd = ("License: Copyright (c) X.\n        All rights reserved.\n        \n"
           "        Redistribution and use in source and binary forms, with or without")
    assert cb.normalize_license(_metadata(bsd)).license == "BSD"


@pytest.mark.parametrize("headers, reason", [
    (["License-Expression: GPL-2.0-or-later"], "not a permissive licence"),
    (["License-Expression: MPL-2.0 AND MIT"], "mixed"),
    (["License-Expression: LGPL-2.1"], "not a permissive licence"),
    (["Classifier: License :: OSI Approved :: GNU General Public License v3 (GPLv3)"],
     "non-permissive"),
    (["Classifier: License :: OSI Approved :: BSD License",
      "Classifier: License :: OSI Approved :: GNU General Public License (GPL)"], "mixed"),
    (["Classifier: License :: OSI Approved :: Mozilla Public License 2.0 (MPL 2.0)"],
     "non-permissive"),
    (["License: Proprietary"], "not a permissive licence"),
    (["License: UNKNOWN"], "empty License field"),
    (["License: Copyright Foo Inc. All rights reserved. Some long custom terms that are not "
      "any known licence and go on for a while, long enough to be a text.\n        More."],
     "not recognised"),
    ([], "no licence in metadata"),
])
def test_other_licences_exclude_the_package(headers, reason):
    info = cb.normalize_license(_metadata(*headers))
    assert info.license is None and reason in info.reason


def _wheel(path: Path, name: str, files: dict[str, str | bytes], license_header: str) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for rel, data in files.items():
            zf.writestr(rel, data)
        zf.writestr(f"{name}-1.0.dist-info/METADATA", _metadata(license_header))
        zf.writestr(f"{name}-1.0.dist-info/RECORD", "")
    return path


LIB = "def f(x):\n    '''Double x.'''\n    return 2 * x\n"


def test_extract_package_filters_a_fake_wheel(tmp_path):
    table = "TABLE = [\n" + "    (1, 2, 3, 4.5, 'ab', 0x1F),\n" * 2000 + "]\n"
    files = {
        "pkg/__init__.py": "from .core import f\n",
        "pkg/core.py": LIB,
        "pkg/_vendor/six.py": "import sys\n",
        "pkg/extern/other.py": "x = 1\n",
        "pkg/big.py": "x = 1\n" * 100_000,
        "pkg/bad.py": b"\xff\xfe not utf-8\n",
        "pkg/table.py": table,
        "pkg/long.py": "S = '" + "a" * 6000 + "'\n",
        "pkg/gen.py": "# Generated by the tool. DO NOT EDIT.\nx = 1\n",
        "pkg/empty.py": "\n",
        "pkg/chatml.py": "END = '<|im_end|>'\nx = 1\n",
        "pkg/data.json": "{}",
        "pkg-1.0.data/purelib/extra.py": "y = 2\n",
        "pkg-1.0.data/scripts/tool.py": "print(1)\n",
    }
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", "pkg", files, "License: MIT")
    got = cb.extract_package(wheel)
    assert [p for p, _ in got.files] == ["extra.py", "pkg/__init__.py", "pkg/core.py"]
    assert dict(got.skipped) == {"vendored": 2, "too_large": 1, "not_utf8": 1, "data": 1,
                                 "long_lines": 1, "generated": 1, "empty": 1, "not_package": 1,
                                 "special_tokens": 1}
    assert cb.normalize_license(cb.read_metadata(wheel)).license == "MIT"


def test_tests_are_kept_up_to_half_the_library_bytes(tmp_path):
    lib = "x = 1\n" * 100  # 600 bytes of library code: test budget 300 bytes
    files = {"pkg/mod.py": lib, "pkg/tests/test_a.py": "y = 1\n" * 30,  # 180 bytes
             "pkg/tests/test_b.py": "z = 1\n" * 30, "pkg/conftest.py": "w = 1\n" * 10}
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", "pkg", files, "License: MIT")
    got = cb.extract_package(wheel)
    tests = [p for p, _ in got.files if cb.is_test_path(p)]
    assert sum(len(t) for p, t in got.files if p in tests) <= 300
    assert len(tests) == 2 and got.skipped["test_cap"] == 1
    assert cb.is_test_path("a/testing/x.py") and cb.is_test_path("a/foo_test.py")
    assert not cb.is_test_path("a/contest.py") and not cb.is_test_path("a/attest/x.py")


def test_sdist_metadata_and_paths(tmp_path):
    path = tmp_path / "Pkg-2.0.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for rel, text in {"Pkg-2.0/PKG-INFO": _metadata("License-Expression: Apache-2.0"),
                          "Pkg-2.0/src/pkg/core.py": LIB, "Pkg-2.0/setup.py": "x = 1\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    assert cb.normalize_license(cb.read_metadata(path)).license == "Apache-2.0"
    assert [p for p, _ in cb.extract_package(path).files] == ["pkg/core.py", "setup.py"]
    assert cb._archive_key(path.name) == ("pkg", "2.0")
    assert cb._archive_key("Scikit_Learn-1.6.1-cp311-cp311-manylinux_x86_64.whl") == (
        "scikit_learn", "1.6.1")


def test_dedup_exact_and_near_exact():
    d = cb.Deduper()
    a = "def f(x):\n    return x + 1\n"
    assert d.keep(a)
    assert not d.keep(a)  # exact
    assert not d.keep("# a comment\ndef f(x):\n\n        return   x + 1\n")  # near
    assert d.keep("def f(x):\n    return x + 2\n")
    assert d.keep("def f(x):\n    return 'x  +  1'\n")
    assert dict(d.counts) == {"exact": 1, "near": 1}


def test_read_package_list(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("# comment\nfoo==1.0\n\nBar-baz==2.3.1 [eval]  # note\n")
    assert cb.read_package_list(path) == [cb.PackageSpec("foo", "1.0"),
                                          cb.PackageSpec("Bar-baz", "2.3.1", "eval")]
    path.write_text("foo\n")
    with pytest.raises(ValueError, match="name==version"):
        cb.read_package_list(path)
    path.write_text("foo==1\nFOO==2\n")
    with pytest.raises(ValueError, match="duplicate"):
        cb.read_package_list(path)


def test_build_offline_splits_by_package_and_records_licences(tmp_path):
    cache = tmp_path / "wheels"
    cache.mkdir()
    shared = "def shared(a, b):\n    '''Add.'''\n    return a + b\n"
    _wheel(cache / "alpha-1.0-py3-none-any.whl", "alpha",
           {"alpha/__init__.py": LIB, "alpha/util.py": shared}, "License-Expression: MIT")
    _wheel(cache / "beta-1.0-py3-none-any.whl", "beta",
           {"beta/__init__.py": "B = 1\n", "beta/copy_of_util.py": shared + "\n# copied\n",
            "beta/_vendored/x.py": "x = 1\n"}, "License-Expression: BSD-3-Clause")
    _wheel(cache / "gamma-1.0-py3-none-any.whl", "gamma", {"gamma/a.py": "G = 1\n"},
           "License-Expression: GPL-3.0-only")
    stdlib = tmp_path / "stdlib"
    _write(stdlib, "os.py", "import sys\n")
    _write(stdlib, "copy.py", "import types\n")  # copy.py is in the stdlib eval split
    packages = tmp_path / "packages.txt"
    packages.write_text("alpha==1.0\nbeta==1.0 [eval]\ngamma==1.0\n")
    out = tmp_path / "out"
    manifest = cb.build(packages, out, cache, stdlib_root=stdlib, log=lambda *_: None)

    rows = {s: [json.loads(x) for x in (out / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "eval")}
    train_pk = {r["package"] for r in rows["train"]}
    eval_pk = {r["package"] for r in rows["eval"]}
    assert train_pk == {"python-stdlib", "alpha"} and eval_pk == {"python-stdlib", "beta"}
    assert not (train_pk & eval_pk) - {"python-stdlib"}
    assert {r["path"] for r in rows["eval"]} == {"copy.py", "beta/__init__.py"}
    assert set(rows["train"][0]) == {"package", "version", "license", "path", "text"}
    assert {r["license"] for r in rows["train"] if r["package"] == "alpha"} == {"MIT"}

    assert manifest["excluded"]["gamma"]["reason"].startswith("not a permissive licence")
    beta = manifest["packages"]["beta"]
    assert beta["split"] == "eval" and beta["license"] == "BSD"
    assert beta["license_field"] == "License-Expression"
    assert beta["files_skipped"] == {"vendored": 1, "duplicate": 1}  # the near copy of util.py
    assert manifest["dedup"]["near_duplicates_dropped"] == 1
    assert manifest["eval_packages"] == ["beta"]
    assert manifest["totals"]["licenses"] == {"BSD": 1, "MIT": 1, "PSF": 1}
    assert json.loads((out / "manifest.json").read_text()) == manifest


def test_shipped_package_list_and_manifest_agree():
    specs = cb.read_package_list(Path(cb.__file__).with_name("corpus_packages.txt"))
    assert len(specs) >= 80
    manifest = json.loads((ASSETS / "corpus" / "manifest.json").read_text())
    listed = {s.name for s in specs}
    assert set(manifest["packages"]) - {cb.STDLIB_PACKAGE} | set(manifest["excluded"]) == listed
    eval_specs = {s.name for s in specs if s.split == "eval"}
    assert set(manifest["eval_packages"]) == eval_specs
    for name, entry in manifest["packages"].items():
        assert entry["license"] in cb.LICENSES, name


def test_cli_build_corpus_counts_tokens_into_the_manifest(tmp_path, capsys):
    from workbench.cli import main as cli_main

    out = tmp_path / "out"
    out.mkdir()
    docs = {"train": [("a", "def f(x):\n    return x\n"), ("b", "import os\n")],
            "eval": [("c", "y = 2\n")]}
    for split, rows in docs.items():
        (out / f"{split}.jsonl").write_text("".join(
            json.dumps({"package": p, "version": "1", "license": "MIT", "path": "m.py",
                        "text": t}) + "\n" for p, t in rows))
    packages = {p: {"split": s} for s, rows in docs.items() for p, _ in rows}
    (out / "manifest.json").write_text(json.dumps({"packages": packages}))
    tokenizer = ASSETS / "corpus" / "tokenizer"
    assert cli_main(["build-corpus", "--out", str(out), "--tokenizer", str(tokenizer),
                     "--count-only"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(tokenizer / "tokenizer.json"))
    for package, text in [*docs["train"], *docs["eval"]]:
        assert manifest["packages"][package]["tokens"] == len(hf.encode(text).ids)
    files = manifest["tokens"]["files"]
    assert set(files) == {"train.jsonl", "eval.jsonl"}
    assert files["train.jsonl"]["bytes"] == 33
    printed = capsys.readouterr().out  # a line per file, then the figures as JSON
    assert json.loads(printed[printed.index("{\n"):])["files"] == files
