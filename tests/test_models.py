"""The models are exact: parity with transformers' DeepseekV3, naive == absorbed MLA, and the
EAGLE-3 draft equal to the spec (eagle3_mla.md §3-4) restated here with loops and formulas.

Every config here turns on what a wrong formula would need to hide behind: all RMSNorm
weights random in [0.5, 1.5], a random `e_score_correction_bias`, grouped routing, a routed
scaling factor != 1, YaRN with factor > 1 and mscale != mscale_all_dim (so the cos/sin
magnitude ratio is not 1), interleaved rope, and v_head_dim != qk_nope_head_dim.
"""
from __future__ import annotations

import math

import pytest
import torch

import workbench as wb
from workbench.cache import KVCache
from workbench.config import DraftConfig, MLADims
from workbench.models import Eagle3Draft
from workbench.models.mla import MLAttention

ATOL_HF = 1e-4  # fp32, issue #2
ATOL = 1e-5  # same-library paths / the restated spec, fp32
VOCAB = 320
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}


def randomise(module: torch.nn.Module, seed: int, std: float | None = 0.15) -> None:
    """N(0, std) weights (std None: N(0, 1/fan_in), outputs of unit size at any width), norms
    U(0.5, 1.5), routing bias N(0, 0.3): nothing a bug can hide in."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (std if std is not None else p.shape[-1] ** -0.5))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)


# --------------------------------------------------------------------------- transformers parity

def hf_config(q_lora_rank: int | None, layers: int = 4):
    transformers = pytest.importorskip("transformers")
    # rms_norm_eps stays 1e-6: transformers hard-codes 1e-6 for q_a/kv_a_layernorm whatever the
    # config says, while we (like vLLM and the lmdeploy note in §7.6) use the config's eps.
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
        rms_norm_eps=1e-6, rope_interleave=True, max_position_embeddings=1024,
        rope_parameters={"rope_theta": 10000.0, **YARN}, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False)


def hf_pair(tmp_path_factory, q_lora_rank: int | None, seed: int):
    """(transformers model, our Verifier loaded from its save_pretrained directory)."""
    transformers = pytest.importorskip("transformers")
    cfg = hf_config(q_lora_rank)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    assert hf.config._attn_implementation == "eager"
    randomise(hf, seed)
    directory = tmp_path_factory.mktemp(f"hf_q{q_lora_rank}")
    hf.save_pretrained(directory)  # safetensors
    assert (directory / "model.safetensors").is_file()
    return hf, wb.load_verifier(directory)


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    """q_lora_rank set (q_a -> norm -> q_b), and the reference logits of a 300-token prompt."""
    hf, ours = hf_pair(tmp_path_factory, 48, seed=1)
    ids = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    return hf, ours, ids, ref


@pytest.fixture(scope="module")
def dsv2_style(tmp_path_factory):
    """q_lora_rank None: a direct q_proj, as DeepSeek-V2-Lite."""
    hf, ours = hf_pair(tmp_path_factory, None, seed=3)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids)
    return hf, ours, ids, ref


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def test_prefill_300_tokens_matches_transformers(dsv3):
    hf, ours, ids, ref = dsv3
    assert ours.model.layers[1].self_attn.q_a_proj.weight.shape == (48, 64)
    out = ours(ids)
    assert out.logits.shape == ref.logits.shape == (1, 300, VOCAB)
    assert max_diff(out.logits, ref.logits) <= ATOL_HF
    assert ref.logits.std() > 0.5  # the comparison is not between two near-constant tensors


@torch.no_grad()
def test_decode_token_by_token_matches_transformers(dsv3):
    """Each step: one token through our latent cache (absorbed path) vs HF's full-sequence logits."""
    hf, ours, ids, ref = dsv3
    cache = ours.new_cache(64)
    for t in range(40):
        step = ours(ids[:, t:t + 1], cache=cache)
        assert cache.length == t + 1
        assert max_diff(step.logits[:, 0], ref.logits[:, t]) <= ATOL_HF, f"position {t}"


