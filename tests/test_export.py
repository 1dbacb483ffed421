"""The vLLM export check: `export_draft` writes what vLLM's Eagle3DeepseekV2ForCausalLM loads.

`check_vllm_draft_dir` states the expected checkpoint from eagle3_mla.md §1-2 (names, the
exact [out, in] shapes of the §2 table, config fields), independently of the exporter, and
`vllm_reads` restates what vLLM's config code makes of a draft config (tests/data/real/README.md).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from tests.helpers import EMBEDDED, make_random_pair
from workbench.engine_readings import fused_states
from workbench.integrations.vllm import export_draft

VOCAB = 512


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def vllm_reads(c: dict, num_target_layers: int) -> dict:
    """What vLLM's config code makes of a draft config.json, restated from its source:

    - `SpeculativeConfig.hf_config_override` turns model_type deepseek_v3 (and deepseek_v32,
      glm_moe_dsa) into deepseek_mtp with architecture DeepSeekMTPModel: an MTP head, not EAGLE-3;
    - `get_eagle3_aux_layers_from_config` takes a top-level, non-empty list
      `eagle_aux_hidden_state_layer_ids`; otherwise the verifier's default (2, L // 2, L - 3)
      applies, whatever eagle_config holds.
    """
    model_type, archs = c.get("model_type"), list(c.get("architectures") or [])
    if model_type in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        model_type, archs = "deepseek_mtp", ["DeepSeekMTPModel"]
    ids = c.get("eagle_aux_hidden_state_layer_ids")
    L = num_target_layers
    aux = tuple(ids) if ids and isinstance(ids, (list, tuple)) else (2, L // 2, L - 3)
    return {"model_type": model_type, "architectures": archs, "aux_layer_ids": aux}


def test_vllm_reads_restates_the_rules():
    torchspec = {"model_type": "kimi_k2", "architectures": ["Eagle3DeepseekV2ForCausalLM"],
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    assert vllm_reads(torchspec, 61) == {"model_type": "kimi_k2", "architectures": ["Eagle3DeepseekV2ForCausalLM"],
                                         "aux_layer_ids": (2, 30, 58)}
    old_export = dict(torchspec, model_type="deepseek_v3", eagle_aux_hidden_state_layer_ids=[1, 29, 57])
    assert vllm_reads(old_export, 61) == {"model_type": "deepseek_mtp", "architectures": ["DeepSeekMTPModel"],
                                          "aux_layer_ids": (1, 29, 57)}
    assert vllm_reads(dict(torchspec, eagle_aux_hidden_state_layer_ids=[]), 8)["aux_layer_ids"] == (2, 4, 5)


def check_vllm_draft_dir(directory: Path, verifier_cfg, rope=None) -> dict:
    """Everything vLLM's MLA draft loader expects of `directory` (eagle3_mla.md §1-2); returns config.
    `rope`: the rope_theta / rope_scaling / max_position_embeddings expected (default: the verifier's)."""
    directory = Path(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]  # safetensors only
    c = json.loads((directory / "config.json").read_text())
    assert c["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    # kimi_k2, as the published Kimi MLA drafts: deepseek_v3 would be read as an MTP head (see vllm_reads)
    assert c["model_type"] == "kimi_k2"
    read = vllm_reads(c, verifier_cfg.num_hidden_layers)
    assert read["model_type"] == "kimi_k2" and read["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    # eagle_config says the same states as "output of layer i" (SGLang, trainers): one less
    assert [i - 1 for i in read["aux_layer_ids"]] == c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert fused_states(c, verifier_cfg.num_hidden_layers)["sglang"] == read["aux_layer_ids"]
    rope = rope or {f: getattr(verifier_cfg, f) for f in ("rope_theta", "rope_scaling", "max_position_embeddings")}
    assert c["rope_theta"] == rope["rope_theta"] and c["max_position_embeddings"] == rope["max_position_embeddings"]
    assert {k: v for k, v in c["rope_scaling"].items() if k not in ("rope_type", "rope_theta")} == rope["rope_scaling"]
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False and c["hidden_act"] == "silu"
    H = c["hidden_size"]
    assert H == verifier_cfg.hidden_size and c["target_hidden_size"] == verifier_cfg.hidden_size
    assert c["vocab_size"] == verifier_cfg.vocab_size
    Vd = c["draft_vocab_size"]
    assert 0 < Vd <= c["vocab_size"]
    eagle = c["eagle_config"]
    aux = eagle["eagle_aux_hidden_state_layer_ids"]
    assert eagle["use_aux_hidden_state"] is True and len(aux) == 3
    assert all(isinstance(i, int) and 0 <= i + 1 < verifier_cfg.num_hidden_layers for i in aux)
    for key in ("rms_norm_eps", "rope_theta", "max_position_embeddings", "intermediate_size", "bos_token_id",
                "eos_token_id"):
        assert key in c, key
    rs = c["rope_scaling"]
    assert rs.get("type", rs.get("rope_type")) == "yarn"
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        assert key in rs, key
    N, Lq, L = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    P, R, V, I = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["intermediate_size"]
    a, m = "layers.0.self_attn.", "layers.0.mlp."
    want = {
        "fc.weight": [H, 3 * H],
        "layers.0.input_layernorm.weight": [H],
        "layers.0.hidden_norm.weight": [H],
        a + "kv_a_proj_with_mqa.weight": [L + R, 2 * H],
        a + "kv_a_layernorm.weight": [L],
        a + "kv_b_proj.weight": [N * (P + V), L],
        a + "o_proj.weight": [H, N * V],
        "layers.0.post_attention_layernorm.weight": [H],
        m + "gate_proj.weight": [I, H],
        m + "up_proj.weight": [I, H],
        m + "down_proj.weight": [H, I],
        "norm.weight": [H],
        "lm_head.weight": [Vd, H],
    }
    if Lq is None:
        want[a + "q_proj.weight"] = [N * (P + R), 2 * H]
    else:
        want.update({a + "q_a_proj.weight": [Lq, 2 * H], a + "q_a_layernorm.weight": [Lq],
                     a + "q_b_proj.weight": [N * (P + R), Lq]})
    if Vd < c["vocab_size"]:
        want["d2t"] = [Vd]
    if c.get("fc_norm"):  # EAGLE-3.1: under the names SGLang loads
        want.update({f"fc_norm.{i}.weight": [H] for i in range(3)})
    header = safetensors_header(directory / "model.safetensors")
    assert set(header) == set(want), f"extra {set(header) - set(want)}, missing {set(want) - set(header)}"
    for name, shape in want.items():
        assert header[name]["shape"] == shape, name
    assert not any(n.startswith(("model.", "midlayer.")) or "embed_tokens" in n for n in header)
    float_dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[c["torch_dtype"]]
    for name, info in header.items():
        assert info["dtype"] == ("I64" if name == "d2t" else float_dtype), name
    try:  # vLLM's config registry reads kimi_k2 as transformers' DeepseekV3Config (strict dataclasses in v5)
        import transformers
    except ImportError:
        return c
    hf = transformers.DeepseekV3Config.from_pretrained(directory)
    assert (hf.num_hidden_layers, hf.hidden_size, hf.kv_lora_rank) == (1, H, L)
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == aux and hf.draft_vocab_size == Vd
    assert list(hf.eagle_aux_hidden_state_layer_ids) == [i + 1 for i in aux]  # getattr(hf_config, ...): vLLM
    return c


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    vdir, ddir = make_random_pair(tmp_path_factory.mktemp("pair"), seed=5, vocab=VOCAB, aux_layer_ids=(1, 2, 3))
    return wb.load_pair(vdir, ddir, dtype="float32")


def reload_and_compare(pair, export_dir: Path, exact: bool) -> None:
    """The export, loaded back as a draft of the same verifier, gives the same draft logits as the
    plain draft it came from."""
    pair = pair.reference()
    back = wb.load_draft(export_dir, pair.verifier, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, pair.verifier.config.vocab_size, (1, 7), generator=g)
    with torch.no_grad():
        aux = pair.verifier(ids).aux_hidden_states
        got = back.compute_logits(back(ids, back.combine_hidden_states(aux))[0])
        want = pair.draft.compute_logits(pair.draft(ids, pair.draft.combine_hidden_states(aux))[0])
    if exact:
        assert torch.equal(got, want)
    else:
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got))
        assert (got[finite] - want[finite]).abs().max() < 0.05 * want[finite].abs().max()


def test_export_random_pair_fp32_reloads_identically(random_pair, tmp_path):
    out = export_draft(random_pair, tmp_path / "vllm", dtype="float32")
    c = check_vllm_draft_dir(out, random_pair.verifier.config)
    assert c["draft_vocab_size"] == VOCAB and c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    stored = load_file(out / "model.safetensors")
    assert torch.equal(stored["lm_head.weight"], random_pair.verifier.lm_head.weight)  # copied from the verifier
    for name, t in random_pair.draft.state_dict().items():
        assert torch.equal(stored[name], t), name
    reload_and_compare(random_pair, out, exact=True)


def test_export_bf16(random_pair, tmp_path):
    out = export_draft(random_pair, tmp_path / "vllm")
    c = check_vllm_draft_dir(out, random_pair.verifier.config)
    assert c["torch_dtype"] == "bfloat16"
    assert c["rope_scaling"]["rope_theta"] == c["rope_theta"] == random_pair.verifier.config.rope_theta
    stored = load_file(out / "model.safetensors")
    assert torch.equal(stored["fc.weight"], random_pair.draft.fc.weight.to(torch.bfloat16))
    reload_and_compare(random_pair, out, exact=False)


def test_export_reduced_vocab_with_d2t(random_pair, tmp_path):
    """A SpecForge-style draft: own 100-row lm_head plus d2t offsets."""
    src = tmp_path / "draft"
    wb.save_model(random_pair.draft, src)
    targets = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:100].sort().values
    tensors = load_file(src / "model.safetensors")
    tensors.update({"lm_head.weight": torch.randn(100, 64) * 0.1, "d2t": targets - torch.arange(100),
                    "t2d": torch.zeros(VOCAB, dtype=torch.bool)})
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, draft_vocab_size=100)))
    pair = random_pair.with_draft(src)
    assert pair.draft.config.draft_vocab_size == 100
    out = export_draft(pair, tmp_path / "vllm", dtype="float32")
    check_vllm_draft_dir(out, pair.verifier.config)
    stored = load_file(out / "model.safetensors")
    assert stored["d2t"].dtype == torch.int64 and torch.equal(stored["d2t"] + torch.arange(100), targets)
    assert torch.equal(stored["lm_head.weight"], tensors["lm_head.weight"])
    reload_and_compare(pair, out, exact=True)


