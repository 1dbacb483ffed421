"""The permissively licensed Python corpus of the new verifier (issue 42), built from PyPI.

Pipeline, one package at a time, in the order of the pinned list
(`workbench/training/corpus_packages.txt`, `name==version` per line, `[eval]` marks a held-out
package):

1. download the package's wheel for CPython 3.11 (the sdist where no wheel exists) into a cache
   directory that later runs reuse;
2. read its licence from the archive's own metadata (never from a hand-kept table):
   `License-Expression` first, then `Classifier: License ::`, then the free-text `License`
   field, and normalise it to MIT, BSD, Apache-2.0 or PSF; any other licence (GPL, LGPL, MPL,
   ...), a mix of permissive and other terms, or nothing recognisable excludes the package,
   with the reason recorded;
3. keep its `.py` files except vendored copies of other projects, generated or data-like
   files, and files that are not UTF-8; cap its test files at a share of its library code;
4. drop exact (sha1 of the bytes) and near-exact (sha1 after normalising whitespace and
   dropping comment lines) duplicates across the whole corpus, the stdlib included; the first
   copy wins, in the order stdlib, train packages, eval packages, so no eval file has a copy
   in train;
5. write `train.jsonl` / `eval.jsonl` (one document a line: package, version, license, path,
   text) and `manifest.json` (per package: version, licence as read and its field, files kept
   and skipped by reason, bytes, split; the excluded packages; totals; dedup counts).

The stdlib (CPython 3.11, tests excluded, as `corpus.stdlib_files`) keeps its old per-file
hash split, so the embedded pair's held-out prompts (`assets/prompts/code.jsonl`, cut from
the stdlib eval files) stay held out for a verifier trained on this corpus too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath

from workbench.training import corpus as stdlib_corpus
from workbench.training.tokenizer import CHAT_SPECIAL_TOKENS

LICENSES = ("MIT", "BSD", "Apache-2.0", "PSF")
MAX_FILE_BYTES = 500_000
TEST_SHARE = 0.5  # a package's kept test bytes are at most this times its non-test bytes
STDLIB_PACKAGE = "python-stdlib"

# Directory names that hold a copy of another project's code.
VENDORED_DIRS = frozenset({"_vendor", "vendor", "vendored", "_vendored", "extern", "_extern",
                           "externals", "third_party", "_thirdparty", "thirdparty"})
SKIPPED_DIRS = frozenset({"__pycache__", "site-packages"})
TEST_DIRS = frozenset({"test", "tests", "testing", "unittests"})


# ---- the package list ------------------------------------------------------------------

@dataclass(frozen=True)
class PackageSpec:
    name: str
    version: str
    split: str = "train"


def read_package_list(path: str | Path) -> list[PackageSpec]:
    """`name==version [eval]` lines; blank lines and `#` comments ignored."""
    specs = []
    for lineno, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if "==" not in parts[0] or parts[1:] not in ([], ["[eval]"]):
            raise ValueError(f"{path}:{lineno}: expected 'name==version [eval]', got {raw!r}")
        name, version = parts[0].split("==", 1)
        specs.append(PackageSpec(name, version, "eval" if parts[1:] else "train"))
    names = [normalize_name(s.name) for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate package names")
    return specs


def normalize_name(name: str) -> str:
    """PEP 503 normal form, with `_` as wheels spell it: `Scikit-Learn` -> `scikit_learn`."""
    return re.sub(r"[-_.]+", "_", name).lower()


# ---- download (cached) -----------------------------------------------------------------

def _archive_key(filename: str) -> tuple[str, str] | None:
    """(normalised name, version) of a wheel or sdist file name, None for anything else."""
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        return (normalize_name(parts[0]), parts[1]) if len(parts) >= 5 else None
    for ext in (".tar.gz", ".zip", ".tar.bz2"):
        if filename.endswith(ext):
            stem = filename[: -len(ext)]
            if "-" in stem:
                name, version = stem.rsplit("-", 1)
                return normalize_name(name), version
    return None


def find_cached(spec: PackageSpec, cache_dir: Path) -> Path | None:
    """A downloaded archive of exactly `spec` in `cache_dir`, wheels before sdists."""
    want = (normalize_name(spec.name), spec.version)
    hits = sorted((p for p in cache_dir.iterdir() if _archive_key(p.name) == want),
                  key=lambda p: (not p.name.endswith(".whl"), p.name)) if cache_dir.is_dir() else []
    return hits[0] if hits else None


def download(spec: PackageSpec, cache_dir: Path) -> Path:
    """The package's archive: cached, else a CPython 3.11 wheel, else the sdist."""
    cached = find_cached(spec, cache_dir)
    if cached is not None:
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--disable-pip-version-check", "-d", str(cache_dir), f"{spec.name}=={spec.version}"]
    attempts = [base + ["--only-binary=:all:", "--python-version", "3.11"],
                base + ["--no-binary=:all:", "--no-build-isolation"]]
    errors = []
    for cmd in attempts:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        cached = find_cached(spec, cache_dir)
        if cached is not None:
            return cached
        errors.append(proc.stderr.strip().splitlines()[-1:] or [f"rc {proc.returncode}"])
    raise RuntimeError(f"could not download {spec.name}=={spec.version}: {errors}")


