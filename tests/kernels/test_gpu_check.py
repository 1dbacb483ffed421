"""`python -m workbench.kernels.gpu_check` / `bench-kernels --gpu-report`: its CPU-testable parts.

The command itself needs a CUDA GPU (it refuses without one, tested here); the pieces it is
made of (pytest outcomes as JSON, the report's assembly) run on the CPU with a stand-in bench.
"""
import json

import pytest
import torch

from workbench.kernels import bench, bench_cli, gpu_check

SAMPLE_TESTS = '''
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 1 + 1 == 3

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("setup breaks")

def test_setup_error(broken):
    pass
'''


@pytest.fixture
def sample_suite(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    return [str(tmp_path), "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
            "--import-mode=importlib"]  # pytest in pytest: no clash with an earlier test_sample


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the report runs for real")
def test_gpu_report_refuses_without_cuda(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    assert bench_cli.main(["--gpu-report", str(out)]) == 2
    assert "CUDA" in capsys.readouterr().err and not out.exists()
    with pytest.raises(RuntimeError, match="CUDA"):
        gpu_check.run(out)


def test_test_outcomes_are_collected_per_test(sample_suite):
    res = gpu_check.collect_test_outcomes(sample_suite)
    assert res["exit_code"] == 1
    assert res["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    by_name = {t["nodeid"].split("::")[-1]: t for t in res["tests"]}
    assert by_name["test_fails"]["outcome"] == "failed" and "assert" in by_name["test_fails"]["message"]
    assert by_name["test_setup_error"]["outcome"] == "error"
    json.dumps(res)  # the report is one JSON file


def test_report_joins_tests_and_bench(tmp_path, sample_suite, monkeypatch):
    """With CUDA faked and a stand-in bench: one JSON with the environment, tests, bench, summary."""
    rows = [dict(gbps=1500.0, copy_bw_fraction=0.5), dict(gbps=2400.0, copy_bw_fraction=0.8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "environment", lambda: dict(device="stand-in"))
    asked = []
    monkeypatch.setattr(bench, "run", lambda **kw: asked.append(kw) or dict(
        copy_bandwidth_gbps=3000.0, rows=rows))
    out = tmp_path / "report.json"
    report = gpu_check.run(out, sample_suite, batches=(1,), contexts=(1024,), query_tokens=(1, 4))
    assert json.loads(out.read_text()) == report and report["environment"] == dict(device="stand-in")
    assert asked == [dict(batches=(1,), contexts=(1024,), query_tokens=(1, 4))]
    assert report["tests"]["counts"]["failed"] == 1
    s = report["summary"]
    assert s["tests_ok"] is False and s["best_gbps"] == 2400.0 and s["best_copy_bw_fraction"] == 0.8
    assert gpu_check.run_from_args(out, " ".join(sample_suite), (1,), (1024,), (1,)) == 1  # a test failed
