"""The published artefacts in tests/data/real (configs and tensor listings of checkpoints people serve):
each config parses, a model built from it (on the meta device, shrunk to 3 layers with every head
and expert dimension kept) expects exactly the tensors its listing names once the loader's renames
are applied, its KV cache costs the bytes worked out by hand below, and the two public drafts load
against their verifiers with the aux ids vLLM captures, export as vLLM reads them, and are checked
by the doctor's field checks.

The folder is part of the repository (its README gives each file's source); these tests fail, not
skip, without it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import REAL
from tests.test_export import vllm_reads
from workbench.analysis import field_checks as fc
from workbench.analysis.kvcache import bytes_per_token
from workbench.checkpoint import MULTIMODAL_PREFIXES, logical_layout, text_prefix, verifier_name
from workbench.config import DraftConfig, VerifierConfig
from workbench.models import Eagle3Draft, Verifier
from workbench.pair import check_pairing

K2, K25, V2_LITE = "moonshotai__Kimi-K2-Instruct", "moonshotai__Kimi-K2.5", "deepseek-ai__DeepSeek-V2-Lite"
TORCHSPEC, SPECFORGE = "zhubohao911__TorchSpec__kimi_k25_eagle3_mla", "sgl-project__SpecForge__kimi-k2-eagle3"
LISTINGS = {K2: "moonshotai__Kimi-K2-Instruct", K25: "moonshotai__Kimi-K2.5",
            V2_LITE: "deepseek-ai__DeepSeek-V2-Lite-Chat"}  # V2-Lite's listing is the Chat model's, same layout
FILES = {"README.md", *(f"{n}.config.json" for n in (K2, K25, V2_LITE, TORCHSPEC, SPECFORGE)),
         *(f"{n}.weights.md" for n in LISTINGS.values())}
SHRUNK_LAYERS = 3  # layer 0 dense (first_k_dense_replace = 1 in all three), layers 1 and 2 MoE


def real(name: str) -> Path:
    if not REAL.is_dir():
        pytest.fail(f"{REAL}: missing; these tests read the published configs and tensor listings from "
                    f"tests/data/real in the repository")
    path = REAL / name
    if not path.is_file():
        pytest.fail(f"{path}: missing from tests/data/real; expected the published artefact of that name")
    return path


def config(name: str) -> tuple[dict, str]:
    path = real(f"{name}.config.json")
    return json.loads(path.read_text()), str(path)


def verifier_config(name: str, layers: int | None = None) -> VerifierConfig:
    d, src = config(name)
    if layers is not None:
        (d["text_config"] if "text_config" in d else d)["num_hidden_layers"] = layers
    return VerifierConfig.from_hf(d, src)


def test_every_artefact_is_covered():
    """Every file in tests/data/real is one these tests read, and the README's table names each of them."""
    real("README.md")
    assert {p.name for p in REAL.iterdir()} == FILES
    table = real("README.md").read_text()
    for name in FILES - {"README.md", f"{LISTINGS[V2_LITE]}.weights.md"}:
        assert name.split(".config.json")[0].split(".weights.md")[0] in table, name


# --------------------------------------------------------------------------- verifier configs

def test_kimi_k2_config():
    c = verifier_config(K2)
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == ("kimi_k2", 61, 7168, 64)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim) == (1536, 512, 128, 64)
    assert c.v_head_dim == 128
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.first_k_dense_replace) == (384, 8, 1, 1)
    assert (c.topk_method, c.scoring_func, c.routed_scaling_factor) == ("noaux_tc", "sigmoid", 2.827)
    assert c.norm_topk_prob
    assert c.has_correction_bias and c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 131072
    assert c.rope_theta == 50000.0 and (c.rope_scaling["factor"], c.rope_scaling["beta_fast"]) == (32.0, 1.0)
    assert c.quantization == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                              "weight_block_size": [128, 128]}


def test_kimi_k25_config():
    """The multimodal wrapper: the text model under text_config (transformers' rendering writes its
    model_type as deepseek_v3), rope in transformers 5's rope_parameters, compressed-tensors int4."""
    c = verifier_config(K25)
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("deepseek_v3", 61, 7168, 163840)
    assert (c.rms_norm_eps, c.max_position_embeddings, c.bos_token_id, c.eos_token_id) == (1e-5, 262144, 163584, 163585)
    assert c.rope_theta == 50000.0 and c.rope_scaling == {
        "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert (c.topk_method, c.n_routed_experts, c.has_correction_bias) == ("noaux_tc", 384, True)
    q = c.quantization
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "pack-quantized")
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["strategy"], w["symmetric"]) == (4, 32, "group", True)
    assert "vision_config" not in c.extra and "text_config" not in c.extra