# ---- archives ---------------------------------------------------------------------------

def iter_archive(path: Path) -> Iterator[tuple[str, bytes]]:
    """(member path, bytes) of each regular file in a wheel/zip or a tar sdist."""
    if path.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.is_dir():
                    yield info.filename, zf.read(info)
    else:
        with tarfile.open(path) as tf:
            for member in tf:
                if member.isfile():
                    f = tf.extractfile(member)
                    if f is not None:
                        yield member.name, f.read()


def read_metadata(path: Path) -> str:
    """The core metadata text: a wheel's `*.dist-info/METADATA`, an sdist's top `PKG-INFO`."""
    if path.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            if not names and path.suffix == ".zip":
                names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+/PKG-INFO", n)]
            if not names:
                raise ValueError(f"{path.name}: no METADATA")
            return zf.read(names[0]).decode("utf-8", "replace")
    with tarfile.open(path) as tf:
        for member in tf:
            if re.fullmatch(r"[^/]+/PKG-INFO", member.name):
                return tf.extractfile(member).read().decode("utf-8", "replace")
    raise ValueError(f"{path.name}: no PKG-INFO")


def _relative_path(member: str, is_wheel: bool) -> str | None:
    """The member's path inside the installed package, None when it is not package source.

    Wheel: as installed (`pkg/mod.py`; `*.data/purelib|platlib/...` unwrapped; dist-info and
    scripts dropped). Sdist: without the `name-version/` top directory."""
    parts = PurePosixPath(member).parts
    if is_wheel:
        if not parts or parts[0].endswith(".dist-info"):
            return None
        if parts[0].endswith(".data"):
            if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                return None
            parts = parts[2:]
    else:
        parts = parts[1:]
        if parts[:1] == ("src",):
            parts = parts[1:]
    return "/".join(parts) if parts else None


# ---- licences ---------------------------------------------------------------------------

# Other permissive SPDX ids accepted beside a main licence in an AND expression (numpy, for
# one, lists the licences of the small pieces it bundles). Never a package's label.
_MINOR_PERMISSIVE = frozenset({"0bsd", "zlib", "isc", "cc0-1.0", "unlicense", "hpnd", "mit-cmu",
                               "bsl-1.0", "python-2.0.1", "cnri-python", "x11", "ncsa"})
_COPYLEFT = re.compile(r"\b(a?gpl|lgpl|mpl|mozilla|general public|epl|eclipse|cddl|eupl|"
                       r"osl|affero|copyleft|sspl|commons clause|proprietary)", re.I)


