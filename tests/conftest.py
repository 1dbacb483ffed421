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
import tempfile

# Inductor's on-disk graph cache, fresh for each test session: the compiled tests count its hits
# and misses from a cold start, and neither a user's cache nor an earlier run's may serve them.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="workbench-tests-inductor-")
atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest

from tests.helpers import make_random_pair


@pytest.fixture(scope="session")
def embedded_pair():
    """The shipped tiny-kimi pair in fp32 (exact), loaded once per test session."""
    import workbench as wb

    return wb.load_pair(dtype="float32")


@pytest.fixture
def random_pair_dirs(tmp_path):
    return make_random_pair(tmp_path)
