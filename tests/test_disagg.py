"""Prefill/decode disaggregation: every hand-over mode lossless, handed-over caches equal a fresh
prefill's, and the bytes equal a hand calculation from the configs."""
from __future__ import annotations

import json

import pytest
import torch

import workbench as wb
from tests.helpers import REAL, REPO
from workbench.config import DraftConfig, VerifierConfig
from workbench.analysis.kvcache import handover_bytes
from workbench.analysis.disagg import MODES, Packed, decode_instance, prefill_instance

PROMPT = 'import json\n\n\ndef load_config(path):\n    """Read a JSON config file and return a dict."""'


@pytest.fixture(scope="module")
def pairs(embedded_pair):
    return {"mla": embedded_pair, "mha": embedded_pair.with_draft(REPO / "assets" / "tiny-kimi" / "draft-mha")}


def _decoder(pair, k=3, **kw):
    return wb.SpecDecoder(pair, k, fused=False, **kw)


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_lossless(pairs, kind, mode):
    pair = pairs[kind]
    plain = wb.generate_autoregressive(pair, PROMPT, 40)
    h = prefill_instance(_decoder(pair), PROMPT, 40, mode)
    res = decode_instance(_decoder(pair), h)
    assert res.tokens == plain.tokens and res.text == plain.text
    one = _decoder(pair).generate(PROMPT, 40)
    if mode != "cold":  # the draft sees what it sees in one process: the same proposals
        assert [e.proposed for e in res.events] == [e.proposed for e in one.events]
    assert res.stats.num_tokens == 40 and res.events[0].kind == "prefill"


def test_sampling_continues_the_same_random_stream(pairs):
    pair = pairs["mla"]
    one = _decoder(pair, temperature=0.9, seed=5).generate(PROMPT, 30)
    h = prefill_instance(_decoder(pair, temperature=0.9, seed=5), PROMPT, 30, "full")
    assert decode_instance(_decoder(pair, temperature=0.9, seed=5), h).tokens == one.tokens


def test_handed_over_caches_equal_a_fresh_prefill(embedded_pair):
    pair = embedded_pair.reference()  # fp32 plain models
    dec = _decoder(pair)
    h = prefill_instance(dec, PROMPT, 8, "full")
    ids = pair.encode(PROMPT)
    fresh = pair.verifier_cache(len(ids))
    pair.verifier(torch.tensor([ids]), fresh)
    torch.testing.assert_close(h.verifier_rows.tensor(), fresh.valid(), rtol=0, atol=1e-5)
    # the draft's rows equal those the engine writes in one process before its first chain
    one = _decoder(pair)
    list(one.stream(PROMPT, 2))
    T = len(ids)
    torch.testing.assert_close(h.draft_rows.tensor(), one.proposer.cache.rows[:, :1, :T - 1], rtol=0, atol=1e-5)
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    assert torch.equal(Packed.of(x).tensor(), x) and Packed.of(x).nbytes == 30  # bf16 crosses as its bits


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_bytes_equal_the_hand_calculation(pairs, kind):
    pair = pairs[kind]
    v, d = pair.verifier.config, pair.draft.config
    ids = pair.encode(PROMPT)
    T, E = len(ids), 4  # fp32: 4 bytes a value
    hand_v = v.num_hidden_layers * (v.kv_lora_rank + v.qk_rope_head_dim) * T * E
    hand_d = ((d.kv_lora_rank + d.qk_rope_head_dim) if kind == "mla" else 2 * d.num_key_value_heads * d.head_dim) \
        * (T - 1) * E
    hand_aux = 3 * v.hidden_size * E
    for mode in MODES:
        h = prefill_instance(_decoder(pair), PROMPT, 4, mode)
        want = {"verifier_kv": hand_v, "last_aux": hand_aux, "draft_kv": hand_d if mode == "full" else 0,
                "prompt_aux": hand_aux * T if mode == "recompute" else 0}
        assert h.bytes_by_part == want
        model = handover_bytes(v, d, T, mode, dtype_bytes=E)
        assert {p: model[p] for p in want} == want and model["total"] == h.nbytes
        assert model["page_layouts"] == (1 if kind == "mla" else 2)