def _classify_term(term: str) -> str | None:
    """One licence name (an SPDX id, a classifier tail or a short free-text name) -> one of
    LICENSES, "minor" (other permissive id), or None (not recognised / not permissive)."""
    t = term.strip().strip("()").strip()
    low = t.lower()
    if not low or _COPYLEFT.search(low):
        return None
    if low in _MINOR_PERMISSIVE:
        return "minor"
    if re.fullmatch(r"(the )?(mit|expat|mit-0)( license| licence)?", low):
        return "MIT"
    if re.fullmatch(r"(the )?((new|modified|simplified|revised) )?"
                    r"(bsd|bsd-[23]-clause(-clear)?|[23][- ]clause bsd)( license| licence)?"
                    r"( \(.*\))?", low):
        return "BSD"
    if re.fullmatch(r"(the )?apache([- ]2(\.0)?| software license| license,? (version )?2\.0"
                    r"| license 2\.0| 2\.0 license)?( license)?", low):
        return "Apache-2.0"
    if re.fullmatch(r"(psf(-2\.0)?|python-2\.0|python software foundation( license)?"
                    r"|psf license)", low):
        return "PSF"
    return None


def _classify_expression(expr: str) -> tuple[str | None, str]:
    """An SPDX-like expression -> (label, reason). OR: the first permissive alternative; AND:
    every term permissive, labelled by its first main licence."""
    alternatives = re.split(r"\s+OR\s+", expr.strip(), flags=re.I) if expr.strip() else []
    rejected = []
    for alt in alternatives:
        terms = re.split(r"\s+AND\s+|\s+WITH\s+", alt.strip().strip("()"), flags=re.I)
        kinds = [_classify_term(t) for t in terms]
        if None in kinds:
            rejected.append(alt)
            continue
        main = [k for k in kinds if k != "minor"]
        if main:
            return main[0], ""
        rejected.append(alt)
    if len(alternatives) > 1 or " AND " in expr.upper():
        return None, f"mixed or non-permissive expression {expr!r}"
    return None, f"not a permissive licence: {expr!r}"


def _classify_license_text(text: str) -> tuple[str | None, str]:
    """The free-text `License` field: a short name, or a licence's full text."""
    t = text.strip()
    if not t or t.upper() in ("UNKNOWN", "NONE"):
        return None, "empty License field"
    first = t.splitlines()[0].strip()
    if len(t) < 100 and "\n" not in t:
        if re.search(r"\s(OR|AND)\s", t):
            return _classify_expression(t)
        label = _classify_term(first)
        return (label, "") if label in LICENSES else (None, f"not a permissive licence: {t!r}")
    if _COPYLEFT.search(t[:2000]):
        return None, f"licence text names a non-permissive licence: {first[:80]!r}"
    if "Permission is hereby granted, free of charge" in t:
        return "MIT", ""
    if "Redistribution and use in source and binary forms" in t:
        return "BSD", ""
    if re.search(r"Apache License,?\s+Version 2\.0", t):
        return "Apache-2.0", ""
    if re.search(r"PYTHON SOFTWARE FOUNDATION LICENSE|PSF LICENSE AGREEMENT", t, re.I):
        return "PSF", ""
    return None, f"licence text not recognised: {first[:80]!r}"


@dataclass
class LicenseInfo:
    license: str | None  # one of LICENSES, None when excluded
    field: str  # "License-Expression", "Classifier", "License" or "" when none matched
    raw: str  # the text it was read from
    reason: str = ""  # why excluded


