"""workbench.checkpoint: round trips, the draft/verifier name maps, FP8 block dequantisation,
and one test per kind of bad checkpoint (each checks the message names file, tensor, expectation)."""
from __future__ import annotations

import builtins
import json
import math
import pickle

import pytest
import torch
from torch import nn

from workbench.checkpoint import (
    CheckpointError, SafetensorsReader, dequantize_fp8_blocks, dequantize_packed, draft_name, load_state,
    logical_layout, save_state, skipped_multimodal, text_prefix, unpack_int32, verifier_name,
)

H, VOCAB, DRAFT_VOCAB = 8, 16, 6


class Norm(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_a_proj = nn.Linear(2 * H, 4, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * H, 6, bias=False)
        self.o_proj = nn.Linear(4, H, bias=False)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attn()
        self.input_layernorm = Norm(H)
        self.hidden_norm = Norm(H)


class TinyDraft(nn.Module):
    """vLLM's draft names without `model.`: fc, layers.0.*, norm, lm_head, embed_tokens, d2t."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.layers = nn.ModuleList([Layer()])
        self.norm = Norm(H)
        self.lm_head = nn.Linear(H, DRAFT_VOCAB, bias=False)
        self.embed_tokens = nn.Embedding(VOCAB, H)
        self.register_buffer("d2t", torch.randint(0, 10, (DRAFT_VOCAB,), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(3), persistent=False)  # never in checkpoints
        self.to(dtype)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.head = nn.Linear(H, VOCAB, bias=False)
        self.head.weight = self.embed.weight


def on_meta(cls, *args) -> nn.Module:
    with torch.device("meta"):
        return cls(*args)


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k  # bit-identical, not approximately equal


# --------------------------------------------------------------------------- round trips

def test_round_trip_single_file_bf16_and_int_buffer(tmp_path):
    src = TinyDraft(torch.bfloat16)
    files = save_state(src.state_dict(), tmp_path, metadata={"producer": "test"})
    assert files == [tmp_path / "model.safetensors"]
    dst = on_meta(TinyDraft, torch.bfloat16)
    loaded = load_state(dst, SafetensorsReader(tmp_path))
    assert loaded == set(src.state_dict())
    assert dst.d2t.dtype == torch.int64 and dst.fc.weight.dtype == torch.bfloat16
    assert isinstance(dst.fc.weight, nn.Parameter) and dst.fc.weight.requires_grad
    assert dst.cache.is_meta  # non-persistent buffers are not the checkpoint's business
    assert_same(state(src), state(dst))
    from safetensors import safe_open
    meta = safe_open(str(files[0]), framework="pt").metadata()
    assert meta == {"format": "pt", "producer": "test"}


def test_round_trip_sharded(tmp_path):
    src = TinyDraft()
    sd = src.state_dict()
    total = sum(t.numel() * t.element_size() for t in sd.values())
    files = save_state(sd, tmp_path, max_shard_bytes=600)
    shards, index = files[:-1], files[-1]
    assert len(shards) > 2 and index.name == "model.safetensors.index.json"
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    doc = json.loads(index.read_text())
    assert doc["metadata"]["total_size"] == total
    assert set(doc["weight_map"]) == set(sd) and set(doc["weight_map"].values()) == {p.name for p in shards}
    reader = SafetensorsReader(tmp_path)
    assert reader.file_of("fc.weight") == str(tmp_path / doc["weight_map"]["fc.weight"])
    dst = TinyDraft()
    load_state(dst, reader)
    assert_same(state(src), state(dst))
    # Saving again unsharded removes the old shards, so a reader cannot mix two saves.
    assert save_state(sd, tmp_path) == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_load_casts_floats_only(tmp_path):
    src = TinyDraft()
    save_state(src.state_dict(), tmp_path)
    dst = TinyDraft()
    load_state(dst, SafetensorsReader(tmp_path), dtype=torch.bfloat16)
    assert dst.fc.weight.dtype == torch.bfloat16 and dst.d2t.dtype == torch.int64
    assert torch.equal(dst.fc.weight, src.fc.weight.to(torch.bfloat16))
    assert torch.equal(dst.d2t, src.d2t)


def test_tied_weights_save_and_stay_tied(tmp_path):
    src = Tied()
    save_state(src.state_dict(), tmp_path)  # both names, one storage: cloned, not refused
    reader = SafetensorsReader(tmp_path)
    assert sorted(reader.keys()) == ["embed.weight", "head.weight"]
    dst = on_meta(Tied)
    assert load_state(dst, reader) == {"embed.weight", "head.weight"}
    assert dst.head.weight is dst.embed.weight
    assert torch.equal(dst.head.weight, src.embed.weight)
    # transformers saves only one name of a tied pair; that is enough for both.
    save_state({"embed.weight": src.embed.weight}, tmp_path / "one")
    dst = on_meta(Tied)
    assert load_state(dst, SafetensorsReader(tmp_path / "one")) == {"embed.weight", "head.weight"}
    assert dst.head.weight is dst.embed.weight


def test_tied_weights_that_differ_are_refused(tmp_path):
    save_state({"embed.weight": torch.zeros(VOCAB, H), "head.weight": torch.ones(VOCAB, H)}, tmp_path)
    differ = r"model\.safetensors.*'embed\.weight' and 'head\.weight' differ"
    with pytest.raises(CheckpointError, match=differ):
        load_state(Tied(), SafetensorsReader(tmp_path))


# --------------------------------------------------------------------------- draft name map

def draft_tensors(prefix: str) -> dict[str, torch.Tensor]:
    """A draft checkpoint as SpecForge (`midlayer.`) or TorchSpec (`layers.0.`) writes it."""
    torch.manual_seed(0)
    out = {(prefix + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
           for k, v in TinyDraft().state_dict().items()}
    out["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    out[prefix + "self_attn.rotary_emb.inv_freq"] = torch.ones(2)
    return out


@pytest.mark.parametrize("form", ["midlayer.", "layers.0.", "model.midlayer.", "model.layers.0."])
def test_draft_name_forms_load_identically(tmp_path, form):
    tensors = draft_tensors(form.removeprefix("model."))
    if form.startswith("model."):
        tensors = {"model." + k: v for k, v in tensors.items()}
    save_state(tensors, tmp_path)
    dst = TinyDraft()
    load_state(dst, SafetensorsReader(tmp_path), rename=draft_name)
    assert_same(state(dst), {k: v for k, v in draft_tensors("layers.0.").items()
                             if k != "t2d" and "inv_freq" not in k})


def test_draft_name_table():
    assert draft_name("midlayer.hidden_norm.weight") == "layers.0.hidden_norm.weight"
    assert draft_name("model.midlayer.self_attn.q_a_proj.weight") == "layers.0.self_attn.q_a_proj.weight"
    assert draft_name("model.fc.weight") == "fc.weight"
    assert draft_name("fc_norm.2.weight") == "fc_norm.2.weight"
    assert draft_name("d2t") == "d2t" and draft_name("t2d") is None
    assert draft_name("layers.0.self_attn.rotary_emb.inv_freq") is None
    assert draft_name("lm_head.weight") == "lm_head.weight"


def test_optional_tensors_may_be_absent(tmp_path):
    src = TinyDraft()
    sd = {k: v for k, v in src.state_dict().items() if k not in ("d2t", "embed_tokens.weight")}
    save_state(sd, tmp_path)
    dst = TinyDraft()
    before = dst.d2t.clone()
    loaded = load_state(dst, SafetensorsReader(tmp_path), optional={"d2t", "embed_tokens.weight"})
    assert loaded == set(sd)
    assert torch.equal(dst.d2t, before)
    with pytest.raises(ValueError, match="'nope'"):
        load_state(dst, SafetensorsReader(tmp_path), optional={"nope"})


def test_two_names_onto_one_tensor_refused(tmp_path):
    tensors = draft_tensors("midlayer.")
    tensors["layers.0.hidden_norm.weight"] = tensors["midlayer.hidden_norm.weight"]
    save_state(tensors, tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*'layers\.0\.hidden_norm\.weight' and "
                                              r"'midlayer\.hidden_norm\.weight' both map"):
        load_state(TinyDraft(), SafetensorsReader(tmp_path), rename=draft_name)


# --------------------------------------------------------------------------- verifier name map

def test_verifier_name_drops_mtp_layer_and_inv_freq():
    rename = verifier_name(61)
    expert = "model.layers.60.mlp.experts.3.gate_proj.weight"
    assert rename(expert) == expert
    assert rename("model.layers.61.eh_proj.weight") is None  # DeepSeek-V3 MTP layer
    assert rename("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert rename("lm_head.weight") == "lm_head.weight"
    assert verifier_name(2)("model.layers.10.input_layernorm.weight") is None
    norm = "model.layers.1.input_layernorm.weight"
    assert verifier_name(2)(norm) == norm


def test_reader_on_transformers_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    model.save_pretrained(tmp_path, safe_serialization=True)
    reader = SafetensorsReader(tmp_path)
    rename = verifier_name(cfg.num_hidden_layers)
    keys = reader.keys()
    assert all(rename(k) == k for k in keys)
    sd = model.state_dict()
    for k in keys:  # names HF's module holds directly: same shape and bits
        if k in sd:
            assert reader.shape(k) == tuple(sd[k].shape) and torch.equal(reader.get(k), sd[k]), k
    # The names the brief promises our verifier module uses, per expert (transformers 5 fuses
    # experts in memory but saves them per expert).
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_a_proj.weight",
                 "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.norm.weight", "lm_head.weight"):
        assert name in reader, name
    inter, fused = cfg.moe_intermediate_size, "model.layers.1.mlp.experts."
    for e in range(cfg.n_routed_experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"{fused}{e}.{proj}.weight" in keys
        gate_up, down = sd[fused + "gate_up_proj"][e], sd[fused + "down_proj"][e]
        assert torch.equal(reader.get(f"{fused}{e}.gate_proj.weight"), gate_up[:inter])
        assert torch.equal(reader.get(f"{fused}{e}.up_proj.weight"), gate_up[inter:])
        assert torch.equal(reader.get(f"{fused}{e}.down_proj.weight"), down)
    assert reader.shape(f"{fused}0.down_proj.weight") == (cfg.hidden_size, inter)


# --------------------------------------------------------------------------- FP8

def quantise_fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style: one scale per block = amax / 448 (e4m3 max); stores q = w / scale."""
    rows, cols = w.shape
    sr, sc = math.ceil(rows / block), math.ceil(cols / block)
    scale = torch.empty(sr, sc)
    for i in range(sr):
        for j in range(sc):
            scale[i, j] = w[i * block:(i + 1) * block, j * block:(j + 1) * block].abs().max() / 448.0
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def test_fp8_block_dequant_on_get(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(300, 200) * 0.02
    q, scale = quantise_fp8_blocks(w)
    save_state({"proj.weight": q, "proj.weight_scale_inv": scale, "raw": q[:3]}, tmp_path)
    reader = SafetensorsReader(tmp_path)
    assert sorted(reader.keys()) == ["proj.weight", "raw"]  # scales hidden, still readable
    assert reader.shape("proj.weight") == (300, 200) and "proj.weight_scale_inv" in reader
    expect = q.float() * scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    got = reader.get("proj.weight")
    assert got.dtype == torch.float32 and torch.equal(got, expect)
    assert torch.equal(reader.get("proj.weight", dtype=torch.bfloat16), expect.to(torch.bfloat16))
    assert torch.equal(dequantize_fp8_blocks(q, scale), expect)
    assert (got - w).abs().max() <= w.abs().max() / 16  # e4m3 keeps 3 mantissa bits
    assert torch.equal(reader.get("raw", dtype=torch.float32), q[:3].float())  # no scale: cast
    layer = nn.Linear(200, 300, bias=False, dtype=torch.bfloat16)
    load_state(layer, reader, rename=lambda n: "weight" if n == "proj.weight" else None)
    assert torch.equal(layer.weight, expect.to(torch.bfloat16))


def test_fp8_scale_of_wrong_shape(tmp_path):
    q, scale = quantise_fp8_blocks(torch.randn(300, 200))
    save_state({"proj.weight": q, "proj.weight_scale_inv": scale[:2, :1]}, tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'proj\.weight_scale_inv' has "
                                              r"shape \(2, 1\); expected \(3, 2\)"):
        SafetensorsReader(tmp_path).get("proj.weight")
    with pytest.raises(ValueError, match=r"expected \(3, 2\)"):
        dequantize_fp8_blocks(q, scale[:2, :1])


# --------------------------------------------------------------------------- compressed-tensors int

EXPERT = "language_model.model.layers.1.mlp.experts.0.down_proj"


def ct_quantization(num_bits: int = 4, group_size: int | None = 32, symmetric: bool = True, **weights) -> dict:
    """Kimi-K2.5's quantization_config, with the weight scheme's fields open to change."""
    strategy = "group" if group_size else "channel"
    w = {"num_bits": num_bits, "type": "int", "strategy": strategy, "group_size": group_size,
         "symmetric": symmetric, "actorder": None, "dynamic": False, "observer": "minmax", **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": None}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]}


def ct_compress(w: torch.Tensor, q: dict, scale_dtype=torch.bfloat16) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' own compressor on w (min-max scales, as the Kimi checkpoints' observer):
    (its state dict: weight_packed, weight_scale, weight_shape[, weight_zero_point], its decompressed weight)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = q["config_groups"]["group_0"]["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{k: args[k] for k in (
        "num_bits", "type", "strategy", "group_size", "symmetric")}))
    assert ct.__version__  # the package itself, not a stand-in
    rows, cols = w.shape
    size = args["group_size"] or cols
    g = w.view(rows, cols // size, size)
    top = 2 ** (args["num_bits"] - 1)
    if args["symmetric"]:
        scale, zp = (g.abs().amax(-1) / (top - 0.5)).to(scale_dtype), None
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / (2 * top - 1)).to(scale_dtype)
        zp = (-top - torch.round(lo / scale.float())).clamp(-top, top - 1).to(torch.int8)
    state = {"weight": w.to(scale_dtype), "weight_scale": scale}
    if zp is not None:
        state["weight_zero_point"] = zp
    packed = PackedQuantizationCompressor.compress(state, scheme)
    return packed, PackedQuantizationCompressor.decompress(packed, scheme)["weight"]


