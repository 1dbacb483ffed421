"""Loading and saving whole models: round trips, the draft checkpoint forms seen in the wild,
embedding/lm_head sharing, FP8 block-quantised verifiers, and one test per kind of bad input
(each asserts the message names the file/field/tensor and what was expected)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from tests.helpers import make_random_pair
from workbench.config import VerifierConfig, write_config_json
from workbench.models import Verifier

VOCAB = 512


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    """A random 4-layer verifier (hidden 64, vocab 512) and its MLA draft, aux ids (1, 2, 3)."""
    return make_random_pair(tmp_path_factory.mktemp("pair"), seed=3, vocab=VOCAB, aux_layer_ids=(1, 2, 3))


@pytest.fixture(scope="module")
def verifier(dirs) -> Verifier:
    return wb.load_verifier(dirs[0])


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def edit_tensors(directory: Path, fn) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    save_file(fn(tensors), path, metadata={"format": "pt"})


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def expect_error(fn, cls: type, *fragments: str) -> str:
    """fn() must raise `cls` (never a bare KeyError) whose message holds every fragment."""
    with pytest.raises(Exception) as info:
        fn()
    err = info.value
    assert isinstance(err, cls) and not isinstance(err, KeyError), repr(err)
    for f in fragments:
        assert f in str(err), f"{f!r} not in {str(err)!r}"
    return str(err)


# --------------------------------------------------------------------------- round trips

def test_verifier_round_trip_fp32(dirs, verifier, tmp_path):
    raw = load_file(dirs[0] / "model.safetensors")
    state = verifier.state_dict()
    assert raw.keys() == state.keys()
    assert all(torch.equal(raw[k], state[k]) for k in raw)
    wb.save_model(verifier, tmp_path)
    assert_same_state(verifier, wb.load_verifier(tmp_path))


def test_verifier_round_trip_bf16(verifier, tmp_path):
    wb.save_model(verifier, tmp_path, dtype=torch.bfloat16)
    stored = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    back = wb.load_verifier(tmp_path, dtype="bfloat16")
    assert back.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert back.model.layers[1].mlp.gate.weight.dtype == torch.float32  # routing stays fp32
    for k, t in back.state_dict().items():
        assert torch.equal(t, verifier.state_dict()[k].to(torch.bfloat16).to(t.dtype)), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_round_trip(dirs, verifier, tmp_path, dtype):
    draft = wb.load_draft(dirs[1], verifier, dtype=dtype)
    assert draft.fc.weight.dtype == dtype
    wb.save_model(draft, tmp_path, dtype=dtype)
    assert set(load_file(tmp_path / "model.safetensors")) == set(draft.state_dict())
    assert "embed_tokens.weight" not in draft.state_dict()  # shared parts are not saved
    assert_same_state(draft, wb.load_draft(tmp_path, verifier, dtype=dtype))


def test_midlayer_and_layers0_names_load_identically(dirs, verifier, tmp_path):
    spec = copy_dir(dirs[1], tmp_path / "specforge")
    edit_tensors(spec, lambda t: {k.replace("layers.0.", "midlayer."): v for k, v in t.items()})
    assert any(k.startswith("midlayer.") for k in load_file(spec / "model.safetensors"))
    assert_same_state(wb.load_draft(dirs[1], verifier), wb.load_draft(spec, verifier))


@torch.no_grad()
def test_draft_embedding_own_or_shared(dirs, verifier, tmp_path):
    shared = wb.load_draft(dirs[1], verifier)
    assert shared.part("embed_tokens") is verifier.model.embed_tokens
    assert shared.part("lm_head") is verifier.lm_head
    own_embed = torch.randn(VOCAB, 64)
    own = copy_dir(dirs[1], tmp_path / "own")
    edit_tensors(own, lambda t: {**t, "embed_tokens.weight": own_embed})
    draft = wb.load_draft(own, verifier)
    assert draft.part("embed_tokens") is draft.embed_tokens
    assert torch.equal(draft.embed_tokens.weight, own_embed)
    ids, h = torch.tensor([[5, 9, 11]]), torch.randn(1, 3, 64)
    mine, theirs = draft(ids, h)[0], shared(ids, h)[0]
    assert (mine - theirs).abs().max() > 1e-3  # the draft's own table is what it embeds with
    shared.share(torch.nn.Embedding.from_pretrained(own_embed), verifier.lm_head)
    assert torch.equal(shared(ids, h)[0], mine)


def quantise_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style e4m3 blocks: scale_inv = amax / 448 per 128x128 block, stored q = w / scale_inv."""
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / block), math.ceil(cols / block))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = blk.abs().max() / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantise(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            sl = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            out[sl] = q[sl].float() * scale[i, j]
    return out


def test_fp8_block_quantised_verifier(tmp_path):
    """Widths 256/160/320 make full and partial 128-blocks in both dims."""
    cfg = VerifierConfig(
        model_type="deepseek_v3", vocab_size=300, hidden_size=256, intermediate_size=320, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=2, q_lora_rank=160, kv_lora_rank=144, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=40, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None)
    torch.manual_seed(0)
    model = Verifier(cfg)
    tensors, expect = {}, {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p = torch.randn(p.shape) * 0.05 if "norm" not in name else torch.rand(p.shape) + 0.5
            quantised = p.dim() == 2 and ".layers." in name and not name.endswith("mlp.gate.weight")
            if quantised:  # as DeepSeek-V3 ships: every layer matrix but the router
                tensors[name], tensors[name + "_scale_inv"] = quantise_fp8(p)
                expect[name] = dequantise(tensors[name], tensors[name + "_scale_inv"])
            else:
                tensors[name] = expect[name] = p.to(torch.bfloat16) if p.dim() == 2 else p
    assert tensors["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"].shape == (2, 1)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    write_config_json(cfg, tmp_path)
    edit_config(tmp_path, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    for dtype in (torch.float32, torch.bfloat16):
        v = wb.load_verifier(tmp_path, dtype=dtype)
        state = v.state_dict()
        assert state.keys() == expect.keys()
        for name, want in expect.items():
            assert torch.equal(state[name], want.to(state[name].dtype)), name
        assert state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == dtype
    assert torch.isfinite(v(torch.tensor([[1, 2, 3]])).logits).all()


def test_kimi_k25_layout_verifier(tmp_path, caplog):
    """Kimi-K2.5's layout, small: the text model under text_config and `language_model.`, a vision tower
    and projector beside it (skipped, and said so), routed experts in compressed-tensors int4 groups of
    32 (dequantised exactly as compressed-tensors does), everything else bf16."""
    from tests.test_checkpoint import ct_compress, ct_quantization

    cfg = VerifierConfig(
        model_type="kimi_k2", vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=2, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling=None)
    q = ct_quantization()
    torch.manual_seed(0)
    tensors, expect = {}, {}
    for name, t in Verifier(cfg).state_dict().items():
        t = torch.rand(t.shape) + 0.5 if "norm" in name else torch.randn(t.shape) * 0.05
        if ".mlp.experts." in name:
            packed, expect[name] = ct_compress(t, q)
            tensors.update({f"language_model.{name}_{k.removeprefix('weight_')}": v for k, v in packed.items()})
        else:
            tensors["language_model." + name] = expect[name] = t if name.endswith("correction_bias") else t.bfloat16()
    tensors.update({f"vision_tower.blocks.{i}.wqkv.weight": torch.zeros(4, 4) for i in range(3)})
    tensors["mm_projector.proj.0.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    text = {k: v for k, v in cfg.to_hf().items() if k not in ("bos_token_id", "eos_token_id")}
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "bos_token_id": 1,
        "eos_token_id": 2, "quantization_config": q, "vision_config": {"vt_hidden_size": 4},
        "text_config": dict(text, model_type="deepseek_v3", quantization_config=q)}))
    with caplog.at_level("INFO", logger="workbench.pair"):
        v = wb.load_verifier(tmp_path)
    state = v.state_dict()
    assert state.keys() == expect.keys()
    for name, want in expect.items():  # fp32 holds the exact int4 x scale products; compressed-tensors rounds to bf16
        assert torch.equal(state[name].to(want.dtype), want), name
    assert v.config.quantization["format"] == "pack-quantized"
    assert (v.config.bos_token_id, v.config.eos_token_id) == (1, 2)
    assert v.load_notes[0].endswith("skipped 4 tensors of no text-model part (vision_tower.* x3, mm_projector.* x1)")
    assert "skipped 4 tensors" in caplog.text
    assert torch.isfinite(v(torch.tensor([[1, 2, 3]])).logits).all()
    bf16 = wb.load_verifier(tmp_path, dtype=torch.bfloat16)  # int4 x bf16 scale is exact: the same bits as theirs
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    assert torch.equal(bf16.state_dict()[name], expect[name])


def test_nested_output_of_layer_ids_capture_what_vllm_captures(tmp_path):
    """A TorchSpec-style draft nests [1, L//2 - 1, L - 4] ("output of layer i") and no top-level ids: we
    capture vLLM's (2, L//2, L - 3), i.e. transformers' output_hidden_states[2, L//2, L - 3], which are
    exactly the outputs of the nested layers (hidden_states[i + 1]), not the nested ids read as inputs."""
    transformers = pytest.importorskip("transformers")
    from workbench.training.draft_init import draft_config_for, init_draft

    L = 8
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=L,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, max_position_embeddings=256, tie_word_embeddings=False)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(4)
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, prm in hf.named_parameters():
            prm.copy_(torch.rand(prm.shape) + 0.5 if "norm" in name else torch.randn(prm.shape) * 0.1)
    hf.save_pretrained(tmp_path / "verifier")
    verifier = wb.load_verifier(tmp_path / "verifier")
    nested = [1, L // 2 - 1, L - 4]
    wb.save_model(init_draft(draft_config_for(verifier.config, intermediate_size=64, aux_layer_ids=(1, 2, 3))),
                  tmp_path / "draft")
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = nested
    (tmp_path / "draft" / "config.json").write_text(json.dumps(cfg))
    draft = wb.load_draft(tmp_path / "draft", verifier)
    assert (draft.config.aux_layer_ids, draft.config.aux_ids_source) == ((2, 4, 5), "default")
    assert draft.config.nested_aux_layer_ids == (1, 3, 4) and verifier.aux_layer_ids == (2, 4, 5)
    assert "eagle_config names aux ids [1, 3, 4]; capturing [2, 4, 5] (default)" in draft.load_notes[0]
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True).hidden_states
        got = verifier(ids).aux_hidden_states
    for j, i in enumerate(nested):
        assert (got[j] - want[i + 1]).abs().max() <= 1e-4  # the output of layer i = the input of layer i + 1
        assert (got[j] - want[i]).abs().max() > 1e-2  # what reading the nested ids as capture-before would fuse


