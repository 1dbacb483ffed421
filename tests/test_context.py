"""Accept length by context length (`workbench.analysis.context`, `workbench context`), the long
held-out documents it reads, and the long-prompt prefill it relies on (torch's fused attention)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.helpers import EMBEDDED
from workbench.analysis.context import context_sweep, load_documents
from workbench.analysis.protocol import Timing
from workbench.models.mla import attend_heads, causal_mask

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair():
    return wb.load_pair(dtype="float32")


def test_the_long_documents_are_held_out_permissive_and_long_enough(pair):
    """Every document names its package, version, path and licence, comes from a package held out
    of the chat verifier's corpus (assets/corpus/manifest.json), and reaches the longest default
    cut plus 64 new tokens under the embedded pair's tokenizer and the first (stdlib) pair's."""
    docs = load_documents()
    manifest = json.loads((REPO / "assets/corpus/manifest.json").read_text())["packages"]
    from tokenizers import Tokenizer

    v1 = Tokenizer.from_file(str(REPO / "assets/tiny-kimi-v1/verifier/tokenizer.json"))
    assert len(docs) >= 16 and len({d["package"] for d in docs}) >= 8
    for d in docs:
        assert d["license"] in ("MIT", "BSD", "Apache-2.0", "PSF"), d["path"]
        assert manifest[d["package"]]["split"] == "eval" and manifest[d["package"]]["version"] == d["version"]
        assert len(pair.encode(d["text"])) >= 1920 + 64 and len(v1.encode(d["text"]).ids) >= 1920 + 64, d["path"]


def test_a_bad_documents_file_names_the_file_line_and_field(tmp_path):
    bad = tmp_path / "docs.jsonl"
    bad.write_text('{"text": "def f(): pass"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"docs.jsonl, line 2: field \"text\" missing"):
        load_documents(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"docs.jsonl, line 1: not valid JSON"):
        load_documents(bad)
    with pytest.raises(ValueError, match="cannot read it"):
        load_documents(tmp_path / "missing.jsonl")


def test_accept_length_by_context_is_measured_per_cut_and_lossless(pair):
    docs = [d["text"] for d in load_documents()[:2]]
    report = context_sweep(pair, docs, lengths=(48, 300), k=3, temperatures=(0.0, 0.7), new_tokens=16)
    assert [(p.prompt_tokens, p.temperature) for p in report.points] == [(48, 0.0), (48, 0.7), (300, 0.0), (300, 0.7)]
    assert [p.bucket for p in report.points] == ["0-256", "0-256", "256-512", "256-512"]
    for p in report.points:
        assert p.requests == 2 and 0 <= p.loops <= 2
        assert 1.0 <= p.accept_length <= 4.0 and p.step_ms > p.draft_ms_per_step > 0
        if p.temperature == 0:
            assert p.identical == 2 and p.speedup == pytest.approx(p.tokens_per_s / p.plain_tokens_per_s)
        else:
            assert p.identical is None and p.plain_tokens_per_s is None
    clean = {p.temperature: [q.accept_length_clean for q in report.points if q.temperature == p.temperature]
             for p in report.points}
    for t, (short, long) in clean.items():
        want = None if short is None or long is None else long / short
        assert report.retained(t) == (pytest.approx(want) if want is not None else None)
    kv = report.kv_bytes_per_token
    assert kv["verifier"] > kv["draft"] > 0
    assert "accept length by context" in report.summary()


def test_cuts_that_do_not_fit_are_refused(pair):
    docs = [d["text"] for d in load_documents()[:1]]
    with pytest.raises(ValueError, match="within the pair's context"):
        context_sweep(pair, docs, lengths=(pair.context_length - 8,), new_tokens=16)
    with pytest.raises(ValueError, match="fewer than 400 tokens"):
        context_sweep(pair, ["def f():\n    return 1\n"], lengths=(400,), new_tokens=4)


def test_the_cli_prints_the_report_as_json():
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "context", "--limit", "1", "--lengths", "40,90",
                          "--new-tokens", "8", "--temperatures", "0", "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert [p["prompt_tokens"] for p in res["points"]] == [40, 90] and res["documents"] == 1
    assert res["points"][0]["identical"] == 1 and list(res["retained"]) == ["0.0"] and res["pair"]


def test_drafts_of_one_verifier_are_measured_side_by_side(pair):
    """`context_compare`: the MLA draft and its MHA twin on the same cuts, plain decoding once. Each
    draft's figures are what it gives alone, and the plain figures are shared."""
    from workbench.analysis.context import context_compare

    docs = [d["text"] for d in load_documents()[:2]]
    mha = pair.with_draft(str(EMBEDDED / "draft-mha"))
    kw = dict(lengths=(48, 200), k=3, temperatures=(0.0,), new_tokens=12)
    both = context_compare({"mla": pair, "mha": mha}, docs, **kw)
    assert list(both) == ["mla", "mha"]
    alone = context_sweep(mha, docs, **kw)
    for a, b in zip(both["mha"].points, alone.points):  # greedy: the same tokens, so the same accept lengths
        assert (a.accept_length, a.loops, a.identical) == (b.accept_length, b.loops, b.identical)
    assert both["mla"].kv_bytes_per_token["draft"] < both["mha"].kv_bytes_per_token["draft"]  # MLA's smaller cache
    assert all(p.identical == 2 for r in both.values() for p in r.points)  # greedy stays lossless for both
    other = wb.load_pair(str(EMBEDDED.parent / "tiny-kimi-v1" / "verifier"), no_draft=True)
    with pytest.raises(ValueError, match="no draft"):
        context_compare({"mla": pair, "none": other}, docs, **kw)


def test_the_cli_compares_drafts_by_name():
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "context", "--limit", "1", "--lengths", "40",
                          "--new-tokens", "6", "--temperatures", "0", "--vs-draft",
                          f"mha={EMBEDDED / 'draft-mha'}", "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)["drafts"]
    assert list(res) == ["draft", "mha"] and all(r["points"][0]["identical"] == 1 for r in res.values())
    bad = subprocess.run([sys.executable, "-m", "workbench.cli", "context", "--vs-draft", "nameless"],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert bad.returncode != 0 and "expected NAME=DIR" in bad.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_pads_a_narrow_v_and_a_fresh_block_is_its_causal_mask(dtype):
    """MLA's v is narrower than q and k: padded, SDPA takes its fused kernel, and the result is
    the unpadded attention's (to rounding); `causal` equals the square causal mask."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 37, 48, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(2, 4, 37, 32, generator=gen).to(dtype)
    mask = causal_mask(37, [0, 0], "cpu")
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got in (attend_heads(q, k, v, mask, 0.2), attend_heads(q, k, v, None, 0.2, causal=True)):
        assert got.shape == (2, 4, 37, 32)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_the_drafts_prefill_is_counted_in_the_requests_prefill(pair):
    """The draft's pass over the prompt runs after the verifier's prefill event is made: its time
    goes into that event, so a decode's tokens/s does not carry a prompt-length cost."""
    prompt = load_documents()[0]["text"][:3000]
    r = wb.SpecDecoder(pair, 3).generate(prompt, 8)
    first = r.events[0]
    assert first.kind == "prefill" and first.draft_time > 0
    t = Timing.of(r)
    assert t.prefill_s == pytest.approx(first.verify_time + first.draft_time)
    assert r.stats.prefill_time == pytest.approx(t.prefill_s)
    plain = wb.generate_autoregressive(pair, prompt, 8)
    assert plain.events[0].draft_time == 0 and plain.tokens == r.tokens