@pytest.mark.parametrize("num_bits", [2, 4, 8])
@pytest.mark.parametrize("cols", [64, 37])  # 37: the last int32 word of each row is part padding
def test_unpack_int32_inverts_compressed_tensors_pack(num_bits, cols):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    top = 2 ** (num_bits - 1)
    values = torch.randint(-top, top, (19, cols), generator=torch.Generator().manual_seed(cols), dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_to_int32(values, num_bits), num_bits, cols), values)
    assert torch.equal(unpack_int32(pack_to_int32(values, num_bits, packed_dim=0), num_bits, 19, dim=0), values)


@pytest.mark.parametrize("group_size, symmetric, scale_dtype", [
    (32, True, torch.bfloat16),  # Kimi-K2.5/K2.6's routed experts
    (32, False, torch.float32),  # asymmetric: a packed zero point
    (None, True, torch.bfloat16),  # per channel
])
def test_dequantize_packed_equals_compressed_tensors(group_size, symmetric, scale_dtype):
    """compressed-tensors dequantises in the scale's dtype; we work in fp32, where each product is exact,
    so ours rounded to that dtype is bit-identical to theirs."""
    q = ct_quantization(group_size=group_size, symmetric=symmetric)
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    packed, theirs = ct_compress(w, q, scale_dtype)
    ours = dequantize_packed(packed["weight_packed"], packed["weight_scale"], tuple(packed["weight_shape"].tolist()),
                             4, group_size, packed.get("weight_zero_point"))
    assert ours.dtype == torch.float32 and torch.equal(ours.to(theirs.dtype), theirs)
    assert (ours - w).abs().max() < 0.25 * w.abs().max()  # int4: a few levels per group


