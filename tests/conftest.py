"""Shared fixtures: the embedded pair, and small random pairs written to disk as real checkpoints."""
from __future__ import annotations

import os

# The Triton interpreter must be chosen before triton is imported anywhere (CPU-only machines).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)  # tiny ops: threads cost more than they give, badly so on a busy machine
except ImportError:  # pragma: no cover
    pass

import atexit
import shutil
import sys
import tempfile

# Inductor's on-disk graph cache, fresh for each test session: the compiled tests count its hits
# and misses from a cold start, and neither a user's cache nor an earlier run's may serve them.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="workbench-tests-inductor-")
atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest

from tests.helpers import make_random_pair

# --- The repository tests on its own: no test may read beside it (a clone has nothing there). ---
# An audit hook sees every `open` and directory listing of this process; those that land in the
# repository's parent folder but outside the repository are recorded, and the test that made them
# fails. Interpreters, virtual environments, temporary folders and tools' dot-folders in the home
# directory are not the project's data, wherever they sit.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BESIDE = os.path.dirname(_REPO) + os.sep
# (A folder that holds the repository itself, as /tmp does for a clone made there, allows nothing.)
_ALLOWED = tuple(d for d in {os.path.join(os.path.abspath(d), "") for d in
                             (sys.prefix, sys.base_prefix, sys.exec_prefix, tempfile.gettempdir())}
                 if not _BESIDE.startswith(d)) + (os.path.join(os.path.expanduser("~"), "."),)
outside_reads: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event not in ("open", "os.listdir", "os.scandir") or not args or isinstance(args[0], (int, type(None))):
        return
    path = os.fsdecode(args[0])
    full = os.path.abspath(path)
    if (full.startswith(_BESIDE) and not (full + os.sep).startswith(_REPO + os.sep)
            and not full.startswith(_ALLOWED)):
        outside_reads.append(full)


sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def _reads_stay_in_the_repository():
    before = len(outside_reads)
    yield
    beside = outside_reads[before:]
    if beside:
        del outside_reads[before:]
        pytest.fail(f"read outside the repository {_REPO}: {sorted(set(beside))}; "
                    f"a clone has nothing beside it, so keep test data in the repository")


@pytest.fixture(scope="session")
def embedded_pair():
    """The shipped tiny-kimi pair in fp32 (exact), loaded once per test session."""
    import workbench as wb

    return wb.load_pair(dtype="float32")


@pytest.fixture
def random_pair_dirs(tmp_path):
    return make_random_pair(tmp_path)


# --- `pytest -m "not slow"`: the core in a few minutes; CI runs everything. ---
# Whole modules whose every test drives a notebook kernel, a browser, inductor or Triton's
# compiler; single slow tests elsewhere carry @pytest.mark.slow themselves.
SLOW_MODULES = {"test_notebooks", "test_compiled", "test_aot", "test_triton_end_to_end"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in SLOW_MODULES or item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.slow)
