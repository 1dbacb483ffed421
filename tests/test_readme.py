"""The README cannot go stale: its quick start is what CI runs, and its CLI examples work."""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from workbench.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def code_lines(section: str | None = None) -> list[str]:
    text = README if section is None else README.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        lines += [ln.split("  #")[0].strip() for ln in joined.splitlines() if ln.strip() and not ln.startswith("#")]
    return lines


def _ci_run_with_stubs(tmp_path: Path) -> list[list[str]]:
    """Run the real `.ci/run` on a copy of the repository's `.ci/` with stand-ins for `python3`,
    `apt-get` and `chromium` that record their argv instead of installing anything: what CI
    executes, in order, without the minutes it takes."""
    root = tmp_path / "repo"
    (root / ".ci").mkdir(parents=True)
    for f in (REPO / ".ci").iterdir():
        (root / ".ci" / f.name).write_bytes(f.read_bytes())
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    recorder = (f"#!{sys.executable}\nimport json, os, sys\n"
                f"open({str(log)!r}, 'a').write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n"
                "if sys.argv[1:3] == ['-m', 'venv']:\n"
                "    os.makedirs(os.path.join(sys.argv[3], 'bin'), exist_ok=True)\n"
                f"    open(os.path.join(sys.argv[3], 'bin', 'activate'), 'w').write('export PATH={bin_dir}:$PATH\\n')\n")
    for name in ("python3", "python", "chromium", "apt-get"):
        (bin_dir / name).write_text(recorder)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "CI_LATEST": "0"}
    out = subprocess.run(["bash", str(root / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_quick_start_is_two_commands_and_ci_runs_the_test_command(tmp_path):
    """The second quick-start command is `.ci/run`, and what it executes is: a fresh venv, the pinned
    install of the package with its test extras, then the README's test command, last."""
    quick = code_lines("Quick start")
    assert len(quick) == 3 and quick[1] == "bash .ci/run"
    install, start = quick[0].split(" && ")
    assert start == "workbench chat" and "-c .ci/constraints.txt" in install and "torch==2.13.0" in install
    calls = _ci_run_with_stubs(tmp_path)
    assert calls[0][:3] == ["python3", "-m", "venv"]
    installs = [c for c in calls if c[1:4] == ["-m", "pip", "install"]]
    assert installs and all("-c" in c and ".ci/constraints.txt" in c for c in installs)
    assert any("torch==2.13.0" in c and ".[apps,dev]" in c and "-e" in c for c in installs)
    assert calls[-1] == ["python", *shlex.split(quick[2])[1:]], "the README's test command must be what .ci/run runs last"


def pinned_versions() -> dict[str, str]:
    pins = {}
    for ln in (REPO / ".ci" / "constraints.txt").read_text().splitlines():
        if ln and not ln.startswith("#"):
            name, sep, version = ln.partition("==")
            assert sep and version and " " not in ln, f".ci/constraints.txt: {ln!r} is not name==version"
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_constraints_pin_the_peers_and_tools_exactly():
    pins = pinned_versions()
    for peer in ("torch", "transformers", "kernels", "gradio", "gradio-client", "streamlit", "playwright",
                 "pytest", "hypothesis", "tokenizers", "safetensors", "triton", "numpy", "pip"):
        assert peer in pins, f".ci/constraints.txt does not pin {peer}"
    assert pins["torch"] == "2.13.0"


@pytest.mark.skipif(os.environ.get("WORKBENCH_PINNED") != "1", reason="only under .ci/run, which installs the pins")
def test_ci_installed_exactly_the_pins():
    import importlib.metadata

    wrong = {}
    for name, version in pinned_versions().items():
        have = importlib.metadata.version(name).split("+")[0]
        if have != version:
            wrong[name] = (version, have)
    assert not wrong, f"installed versions differ from .ci/constraints.txt (pinned, installed): {wrong}"


def test_every_cli_example_parses():
    examples = [ln for ln in code_lines() if ln.startswith("workbench ")]
    assert len(examples) >= 10
    parser = build_parser()
    for ln in examples:
        argv = shlex.split(ln)[1:]
        if argv[0] in ("chat", "train-draft"):  # these hand their argv to their own parsers
            continue
        if argv[0] == "bench-kernels":  # so does this one, to a parser that can be built here
            from workbench.kernels.bench_cli import build_parser as bench_parser

            bench_parser().parse_args(argv[1:])
            continue
        parser.parse_args(argv)


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_generate_example_runs():
    """The README's first CLI line, shortened: a request through the embedded pair's chat template."""
    shown = next(ln for ln in README.splitlines() if ln.startswith("workbench generate --chat"))
    prompt = shown.split("--prompt '")[1].split("'")[0]
    out = _run(["generate", "--chat", "--prompt", prompt, "--k", "3", "--max-new-tokens", "8", "--json"])
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert len(res["tokens"]) == 8 and res["accept_length"] >= 1 and res["steps"][0]["kind"] == "prefill"


def test_vllm_command_is_the_one_the_readme_shows():
    shown = next(ln for ln in README.splitlines() if ln.startswith("# vllm serve"))[2:]
    out = _run(["vllm-command", "--verifier-name", "moonshotai/Kimi-K2.7-Code",
                "--draft-name", "k-l-lambda/kimi-k2.7-code-eagle3-mla", "--k", "3", "--tp", "8"])
    assert out.returncode == 0 and out.stdout.strip() == shown


def test_sglang_command_is_the_one_the_readme_shows():
    shown = next(ln for ln in README.splitlines() if ln.startswith("# python -m sglang.launch_server"))[2:]
    out = _run(["sglang-command", "--verifier-name", "moonshotai/Kimi-K2.7-Code",
                "--draft-name", "k-l-lambda/kimi-k2.7-code-eagle3-mla", "--k", "3", "--tp", "8"])
    assert out.returncode == 0 and out.stdout.strip() == shown


def test_export_vllm_example_runs(tmp_path):
    out = _run(["export-vllm", str(tmp_path / "draft-vllm"), "--json"])
    assert out.returncode == 0, out.stderr
    cfg = json.loads((tmp_path / "draft-vllm" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]


def test_bench_kernels_says_it_needs_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: bench-kernels runs for real there")
    out = _run(["bench-kernels", "--json"])
    assert out.returncode == 2 and "CUDA" in out.stderr


def test_first_quick_start_command_brings_up_the_chat():
    """The newcomer's path: `workbench chat` serves the embedded pair on 127.0.0.1 with no other step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "chat", "--port", str(port)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                    page = r.read().decode()
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("workbench chat did not answer within 180 s")
        assert r.status == 200 and "gradio" in page.lower()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