def test_deepseek_v2_lite_config():
    c = verifier_config(V2_LITE)
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == ("deepseek_v2", 27, 2048, 16)
    assert c.q_lora_rank is None and (c.kv_lora_rank, c.qk_rope_head_dim) == (512, 64)
    assert (c.topk_method, c.scoring_func, c.routed_scaling_factor) == ("greedy", "softmax", 1.0)
    assert not c.norm_topk_prob
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (64, 6, 2)
    assert not c.has_correction_bias and c.quantization is None
    assert c.rope_scaling["mscale"] == c.rope_scaling["mscale_all_dim"] == 0.707


# --------------------------------------------------------------------------- tensor listings

_ROW = re.compile(r"^\| `([^`]+)`[^|]*\| `\[([\d, ]*)\]` \| `torch\.(\w+)`")


def listing(name: str) -> tuple[dict[str, tuple[tuple[int, ...], str]], list[str]]:
    """{tensor name: (shape, dtype)} with every `a-b` range expanded, and the wildcard rows' names."""
    rows, wild = {}, []
    for line in real(f"{LISTINGS[name]}.weights.md").read_text().splitlines():
        wild += [w for w in re.findall(r"`([^`]*\*)`", line)] if line.startswith("| `") and "*`" in line else []
        m = _ROW.match(line)
        if not m:
            continue
        names = [""]
        for part in m.group(1).split("."):
            r = re.fullmatch(r"(\d+)-(\d+)", part)
            choices = [str(i) for i in range(int(r[1]), int(r[2]) + 1)] if r else [part]
            names = [f"{n}.{c}" if n else c for n in names for c in choices]
        shape = tuple(int(d) for d in m.group(2).split(",")) if m.group(2).strip() else ()
        rows.update({n: (shape, m.group(3)) for n in names})
    return rows, wild


def _index(names, key: str) -> set[int]:
    return {int(m[1]) for n in names if (m := re.search(rf"\.{key}\.(\d+)\.", n))}


@pytest.mark.parametrize("name", [K2, K25, V2_LITE])
def test_listing_spans_the_configs_layers_and_experts(name):
    rows, _ = listing(name)
    c = verifier_config(name)
    layers = _index(rows, "layers")
    assert layers == set(range(c.num_hidden_layers))
    moe = _index([n for n in rows if ".mlp.experts." in n], "layers")
    assert moe == {i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)}
    assert _index(rows, "experts") == set(range(c.n_routed_experts))


@pytest.mark.parametrize("name, renamed", [
    # fp8 block scales folded into their weight: layer 0's 5 attention + 3 MLP matrices, and per MoE layer
    # 5 attention + 3 shared-expert + 384 x 3 expert matrices; one rotary_emb.inv_freq per layer, dropped
    (K2, {"weight_scale_inv": 8 + 2 * (5 + 3 + 384 * 3), "rotary_emb.inv_freq": 3}),
    # each routed expert matrix of layers 1-2 an int4 triplet (weight_packed, weight_scale, weight_shape)
    (K25, {"weight_packed": 2 * 384 * 3, "weight_scale": 2 * 384 * 3, "weight_shape": 2 * 384 * 3}),
    (V2_LITE, {}),
])
def test_model_expects_exactly_the_listed_tensors(name, renamed):
    """Layers 0-2 of the listing (layer 0 dense, 1-2 MoE, every expert) against a 3-layer model on meta:
    the same names and shapes after the loader's renames, nothing missing, nothing left over."""
    rows, wild = listing(name)
    cfg = verifier_config(name, layers=SHRUNK_LAYERS)
    stored = {n: shape for n, (shape, _) in rows.items()
              if not (m := re.search(r"\.layers\.(\d+)\.", n)) or int(m[1]) < SHRUNK_LAYERS}
    logical = logical_layout(stored, cfg.quantization, str(real(f"{LISTINGS[name]}.weights.md")))
    prefix = text_prefix(logical)
    rename = verifier_name(SHRUNK_LAYERS, prefix)
    mapped = {rename(n): shape for n, shape in logical.items() if rename(n) is not None}
    with torch.device("meta"):
        model = Verifier(cfg)
    want = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    extra, missing = sorted(mapped.keys() - want.keys()), sorted(want.keys() - mapped.keys())
    assert not extra and not missing, (extra[:5], missing[:5])
    assert {n: s for n, s in mapped.items() if s != want[n]} == {}
    suffixes = {k: sum(n.endswith(k) for n in stored) for k in renamed}
    assert suffixes == renamed  # what the renames had to do, counted
    assert all(rows[n.removesuffix("_scale_inv")][1] == "float8_e4m3fn" for n in stored if n.endswith("_scale_inv"))
    assert all(rows[n][1] == "int32" for n in stored if n.endswith(("weight_packed", "weight_shape")))
    if name == K25:  # the text model under language_model., the vision rows skipped by the loader
        assert prefix == "language_model." and all(n.startswith("language_model.") for n in stored)
        assert wild == ["mm_projector.*", "vision_tower.*"]
        assert all(w.startswith(MULTIMODAL_PREFIXES) and rename(w.rstrip("*") + "x.weight") is None for w in wild)
    else:
        assert prefix == "" and wild == []
    if name == V2_LITE:  # softmax greedy routing: no correction bias in the checkpoint, none expected
        assert not any("e_score_correction_bias" in n for n in rows) and "model.layers.1.mlp.gate.weight" in mapped


