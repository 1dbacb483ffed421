"""The repository tests on its own: nothing in tests/, workbench/, apps/ or notebooks/ reads a path
outside it. A clone has nothing beside it, so a file read from `../something` passes on the
machine that has the folder and fails everywhere else.

Two guards: a static one over the source (paths anchored at `__file__` that climb out of the
repository, a repository root's `.parent`, string literals that climb with `../`), and a runtime one
in `conftest.py` that fails any test which opens or lists a path beside the repository.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tests.helpers import REAL, REPO

SCANNED = ("tests", "workbench", "apps", "notebooks")
ROOT_NAMES = {"REPO", "ROOT", "REPO_ROOT", "REPOSITORY"}  # names the project gives its root


def _sources() -> list[tuple[Path, str]]:
    """(file, Python source) for every module and every notebook code cell under SCANNED."""
    out = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix == ".py":
                out.append((path, path.read_text(encoding="utf-8")))
            elif path.suffix == ".ipynb":
                cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
                code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
                # IPython magics (`%time`, `!pip`) are not Python: drop those lines before parsing.
                out.append((path, "\n".join(line for cell in code for line in cell.splitlines()
                                             if not line.lstrip().startswith(("%", "!")))))
    return out


def _file_anchor(node: ast.AST, here: Path) -> Path | None:
    """Where `Path(__file__)[.resolve()][.parent...|.parents[i]]` points, or None if `node` is not one."""
    ups = 0
    while True:
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            ups, node = ups + 1, node.value
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
              and node.value.attr == "parents" and isinstance(node.slice, ast.Constant)):
            ups, node = ups + node.slice.value + 1, node.value.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("resolve", "absolute") and not node.args):
            node = node.func.value
        else:
            break
    is_file = (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Path"
               and len(node.args) == 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == "__file__")
    if not is_file or ups == 0:
        return None
    target = here
    for _ in range(ups):
        target = target.parent
    return target


def _escapes(source: str, here: Path) -> list[str]:
    """Each place in `source` (the text of file `here`) that points outside the repository."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", "?")
        anchor = _file_anchor(node, here)
        if anchor is not None and not anchor.is_relative_to(REPO):
            found.append(f"line {line}: {ast.unparse(node)} is {anchor}, outside {REPO}")
        if (isinstance(node, ast.Attribute) and node.attr in ("parent", "parents")
                and isinstance(node.value, ast.Name) and node.value.id in ROOT_NAMES):
            found.append(f"line {line}: {ast.unparse(node)} climbs out of the repository root")
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and (node.value.startswith("../") or "/../" in node.value)):
            found.append(f"line {line}: the literal {node.value!r} climbs with '../'")
    return found


def test_no_source_points_outside_the_repository():
    sources = _sources()
    assert len(sources) > 50, "the scan found too few files to mean anything"
    # This file names the ways out on purpose, to show the scan catches them.
    problems = [f"{path.relative_to(REPO)}: {p}" for path, src in sources if path != Path(__file__).resolve()
                for p in _escapes(src, path)]
    assert not problems, "paths outside the repository:\n" + "\n".join(problems)


# The ways out are spelt with {up} ("../") and {parents} (".parents[2]") filled in at run time, so
# that this file's own text names no path outside the repository.
@pytest.mark.parametrize("snippet, bad", [
    ('ROOT = Path(__file__).resolve().parent.parent', False),           # tests/x.py -> the repository
    ('REAL = Path(__file__).resolve(){parents} / "beside" / "data"', True),
    ('REAL = Path(__file__).parent.parent.parent / "beside"', True),
    ('REAL = REPO.parent / "beside" / "data"', True),
    ('data = open("{up}beside/data/README.md")', True),
    ('data = open("tests/data/real/README.md")', False),
])
def test_the_scan_catches_each_way_out(snippet, bad):
    """The static guard is not vacuous: each way out of the repository that the project has used is caught."""
    snippet = snippet.format(up=".." + "/", parents=".parents" + "[2]")
    assert bool(_escapes(snippet, REPO / "tests" / "x.py")) is bad


def test_the_published_artefacts_are_in_the_repository():
    assert REAL.is_relative_to(REPO) and (REAL / "README.md").is_file()
    assert len(list(REAL.glob("*.config.json"))) >= 5


def test_opening_a_file_beside_the_repository_is_caught(tmp_path):
    """The runtime guard (conftest.py) sees an `open` beside the repository, and only there."""
    from tests.conftest import outside_reads

    sibling = REPO.parent / "beside-the-repository" / "README.md"  # absent or not, the attempt counts
    before = len(outside_reads)
    try:
        open(sibling).close()
    except OSError:
        pass  # the audit event fires before the open fails: absent or present, the attempt is seen
    (tmp_path / "x").write_text("in a temporary folder: allowed")
    open(REPO / "README.md").close()
    assert outside_reads[before:] == [str(sibling)]
    del outside_reads[before:]  # this test's own read is not a violation