@torch.no_grad()
@pytest.mark.parametrize("path", ["absorbed", "naive"])
def test_verify_chunk_after_prefix_matches_transformers(dsv3, path):
    """A 200-token prefix (naive prefill), then a 4-token verify-like chunk."""
    hf, ours, ids, ref = dsv3
    cache = ours.new_cache(256)
    ours(ids[:, :200], cache=cache, logits_to_keep=1)
    chunk = ours(ids[:, 200:204], cache=cache, path=path)
    assert cache.length == 204
    assert max_diff(chunk.logits, ref.logits[:, 200:204]) <= ATOL_HF


@torch.no_grad()
@pytest.mark.parametrize("aux_ids", [(0, 1, 3), (1, 2, 3)])
def test_aux_hidden_states_are_capture_before(dsv3, aux_ids):
    """id k = the residual stream entering layer k = HF output_hidden_states[k] (0 = embeddings)."""
    hf, ours, ids, ref = dsv3
    ours.aux_layer_ids = aux_ids
    try:
        out = ours(ids[:, :64])
    finally:
        ours.aux_layer_ids = ours.config.default_aux_layer_ids
    assert len(out.aux_hidden_states) == 3
    for k, h in zip(aux_ids, out.aux_hidden_states):
        want = ref.hidden_states[k][:, :64]
        if k == 0:
            assert torch.equal(h, want)  # the embedding rows themselves
        else:  # |h| reaches ~10 here, so 1e-5 would be a few fp32 ulps of summation order
            assert max_diff(h, want) <= ATOL_HF
        assert max_diff(h, ref.hidden_states[k + 1][:, :64]) > 1e-2  # an off-by-one would show


@torch.no_grad()
def test_direct_q_proj_config_matches_transformers(dsv2_style):
    hf, ours, ids, ref = dsv2_style
    attn = ours.model.layers[0].self_attn
    assert hasattr(attn, "q_proj") and not hasattr(attn, "q_a_proj")
    assert max_diff(ours(ids).logits, ref.logits) <= ATOL_HF
    cache = ours.new_cache(64)
    ours(ids[:, :30], cache=cache)
    for t in range(30, 33):
        assert max_diff(ours(ids[:, t:t + 1], cache=cache).logits[:, 0], ref.logits[:, t]) <= ATOL_HF
    assert max_diff(ours(ids[:, 33:37], cache=cache, path="absorbed").logits, ref.logits[:, 33:37]) <= ATOL_HF


# --------------------------------------------------------------------------- DeepSeek-V2 parity

V2_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
           "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}  # DeepSeek-V2-Lite's rope_scaling
# DeepSeek-V2-Lite's shapes (its config.json): every head dimension, the dense and expert widths, 2 shared
# experts and top-6 softmax greedy routing; 2 layers (layer 0 dense, as first_k_dense_replace = 1), 8 routed
# experts of its 64 and a 1024-token vocabulary, so the pair fits a test (185M parameters, ~2 GB).
V2_LITE = dict(vocab_size=1024, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
               num_hidden_layers=2, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8, n_shared_experts=2,
               num_experts_per_tok=6, n_group=1, topk_group=1, topk_method="greedy", routed_scaling_factor=1.0)
# Full DeepSeek-V2's routing (group_limited_greedy: groups ranked by their best expert; scaling 16) at small widths.
V2_GROUPED = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                  num_hidden_layers=3, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
                  n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=16.0)