def test_export_refuses_mha_draft(tmp_path):
    vdir, ddir = make_random_pair(tmp_path, seed=6, attention="mha", vocab=VOCAB, layers=3)
    pair = wb.load_pair(vdir, ddir)
    with pytest.raises(ValueError, match=r"draft: the draft is LlamaForCausalLMEagle3 \(MHA attention\); vLLM's "
                                         r"Eagle3DeepseekV2ForCausalLM .* cannot load it; expected an MLA draft"):
        export_draft(pair, tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()


def test_export_refuses_a_draft_embedding_it_would_drop(random_pair, tmp_path):
    src = tmp_path / "draft"
    wb.save_model(random_pair.draft, src)
    tensors = load_file(src / "model.safetensors")
    same = dict(tensors, **{"embed_tokens.weight": random_pair.verifier.model.embed_tokens.weight.clone()})
    save_file(same, src / "model.safetensors", metadata={"format": "pt"})
    out = export_draft(random_pair.with_draft(src), tmp_path / "same", dtype="float32")
    check_vllm_draft_dir(out, random_pair.verifier.config)  # identical to the verifier's: dropped
    save_file(dict(tensors, **{"embed_tokens.weight": torch.randn(VOCAB, 64)}), src / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'embed_tokens.weight' differs from the verifier's embedding"):
        export_draft(random_pair.with_draft(src), tmp_path / "other")


@pytest.mark.skipif(not (EMBEDDED / "draft" / "model.safetensors").exists(), reason="no embedded draft")
def test_export_embedded_draft(embedded_pair, tmp_path):
    out = export_draft(embedded_pair, tmp_path / "vllm", dtype="float32")
    c = check_vllm_draft_dir(out, embedded_pair.verifier.config)
    assert c["hidden_size"] == 256 and c["q_lora_rank"] == 96
    reload_and_compare(embedded_pair, out, exact=True)


def test_export_rope_is_the_verifiers_unless_asked(random_pair, tmp_path, caplog):
    """A draft whose config says other rope fields (a trainer's default, a shorter context) exports the
    verifier's: an engine gives the draft the verifier's positions. `rope_from="draft"` keeps its own."""
    src = tmp_path / "draft"
    wb.save_model(random_pair.draft, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, rope_theta=20000.0, max_position_embeddings=256)))
    pair = random_pair.with_draft(src)
    own = {f: getattr(pair.draft.config, f) for f in ("rope_theta", "rope_scaling", "max_position_embeddings")}
    assert (own["rope_theta"], own["max_position_embeddings"]) == (20000.0, 256)
    with caplog.at_level("WARNING", logger="workbench.integrations.vllm"):
        out = export_draft(pair, tmp_path / "verifier-rope", dtype="float32")
    c = check_vllm_draft_dir(out, pair.verifier.config)
    assert c["rope_theta"] == pair.verifier.config.rope_theta != 20000.0
    assert "rope_theta 20000.0 -> " in caplog.text and "max_position_embeddings 256 -> 512" in caplog.text
    out = export_draft(pair, tmp_path / "draft-rope", dtype="float32", rope_from="draft")
    assert check_vllm_draft_dir(out, pair.verifier.config, rope=own)["rope_theta"] == 20000.0
    reload_and_compare(pair, out, exact=True)
    with pytest.raises(ValueError, match=r"rope_from = 'target'; expected 'verifier' or 'draft'"):
        export_draft(pair, tmp_path / "bad", rope_from="target")


def test_export_loads_back_with_top_level_ids(random_pair, tmp_path):
    """What we export loads back (kimi_k2, ids from the top level) and captures the same layers."""
    out = export_draft(random_pair, tmp_path / "vllm", dtype="float32")
    back = wb.load_draft(out, random_pair.verifier, dtype=torch.float32)
    assert back.config.model_type == "kimi_k2" and back.config.aux_ids_source == "top-level"
    assert back.config.aux_layer_ids == random_pair.draft.config.aux_layer_ids == (1, 2, 3)
    assert random_pair.verifier.aux_layer_ids == (1, 2, 3)
