"""Configs: the real verifier/draft config.json layouts (eagle3_mla.md §1), both rope spellings,
the softmax scale and YaRN correction range of §4, round trips, and transformers reading ours."""
from __future__ import annotations

import copy
import math
import re

import pytest
import torch

import workbench as wb
from workbench.config import ConfigError, DraftConfig, VerifierConfig, write_config_json
from workbench.models.rope import yarn_inv_freq


def yarn(factor: float, beta_fast: float, mscale: float = 1.0) -> dict:
    return {"type": "yarn", "factor": factor, "original_max_position_embeddings": 4096, "beta_fast": beta_fast,
            "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale}


MLA = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    **MLA, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "rope_scaling": yarn(40, 32), "bos_token_id": 0,
    "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, **MLA, "n_shared_experts": 1,
    "n_routed_experts": 384, "routed_scaling_factor": 2.827, "topk_method": "noaux_tc", "n_group": 1,
    "topk_group": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "rope_scaling": yarn(32, 1), "bos_token_id": 163584,
    "eos_token_id": 163585, "tie_word_embeddings": False,
}
_K25_TEXT = {k: v for k, v in KIMI_K2.items() if k not in ("bos_token_id", "eos_token_id", "architectures")}
_K25_TEXT.update(rms_norm_eps=1e-5, max_position_embeddings=262144, rope_scaling=yarn(64, 32))
KIMI_K25 = {  # the multimodal wrapper: the language model's fields live under text_config
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "text_config": _K25_TEXT, "vision_config": {"hidden_size": 1152}, "bos_token_id": 163584,
    "eos_token_id": 163585,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, **MLA, "n_shared_experts": 2,
    "n_routed_experts": 64, "routed_scaling_factor": 1.0, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "rope_scaling": yarn(40, 32, mscale=0.707), "bos_token_id": 100000,
    "eos_token_id": 100001,
}
# HF k-l-lambda/Kimi-K2.5-Eagle3/config.json (eagle3_mla.md §1.2)
K25_DRAFT = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "num_hidden_layers": 1,
    "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128,
    "q_lora_rank": 1536, **MLA, "intermediate_size": 18432, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0, "rope_scaling": yarn(64, 32), "max_position_embeddings": 262144,
    "vocab_size": 163840, "draft_vocab_size": 163840,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
    "bos_token_id": 163584, "eos_token_id": 163585, "tie_word_embeddings": False,
    "first_k_dense_replace": 1, "moe_layer_freq": 1,
}


# --------------------------------------------------------------------------- verifier configs

def test_deepseek_v3():
    c = VerifierConfig.from_hf(copy.deepcopy(DEEPSEEK_V3))
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("deepseek_v3", 129280, 7168, 61)
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (128, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.qk_head_dim) == (128, 64, 128, 192)
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (256, 1, 8, 8, 4)
    assert (c.first_k_dense_replace, c.routed_scaling_factor, c.scoring_func) == (3, 2.5, "sigmoid")
    assert not c.is_moe_layer(2) and c.is_moe_layer(3) and c.is_moe_layer(60)
    assert c.rope_theta == 10000.0 and c.rope_scaling["factor"] == 40.0 and c.rope_interleave
    assert c.cache_row == 576 and c.default_aux_layer_ids == (2, 30, 58)
    assert c.extra["num_nextn_predict_layers"] == 1  # unknown fields are kept for writing back
    assert "quantization_config" not in c.extra  # we write dequantised weights