def normalize_license(metadata: str) -> LicenseInfo:
    """The package's licence from its core metadata text (METADATA / PKG-INFO)."""
    msg = HeaderParser().parsestr(metadata)
    expr = (msg.get("License-Expression") or "").strip()
    if expr:
        label, reason = _classify_expression(expr)
        return LicenseInfo(label, "License-Expression", expr, reason)
    classifiers = [c.split("::", 1)[1].strip() for c in msg.get_all("Classifier") or []
                   if c.strip().startswith("License ::")]
    tails = [c.split("::")[-1].strip() for c in classifiers if c != "OSI Approved"]
    if tails:
        labels = [_classify_term(t) for t in tails]
        raw = "; ".join(classifiers)
        if None in labels:
            bad = [t for t, lab in zip(tails, labels) if lab is None]
            kind = "mixed" if any(lab in LICENSES for lab in labels) else "non-permissive"
            return LicenseInfo(None, "Classifier", raw, f"{kind} licence classifiers: {bad}")
        main = [lab for lab in labels if lab in LICENSES]
        if main:  # several permissive classifiers are alternatives (e.g. Apache or BSD)
            return LicenseInfo(main[0], "Classifier", raw)
    text = msg.get("License") or ""
    if text.strip():
        label, reason = _classify_license_text(text)
        return LicenseInfo(label, "License", text.strip()[:300], reason)
    return LicenseInfo(None, "", "", "no licence in metadata")


# ---- file filters -----------------------------------------------------------------------

_STRING = re.compile(r"""[rbuRBUfF]{0,2}('[^'\\\n]*(?:\\.[^'\\\n]*)*'|"[^"\\\n]*(?:\\.[^"\\\n]*)*")""")
_HEX = re.compile(r"\b0[xXoObB][0-9a-fA-F_]+\b")
_LITERAL_ONLY = re.compile(r"[\s\d.,:;+\-*xXjJeE()\[\]{}]*")
# A document holding a special token's text would get that token's id inside code (Qwen-style
# chat code in transformers spells "<|im_end|>"): left out, so <|im_end|> only ever ends a turn.
_SPECIAL = re.compile("|".join(re.escape(t) for t in CHAT_SPECIAL_TOKENS))
_GENERATED = re.compile(r"do not edit|autogenerated|auto-generated|automatically generated|"
                        r"generated by the protocol buffer", re.I)


def is_test_path(relpath: str) -> bool:
    parts = relpath.split("/")
    name = parts[-1]
    return (bool(TEST_DIRS & set(parts[:-1])) or name.startswith("test_")
            or name.endswith("_test.py") or name == "conftest.py")


def skip_reason(relpath: str, data: bytes) -> str | None:
    """Why a `.py` file is left out, or None to keep it."""
    parts = relpath.split("/")
    if VENDORED_DIRS & set(parts[:-1]):
        return "vendored"
    if SKIPPED_DIRS & set(parts[:-1]):
        return "cache"
    if len(data) > MAX_FILE_BYTES:
        return "too_large"
    if parts[-1].endswith(("_pb2.py", "_pb2_grpc.py")):
        return "generated"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8"
    if not text.strip():
        return "empty"
    if _SPECIAL.search(text):
        return "special_tokens"
    if _GENERATED.search(text[:1000]):
        return "generated"
    return data_reason(text)