def v2_case(tmp_path_factory, shape: dict, seed: int, tokens: int):
    """(transformers DeepseekV2ForCausalLM, our Verifier from its save_pretrained directory, ids, reference)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV2Config(
        num_key_value_heads=shape["num_attention_heads"], first_k_dense_replace=1, norm_topk_prob=False,
        rms_norm_eps=1e-6, max_position_embeddings=163840, rope_parameters={"rope_theta": 10000.0, **V2_YARN},
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, **shape)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.DeepseekV2ForCausalLM(cfg).eval()
    randomise(hf, seed, std=None)
    directory = tmp_path_factory.mktemp(f"dsv2_{shape['topk_method']}")
    hf.save_pretrained(directory)
    ours = wb.load_verifier(directory)
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        ref = hf(ids).logits
    del hf
    return ours, ids, ref


@pytest.fixture(scope="module")
def dsv2_lite(tmp_path_factory):
    return v2_case(tmp_path_factory, V2_LITE, seed=21, tokens=48)


@pytest.fixture(scope="module")
def dsv2_grouped(tmp_path_factory):
    return v2_case(tmp_path_factory, V2_GROUPED, seed=23, tokens=48)


@torch.no_grad()
@pytest.mark.parametrize("case", ["dsv2_lite", "dsv2_grouped"])
def test_deepseek_v2_matches_transformers(case, request):
    """Prefill, token-by-token decode through the latent cache, and a 4-token verify chunk (both
    attention paths) after a 40-token prefix, against transformers' DeepseekV2 in fp32."""
    ours, ids, ref = request.getfixturevalue(case)
    cfg = ours.config
    assert cfg.model_type == "deepseek_v2" and cfg.q_lora_rank is None and not cfg.has_correction_bias
    gate = ours.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias is None
    assert (gate.topk_method, gate.scoring_func) == (cfg.topk_method, "softmax")
    assert not hasattr(ours.model.layers[0].mlp, "gate")  # first_k_dense_replace = 1
    assert ref.std() > 0.5
    assert max_diff(ours(ids).logits, ref) <= ATOL_HF
    cache = ours.new_cache(64)
    for t in range(8):
        assert max_diff(ours(ids[:, t:t + 1], cache=cache).logits[:, 0], ref[:, t]) <= ATOL_HF, f"position {t}"
    for path in ("absorbed", "naive"):
        cache = ours.new_cache(64)
        ours(ids[:, :40], cache=cache, logits_to_keep=1)
        assert max_diff(ours(ids[:, 40:44], cache=cache, path=path).logits, ref[:, 40:44]) <= ATOL_HF, path


def test_router_weights_v2_and_v3():
    """V2 (DeepSeek-V2's code): renormalise when norm_topk_prob, else scale. V3: renormalise, then scale.
    group_limited_greedy ranks groups by their best score, noaux_tc by their two best biased ones."""
    from workbench.config import VerifierConfig
    from workbench.models.moe import Router

    def router(**over) -> Router:
        cfg = VerifierConfig(num_attention_heads=1, q_lora_rank=None, kv_lora_rank=4, qk_nope_head_dim=2,
                             qk_rope_head_dim=2, v_head_dim=2, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                             hidden_size=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                             routed_scaling_factor=3.0, **over)
        r = Router(cfg)
        with torch.no_grad():
            r.weight.copy_(torch.eye(4))
        return r

    x = torch.tensor([[0.0, 2.0, 1.9, 1.0]])  # groups {0, 1} and {2, 3}: best 2.0 vs 1.9, pair sums 2.0 vs 2.9
    p = x.softmax(-1)[0]
    w, ids = router(topk_method="greedy", scoring_func="softmax", norm_topk_prob=False)(x)
    assert sorted(ids[0].tolist()) == [1, 2] and torch.allclose(w[0].sort().values, 3 * p[[2, 1]])
    w, ids = router(topk_method="greedy", scoring_func="softmax", norm_topk_prob=True)(x)
    assert torch.allclose(w.sum(), torch.tensor(1.0))  # renormalised, not scaled
    w, ids = router(topk_method="group_limited_greedy", scoring_func="softmax", norm_topk_prob=False)(x)
    assert sorted(ids[0].tolist()) == [0, 1] and torch.allclose(w[0].sort().values, 3 * p[[0, 1]])
    r = router(topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True)
    assert r.e_score_correction_bias.shape == (4,) and r.sigmoid
    w, ids = r(x)
    assert sorted(ids[0].tolist()) == [2, 3] and torch.allclose(w.sum(), torch.tensor(3.0))  # renormalised, scaled
    assert router(topk_method="greedy", scoring_func="softmax").e_score_correction_bias is None
    assert "e_score_correction_bias" not in router(topk_method="greedy", scoring_func="softmax").state_dict()


# --------------------------------------------------------------------------- naive == absorbed

def mla_dims(q_lora_rank: int | None = 24, eps: float = 1e-5) -> MLADims:
    return MLADims(num_attention_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=12, rms_norm_eps=eps, rope_theta=10000.0,
                   rope_scaling={"type": "yarn", **YARN}, rope_interleave=True, max_position_embeddings=1024)