def test_reader_shows_packed_triplets_as_one_weight(tmp_path):
    q = ct_quantization()
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(2)) * 0.05
    packed, theirs = ct_compress(w, q)
    packed["weight_shape"] = packed["weight_shape"].to(torch.int32)  # as the published files store it
    norm = torch.ones(64, dtype=torch.bfloat16)
    save_state({**{f"{EXPERT}.{k}": v for k, v in packed.items()}, "language_model.model.norm.weight": norm,
                "vision_tower.patch_embed.weight": torch.zeros(3), "mm_projector.proj.0.weight": torch.zeros(2)},
               tmp_path)
    reader = SafetensorsReader(tmp_path, q)
    keys = reader.keys()
    assert sorted(keys) == sorted([f"{EXPERT}.weight", "language_model.model.norm.weight",
                                   "vision_tower.patch_embed.weight", "mm_projector.proj.0.weight"])
    assert reader.shape(f"{EXPERT}.weight") == (24, 64) and reader.dtype(f"{EXPERT}.weight") == torch.bfloat16
    assert f"{EXPERT}.weight" in reader and reader.file_of(f"{EXPERT}.weight").endswith("model.safetensors")
    got = reader.get(f"{EXPERT}.weight")
    assert got.dtype == torch.float32 and torch.equal(got.to(torch.bfloat16), theirs)
    assert torch.equal(reader.get(f"{EXPERT}.weight", dtype=torch.bfloat16), theirs)
    assert text_prefix(keys) == "language_model."
    assert skipped_multimodal(keys) == {"vision_tower.": 1, "mm_projector.": 1}
    rename = verifier_name(61, "language_model.")
    assert rename(f"{EXPERT}.weight") == "model.layers.1.mlp.experts.0.down_proj.weight"
    assert rename("vision_tower.patch_embed.weight") is None
    assert rename("language_model.lm_head.weight") == "lm_head.weight"