def data_reason(text: str) -> str | None:
    """"long_lines" / "data" for a file that is mostly very long lines or literal tables."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "empty"
    long_bytes = sum(len(ln) for ln in lines if len(ln) > 300)
    if long_bytes > 0.2 * len(text) or max(len(ln) for ln in lines) > 5000:
        return "long_lines"
    if len(text) > 20_000:
        literal = 0
        for ln in lines:
            rest = _HEX.sub("0", _STRING.sub("", ln))
            if len(rest) < len(ln) or any(c.isdigit() for c in rest):
                literal += _LITERAL_ONLY.fullmatch(rest) is not None
        if literal > 0.5 * len(lines):
            return "data"
    return None


# ---- dedup ------------------------------------------------------------------------------

_WS = re.compile(r"\s+")


def near_key(text: str) -> str:
    """sha1 of the text with whitespace runs collapsed, blank and comment-only lines dropped:
    equal for copies that differ only in formatting or comments."""
    kept = []
    for line in text.splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            kept.append(_WS.sub(" ", s))
    return hashlib.sha1("\n".join(kept).encode("utf-8")).hexdigest()


class Deduper:
    """First-seen-wins filter over exact and near-exact duplicates."""

    def __init__(self) -> None:
        self.exact: set[bytes] = set()
        self.near: set[str] = set()
        self.counts = Counter()

    def keep(self, text: str) -> bool:
        exact = hashlib.sha1(text.encode("utf-8")).digest()
        if exact in self.exact:
            self.counts["exact"] += 1
            return False
        self.exact.add(exact)
        near = near_key(text)
        if near in self.near:
            self.counts["near"] += 1
            return False
        self.near.add(near)
        return True


# ---- per package ------------------------------------------------------------------------

@dataclass
class Document:
    package: str
    version: str
    license: str
    path: str
    text: str

    def to_json(self) -> str:
        return json.dumps({"package": self.package, "version": self.version,
                           "license": self.license, "path": self.path, "text": self.text},
                          ensure_ascii=False)


@dataclass
class PackageFiles:
    files: list[tuple[str, str]]  # (relpath, text) kept, sorted by path
    skipped: Counter = field(default_factory=Counter)


def _cap_tests(files: list[tuple[str, str]], skipped: Counter,
               share: float = TEST_SHARE) -> list[tuple[str, str]]:
    """Keep test files, in sha1(path) order, while their bytes stay within `share` x the
    package's non-test bytes; the rest are counted as skipped `test_cap`."""
    lib = sum(len(t.encode()) for p, t in files if not is_test_path(p))
    budget = share * lib
    tests = sorted((p for p, _ in files if is_test_path(p)),
                   key=lambda p: hashlib.sha1(p.encode()).digest())
    texts = dict(files)
    kept_tests, used = set(), 0
    for p in tests:
        size = len(texts[p].encode())
        if used + size <= budget:
            kept_tests.add(p)
            used += size
        else:
            skipped["test_cap"] += 1
    return [(p, t) for p, t in files if not is_test_path(p) or p in kept_tests]


def extract_package(archive: Path) -> PackageFiles:
    """The package's kept `.py` files (filtered, tests capped; not yet deduplicated)."""
    is_wheel = archive.suffix == ".whl"
    skipped = Counter()
    files = {}
    for member, data in iter_archive(archive):
        if not member.endswith(".py"):
            continue
        rel = _relative_path(member, is_wheel)
        if rel is None:
            skipped["not_package"] += 1
            continue
        reason = skip_reason(rel, data)
        if reason:
            skipped[reason] += 1
            continue
        files[rel] = data.decode("utf-8")
    kept = _cap_tests(sorted(files.items()), skipped)
    return PackageFiles(kept, skipped)


def stdlib_documents(root: str | Path | None = None) -> Iterator[tuple[str, Document]]:
    """(split, Document) for each stdlib corpus file, in the old per-file hash split."""
    root = Path(root) if root is not None else stdlib_corpus.stdlib_root()
    version = ".".join(map(str, sys.version_info[:3]))
    for split in stdlib_corpus.SPLITS:
        for rel, text in stdlib_corpus.iter_documents(split, root):
            yield split, Document(STDLIB_PACKAGE, version, "PSF", rel, text)


# ---- build ------------------------------------------------------------------------------

def _add_stdlib(stdlib_root, dedup: "Deduper", writers: dict, totals: dict, log) -> dict:
    """Write the stdlib's files to their splits; return its manifest entry."""
    entry = {"version": None, "license": "PSF", "license_field": "CPython LICENSE",
             "license_raw": "PSF-2.0", "archive": "interpreter stdlib",
             "split": "train+eval (per-file sha1 split, corpus.split_of)",
             "files_kept": {"train": 0, "eval": 0}, "bytes": {"train": 0, "eval": 0},
             "files_skipped": {}}
    for split, doc in stdlib_documents(stdlib_root):
        entry["version"] = doc.version
        if _SPECIAL.search(doc.text):
            entry["files_skipped"]["special_tokens"] = entry["files_skipped"].get("special_tokens", 0) + 1
            continue
        if not dedup.keep(doc.text):
            entry["files_skipped"]["duplicate"] = entry["files_skipped"].get("duplicate", 0) + 1
            continue
        n = len(doc.text.encode("utf-8"))
        writers[split].write(doc.to_json() + "\n")
        entry["files_kept"][split] += 1
        entry["bytes"][split] += n
        totals[split]["files"] += 1
        totals[split]["bytes"] += n
    log(f"{STDLIB_PACKAGE}: {entry['files_kept']} files, {entry['bytes']} bytes")
    return entry