def run_attention(attn, x: torch.Tensor, cache: KVCache, path: str) -> torch.Tensor:
    T = x.shape[1]
    pos = cache.positions(T, x.device)  # [B, T]: each sequence at its own length
    out = attn(x, pos, cache, 0, path=path)
    cache.advance(T)
    return out


def check_paths_agree(attn, input_size: int, seed: int) -> None:
    """Prefill, a 1-token decode and a 4-token verify chunk on a cached prefix, batch of 2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 30, input_size, generator=g)
    caches = {p: KVCache(1, attn.row_width, 64, batch=2) for p in ("naive", "absorbed")}
    with torch.no_grad():
        uncached = attn(x, torch.arange(30)[None])
        outs = {p: [run_attention(attn, x[:, :25], c, p),       # prefill (both paths)
                    run_attention(attn, x[:, 25:26], c, p),     # decode
                    run_attention(attn, x[:, 26:30], c, p)]     # k+1 = 4 verify
                for p, c in caches.items()}
    assert torch.equal(caches["naive"].rows[:, :, :30], caches["absorbed"].rows[:, :, :30])
    for naive, absorbed in zip(outs["naive"], outs["absorbed"]):
        assert max_diff(naive, absorbed) <= ATOL
    assert max_diff(torch.cat(outs["absorbed"], dim=1), uncached) <= ATOL
    assert uncached.abs().max() > 0.1


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_naive_and_absorbed_agree_verifier_layer(q_lora_rank):
    attn = MLAttention(mla_dims(q_lora_rank), 48, 48)
    randomise(attn, seed=5)
    check_paths_agree(attn, 48, seed=6)


def test_naive_and_absorbed_agree_draft_layer():
    """The draft's MLA layer takes the 2H vector [norm(embed) | norm(h)]."""
    draft = Eagle3Draft(draft_config())
    randomise(draft, seed=7)
    attn = draft.layers[0].self_attn
    assert attn.q_a_proj.weight.shape[1] == attn.kv_a_proj_with_mqa.weight.shape[1] == 2 * 48
    check_paths_agree(attn, 2 * 48, seed=8)


# --------------------------------------------------------------------------- MoE inference paths

def moe_layer(experts: int, top_k: int, seed: int):
    from workbench.models.moe import MoE
    from workbench.training.pretrain import tiny_kimi_config

    cfg = tiny_kimi_config()
    cfg.hidden_size, cfg.moe_intermediate_size = 48, 24
    cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group = experts, top_k, 2, 1
    moe = MoE(cfg)
    randomise(moe, seed=seed)
    return moe


def moe_twins(moe) -> dict:
    """The MoE as every path runs it: the plain model (its one loop), the compiled copy's gathered
    experts (run eagerly here), and the CPU kernels' dense experts where they run on this machine."""
    from workbench.compiled import GatheredMoE
    from workbench.kernels import cpu
    from workbench.kernels.cpu_modules import KernelMoE
    twins = {"plain": moe, "gathered": GatheredMoE(moe)}
    if cpu.available():
        twins["kernels"] = KernelMoE.of(moe)
    return twins


@torch.no_grad()
@pytest.mark.parametrize("experts, top_k, dense", [(8, 2, True), (16, 2, False)])
def test_moe_inference_paths_equal_the_per_expert_loop(experts, top_k, dense):
    """Few experts run densely on the CPU kernels (unchosen ones weighted by zero), many are
    gathered when compiled or looped: every path equals the per-expert loop that training runs,
    for 1, 4 and 40 tokens."""
    moe = moe_layer(experts, top_k, seed=11)
    twins = moe_twins(moe)
    assert (twins.get("kernels") is not None) is (dense and "kernels" in twins)  # the kernels take few experts only
    for n in (1, 4, 40):
        x = torch.randn(n, 48, generator=torch.Generator().manual_seed(n))
        with torch.enable_grad():  # the training path's own arithmetic
            weights, ids = moe.gate(x)
            loop = (moe.routed_experts(x, weights, ids) + moe.shared_experts(x)).detach()
        assert loop.abs().max() > 0.1
        for name, twin in twins.items():
            if twin is not None:
                assert max_diff(twin(x), loop) <= ATOL, (name, n)  # 40 rows: the kernels' own fallback, the loop
        with torch.enable_grad():
            assert torch.equal(moe(x), loop)  # training takes the loop itself