def test_kimi_k2():
    c = VerifierConfig.from_hf(copy.deepcopy(KIMI_K2))
    assert (c.model_type, c.vocab_size, c.num_attention_heads, c.n_routed_experts) == ("kimi_k2", 163840, 64, 384)
    assert (c.first_k_dense_replace, c.n_group, c.topk_group, c.routed_scaling_factor) == (1, 1, 1, 2.827)
    assert (c.bos_token_id, c.eos_token_id, c.rms_norm_eps) == (163584, 163585, 1e-6)
    assert c.rope_theta == 50000.0 and c.max_position_embeddings == 131072
    assert c.rope_scaling == {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_kimi_k25_text_config_nesting():
    c = VerifierConfig.from_hf(copy.deepcopy(KIMI_K25))
    assert c.model_type == "kimi_k2" and c.hidden_size == 7168 and c.num_hidden_layers == 61
    assert (c.rms_norm_eps, c.max_position_embeddings, c.rope_scaling["factor"]) == (1e-5, 262144, 64.0)
    assert (c.bos_token_id, c.eos_token_id) == (163584, 163585)  # taken from the wrapper
    assert "vision_config" not in c.extra


def test_quantization_config_kept_for_the_reader():
    """Kept (the wrapper's when text_config has none), never written back: what we save is dequantised."""
    c = VerifierConfig.from_hf(copy.deepcopy(DEEPSEEK_V3))
    assert c.quantization["quant_method"] == "fp8" and "quantization_config" not in c.to_hf()
    q = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    assert VerifierConfig.from_hf(dict(copy.deepcopy(KIMI_K25), quantization_config=q)).quantization == q
    with pytest.raises(ConfigError, match=r"cfg\.json: field 'quantization_config' = 'fp8'; expected an object"):
        VerifierConfig.from_hf(dict(copy.deepcopy(KIMI_K2), quantization_config="fp8"), "cfg.json")


def test_deepseek_v2_direct_q_proj():
    c = VerifierConfig.from_hf(copy.deepcopy(DEEPSEEK_V2_LITE))
    assert c.q_lora_rank is None and c.num_attention_heads == 16
    # DeepSeek-V2 defaults when the fields are absent: softmax routing, greedy top-k, no renormalising
    assert (c.scoring_func, c.topk_method, c.norm_topk_prob) == ("softmax", "greedy", False)
    assert c.rope_scaling["mscale"] == c.rope_scaling["mscale_all_dim"] == 0.707


def test_rope_scaling_and_rope_parameters_spellings_agree():
    classic = copy.deepcopy(KIMI_K2)
    modern = copy.deepcopy(KIMI_K2)
    scaling, theta = modern.pop("rope_scaling"), modern.pop("rope_theta")
    modern["rope_parameters"] = {"rope_type": "yarn", "rope_theta": theta,
                                 **{k: v for k, v in scaling.items() if k != "type"}}
    a, b = VerifierConfig.from_hf(classic), VerifierConfig.from_hf(modern)
    assert a == b
    assert b.rope_theta == 50000.0 and b.rope_scaling["factor"] == 32.0


def test_unknown_model_type():
    bad = dict(copy.deepcopy(KIMI_K2), model_type="llama")
    with pytest.raises(ConfigError, match=r"cfg\.json: field 'model_type' = 'llama'; expected one of .*deepseek_v3"):
        VerifierConfig.from_hf(bad, "cfg.json")


def test_missing_field_named():
    bad = copy.deepcopy(KIMI_K2)
    del bad["kv_lora_rank"]
    with pytest.raises(ConfigError, match=r"field 'kv_lora_rank' is missing; expected int"):
        VerifierConfig.from_hf(bad)


# --------------------------------------------------------------------------- §4 numbers

@pytest.mark.parametrize("cfg, m, scale", [
    (KIMI_K2, 1.34657, 0.13086),
    (KIMI_K25, 1.41589, 0.14468),
    (DEEPSEEK_V3, 1.36889, 0.13523),
])
def test_softmax_scale(cfg, m, scale):
    c = VerifierConfig.from_hf(copy.deepcopy(cfg))
    assert c.softmax_scale == pytest.approx(scale, abs=5e-6)
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * m * m, rel=1e-5)
    assert DraftConfig.from_hf(dict(K25_DRAFT)).softmax_scale == pytest.approx(0.14468, abs=5e-6)