# --------------------------------------------------------------------------- KV cache, by hand

@pytest.mark.parametrize("name, per_token", [
    (K2, 61 * (512 + 64) * 2),  # 61 layers x one latent row [c_kv 512 | k_pe 64] x 2 bytes (bf16) = 70272
    (K25, 61 * (512 + 64) * 2),  # the same text model: 70272
    (V2_LITE, 27 * (512 + 64) * 2),  # 27 layers x 576 x 2 = 31104
])
def test_verifier_kv_cache_bytes_per_token(name, per_token):
    assert bytes_per_token(verifier_config(name)) == per_token


@pytest.mark.parametrize("name, verifier, per_token", [
    (TORCHSPEC, K25, 1 * (512 + 64) * 2),  # one MLA layer: 1152
    (SPECFORGE, K2, 1 * 2 * 64 * 128 * 2),  # one Llama layer: K and V x 64 KV heads x head_dim 128 x 2 bytes = 32768
])
def test_draft_kv_cache_bytes_per_token(name, verifier, per_token):
    d, src = config(name)
    assert bytes_per_token(DraftConfig.from_hf(d, src, verifier_config(verifier).num_hidden_layers)) == per_token


# --------------------------------------------------------------------------- the public drafts

def draft_config(name: str, verifier: str) -> tuple[DraftConfig, VerifierConfig]:
    d, src = config(name)
    v = verifier_config(verifier)
    return DraftConfig.from_hf(d, src, v.num_hidden_layers), v


def test_torchspec_mla_draft_against_kimi_k25():
    """Nested [1, 29, 57], no top-level ids: vLLM captures (2, 30, 58), the same states ("output of layer i")."""
    dc, vc = draft_config(TORCHSPEC, K25)
    check_pairing(dc, vc, "torchspec draft", "kimi-k2.5")
    assert (dc.attention, dc.architecture, dc.model_type) == ("mla", "Eagle3DeepseekV2ForCausalLM", "kimi_k2")
    assert (dc.aux_layer_ids, dc.aux_ids_source, dc.nested_aux_layer_ids) == ((2, 30, 58), "default", (1, 29, 57))
    assert (dc.q_lora_rank, dc.kv_lora_rank, dc.cache_row, dc.draft_vocab_size) == (1536, 512, 576, 163840)
    assert "max_position_embeddings" in dc.unstated and dc.rope_scaling["beta_fast"] == 1.0
    assert fc.aux_id_readings(dc, vc) == {"vllm": (2, 30, 58), "eagle_config": (1, 29, 57),
                                          "eagle_config+1": (2, 30, 58)}