@torch.no_grad()
def test_dense_moe_ignores_unchosen_experts_even_when_they_overflow():
    """An expert no token chooses contributes exact zeros, not 0 * inf = NaN, on every path."""
    moe = moe_layer(8, 2, seed=12)
    moe.gate.e_score_correction_bias[0] = -1e4  # expert 0 is never chosen...
    moe.experts[0].up_proj.weight.fill_(float("inf"))  # ...and would overflow if it ran
    x = torch.randn(4, 48)
    weights, ids = moe.gate(x)
    assert not (ids == 0).any()
    for name, twin in moe_twins(moe).items():
        out = twin(x)
        assert torch.isfinite(out).all(), name
        assert max_diff(out, moe.routed_experts(x, weights, ids) + moe.shared_experts(x)) <= ATOL, name


# --------------------------------------------------------------------------- the draft vs the spec

def draft_config(draft_vocab: int = VOCAB, **over) -> DraftConfig:
    dims = dict(vars(mla_dims()))
    dims.update(over)
    return DraftConfig(**dims, attention="mla", hidden_size=48, target_hidden_size=48, intermediate_size=80,
                       vocab_size=VOCAB, draft_vocab_size=draft_vocab, aux_layer_ids=(1, 3, 5))


def spec_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def spec_yarn(d: int, theta: float, s: dict) -> tuple[list[float], float]:
    """eagle3_mla.md §4, line by line: inv_freq per rope pair and the cos/sin magnitude."""
    lo = s["original_max_position_embeddings"]

    def corr(r):
        return d * math.log(lo / (2 * math.pi * r)) / (2 * math.log(theta))

    def m(factor, ms):
        return 1.0 if factor <= 1 else 0.1 * ms * math.log(factor) + 1

    low = max(math.floor(corr(s["beta_fast"])), 0)
    high = min(math.ceil(corr(s["beta_slow"])), d - 1)
    if low == high:
        high += 0.001
    inv = []
    for j in range(d // 2):
        pos_freq = theta ** (2 * j / d)
        ramp = min(max((j - low) / (high - low), 0.0), 1.0)
        mask = 1 - ramp
        inv.append(1 / (s["factor"] * pos_freq) * (1 - mask) + 1 / pos_freq * mask)
    return inv, m(s["factor"], s["mscale"]) / m(s["factor"], s["mscale_all_dim"])


def spec_rope(x: torch.Tensor, pos: int, inv: list[float], mag: float) -> torch.Tensor:
    """Interleaved (GPT-J) rotation: pair (2j, 2j+1) turns by pos * inv[j]."""
    out = x.clone()
    for j, f in enumerate(inv):
        c, s = math.cos(pos * f) * mag, math.sin(pos * f) * mag
        out[..., 2 * j] = x[..., 2 * j] * c - x[..., 2 * j + 1] * s
        out[..., 2 * j + 1] = x[..., 2 * j + 1] * c + x[..., 2 * j] * s
    return out


def spec_draft(draft: Eagle3Draft, embed_w: torch.Tensor, ids: torch.Tensor, h: torch.Tensor,
               norm_before_residual: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """§3.3 + §4 with one sequence, one head at a time, in float64. Returns (post-norm, pre-norm)."""
    cfg = draft.config
    W = {k: v.double() for k, v in draft.state_dict().items()}
    L0, eps = "layers.0.", cfg.rms_norm_eps
    N, P, R, V, Lk = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                      cfg.kv_lora_rank)
    inv, mag = spec_yarn(R, cfg.rope_theta, cfg.rope_scaling)
    m = 0.1 * cfg.rope_scaling["mscale_all_dim"] * math.log(cfg.rope_scaling["factor"]) + 1
    scale = (P + R) ** -0.5 * m * m
    e, h = embed_w.double()[ids[0]], h[0].double()
    T = e.shape[0]
    hn = spec_rmsnorm(h, W[L0 + "hidden_norm.weight"], eps)
    residual = hn if norm_before_residual else h
    x = torch.cat([spec_rmsnorm(e, W[L0 + "input_layernorm.weight"], eps), hn], dim=-1)  # embedding first
    a = L0 + "self_attn."
    c_q = spec_rmsnorm(x @ W[a + "q_a_proj.weight"].T, W[a + "q_a_layernorm.weight"], eps)
    q = c_q @ W[a + "q_b_proj.weight"].T                      # [T, N*(P+R)]
    kv_a = x @ W[a + "kv_a_proj_with_mqa.weight"].T           # [T, L+R]
    c_kv = spec_rmsnorm(kv_a[:, :Lk], W[a + "kv_a_layernorm.weight"], eps)
    k_pe = torch.stack([spec_rope(kv_a[t, Lk:], t, inv, mag) for t in range(T)])
    kv = c_kv @ W[a + "kv_b_proj.weight"].T                   # [T, N*(P+V)]
    heads = []
    for n in range(N):
        qn = q[:, n * (P + R):(n + 1) * (P + R)]
        q_nope = qn[:, :P]
        q_pe = torch.stack([spec_rope(qn[t, P:], t, inv, mag) for t in range(T)])
        k_nope = kv[:, n * (P + V):n * (P + V) + P]
        v = kv[:, n * (P + V) + P:(n + 1) * (P + V)]
        o = torch.zeros(T, V, dtype=torch.float64)
        for t in range(T):
            s = scale * (k_nope[:t + 1] @ q_nope[t] + k_pe[:t + 1] @ q_pe[t])
            o[t] = torch.softmax(s, 0) @ v[:t + 1]
        heads.append(o)
    residual = residual + torch.cat(heads, dim=-1) @ W[a + "o_proj.weight"].T
    z = spec_rmsnorm(residual, W[L0 + "post_attention_layernorm.weight"], eps)
    mlp = L0 + "mlp."
    gate, up = z @ W[mlp + "gate_proj.weight"].T, z @ W[mlp + "up_proj.weight"].T
    pre = residual + (gate * torch.sigmoid(gate) * up) @ W[mlp + "down_proj.weight"].T
    return spec_rmsnorm(pre, W["norm.weight"], eps)[None], pre[None]


def shared_parts(seed: int, hidden: int = 48) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.nn.Embedding(VOCAB, hidden), torch.nn.Linear(hidden, VOCAB, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, hidden, generator=g))
        head.weight.copy_(torch.randn(VOCAB, hidden, generator=g) * 0.2)
    return embed, head


