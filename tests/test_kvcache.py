"""KV-cache bytes: Kimi-K2 figures from the definitions, the MHA twin, and the table."""
import pytest

from workbench.analysis.kvcache import (
    KIMI_K2_MLA_DRAFT,
    KIMI_K2_VERIFIER,
    bytes_per_token,
    memory_table,
    mha_equivalent,
)
from workbench.config import ConfigError, DraftConfig, VerifierConfig

# Kimi-K2 from eagle3_mla.md §1.2, written out here rather than read from the presets.
LAYERS, KV_LORA, ROPE, HEADS, HIDDEN = 61, 512, 64, 64, 7168
BF16 = 2
MLA_ROW = (KV_LORA + ROPE) * BF16  # one latent row [c_kv | k_pe] per token per layer
MHA_ROW = 2 * HEADS * (HIDDEN // HEADS) * BF16  # K and V of every head


def test_kimi_k2_bytes_exact():
    assert MLA_ROW == 1152
    assert bytes_per_token(KIMI_K2_VERIFIER) == LAYERS * MLA_ROW == 70272
    assert bytes_per_token(KIMI_K2_MLA_DRAFT) == MLA_ROW
    assert bytes_per_token(mha_equivalent(KIMI_K2_MLA_DRAFT)) == MHA_ROW == 64 * 112 * 2 * 2
    assert bytes_per_token(KIMI_K2_VERIFIER, dtype_bytes=1) == 70272 // 2  # fp8 cache


def test_presets_are_the_reference_configs():
    v, d = KIMI_K2_VERIFIER, KIMI_K2_MLA_DRAFT
    assert (v.num_hidden_layers, v.num_attention_heads, v.hidden_size, v.vocab_size) == (61, 64, 7168, 163840)
    assert (v.q_lora_rank, v.kv_lora_rank, v.qk_nope_head_dim, v.qk_rope_head_dim, v.v_head_dim) == (1536, 512, 128, 64, 128)
    assert v.rope_scaling["factor"] == 32.0 and v.rope_theta == 50000.0 and v.n_routed_experts == 384
    assert isinstance(d, DraftConfig) and d.attention == "mla" and d.architecture == "Eagle3DeepseekV2ForCausalLM"
    assert d.aux_layer_ids == (2, 30, 58) and d.rope_scaling["factor"] == 64.0 and d.rms_norm_eps == 1e-5
    assert d.aux_layer_ids == v.default_aux_layer_ids  # vLLM default (2, L//2, L-3) for 61 layers


def test_mha_equivalent_shape():
    m = mha_equivalent(KIMI_K2_MLA_DRAFT)
    assert (m.attention, m.architecture) == ("mha", "LlamaForCausalLMEagle3")
    assert (m.num_attention_heads, m.num_key_value_heads, m.head_dim) == (64, 64, 112)
    assert (m.hidden_size, m.intermediate_size, m.vocab_size) == (7168, 18432, 163840)
    assert m.aux_layer_ids == KIMI_K2_MLA_DRAFT.aux_layer_ids
    assert mha_equivalent(m) is m
    bad = DraftConfig.from_hf(dict(KIMI_K2_MLA_DRAFT.to_hf(), hidden_size=7000), "bad.json")
    with pytest.raises(ConfigError, match="'hidden_size' = 7000"):
        mha_equivalent(bad)


def test_small_verifier_from_definitions():
    cfg = VerifierConfig.from_hf({
        "model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    })
    assert bytes_per_token(cfg, dtype_bytes=4) == 4 * (32 + 16) * 4
    with pytest.raises(ValueError, match="dtype_bytes"):
        bytes_per_token(cfg, dtype_bytes=0)
    with pytest.raises(TypeError, match="VerifierConfig or DraftConfig"):
        bytes_per_token({"num_hidden_layers": 4})


def test_memory_table():
    rows = memory_table(KIMI_K2_VERIFIER, KIMI_K2_MLA_DRAFT)
    assert len(rows) == 16
    for r in rows:
        tokens = r["batch"] * r["context"]
        assert (r["verifier_bytes"], r["draft_bytes"], r["mha_draft_bytes"]) == (
            tokens * LAYERS * MLA_ROW, tokens * MLA_ROW, tokens * MHA_ROW)
        assert r["draft_share"] == pytest.approx(1 / (LAYERS + 1))  # one draft layer per 61 verifier layers
        assert r["mha_draft_share"] == pytest.approx(MHA_ROW / (LAYERS * MLA_ROW + MHA_ROW))
        assert r["mha_over_mla"] == pytest.approx(MHA_ROW / MLA_ROW)
    by = {(r["batch"], r["context"]): r for r in rows}
    for b, nb in zip((1, 8, 32), (8, 32, 64)):
        for t, nt in zip((1024, 4096, 16384), (4096, 16384, 131072)):
            for key in ("verifier_bytes", "draft_bytes", "mha_draft_bytes"):
                assert by[(b, t)][key] < by[(nb, t)][key] and by[(b, t)][key] < by[(b, nt)][key]
    # 64 sequences of 128k tokens: the MHA draft would need 224 GiB of cache, the MLA one 9 GiB.
    assert by[(64, 131072)]["mha_draft_bytes"] == 224 * 2**30
    assert by[(64, 131072)]["draft_bytes"] == 9 * 2**30
    with pytest.raises(ValueError, match="batch 0"):
        memory_table(KIMI_K2_VERIFIER, KIMI_K2_MLA_DRAFT, batches=(0,))