# --------------------------------------------------------------------------- bad input

def test_truncated_safetensors(dirs, tmp_path):
    bad = copy_dir(dirs[0], tmp_path / "v")
    path = bad / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    expect_error(lambda: wb.load_verifier(bad), wb.CheckpointError,
                 str(path), "truncated", "expected a complete safetensors file")


def test_missing_tensor(dirs, tmp_path):
    bad = copy_dir(dirs[0], tmp_path / "v")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    edit_tensors(bad, lambda t: {k: v for k, v in t.items() if k != name})
    expect_error(lambda: wb.load_verifier(bad), wb.CheckpointError,
                 str(bad), "missing tensor", f"'{name}' (128, 32)")  # N*(P+V), L


def test_wrong_shape(dirs, tmp_path):
    bad = copy_dir(dirs[0], tmp_path / "v")
    edit_tensors(bad, lambda t: {**t, "model.norm.weight": torch.ones(65)})
    expect_error(lambda: wb.load_verifier(bad), wb.CheckpointError,
                 str(bad / "model.safetensors"), "'model.norm.weight' has shape (65,); expected (64,)")


def test_draft_hidden_size_mismatch(dirs, verifier, tmp_path):
    bad = copy_dir(dirs[1], tmp_path / "d")
    edit_config(bad, hidden_size=32, target_hidden_size=32)
    expect_error(lambda: wb.load_draft(bad, verifier), wb.PairingError,
                 f"{bad}/config.json", "hidden_size = 32; expected", "64")