@pytest.fixture(scope="module")
def spec_case():
    draft = Eagle3Draft(draft_config())
    randomise(draft, seed=11)
    embed, head = shared_parts(12)
    draft.share(embed, head)
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, VOCAB, (1, 24), generator=g)
    aux = [torch.randn(1, 24, 48, generator=g) for _ in range(3)]
    return draft.eval(), embed, ids, aux


@torch.no_grad()
def test_fc_is_a_linear_map_of_concat_aux(spec_case):
    draft, embed, ids, aux = spec_case
    want = torch.cat(aux, -1).double() @ draft.fc.weight.double().T
    assert draft.fc.weight.shape == (48, 3 * 48)
    assert max_diff(draft.combine_hidden_states(aux).double(), want) <= ATOL


@torch.no_grad()
def test_draft_forward_equals_spec_without_cache(spec_case):
    draft, embed, ids, aux = spec_case
    h = draft.combine_hidden_states(aux)
    want_post, want_pre = spec_draft(draft, embed.weight, ids, h)
    post, pre = draft(ids, h)
    assert max_diff(post.double(), want_post) <= ATOL
    assert max_diff(pre.double(), want_pre) <= ATOL
    assert max_diff(post, pre) > 0.1  # the two returns are different tensors, pre-norm fed back