@pytest.mark.parametrize("cfg, low, high", [(KIMI_K2, 19, 20), (KIMI_K25, 8, 20), (DEEPSEEK_V3, 10, 23)])
def test_yarn_correction_range(cfg, low, high):
    """Entries j <= low keep the extrapolated frequency θ^(-2j/d), entries j >= high are the
    interpolated one θ^(-2j/d)/factor, those between are a strict mix (eagle3_mla.md §4)."""
    c = VerifierConfig.from_hf(copy.deepcopy(cfg))
    inv, magnitude = yarn_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
    assert magnitude == 1.0  # mscale == mscale_all_dim in all three
    d, s = 64, c.rope_scaling["factor"]
    kinds = []
    for j, f in enumerate(inv.double().tolist()):
        extra = c.rope_theta ** (-2 * j / d)
        if math.isclose(f, extra, rel_tol=1e-6):
            kinds.append("E")
        elif math.isclose(f, extra / s, rel_tol=1e-6):
            kinds.append("I")
        else:
            assert extra / s < f < extra
            kinds.append("M")
    assert "".join(kinds) == "E" * (low + 1) + "M" * (high - low - 1) + "I" * (d // 2 - high)


def test_yarn_magnitude_ratio_when_mscales_differ():
    _, mag = yarn_inv_freq(64, 10000.0, dict(yarn(40, 32), mscale=1.0, mscale_all_dim=0.707))
    assert mag == pytest.approx((0.1 * math.log(40) + 1) / (0.0707 * math.log(40) + 1))


# --------------------------------------------------------------------------- draft configs

def test_public_k25_draft_config():
    c = DraftConfig.from_hf(copy.deepcopy(K25_DRAFT))
    assert (c.attention, c.architecture, c.model_type) == ("mla", "Eagle3DeepseekV2ForCausalLM", "kimi_k2")
    assert c.aux_layer_ids == (2, 30, 58) and c.use_aux_hidden_state
    assert (c.hidden_size, c.target_hidden_size, c.draft_vocab_size, c.vocab_size) == (7168, 7168, 163840, 163840)
    assert (c.q_lora_rank, c.kv_lora_rank, c.cache_row, c.rms_norm_eps) == (1536, 512, 576, 1e-5)
    assert c.rope_scaling["factor"] == 64.0 and c.rope_theta == 50000.0


def test_draft_aux_ids_top_level_or_eagle_config():
    nested = copy.deepcopy(K25_DRAFT)
    top = copy.deepcopy(K25_DRAFT)
    top.pop("eagle_config")
    top["eagle_aux_hidden_state_layer_ids"] = [2, 30, 58]
    assert DraftConfig.from_hf(nested) == DraftConfig.from_hf(top)
    neither = copy.deepcopy(top)
    neither.pop("eagle_aux_hidden_state_layer_ids")
    assert DraftConfig.from_hf(neither, num_target_layers=61).aux_layer_ids == (2, 30, 58)  # vLLM default
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids' is missing"):
        DraftConfig.from_hf(neither)


def test_draft_aux_ids_read_as_vllm_reads_them():
    """vLLM captures a top-level eagle_aux_hidden_state_layer_ids, else (2, L//2, L - 3): never eagle_config's.
    A TorchSpec draft's nested [1, 29, 57] ("output of layer i") thus fuses (2, 30, 58) of a 61-layer verifier."""
    torchspec = copy.deepcopy(K25_DRAFT)
    torchspec["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 29, 57]
    c = DraftConfig.from_hf(torchspec, num_target_layers=61)
    assert (c.aux_layer_ids, c.aux_ids_source, c.nested_aux_layer_ids) == ((2, 30, 58), "default", (1, 29, 57))
    top = dict(torchspec, eagle_aux_hidden_state_layer_ids=[3, 31, 59])
    c = DraftConfig.from_hf(top, num_target_layers=61)
    assert (c.aux_layer_ids, c.aux_ids_source, c.nested_aux_layer_ids) == ((3, 31, 59), "top-level", (1, 29, 57))
    empty = dict(torchspec, eagle_aux_hidden_state_layer_ids=[])  # vLLM's `if layer_ids` skips an empty list
    assert DraftConfig.from_hf(empty, num_target_layers=8).aux_layer_ids == (2, 4, 5)
    same = DraftConfig.from_hf(copy.deepcopy(K25_DRAFT), num_target_layers=61)  # nested [2, 30, 58] = the default
    assert (same.aux_ids_source, same.nested_aux_layer_ids) == ("default", None)
    alone = DraftConfig.from_hf(torchspec)  # no verifier to take a default from: the nested ids, marked so
    assert (alone.aux_layer_ids, alone.aux_ids_source) == ((1, 29, 57), "eagle_config")
    out = c.to_hf()  # top level capture-before (vLLM); eagle_config "output of layer i" (SGLang, trainers)
    assert out["eagle_aux_hidden_state_layer_ids"] == [3, 31, 59]
    assert out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    back = DraftConfig.from_hf(out, num_target_layers=61)
    assert (back.aux_layer_ids, back.eagle_config_aux_ids) == ((3, 31, 59), (2, 30, 58))
    zero = dict(torchspec, eagle_aux_hidden_state_layer_ids=[0, 31, 59])  # the embedding output has no "output of"
    assert "eagle_aux_hidden_state_layer_ids" not in DraftConfig.from_hf(zero, num_target_layers=61).to_hf()[
        "eagle_config"]
    with pytest.raises(ConfigError, match=r"field 'eagle_aux_hidden_state_layer_ids' = 30; expected a list"):
        DraftConfig.from_hf(dict(torchspec, eagle_aux_hidden_state_layer_ids=30), num_target_layers=61)
    with pytest.raises(ConfigError, match=r"= \[1, 2\] \(top-level\); expected 3 integer layer ids"):
        DraftConfig.from_hf(dict(torchspec, eagle_aux_hidden_state_layer_ids=[1, 2]), num_target_layers=61)


@pytest.mark.parametrize("change, fragment", [
    ({"topk_method": "group_limited"}, "'topk_method' = 'group_limited'; expected one of greedy, group_limited_greedy"),
    ({"topk_group": 9}, "field 'topk_group' = 9; expected 1..n_group=8"),
    ({"num_experts_per_tok": 200}, "field 'num_experts_per_tok' = 200; expected 1..128"),
])
def test_routing_fields_checked(change, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        VerifierConfig.from_hf(dict(copy.deepcopy(DEEPSEEK_V3), **change), "cfg.json")


def test_routing_defaults_and_correction_bias():
    v2 = VerifierConfig.from_hf(copy.deepcopy(DEEPSEEK_V2_LITE))
    assert not v2.has_correction_bias and VerifierConfig.from_hf(copy.deepcopy(KIMI_K2)).has_correction_bias
    full_v2 = dict(DEEPSEEK_V2_LITE, topk_method="group_limited_greedy", n_group=8, topk_group=3,
                   routed_scaling_factor=16.0, n_routed_experts=160)
    c = VerifierConfig.from_hf(full_v2)
    assert (c.topk_method, c.n_group, c.topk_group, c.routed_scaling_factor) == ("group_limited_greedy", 8, 3, 16.0)


def test_draft_defaults_and_v3_alias():
    d = copy.deepcopy(K25_DRAFT)
    d.pop("draft_vocab_size")
    d["architectures"] = ["Eagle3DeepseekV3ForCausalLM"]
    c = DraftConfig.from_hf(d)
    assert c.attention == "mla" and c.architecture == "Eagle3DeepseekV3ForCausalLM"
    assert c.draft_vocab_size == c.vocab_size == 163840
    assert c.target_hidden_size == c.hidden_size == 7168  # absent -> hidden_size
    d["target_hidden_size"] = 4096
    assert DraftConfig.from_hf(d).target_hidden_size == 4096


def test_draft_with_unknown_architecture_or_layers():
    with pytest.raises(ConfigError, match=r"field 'architectures' = \['LlamaForCausalLM'\]; expected one of"):
        DraftConfig.from_hf(dict(K25_DRAFT, architectures=["LlamaForCausalLM"]))
    with pytest.raises(ConfigError, match=r"'num_hidden_layers' = 2; expected 1"):
        DraftConfig.from_hf(dict(K25_DRAFT, num_hidden_layers=2))


@pytest.mark.parametrize("cfg", [DEEPSEEK_V3, KIMI_K2, KIMI_K25, DEEPSEEK_V2_LITE])
def test_verifier_to_hf_round_trip(cfg):
    c = VerifierConfig.from_hf(copy.deepcopy(cfg))
    assert VerifierConfig.from_hf(c.to_hf()) == c


def test_draft_to_hf_round_trip():
    from workbench.training.draft_init import draft_config_for

    c = DraftConfig.from_hf(copy.deepcopy(K25_DRAFT))
    assert DraftConfig.from_hf(c.to_hf()) == c
    mha = draft_config_for(VerifierConfig.from_hf(copy.deepcopy(KIMI_K2)), "mha", aux_layer_ids=(2, 30, 58))
    assert DraftConfig.from_hf(mha.to_hf()) == mha


# --------------------------------------------------------------------------- transformers reads ours

def test_transformers_reads_our_draft_config(tmp_path):
    """transformers 5 configs are strict dataclasses: a null n_routed_experts is refused."""
    transformers = pytest.importorskip("transformers")
    c = DraftConfig.from_hf(dict(K25_DRAFT, model_type="deepseek_v3"))
    write_config_json(c, tmp_path)
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "DeepseekV3Config"
    assert (hf.num_hidden_layers, hf.hidden_size, hf.q_lora_rank, hf.rms_norm_eps) == (1, 7168, 1536, 1e-5)
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]  # "output of layer i"
    assert hf.eagle_aux_hidden_state_layer_ids == [2, 30, 58]


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_transformers_loads_our_verifier_dir(tmp_path, q_lora_rank):
    transformers = pytest.importorskip("transformers")
    from workbench.models import Verifier

    cfg = VerifierConfig.from_hf(dict(
        DEEPSEEK_V3, vocab_size=200, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=24,
        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=512,
        rope_scaling=dict(yarn(8, 32), original_max_position_embeddings=64)))
    torch.manual_seed(0)
    ours = Verifier(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "norm" in name else torch.randn(p.shape, generator=g) * 0.15)
        for name, b in ours.named_buffers():
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)  # e_score_correction_bias
    wb.save_model(ours.eval(), tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.randint(0, 200, (1, 40), generator=g)
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max() <= 1e-4
