"""The roofline MODEL of a speculative step: presets against the real configs, bytes, FLOPs and
all-reduces by hand, HBM capacity by hand, the physics every row must obey, and input checks."""
import json
from dataclasses import replace

import pytest

from workbench.decoding.stats import expected_accept_length
from workbench.analysis.roofline import (
    GPU_MEMORY_UTILIZATION,
    H200,
    KIMI_K2,
    KIMI_K2_MLA_DRAFT,
    KIMI_MLA_COND_RATES,
    Hardware,
    draft_cost,
    gpu_model,
    max_batch,
    verify_cost,
    weights_per_gpu,
)
from tests.helpers import REAL
from workbench.config import DraftConfig, VerifierConfig

VERIFIER_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                   "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
                   "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                   "first_k_dense_replace", "moe_layer_freq", "vocab_size", "cache_row")
DRAFT_FIELDS = ("attention", "hidden_size", "target_hidden_size", "num_attention_heads", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
                "draft_vocab_size", "cache_row")


@pytest.fixture(scope="module")
def default_model():
    return gpu_model()


def _row(model, b, k):
    return next(r for r in model.table if r["B"] == b and r["k"] == k)


def test_presets_are_the_real_configs():
    v = VerifierConfig.from_hf(json.loads((REAL / "moonshotai__Kimi-K2-Instruct.config.json").read_text()))
    d = DraftConfig.from_hf(json.loads((REAL / "zhubohao911__TorchSpec__kimi_k25_eagle3_mla.config.json").read_text()),
                            num_target_layers=v.num_hidden_layers)
    for name in VERIFIER_FIELDS:
        assert getattr(KIMI_K2, name) == getattr(v, name), name
    assert [KIMI_K2.is_moe_layer(i) for i in range(61)] == [v.is_moe_layer(i) for i in range(61)]
    for name in DRAFT_FIELDS:
        assert getattr(KIMI_K2_MLA_DRAFT, name) == getattr(d, name), name


def test_parameter_counts_match_the_published_sizes():
    # Kimi-K2: "1T total, 32B activated"; the MLA draft: 0.667 B core + a 1.174 B lm_head (eagle3_mla.md §2).
    one = dict(tp=1, weight_bytes=1.0)
    assert verify_cost(KIMI_K2, 1, 0, 0, **one).weight_bytes == pytest.approx(31.7e9, rel=0.01)
    assert verify_cost(KIMI_K2, 10**5, 0, 0, **one).weight_bytes == pytest.approx(1.025e12, rel=0.01)
    assert draft_cost(KIMI_K2_MLA_DRAFT, KIMI_K2, 1, 0, **one).weight_bytes == pytest.approx(1.841e9, rel=0.001)


def test_toy_verifier_by_hand():
    H, heads, L, P, R, V, I, moe_i, vocab = 16, 2, 8, 4, 2, 4, 32, 8, 50
    cfg = VerifierConfig(num_attention_heads=heads, q_lora_rank=None, kv_lora_rank=L, qk_nope_head_dim=P,
                         qk_rope_head_dim=R, v_head_dim=V, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                         vocab_size=vocab, hidden_size=H, intermediate_size=I, moe_intermediate_size=moe_i,
                         num_hidden_layers=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                         first_k_dense_replace=1)
    attn = H * heads * (P + R) + H * (L + R) + L + L * heads * (P + V) + heads * V * H + 2 * H  # per layer
    expert = 3 * H * moe_i
    dense = 2 * attn + 3 * H * I + (expert + 4 * H) + (vocab * H + H)  # MLP of layer 0; shared + router of 1
    assert (attn, dense) == (648, 4096)
    B, k, context, tp = 1, 1, 5, 2
    touched = 4 * (1 - (1 - 2 / 4) ** 2)  # two tokens, top-2 of 4 experts
    weight = (dense + touched * expert) / tp
    kv = 2 * (L + R) * 2 * (B * (context + k + 1) + B * (k + 1))  # 2 layers, bf16, replicated
    attn_flops = 2 * heads * (B * (2 * context + 1 + 2)) * (2 * (L + R) + 2 * L)  # keys seen: 6 and 7
    flops = (2 * (dense + 2 * expert) * 2 + attn_flops) / tp
    toy = Hardware("toy", hbm_bytes_per_s=1000.0, dense_flops_per_s=1e4, nvlink_bytes_per_s=64.0,
                   allreduce_latency_s=0.25)
    c = verify_cost(cfg, B, k, context, hw=toy, tp=tp, comm=False)
    assert (c.weight_bytes, c.kv_bytes, c.flops, c.comm_s) == (pytest.approx(weight), kv, pytest.approx(flops), 0)
    assert (weight, kv, flops) == (2624, 360, 10664)
    assert c.seconds == pytest.approx((2624 + 360) / 1000.0) and c.bound == "memory"
    assert verify_cost(cfg, B, k, context, hw=replace(toy, hbm_bytes_per_s=1e9), tp=tp, comm=False).bound == "compute"
    # 2 layers x 2 all-reduces of 2 tokens x 16 bf16 values (64 B): ring 2*(2-1)/2 * 64 B / 64 B/s + 0.25 s.
    c = verify_cost(cfg, B, k, context, hw=toy, tp=tp)
    assert c.comm_s == pytest.approx(4 * (1.0 + 0.25)) and c.bound == "communication"
    assert c.seconds == pytest.approx((2624 + 360) / 1000.0 + 5.0)
    assert verify_cost(cfg, B, k, context, hw=toy, tp=1).comm_s == 0  # no TP, no all-reduce