@torch.no_grad()
@pytest.mark.parametrize("split", [20, 5])  # 20 new rows: naive path under "auto"; 5: absorbed
def test_draft_forward_equals_spec_with_cache_in_two_chunks(spec_case, split):
    draft, embed, ids, aux = spec_case
    h = draft.combine_hidden_states(aux)
    want_post, want_pre = spec_draft(draft, embed.weight, ids, h)
    cache = draft.new_cache(32)
    assert cache.row_width == 32 + 8  # [c_kv | k_pe]
    first = draft(ids[:, :split], h[:, :split], cache)
    second = draft(ids[:, split:], h[:, split:], cache)
    assert cache.length == 24
    assert max_diff(torch.cat([first[0], second[0]], 1).double(), want_post) <= ATOL
    assert max_diff(torch.cat([first[1], second[1]], 1).double(), want_pre) <= ATOL


@torch.no_grad()
def test_draft_variants_norm_before_residual_and_norm_output():
    draft = Eagle3Draft(draft_config(norm_before_residual=True, norm_output=True))
    randomise(draft, seed=14)
    embed, head = shared_parts(15)
    draft.share(embed, head)
    g = torch.Generator().manual_seed(16)
    ids, h = torch.randint(0, VOCAB, (1, 10), generator=g), torch.randn(1, 10, 48, generator=g)
    want_post, _ = spec_draft(draft, embed.weight, ids, h, norm_before_residual=True)
    post, fed_back = draft(ids, h)
    assert max_diff(post.double(), want_post) <= ATOL
    assert torch.equal(fed_back, post)  # EAGLE-3.1: the post-norm state is fed back


@torch.no_grad()
def test_compute_logits_maps_draft_vocab_through_d2t():
    vd = 40
    draft = Eagle3Draft(draft_config(draft_vocab=vd), own_lm_head=True)
    randomise(draft, seed=17)
    g = torch.Generator().manual_seed(18)
    targets = torch.randperm(VOCAB, generator=g)[:vd].sort().values  # ascending, as SpecForge builds it
    draft.d2t.copy_(targets - torch.arange(vd))
    assert draft.d2t.max() > 0  # non-trivial offsets
    post = torch.randn(2, 3, 48, generator=g)
    full = draft.compute_logits(post)
    small = post @ draft.lm_head.weight.T
    assert full.shape == (2, 3, VOCAB)
    assert torch.equal(full[..., targets], small)
    rest = torch.ones(VOCAB, dtype=torch.bool)
    rest[targets] = False
    assert torch.isneginf(full[..., rest]).all()
    assert torch.equal(full.argmax(-1), targets[small.argmax(-1)])


def test_full_vocab_draft_logits_are_the_lm_head():
    draft = Eagle3Draft(draft_config())
    embed, head = shared_parts(19)
    draft.share(embed, head)
    post = torch.randn(1, 2, 48)
    assert not hasattr(draft, "d2t")
    assert torch.equal(draft.compute_logits(post), head(post))


@torch.no_grad()
def test_mha_draft_shapes_and_cache():
    from workbench.training.draft_init import draft_config_for, init_draft
    from workbench.training.pretrain import tiny_kimi_config

    vcfg = tiny_kimi_config(vocab_size=VOCAB)
    vcfg.hidden_size = 48
    cfg = draft_config_for(vcfg, "mha", intermediate_size=64)
    draft = init_draft(cfg, seed=20, std=0.15)
    randomise(draft.layers[0], seed=21)
    embed, head = shared_parts(22)
    draft.share(embed, head)
    attn = draft.layers[0].self_attn
    n, d = cfg.num_attention_heads, cfg.head_dim
    assert (n, d) == (4, 12)
    assert attn.q_proj.weight.shape == (n * d, 96) and attn.k_proj.weight.shape == (n * d, 96)
    assert attn.o_proj.weight.shape == (48, n * d)
    cache = draft.new_cache(32)
    assert cache.row_width == attn.row_width == cfg.cache_row == 2 * cfg.num_key_value_heads * d
    g = torch.Generator().manual_seed(23)
    ids, h = torch.randint(0, VOCAB, (1, 14), generator=g), torch.randn(1, 14, 48, generator=g)
    post, pre = draft(ids, h)
    parts = [draft(ids[:, a:b], h[:, a:b], cache) for a, b in ((0, 9), (9, 10), (10, 14))]
    assert cache.length == 14
    assert max_diff(torch.cat([p[0] for p in parts], 1), post) <= ATOL
    assert max_diff(torch.cat([p[1] for p in parts], 1), pre) <= ATOL