def test_torchspec_draft_builds_the_spec_tensors():
    """The names and [out, in] shapes of eagle3_mla.md §2 for H = 7168, N = 64 (on meta)."""
    dc, _ = draft_config(TORCHSPEC, K25)
    with torch.device("meta"):
        draft = Eagle3Draft(dc, own_lm_head=True)
    a, m, H = "layers.0.self_attn.", "layers.0.mlp.", 7168
    assert {n: tuple(t.shape) for n, t in draft.state_dict().items()} == {
        "fc.weight": (H, 3 * H), "layers.0.input_layernorm.weight": (H,), "layers.0.hidden_norm.weight": (H,),
        a + "q_a_proj.weight": (1536, 2 * H), a + "q_a_layernorm.weight": (1536,), a + "q_b_proj.weight": (12288, 1536),
        a + "kv_a_proj_with_mqa.weight": (576, 2 * H), a + "kv_a_layernorm.weight": (512,),
        a + "kv_b_proj.weight": (16384, 512), a + "o_proj.weight": (H, 8192),
        "layers.0.post_attention_layernorm.weight": (H,), m + "gate_proj.weight": (18432, H),
        m + "up_proj.weight": (18432, H), m + "down_proj.weight": (H, 18432), "norm.weight": (H,),
        "lm_head.weight": (163840, H)}


def test_specforge_mha_draft_against_kimi_k2():
    dc, vc = draft_config(SPECFORGE, K2)
    check_pairing(dc, vc, "specforge draft", "kimi-k2")
    assert (dc.attention, dc.architecture, dc.model_type) == ("mha", "LlamaForCausalLMEagle3", "kimi_k2")
    assert (dc.aux_layer_ids, dc.aux_ids_source, dc.nested_aux_layer_ids) == ((2, 30, 58), "default", None)
    assert (dc.num_key_value_heads, dc.head_dim, dc.draft_vocab_size, dc.rope_theta) == (64, 128, 32000, 1e6)
    assert dc.rope_scaling is None and dc.max_position_embeddings == 131072 and dc.unstated == ()


def test_torchspec_draft_exports_as_vllm_reads_it():
    from workbench.integrations.vllm import export_config

    dc, vc = draft_config(TORCHSPEC, K25)
    out = export_config(dc, vc)
    assert vllm_reads(out, vc.num_hidden_layers) == {
        "model_type": "kimi_k2", "architectures": ["Eagle3DeepseekV2ForCausalLM"], "aux_layer_ids": (2, 30, 58)}
    assert out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]  # as TorchSpec wrote it
    assert (out["max_position_embeddings"], out["rope_theta"]) == (262144, 50000.0)
    assert out["rope_scaling"]["beta_fast"] == 32.0  # the verifier's, not the config's 1.0
    back = DraftConfig.from_hf(out, "export", vc.num_hidden_layers)
    assert (back.aux_layer_ids, back.aux_ids_source, back.nested_aux_layer_ids) == ((2, 30, 58), "top-level",
                                                                                    (1, 29, 57))
    assert back.rope_scaling == vc.rope_scaling and back.unstated == ()


def test_specforge_mha_draft_does_not_export_to_the_mla_class():
    from workbench.integrations.vllm import export_config

    dc, vc = draft_config(SPECFORGE, K2)
    with pytest.raises(ValueError, match=r"LlamaForCausalLMEagle3 \(MHA attention\).*expected an MLA draft"):
        export_config(dc, vc)


def test_field_checks_on_the_public_drafts():
    dc, vc = draft_config(TORCHSPEC, K25)
    checks = {c.name: c for c in (fc.rope_check(dc, vc), fc.positions_check(dc, vc), fc.model_type_check(dc),
                                  fc.aux_ids_check(dc, vc), fc.prompt_length_check(dc, 8192))}
    assert checks["rope vs verifier"].status == "warn" and "beta_fast 1.0 vs 32.0" in checks["rope vs verifier"].detail
    positions = checks["draft max_position_embeddings"]
    assert positions.status == "warn" and "states none" in positions.detail
    assert checks["prompt length"].status == "warn" and "4096 positions" in checks["prompt length"].detail
    assert checks["draft model_type"].status == "ok"
    assert checks["nested aux ids"].status == "info" and "[1, 29, 57]" in checks["nested aux ids"].detail
    dc, vc = draft_config(SPECFORGE, K2)
    rope = fc.rope_check(dc, vc)
    assert rope.status == "warn" and "rope_theta 1e+06 vs the verifier's 50000" in rope.detail
    assert fc.positions_check(dc, vc).status == "ok" and fc.model_type_check(dc).status == "info"
    assert fc.aux_ids_check(dc, vc).status == "ok"