def test_kimi_k2_allreduces_by_hand():
    # B=8, k=3 at TP 8: 2 all-reduces x 61 layers of 32 tokens x 7168 bf16 values each.
    one = 2 * 7 / 8 * 32 * 7168 * 2 / 900e9 + 10e-6
    v = verify_cost(KIMI_K2, 8, 3, 4096)
    assert v.comm_s == pytest.approx(122 * one, rel=1e-12) and v.comm_s == pytest.approx(1.329e-3, rel=1e-3)
    bare = verify_cost(KIMI_K2, 8, 3, 4096, comm=False)
    assert bare.comm_s == 0 and v.seconds == pytest.approx(bare.seconds + v.comm_s, rel=1e-12)
    d = draft_cost(KIMI_K2_MLA_DRAFT, KIMI_K2, 8, 4096)  # its one layer: 2 all-reduces of 8 tokens
    assert d.comm_s == pytest.approx(2 * (2 * 7 / 8 * 8 * 7168 * 2 / 900e9 + 10e-6), rel=1e-12)
    assert verify_cost(KIMI_K2, 8, 3, 4096, tp=1).comm_s == 0


def test_weights_per_gpu_by_hand():
    # Kimi-K2 FP8 at TP 8, norms left out: 61 MLA blocks, layer 0's dense MLP, 60 MoE layers of
    # 384 routed + 1 shared expert and a router, embedding + lm_head; the bf16 draft of 1.841 B.
    H, V = 7168, 163840
    attn = H * 1536 + 1536 * 64 * 192 + H * 576 + 512 * 64 * (128 + 128) + 64 * 128 * H
    verifier = 61 * attn + 3 * H * 18432 + 60 * (385 * 3 * H * 2048 + 384 * H) + 2 * V * H
    by_hand = (verifier * 1.0 + 1.841e9 * 2.0) / 8
    module = weights_per_gpu(KIMI_K2, KIMI_K2_MLA_DRAFT, tp=8)
    assert module == pytest.approx(by_hand, rel=0.01) and 127e9 < module < 130e9
    assert module > GPU_MEMORY_UTILIZATION * 141e9  # "141 GB" read as 141e9 B would not even hold them


