"""llama.cpp as a peer: the GGUF export read back tensor by tensor against the checkpoint (bf16 exact,
Q8_0 within its block scale), the metadata llama.cpp's deepseek2 reads, bad input named, the CLI; and,
where llama-cpp-python is installed, llama.cpp's greedy tokens equal ours."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tests.helpers import EMBEDDED
from workbench.checkpoint import SafetensorsReader
from workbench.cli import main
from workbench.config import load_verifier_config
from workbench.integrations.llama_cpp import GGUFExportError, dequantize, export_gguf, read_gguf

VERIFIER = EMBEDDED / "verifier"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    return {d: read_gguf(export_gguf(VERIFIER, out / f"v-{d}.gguf", d)) for d in ("bf16", "q8_0")}


def _source() -> dict[str, torch.Tensor]:
    r = SafetensorsReader(VERIFIER)
    return {n: r.get(n, torch.float32) for n in r.keys()}


def test_metadata_is_what_deepseek2_reads(exported):
    meta, _ = exported["bf16"]
    cfg = load_verifier_config(VERIFIER)
    a = "deepseek2."
    assert meta["general.architecture"] == "deepseek2"
    assert (meta[a + "block_count"], meta[a + "embedding_length"], meta[a + "attention.head_count"]) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads)
    assert meta[a + "attention.head_count_kv"] == 1  # MLA as MQA over the latent
    assert meta[a + "attention.key_length"] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert meta[a + "attention.key_length_mla"] == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert meta[a + "attention.value_length_mla"] == cfg.v_head_dim
    assert (meta[a + "expert_count"], meta[a + "expert_used_count"], meta[a + "expert_shared_count"]) == (
        cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts)
    assert (meta[a + "expert_group_count"], meta[a + "expert_group_used_count"]) == (cfg.n_group, cfg.topk_group)
    assert meta[a + "expert_gating_func"] == 2  # sigmoid, written out: absent means softmax to llama.cpp
    assert meta[a + "leading_dense_block_count"] == cfg.first_k_dense_replace
    assert meta[a + "expert_weights_scale"] == pytest.approx(cfg.routed_scaling_factor)
    assert meta[a + "rope.scaling.type"] == "yarn" and meta[a + "rope.scaling.factor"] == cfg.rope_scaling["factor"]
    assert meta[a + "rope.scaling.original_context_length"] == cfg.rope_scaling["original_max_position_embeddings"]
    assert meta["tokenizer.ggml.tokens.count"] == cfg.vocab_size and meta["tokenizer.ggml.add_bos_token"] is False


def test_bf16_tensors_equal_the_checkpoint(exported):
    """Every weight is there exactly once, in bf16 (norms and biases f32); kv_b splits into k_b
    (transposed) and v_b that put it back together; the experts stack in order."""
    _, tensors = exported["bf16"]
    src = _source()
    cfg = load_verifier_config(VERIFIER)
    H, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    got = {n: torch.from_numpy(dequantize(d, kind, shape)) for n, (shape, kind, d) in tensors.items()}
    assert all(kind == ("F32" if len(shape) == 1 else "BF16") for shape, kind, _ in tensors.values())
    assert torch.equal(got["token_embd.weight"], src["model.embed_tokens.weight"])
    assert torch.equal(got["output.weight"], src["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        assert torch.equal(got[b + "attn_q_b.weight"], src[p + "self_attn.q_b_proj.weight"])
        kv_b = torch.cat([got[b + "attn_k_b.weight"].transpose(1, 2), got[b + "attn_v_b.weight"]], 1)
        assert torch.equal(kv_b.reshape(H * (nope + v), -1), src[p + "self_attn.kv_b_proj.weight"])
        if cfg.is_moe_layer(i):
            for e in (0, cfg.n_routed_experts - 1):
                assert torch.equal(got[b + "ffn_down_exps.weight"][e], src[f"{p}mlp.experts.{e}.down_proj.weight"])
            assert torch.equal(got[b + "exp_probs_b.bias"], src[p + "mlp.gate.e_score_correction_bias"])
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    # 3 + 10 a layer (attention, norms) + 3 a dense MLP + 8 a MoE layer: nothing left out or doubled
    assert len(tensors) == 3 + 10 * cfg.num_hidden_layers + 3 * (cfg.num_hidden_layers - n_moe) + 8 * n_moe


def test_q8_0_is_within_half_a_block_step(exported):
    _, tensors = exported["q8_0"]
    src = _source()
    shape, kind, data = tensors["blk.1.attn_q_b.weight"]
    w = src["model.layers.1.self_attn.q_b_proj.weight"].numpy()
    assert kind == "Q8_0" and shape == w.shape
    blocks = w.reshape(-1, 32)
    step = np.abs(blocks).max(1, keepdims=True) / 127  # one scale per 32 weights
    err = np.abs(dequantize(data, kind, shape).reshape(-1, 32) - blocks)
    # half a step, plus the scale's own f16 rounding (2^-11 of it) times up to 127
    assert (err <= step * (0.5 + 127 * 2**-11) + 1e-8).all() and err.max() > 0
    assert tensors["blk.1.attn_norm.weight"][1] == "F32"


def test_bad_input_is_named(tmp_path):
    bad = tmp_path / "softmax"
    shutil.copytree(VERIFIER, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "scoring_func": "softmax"}))
    with pytest.raises(GGUFExportError, match=r"config.json: field 'scoring_func' = 'softmax'"):
        export_gguf(bad, tmp_path / "x.gguf")
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "tokenizer.json").unlink()
    with pytest.raises(GGUFExportError, match=r"tokenizer.json: not found"):
        export_gguf(bad, tmp_path / "x.gguf")
    with pytest.raises(GGUFExportError, match=r"dtype = 'q4'"):
        export_gguf(VERIFIER, tmp_path / "x.gguf", "q4")


def test_cli_export_gguf(tmp_path, capsys):
    assert main(["export-gguf", str(tmp_path / "v.gguf"), "--dtype", "q8_0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["architecture"] == "deepseek2" and out["tensors"] == len(read_gguf(tmp_path / "v.gguf")[1])
    assert main(["export-gguf", str(tmp_path / "w.gguf"), "--verifier", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_llama_cpp_decodes_our_greedy_tokens_and_the_bench_says_so(tmp_path):
    """llama.cpp, fed our token ids, decodes the f32 GGUF to our fp32 greedy tokens; the bench's
    llama.cpp comparison reports that agreement and each arm's speed. Needs the llama extra."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the optional llama extra (it builds llama.cpp)")
    import workbench as wb
    from workbench.integrations.llama_cpp import LlamaCppPeer
    from workbench.integrations.llama_cpp_bench import llama_cpp_bench, llama_cpp_text

    pair = wb.load_pair(dtype="float32")
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n"]
    peer = LlamaCppPeer(export_gguf(VERIFIER, tmp_path / "v.gguf", "f32"), threads=1, n_ctx=256)
    for p in prompts:
        ids = pair.encode(p)
        assert peer.greedy(ids, 24, set(pair.eos_token_ids)).tokens == wb.generate_autoregressive(pair, ids, 24).tokens
    r = llama_cpp_bench(pair, prompts[:2], max_new_tokens=16, k=3, rounds=1, workdir=tmp_path)
    assert r["gguf"]["f32"]["same_tokens"] == 2 and set(r["gguf"]) == {"f32", "q8_0"}
    assert set(r["tokens_per_s"]) == {"ours plain", "ours speculative k=3", "llama.cpp f32 plain", "llama.cpp q8_0 plain"}
    assert all(s["n"] == 2 and s["min"] <= s["median"] <= s["max"] for s in r["tokens_per_s"].values())
    assert r["over_llama_cpp_same_precision"]["llama.cpp f32 plain"] == 1.0
    assert "equal ours on 2 of 2 prompts" in llama_cpp_text(r)