def test_draft_vocab_mismatch(dirs, verifier, tmp_path):
    bad = copy_dir(dirs[1], tmp_path / "d")
    edit_config(bad, vocab_size=1000)
    expect_error(lambda: wb.load_draft(bad, verifier), wb.PairingError,
                 f"{bad}/config.json", "vocab_size = 1000; expected the verifier's vocab_size 512")


def test_aux_ids_out_of_range(dirs, verifier, tmp_path):
    bad = copy_dir(dirs[1], tmp_path / "d")
    edit_config(bad, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9], "use_aux_hidden_state": True},
                eagle_aux_hidden_state_layer_ids=[1, 2, 9])  # the top level: where vLLM (and load_draft) reads
    expect_error(lambda: wb.load_draft(bad, verifier), wb.PairingError,
                 f"{bad}/config.json", "eagle_aux_hidden_state_layer_ids = [1, 2, 9]", "[9] out of range",
                 "expected ids in [0, 3]")


def test_unknown_model_type(dirs, tmp_path):
    bad = copy_dir(dirs[0], tmp_path / "v")
    edit_config(bad, model_type="llama")
    expect_error(lambda: wb.load_verifier(bad), wb.ConfigError,
                 str(bad / "config.json"), "field 'model_type' = 'llama'", "expected one of", "deepseek_v3")