def test_max_batch_by_hand(default_model):
    budget = 0.9 * 139.81 * 2**30 - weights_per_gpu(KIMI_K2, KIMI_K2_MLA_DRAFT)
    per_seq = (4096 + 0 + 1) * (61 + 1) * 576 * 2  # latent rows of verifier + draft, bf16, every rank
    assert max_batch(context=4096) == int(budget // per_seq) == 21
    per_seq_k5 = (4096 + 5 + 1) * 62 * 576 * 2
    assert max_batch(context=4096, k=5) == int(budget // per_seq_k5) == default_model.max_batch
    assert default_model.weight_bytes_per_gpu == weights_per_gpu(KIMI_K2, KIMI_K2_MLA_DRAFT)
    for r in default_model.table:
        assert r["fits"] == (r["B"] <= 21)
    assert sorted(default_model.best_k) == list(range(1, 22))  # best_k only over feasible B
    assert max_batch(context=256) > 16 * max_batch(context=4096)
    assert max_batch(context=4096, tp=16) > 10 * max_batch(context=4096)  # half the weights per GPU


def test_infeasible_configs_raise():
    with pytest.raises(ValueError, match=r"weights alone take 257.1 GB per GPU at tp = 8"):
        gpu_model(batch_sizes=(1,), weight_bytes=2.0)  # bf16 Kimi-K2 on 8 H200s
    with pytest.raises(ValueError, match=r"weights alone take 128.8 GB"):
        max_batch(hw=replace(H200, hbm_capacity_bytes=141e9))
    with pytest.raises(ValueError, match=r"one sequence of 1000000 \+ 1 tokens needs 71.42 GB"):
        max_batch(context=10**6)
    assert max_batch(context=900_000, tp=16) == 1  # 64.3 GB of cache beside 64.4 GB of weights


def test_speedup_never_beats_accept_length(default_model):
    for r in default_model.table:
        assert r["speedup"] <= expected_accept_length(list(KIMI_MLA_COND_RATES), r["k"]) + 1e-12
        assert r["t_step_ms"] >= r["t_decode_ms"]


def test_verify_grows_with_batch_and_k(default_model):
    for k in range(6):
        ts = [_row(default_model, b, k)["t_verify_ms"] for b in (1, 2, 8, 21, 64, 256, 1024)]
        assert ts == sorted(ts) and len(set(ts)) == len(ts)
    for b in (1, 8, 21, 64, 256, 1024):
        ts = [_row(default_model, b, k)["t_verify_ms"] for k in range(6)]
        assert ts == sorted(ts) and len(set(ts)) == len(ts)


def test_small_batch_is_weight_or_latency_bound():
    v0, v3 = verify_cost(KIMI_K2, 1, 0, 4096, comm=False), verify_cost(KIMI_K2, 1, 3, 4096, comm=False)
    assert v0.bound == v3.bound == "memory" and v0.weight_bytes > 10 * v0.kv_bytes
    # A dense verifier of the same shape: 4 tokens cost what 1 does (the weights are read once).
    dense = replace(KIMI_K2, n_routed_experts=None)
    d3, d0 = (verify_cost(dense, 1, k, 4096, comm=False).seconds for k in (3, 0))
    assert d3 / d0 < 1.01
    # The MoE: 4 uniformly routed tokens touch ~31 of 384 experts per layer where 1 touches 8, so
    # the verify costs ~2.8 decodes, all of it in the weights read.
    ratio = v3.seconds / v0.seconds
    assert 2.5 < ratio < 3.0
    assert ratio == pytest.approx((v3.weight_bytes + v3.kv_bytes) / (v0.weight_bytes + v0.kv_bytes))
    # With the 122 all-reduce latencies (1.22 ms) one decode token waits on communication more than
    # on its 0.89 ms of HBM reads; a verify pays them once for its 4 tokens, and speculation pays.
    c0 = verify_cost(KIMI_K2, 1, 0, 4096)
    assert c0.bound == "communication" and 1.2e-3 < c0.comm_s < 1.25e-3
    assert verify_cost(KIMI_K2, 1, 3, 4096).seconds / c0.seconds < 2.0


def test_crossover_needs_room_for_thousands_of_short_sequences():
    # On real H200s at TP 8 a short context still fits only a few hundred sequences: no crossover.
    real = gpu_model(batch_sizes=[2 ** i for i in range(12)], context=256)
    assert real.max_batch == max_batch(context=256, k=5) < 400 and real.crossover is None
    assert _row(real, 2048, 1)["fits"] is False and 2048 not in real.best_k
    # A hypothetical H200 with twice the HBM, at 128 tokens of context: B up to ~14800 fit.
    big = replace(H200, name="H200 with 2x HBM", hbm_capacity_bytes=2 * H200.hbm_capacity_bytes)
    grid = [2 ** i for i in range(15)]
    m = gpu_model(batch_sizes=grid, context=128, hw=big)
    assert 8192 < m.max_batch < 16384 and not _row(m, 16384, 0)["fits"]
    assert m.crossover is not None and 1024 < m.crossover <= 8192
    assert all(m.best_k[b] == 0 for b in grid if m.crossover <= b <= m.max_batch)
    assert _row(m, 8192, 1)["bound"] == "compute" and _row(m, 8192, 0)["bound"] == "compute"
    assert all(x is not None and x <= 8192 for x in m.crossover_per_k.values())
    assert m.crossover_per_k[5] <= m.crossover_per_k[1]  # a longer chain stops paying first


def test_defaults_have_no_crossover(default_model):
    # Only 21 sequences of 4096 tokens fit; at each, speculation pays (the all-reduce latencies at
    # small B, the replicated latent cache read shared by the k+1 queries near the limit).
    assert default_model.crossover is None and set(default_model.crossover_per_k.values()) == {None}
    assert default_model.best_k[21] > 0 and _row(default_model, 21, 3)["speedup"] > 1.3
    assert _row(default_model, 21, 0)["bound"] == "memory"
    assert all(k > 0 for k in default_model.best_k.values())


def test_best_k_is_the_table_argmax(default_model):
    for b in (1, 3, 8, 16, 21):
        rows = [_row(default_model, b, k) for k in range(1, 6)]
        top = max(rows, key=lambda r: r["speedup"])
        assert default_model.best_k[b] == (top["k"] if top["speedup"] > 1 else 0)
    # k=5 loses at B=1 on the bare roofline (the experts), wins once the all-reduces are counted.
    assert gpu_model(batch_sizes=(1,), ks=(0, 5), comm=False).best_k == {1: 0}
    assert gpu_model(batch_sizes=(1,), ks=(0, 5)).best_k == {1: 5}


def test_fixed_cost_per_forward_favours_speculation():
    bare, fixed = (gpu_model(batch_sizes=(1,), ks=(3,), fixed_s=f, comm=False) for f in (0.0, 0.010))
    assert _row(bare, 1, 3)["speedup"] < 1 < _row(fixed, 1, 3)["speedup"]
    assert _row(fixed, 1, 0)["t_decode_ms"] == pytest.approx(_row(bare, 1, 0)["t_decode_ms"] + 10)


def test_serialises_and_says_it_is_a_model():
    m = gpu_model(batch_sizes=(1, 64), ks=range(0, 3))
    back = json.loads(json.dumps(m.to_dict()))
    assert back["hardware"] == {"name": "H200", "hbm_bytes_per_s": 4.8e12, "dense_flops_per_s": 989e12,
                                "hbm_capacity_bytes": 139.81 * 2**30, "nvlink_bytes_per_s": 900e9,
                                "allreduce_latency_s": 10e-6}
    assert len(back["table"]) == 6 and set(back["best_k"]) == {"1"} and back["max_batch"] == 21
    assert [r["fits"] for r in back["table"]] == [True] * 3 + [False] * 3
    text = m.summary()
    assert "MODEL, not a measurement" in text and "uniform expert routing" in text
    assert "Feasible B: 1..21" in text and "all-reduces" in text
    assert H200 == Hardware()


@pytest.mark.parametrize("call, match", [
    (lambda: verify_cost(KIMI_K2, 0, 3, 10), r"B = 0; expected an integer >= 1"),
    (lambda: verify_cost(KIMI_K2, 1.5, 3, 10), r"B = 1.5; expected an integer >= 1"),
    (lambda: verify_cost(KIMI_K2, 1, -1, 10), r"k = -1; expected an integer >= 0"),
    (lambda: verify_cost(KIMI_K2, 1, 1, -5), r"context = -5; expected an integer >= 0"),
    (lambda: verify_cost(KIMI_K2, 1, 1, 10, tp=0), r"tp = 0; expected an integer >= 1"),
    (lambda: verify_cost(KIMI_K2, 1, 1, 10, weight_bytes=0), r"weight_bytes = 0; expected bytes > 0"),
    (lambda: draft_cost(KIMI_K2_MLA_DRAFT, KIMI_K2, 0, 10), r"B = 0; expected an integer >= 1"),
    (lambda: gpu_model(batch_sizes=(1,), tp=0), r"tp = 0; expected an integer >= 1"),
    (lambda: gpu_model(batch_sizes=(1,), ks=(-1,)), r"k = -1; expected an integer >= 0"),
    (lambda: gpu_model(batch_sizes=(1,), cond_rates=(0.8, 1.2)), r"cond_rates\[1\] = 1.2; expected a probability in \[0, 1\]"),
    (lambda: gpu_model(batch_sizes=(1,), cond_rates=(-0.1,)), r"cond_rates\[0\] = -0.1; expected a probability"),
    (lambda: gpu_model(batch_sizes=(1,), cond_rates=()), r"cond_rates is empty"),
    (lambda: gpu_model(batch_sizes=(1,), gpu_memory_utilization=1.5), r"gpu_memory_utilization = 1.5; expected a"),
    (lambda: max_batch(context=-1), r"context = -1; expected an integer >= 0"),
    (lambda: max_batch(draft_weight_bytes=0), r"draft_weight_bytes = 0; expected bytes > 0"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