def _add_package(spec: PackageSpec, cache: Path, dedup: "Deduper", writers: dict, totals: dict,
                 manifest: dict, log) -> None:
    """Download one package, read its licence, write its kept files; record it or why it is excluded."""
    try:
        archive = download(spec, cache)
        info = normalize_license(read_metadata(archive))
    except Exception as exc:  # noqa: BLE001 - recorded, the build goes on
        manifest["excluded"][spec.name] = {"version": spec.version, "reason": f"{type(exc).__name__}: {exc}"}
        log(f"{spec.name}: EXCLUDED ({exc})")
        return
    if info.license is None:
        manifest["excluded"][spec.name] = {"version": spec.version, "reason": info.reason,
                                           "license_field": info.field, "license_raw": info.raw[:300]}
        log(f"{spec.name}: EXCLUDED ({info.reason})")
        return
    pkg = extract_package(archive)
    kept = n_bytes = 0
    for rel, text in pkg.files:
        if not dedup.keep(text):
            pkg.skipped["duplicate"] += 1
            continue
        doc = Document(spec.name, spec.version, info.license, rel, text)
        writers[spec.split].write(doc.to_json() + "\n")
        kept += 1
        n_bytes += len(text.encode("utf-8"))
    totals[spec.split]["files"] += kept
    totals[spec.split]["bytes"] += n_bytes
    manifest["packages"][spec.name] = {
        "version": spec.version, "license": info.license, "license_field": info.field,
        "license_raw": info.raw[:300], "archive": archive.name, "split": spec.split,
        "files_kept": kept, "bytes": n_bytes, "files_skipped": dict(sorted(pkg.skipped.items()))}
    log(f"{spec.name}=={spec.version} [{info.license} via {info.field}] {spec.split}: "
        f"{kept} files, {n_bytes / 1e6:.2f} MB, skipped {dict(pkg.skipped)}")


def build(packages: str | Path, out: str | Path, cache_dir: str | Path | None = None,
          stdlib_root: str | Path | None = None, log=print) -> dict:
    """Run the whole pipeline; returns (and writes) the manifest."""
    specs = read_package_list(packages)
    out = Path(out)
    cache = Path(cache_dir) if cache_dir is not None else out / "wheels"
    out.mkdir(parents=True, exist_ok=True)
    # Train packages before eval ones, so a file shared by both stays in train only.
    order = [s for s in specs if s.split == "train"] + [s for s in specs if s.split == "eval"]
    dedup = Deduper()
    manifest = {"packages": {}, "excluded": {}, "dedup": {}, "totals": {}}
    writers = {s: open(out / f"{s}.jsonl.tmp", "w", encoding="utf-8") for s in ("train", "eval")}
    totals = {s: Counter() for s in ("train", "eval")}
    start = time.perf_counter()
    try:
        manifest["packages"][STDLIB_PACKAGE] = _add_stdlib(stdlib_root, dedup, writers, totals, log)
        for spec in order:
            _add_package(spec, cache, dedup, writers, totals, manifest, log)
    finally:
        for w in writers.values():
            w.close()
    for s in ("train", "eval"):
        (out / f"{s}.jsonl.tmp").replace(out / f"{s}.jsonl")
    licences = Counter(p["license"] for p in manifest["packages"].values())
    manifest["dedup"] = {"exact_duplicates_dropped": dedup.counts["exact"],
                         "near_duplicates_dropped": dedup.counts["near"],
                         "rule": "first copy wins; order stdlib, train packages, eval packages; "
                                 "near = sha1 after collapsing whitespace and dropping blank "
                                 "and comment-only lines"}
    manifest["totals"] = {s: dict(totals[s]) for s in totals}
    manifest["totals"]["packages_included"] = len(manifest["packages"])
    manifest["totals"]["packages_excluded"] = len(manifest["excluded"])
    manifest["totals"]["licenses"] = dict(sorted(licences.items()))
    manifest["eval_packages"] = [s.name for s in specs
                                 if s.split == "eval" and s.name in manifest["packages"]]
    manifest["rules"] = {
        "max_file_bytes": MAX_FILE_BYTES, "test_share": TEST_SHARE,
        "vendored_dirs": sorted(VENDORED_DIRS),
        "stdlib": "CPython stdlib without tests/idlelib, old per-file sha1 split (5% eval)",
        "build_seconds": round(time.perf_counter() - start, 1)}
    write_manifest(manifest, out / "manifest.json")
    return manifest