def test_kimi_k2_bytes_as_a_model():
    """Kimi-K2 with the TorchSpec MLA draft and with the SpecForge MHA draft, bf16, a 4K prompt."""
    path = REAL / "moonshotai__Kimi-K2-Instruct.config.json"
    v = VerifierConfig.from_hf(json.loads(path.read_text()), str(path))
    assert (v.num_hidden_layers, v.kv_lora_rank + v.qk_rope_head_dim, v.hidden_size) == (61, 576, 7168)
    mla = handover_bytes(v, _draft(REAL / "zhubohao911__TorchSpec__kimi_k25_eagle3_mla.config.json", 61), 4096,
                         "full")
    mha = handover_bytes(v, _draft(REAL / "sgl-project__SpecForge__kimi-k2-eagle3.config.json", 61), 4096, "full")
    assert mla["verifier_kv"] == mha["verifier_kv"] == 61 * 576 * 4096 * 2
    assert mla["draft_kv"] == 576 * 4095 * 2 and mla["page_layouts"] == 1
    assert mha["draft_kv"] == 2 * 64 * 128 * 4095 * 2 and mha["page_layouts"] == 2
    recompute = handover_bytes(v, _draft(REAL / "zhubohao911__TorchSpec__kimi_k25_eagle3_mla.config.json", 61),
                               4096, "recompute")
    assert recompute["prompt_aux"] == 3 * 7168 * 4096 * 2  # 37x the MLA draft's own rows


def _draft(path, layers):
    return DraftConfig.from_hf(json.loads(path.read_text()), str(path), layers)


def test_bad_mode_and_fused_decoders_are_refused(pairs):
    with pytest.raises(ValueError, match="mode = 'partial'; expected one of full, recompute, cold"):
        prefill_instance(_decoder(pairs["mla"]), PROMPT, 4, "partial")
    with pytest.raises(ValueError, match="an EAGLE draft"):
        prefill_instance(wb.SpecDecoder(pairs["mla"], 3, proposer="ngram"), PROMPT, 4, "full")
    assert json.dumps(handover_bytes(pairs["mla"].verifier.config, pairs["mla"].draft.config, 10, "cold"))
    with pytest.raises(ValueError, match="prompt_len = 0"):
        handover_bytes(pairs["mla"].verifier.config, pairs["mla"].draft.config, 0, "full")


def test_pd_study_and_the_cli(pairs, capsys):
    from workbench.analysis.context import load_documents
    from workbench.analysis.pd import document_cuts, pd_study
    from workbench.cli import main

    docs = [d["text"] for d in load_documents()]
    long = document_cuts(pairs["mla"], docs, 200, count=1)
    assert 190 <= len(pairs["mla"].encode(long[0])) <= 210 and docs[0].startswith(long[0])
    with pytest.raises(ValueError, match="reach 400 tokens; expected 2"):
        document_cuts(pairs["mla"], ["def f(): pass", docs[0]], 400, count=2)
    report = pd_study(pairs, {"short": [PROMPT], "long": long}, k=2, max_new_tokens=12)
    assert [(r.draft, r.prompts, r.mode) for r in report.results][:3] == [("mla", "short", m) for m in MODES]
    for r in report.results:
        assert r.identical == r.num_prompts  # greedy: every mode lossless
        assert r.bytes_per_request == r.model_bytes_per_request  # measured bytes = the configs' model
        assert r.accept_length >= 1 and r.decode_tokens_per_s > 0
        assert 0 <= r.degenerate <= r.num_prompts and (r.accept_length_clean is None) == (r.degenerate == r.num_prompts)
    assert "clean" in report.summary().splitlines()[1] and "loops" in report.summary().splitlines()[1]
    full, cold = report.result("mla", "long", "full"), report.result("mla", "long", "cold")
    assert cold.bytes_per_request < full.bytes_per_request < report.result("mla", "long", "recompute").bytes_per_request
    assert main(["pd", "--limit", "1", "--max-new-tokens", "6", "--mha-draft", "", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in out["results"]] == list(MODES)
    assert main(["pd", "--limit", "1", "--max-new-tokens", "4", "--mha-draft", "", "--long-tokens", "40,90",
                 "--long-count", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted({r["prompts"] for r in out["results"]}) == ["long-40", "long-90", "short"]
    assert main(["pd", "--limit", "1", "--long-tokens", "5000"]) == 2
    assert "--long-tokens = 5000" in capsys.readouterr().err


def test_roles_must_run_the_same_speculative_config():
    from workbench.analysis.pd import role_mismatches

    a = {"method": "eagle3", "model": "org/draft", "num_speculative_tokens": 3,
         "eagle_aux_hidden_state_layer_ids": [2, 30, 58]}
    assert role_mismatches(a, dict(a)) == []
    got = role_mismatches(a, dict(a, num_speculative_tokens=2, eagle_aux_hidden_state_layer_ids=[1, 29, 57]))
    assert got == ["num_speculative_tokens: prefill 3, decode 2",
                   "eagle_aux_hidden_state_layer_ids: prefill [2, 30, 58], decode [1, 29, 57]"]
    with pytest.raises(ValueError, match="decode role: expected a speculative_config JSON object"):
        role_mismatches(a, [1])