def test_directory_without_config(dirs, tmp_path):
    bad = copy_dir(dirs[0], tmp_path / "v")
    (bad / "config.json").unlink()
    expect_error(lambda: wb.load_verifier(bad), wb.ConfigError,
                 str(bad / "config.json"), "missing", "expected a Hugging Face config.json")
    expect_error(lambda: wb.load_verifier(tmp_path / "nowhere"), wb.ConfigError,
                 str(tmp_path / "nowhere"), "not a directory")


def test_invalid_json_config(dirs, tmp_path):
    bad = copy_dir(dirs[0], tmp_path / "v")
    (bad / "config.json").write_text('{"model_type": "deepseek_v3",')
    expect_error(lambda: wb.load_verifier(bad), wb.ConfigError,
                 str(bad / "config.json"), "not valid JSON", "expected a Hugging Face config.json")


def test_reduced_vocab_draft_without_lm_head(dirs, tmp_path):
    bad = copy_dir(dirs[1], tmp_path / "d")
    edit_config(bad, draft_vocab_size=100)
    expect_error(lambda: wb.load_pair(dirs[0], bad), wb.PairingError,
                 str(bad), "no lm_head", "draft_vocab_size = 100", "vocab_size = 512", "expected its own lm_head")


def test_generation_config_eos_ends_a_generation(tmp_path):
    """A chat model lists its end-of-turn token in generation_config.json (Kimi-K2: <|im_end|>): the
    engine stops there, as transformers and vLLM do; a malformed file is refused by name."""
    import json
    import shutil

    from tests.helpers import EMBEDDED

    vdir = tmp_path / "verifier"
    shutil.copytree(EMBEDDED / "verifier", vdir)
    pair = wb.load_pair(vdir, EMBEDDED / "draft", dtype="float32")
    prompt = "import os\n\n\ndef add(a, b):\n"  # continued for 12 tokens without an end of turn
    plain = wb.generate_autoregressive(pair, prompt, max_new_tokens=12)
    stop = plain.tokens[5]
    first = plain.tokens.index(stop)
    (vdir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stop]}))
    assert stop in pair.eos_token_ids and 1 in pair.eos_token_ids
    for res in (wb.generate_autoregressive(pair, prompt, max_new_tokens=12),
                wb.SpecDecoder(pair, 3).generate(prompt, max_new_tokens=12)):
        assert res.finish_reason == "eos" and res.tokens[:first] == plain.tokens[:first]
        assert len(res.tokens) <= first + 1
    (vdir / "generation_config.json").write_text(json.dumps({"eos_token_id": "im_end"}))
    with pytest.raises(ValueError, match="generation_config.json: field 'eos_token_id'"):
        pair.eos_token_ids