def write_manifest(manifest: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n",
                          encoding="utf-8")


def read_jsonl(path: str | Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def count_tokens(corpus_dir: str | Path, tokenizer_dir: str | Path, log=print) -> dict:
    """Token counts (no special tokens added) of every corpus file under `corpus_dir`, per
    package and per file, with the tokenizer in `tokenizer_dir`; stored in manifest.json."""
    from tokenizers import Tokenizer

    from workbench.training.tokenizer import count_tokens as count

    corpus_dir = Path(corpus_dir)
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    manifest_path = corpus_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    files = {}
    per_package: Counter = Counter()
    for name in ("train.jsonl", "eval.jsonl", "chat_train.jsonl", "chat_eval.jsonl"):
        path = corpus_dir / name
        if not path.is_file():
            continue
        by_package: dict[str, list[str]] = {}
        for row in read_jsonl(path):
            by_package.setdefault(row["package"], []).append(row["text"])
        n_bytes = n_tokens = 0
        for package, texts in by_package.items():
            b, t = count(tok, texts)
            n_bytes += b
            n_tokens += t
            if not name.startswith("chat_"):
                per_package[package] += t
        files[name] = {"bytes": n_bytes, "tokens": n_tokens,
                       "bytes_per_token": round(n_bytes / max(n_tokens, 1), 3)}
        log(f"{name}: {files[name]}")
    for package, entry in manifest["packages"].items():
        entry["tokens"] = per_package.get(package, 0)
    manifest["tokens"] = {"tokenizer": str(tokenizer_dir), "files": files}
    write_manifest(manifest, manifest_path)
    return manifest["tokens"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench build-corpus")
    parser.add_argument("--packages", default=str(Path(__file__).with_name("corpus_packages.txt")))
    parser.add_argument("--out", default="data/corpus")
    parser.add_argument("--cache", default=None, help="archive cache (default OUT/wheels)")
    parser.add_argument("--no-chat", action="store_true",
                        help="skip the chat pairs (chat_train.jsonl / chat_eval.jsonl)")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="count tokens with the tokenizer in DIR, training it there first "
                             "(on OUT/train.jsonl) if DIR has no tokenizer.json")
    parser.add_argument("--count-only", action="store_true",
                        help="skip the build and the chat pairs; only count with --tokenizer")
    args = parser.parse_args(argv)
    if args.count_only:
        if args.tokenizer is None:
            parser.error("--count-only needs --tokenizer")
        print(json.dumps(count_tokens(args.out, args.tokenizer), indent=1))
        return 0
    manifest = build(args.packages, args.out, args.cache)
    if not args.no_chat:
        from workbench.training import chat_pairs

        manifest["chat"] = chat_pairs.build_chat(args.out)
        write_manifest(manifest, Path(args.out) / "manifest.json")
    if args.tokenizer is not None:
        if not (Path(args.tokenizer) / "tokenizer.json").is_file():
            from workbench.training.tokenizer import train_on_corpus

            train_on_corpus(args.out, args.tokenizer)
        manifest["tokens"] = count_tokens(args.out, args.tokenizer)
    print(json.dumps({"totals": manifest["totals"], "dedup": manifest["dedup"],
                      "eval_packages": manifest["eval_packages"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