def test_logical_layout_of_a_listing():
    """What the reader shows, from shapes alone: the K2.5 triplet [7168, 256] int32 + [7168, 64] scales,
    and a K2 fp8 weight with its [56, 16] block scales."""
    k25 = {f"{EXPERT}.weight_packed": (7168, 256), f"{EXPERT}.weight_scale": (7168, 64),
           f"{EXPERT}.weight_shape": (2,), "language_model.model.norm.weight": (7168,)}
    assert logical_layout(k25, ct_quantization(), "listing") == {f"{EXPERT}.weight": (7168, 2048),
                                                                 "language_model.model.norm.weight": (7168,)}
    fp8 = {"model.layers.1.mlp.experts.0.down_proj.weight": (7168, 2048),
           "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv": (56, 16)}
    q = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert logical_layout(fp8, q) == {"model.layers.1.mlp.experts.0.down_proj.weight": (7168, 2048)}
    with pytest.raises(CheckpointError, match=r"listing: tensor '.*weight_scale_inv' has shape \(56, 8\); "
                                              r"expected \(56, 16\)"):
        logical_layout({**fp8, "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv": (56, 8)}, q, "listing")


@pytest.mark.parametrize("change, fragment", [
    ({"num_bits": 3}, "num_bits 3"),
    ({"actorder": "group"}, "actorder 'group'"),
    ({"type": "float"}, "type 'float'"),
    ({"strategy": "tensor"}, "strategy 'tensor'"),
])
def test_unhandled_compressed_tensors_scheme_names_scheme_tensor_and_file(tmp_path, change, fragment):
    q = ct_quantization()
    packed, _ = ct_compress(torch.randn(8, 64) * 0.05, q)
    save_state({f"{EXPERT}.{k}": v for k, v in packed.items()}, tmp_path)
    q["config_groups"]["group_0"]["weights"].update(change)
    with pytest.raises(CheckpointError) as err:
        SafetensorsReader(tmp_path, q)
    msg = str(err.value)
    for part in (str(tmp_path / "model.safetensors"), f"'{EXPERT}.weight_packed'",
                 "quantization_config.config_groups.group_0", fragment, "does not handle"):
        assert part in msg, (part, msg)


