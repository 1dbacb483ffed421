"""The notebooks run end to end on the embedded pair, and are stored without outputs.

Each notebook executes in a fresh `python3` kernel with the notebook's own folder as the
working directory (as Jupyter runs it), so a cell that depends on the repository root as cwd
fails here too. The kernel must be this interpreter: a kernelspec pointing at another Python
would test a different install of workbench, so that is checked before anything runs.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = ["01_quickstart", "02_tuning_k", "03_fusion", "04_mla_kernels", "05_train_a_draft"]
CELL_TIMEOUT_S = 900  # per cell: seconds on an idle machine, minutes on a shared one; a hang still fails


def _kernel_env() -> dict[str, str]:
    """One intra-op thread unless the caller chose otherwise: the notebooks' matmuls are tiny, and
    on a small shared machine extra OpenMP threads only spin while another process holds the
    core (a 2-minute notebook took over 10 that way)."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _load(name: str):
    path = NOTEBOOK_DIR / f"{name}.ipynb"
    assert path.exists(), f"{path} is missing"
    return nbformat.read(path, as_version=4)


def test_every_notebook_is_listed():
    assert sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_stored_without_outputs(name):
    nb = _load(name)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.get("outputs") == [], f"{name}.ipynb cell {i}: stored with outputs; clear them before committing"
        assert cell.get("execution_count") is None, f"{name}.ipynb cell {i}: stored with an execution count"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_uses_public_api_only(name):
    """Notebooks speak `import workbench as wb` and its documented modules, never private names."""
    nb = _load(name)
    src = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "import workbench as wb" in src, f"{name}.ipynb does not import workbench as wb"
    for bad in ("._", "workbench.models", "workbench.decoding", "workbench.checkpoint"):
        offending = [line for line in src.splitlines() if bad in line and not line.lstrip().startswith("#")]
        assert not offending, f"{name}.ipynb reaches past the public API ({bad!r}): {offending}"


@pytest.fixture(scope="module")
def kernel_name() -> str:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.fail("no 'python3' kernelspec; install ipykernel into this interpreter's environment")
    exe = spec.argv[0]
    # jupyter_client substitutes sys.executable for a bare "python"/"python3"/"python3.X"
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    if exe not in bare:
        assert Path(exe).resolve() == Path(sys.executable).resolve(), (
            f"kernelspec 'python3' runs {exe}, not this interpreter {sys.executable}")
    return "python3"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_name):
    nb = _load(name)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    try:
        client.execute(env=_kernel_env())
    except nbclient.exceptions.CellExecutionError as e:  # names the cell and shows its traceback
        pytest.fail(f"{name}.ipynb: a cell failed\n{e}")
    printed = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert Path(printed.strip()).resolve() == Path(sys.executable).resolve(), (
        f"the kernel ran {printed.strip()!r}, not {sys.executable}")
    errors = [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{name}.ipynb: error outputs in cells {[i for i, _ in errors]}"
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in ran), f"{name}.ipynb: some cells did not run"
