"""The test tree must never hide an installed package (tests/kernels once shadowed Hugging Face's
`kernels`, which transformers imports, and every parity test failed)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from tests.helpers import REPO

TESTS = REPO / "tests"
OWN = {"workbench"}  # the project's own distribution


def installed_top_level_names() -> set[str]:
    names = {n for n, dists in importlib.metadata.packages_distributions().items() if not OWN & set(dists)}
    return {n for n in names if n.isidentifier()}


def names_the_test_tree_puts_on_sys_path(tree: Path = TESTS) -> set[str]:
    """Top-level names the tree adds under pytest's default (prepend) import mode: for each test
    file, the first folder above it without an __init__.py goes on sys.path, and whatever sits in
    that folder becomes importable by its name."""
    names = set()
    for f in tree.rglob("*.py"):
        base = f.parent
        while (base / "__init__.py").exists():
            base = base.parent
        top = f.relative_to(base).parts[0]
        names.add(top.removesuffix(".py"))
    return names


def test_no_test_folder_or_module_shares_an_installed_package_name():
    clash = names_the_test_tree_puts_on_sys_path() & installed_top_level_names()
    assert not clash, f"tests/ makes these importable under installed packages' names: {sorted(clash)}"


def test_installed_packages_resolve_outside_the_test_tree():
    # In this very process, with pytest's sys.path as it is: a spec that lands under tests/ is a shadow.
    inside = []
    for name in sorted(installed_top_level_names()):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        places = [spec.origin] if spec and spec.origin else []
        places += list(spec.submodule_search_locations or []) if spec else []
        if any(Path(p).resolve().is_relative_to(TESTS) for p in places if p and p != "namespace"):
            inside.append(name)
    assert not inside, f"these installed packages import from tests/ instead: {inside}"


def test_the_rule_sees_a_shadowing_folder(tmp_path):
    # The check above would have caught the original layout: a package folder right under tests/.
    tree = tmp_path / "tests"
    (tree / "kernels").mkdir(parents=True)
    (tree / "kernels" / "__init__.py").write_text("")
    (tree / "kernels" / "test_x.py").write_text("")
    (tree / "test_y.py").write_text("")
    assert names_the_test_tree_puts_on_sys_path(tree) == {"kernels", "test_y"}
    (tree / "__init__.py").write_text("")
    assert names_the_test_tree_puts_on_sys_path(tree) == {"tests"}


LONG = 60  # lines: a function longer than this says why in its first comment


def test_long_functions_say_why():
    """Every function over 60 lines in workbench/ and apps/ opens (after its docstring) with a
    `# long: ...` comment giving the reason it is not split."""
    import ast

    silent = []
    for path in sorted([*(REPO / "workbench").rglob("*.py"), *(REPO / "apps").rglob("*.py")]):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno - node.lineno + 1 <= LONG:
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            start = node.body[0].end_lineno if body is not node.body else node.lineno
            between = lines[start:body[0].lineno - 1] if body else []
            if not any(ln.strip().startswith("# long:") for ln in between):
                silent.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not silent, "functions over 60 lines without a '# long:' reason: " + "; ".join(silent)