def test_unhandled_quantisation_formats(tmp_path):
    """Another compressed-tensors format (fp8 weights with weight_scale, no packing), another quant_method,
    a packed tensor the config does not explain, and one its ignore list excludes: each named."""
    save_state({"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn),
                "model.layers.0.mlp.down_proj.weight_scale": torch.ones(4, 1)}, tmp_path / "fp8")
    q = dict(ct_quantization(), format="float-quantized")
    with pytest.raises(CheckpointError, match=r"fp8/model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\."
                                              r"weight_scale' has no .*weight_packed.* format 'float-quantized'"):
        SafetensorsReader(tmp_path / "fp8", q)
    save_state({"model.layers.0.mlp.down_proj.qweight": torch.zeros(4, 4, dtype=torch.int32)}, tmp_path / "awq")
    with pytest.raises(CheckpointError, match=r"cfg\.json: quantization_config\.quant_method = 'awq' is not handled; "
                                              r"first quantised tensor 'model\.layers\.0\.mlp\.down_proj\.qweight' in "
                                              r".*awq/model\.safetensors"):
        SafetensorsReader(tmp_path / "awq", {"quant_method": "awq", "bits": 4}, "cfg.json")
    packed, _ = ct_compress(torch.randn(8, 64) * 0.05, ct_quantization())
    save_state({f"{EXPERT}.{k}": v for k, v in packed.items()}, tmp_path / "ct")
    with pytest.raises(CheckpointError, match=r"is packed, but .* has no compressed-tensors quantization_config"):
        SafetensorsReader(tmp_path / "ct")
    with pytest.raises(CheckpointError, match=r"quantization_config\.ignore lists module"):
        SafetensorsReader(tmp_path / "ct", dict(ct_quantization(), ignore=["re:.*experts.*"]))


# --------------------------------------------------------------------------- bad input

def test_truncated_file(tmp_path):
    save_state(TinyDraft().state_dict(), tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError) as err:
        SafetensorsReader(tmp_path)
    msg = str(err.value)
    assert str(path) in msg and "truncated" in msg
    assert f"needs {len(data)} bytes, the file has {len(data) - 100}" in msg


def test_corrupt_header(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file"):
        SafetensorsReader(tmp_path)


def test_missing_tensor(tmp_path):
    sd = TinyDraft().state_dict()
    del sd["layers.0.hidden_norm.weight"]
    save_state(sd, tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_state(TinyDraft(), SafetensorsReader(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "missing" in msg and f"'layers.0.hidden_norm.weight' ({H},)" in msg


def test_wrong_shape_fails_before_assigning(tmp_path):
    sd = TinyDraft().state_dict()
    sd["fc.weight"] = torch.zeros(H, 2 * H)
    save_state(sd, tmp_path)
    dst = on_meta(TinyDraft)
    with pytest.raises(CheckpointError) as err:
        load_state(dst, SafetensorsReader(tmp_path))
    msg = str(err.value)
    assert f"{tmp_path / 'model.safetensors'}: tensor 'fc.weight' has shape ({H}, {2 * H}); " \
           f"expected ({H}, {3 * H})" in msg
    assert all(t.is_meta for t in dst.state_dict().values())  # nothing half-loaded


def test_float_into_integer_buffer_refused(tmp_path):
    sd = TinyDraft().state_dict()
    sd["d2t"] = sd["d2t"].float()
    save_state(sd, tmp_path)
    with pytest.raises(CheckpointError, match=r"tensor 'd2t' is torch\.float32; expected torch\.int64"):
        load_state(TinyDraft(), SafetensorsReader(tmp_path))


def test_index_names_missing_shard(tmp_path):
    files = save_state(TinyDraft().state_dict(), tmp_path, max_shard_bytes=600)
    gone = files[1]
    gone.unlink()
    with pytest.raises(CheckpointError) as err:
        SafetensorsReader(tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "model.safetensors.index.json") in msg and f"shard '{gone.name}'" in msg


def test_index_names_tensor_not_in_shard(tmp_path):
    files = save_state(TinyDraft().state_dict(), tmp_path, max_shard_bytes=600)
    index = files[-1]
    doc = json.loads(index.read_text())
    doc["weight_map"]["ghost.weight"] = files[0].name
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"{index}: tensor 'ghost\.weight' is mapped to {files[0]}, "
                                              r"which does not contain it"):
        SafetensorsReader(tmp_path)


def test_empty_directory(tmp_path):
    expected = rf"{tmp_path}: no safetensors weights; expected model\.safetensors"
    with pytest.raises(CheckpointError, match=expected):
        SafetensorsReader(tmp_path)


class _Trap:
    """Unpickling this creates a file: proof that the reader never unpickles."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def test_pickle_only_directory_refused_unopened(tmp_path):
    marker = tmp_path.parent / f"{tmp_path.name}-unpickled"
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(str(marker))))
    with pytest.raises(CheckpointError) as err:
        SafetensorsReader(tmp_path)
    msg = str(err.value)
    assert str(tmp_path) in msg and "pytorch_model.bin" in msg and "refused" in msg
    assert not marker.exists()


def test_unexpected_tensors_listed(tmp_path):
    sd = TinyDraft().state_dict()
    extra = {f"extra.{i}.weight": torch.zeros(1) for i in range(7)}
    save_state({**sd, **extra}, tmp_path)
    reader = SafetensorsReader(tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_state(TinyDraft(), reader)
    msg = str(err.value)
    assert "unexpected" in msg and "and 2 more" in msg
    assert f"'extra.0.weight' (in {tmp_path / 'model.safetensors'})" in msg
    assert msg.count("'extra.") == 5
    loaded = load_state(TinyDraft(), reader, ignore=lambda n: n.startswith("extra."))
    assert loaded == set(sd)


def test_unknown_name_suggests_close_match(tmp_path):
    save_state(TinyDraft().state_dict(), tmp_path)
    with pytest.raises(CheckpointError, match=r"no tensor 'fc\.weights'; did you mean \['fc\.weight'"):
        SafetensorsReader(tmp_path).get("fc.weights")
