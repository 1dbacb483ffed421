"""A roofline MODEL (paper arithmetic, not a measurement) of one speculative step of Kimi-K2 with
its EAGLE-3 MLA draft on GPUs, against the batch size B and k (num_speculative_tokens).

Per GPU under tensor parallelism TP, weight bytes and FLOPs divide by TP; the MLA latent KV cache
is replicated on every rank (vLLM runs MLA this way), so KV bytes do not. A forward over N tokens:

    t = max(bytes / hbm_bytes_per_s, flops / dense_flops_per_s) + t_comm + fixed_s
    t_comm = ALLREDUCES_PER_LAYER * layers * (2 (tp-1)/tp * N * hidden * ACT_BYTES / nvlink_bytes_per_s
                                              + allreduce_latency_s)      (0 at tp = 1 or comm=False)

i.e. a ring all-reduce after attention and after the MLP/MoE of each layer (122 per verifier
forward, 2 per draft forward), not overlapped. Left out: the embedding's all-reduce, lm_head's
gather, launches, sampling: `fixed_s` / `draft_fixed_s` (per verifier / draft forward, default 0)
add such seconds. `bound` names the largest of the memory, compute and communication times.
Weights cost `weight_bytes` per parameter (1.0: Kimi-K2's FP8 checkpoint, its bf16 norms, router
and lm_head counted at the same rate), the cache `kv_bytes` per value (2: bf16).

HBM CAPACITY: B sequences fit with k when, per GPU (+1 layer: the draft's own cache),
    W + B * (context + k + 1) * (layers + 1) * cache_row * kv_bytes <= gpu_memory_utilization * hbm_capacity_bytes,
    W = (all verifier parameters, embedding included) * weight_bytes / tp + draft params * draft_weight_bytes / tp.
The rest of HBM stands for activations, CUDA graphs, NCCL buffers. W splits every matrix by TP
(vLLM replicates q_a, kv_a, the router: ~1 GB more per GPU for Kimi-K2 at TP 8): max_batch is an
upper bound. A row has fits = B <= max_batch(k); B is feasible when every k of the grid fits
(B <= GpuModel.max_batch); best_k, crossover and crossover_per_k see feasible B only.

VERIFIER forward over N = B*(k+1) new tokens, each sequence with `context` tokens cached:
- weights read = dense parts once (per layer q_a + q_b or q_proj, kv_a, kv_b, o_proj, norms; the
  SwiGLU MLP of the first_k_dense layers; each MoE layer's shared experts and router; lm_head V*H;
  the N embedding rows are negligible and left out) + per MoE layer the distinct routed experts
  the N tokens touch, E*(1 - (1 - top_k/E)^N), each 3*H*moe_intermediate_size parameters
  (ASSUMPTION: tokens choose experts uniformly and independently);
- KV bytes = per layer B*(context + k + 1) latent rows of cache_row values read (the absorbed MLA
  reads each row once for all heads and all k+1 queries) + N rows written;
- FLOPs = 2 * active * N, active = dense parts + shared experts + top_k routed experts per MoE
  layer + lm_head; kv_b's share, 2*L*P (W_UK into q) + 2*L*V (W_UV out of the latent) per head
  per token, is exactly the absorption of the absorbed path, so it is counted once, there;
  + attention: per layer, head and (new token, visible key) pair 2*(L+R) for the score and 2*L
  for the latent-weighted sum; new token j of the k+1 sees context + j + 1 keys.
  (L = kv_lora_rank, R = qk_rope_head_dim, P = qk_nope_head_dim, V = v_head_dim.)
DRAFT forward (one MLA layer whose q_a and kv_a read a 2H input, fc over 3H, a dense SwiGLU MLP,
its norms, an lm_head of draft_vocab_size rows; the verifier's embedding is shared): the same
terms over B tokens and its one-layer cache; each of a step's k draft forwards counts B tokens.

    t_decode(B) = t_verify(B, k=0);  t_step(B, k) = t_verify(B, k) + k * t_draft(B)
    speedup(B, k) = E(k) * t_decode(B) / t_step(B, k),  E(k) = expected_accept_length(rates, k)

The crossover is the smallest feasible B of the grid from which on (it and every larger feasible
B) no k in 1..k_max has speedup > 1 (with MoE the speedup is not monotone in B). For Kimi-K2 FP8
at TP 8 on H200s the weights take 128.8 of each GPU's 135.1 GB: at 4096 tokens of context B <= 21.
At B = 1 the 122 all-reduce latencies (1.2 ms) outweigh the weight read and a verify pays them
once for k+1 tokens; near B = 21 the replicated cache read, shared by the k+1 queries, dominates.
Speculation pays at every feasible B: no crossover (nor at 64 to 32768 tokens of context).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from workbench.analysis.kvcache import KIMI_K2_MLA_DRAFT, KIMI_K2_VERIFIER, bytes_per_token
from workbench.decoding.stats import expected_accept_length
from workbench.config import DraftConfig, MLADims, VerifierConfig

KIMI_K2 = KIMI_K2_VERIFIER  # the presets built in code from eagle3_mla.md §1.2 (tests check them)
__all__ = ["KIMI_K2", "KIMI_K2_MLA_DRAFT", "H200", "KIMI_MLA_COND_RATES", "Hardware", "StepCost", "GpuModel",
           "verify_cost", "draft_cost", "weights_per_gpu", "max_batch", "gpu_model", "GPU_MEMORY_UTILIZATION"]

# Flat conditional rate 0.797 gives E(3) = 2.94, lightseekorg/kimi-k2.5-eagle3-mla's MT-Bench
# accept length at k=3 (accept_anchors.md §1); flat because the only per-position Kimi MLA
# breakdown there (k2.6-mla, 0.633/0.404/0.264 unconditional) is conditionally 0.633/0.638/0.653.
KIMI_MLA_COND_RATES = (0.797, 0.797, 0.797)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization; the 10% left: activations/runtime
ACT_BYTES = 2  # bf16: the dtype of the activations a TP all-reduce carries
ALLREDUCES_PER_LAYER = 2  # vLLM: row-parallel o_proj and MLP/MoE down projection each end in an all-reduce
# vLLM's total_gpu_memory on an H200, 139.81 GiB (nvidia-smi: 143771 MiB): the datasheet's "141 GB" are GiB.
H200_HBM_BYTES = 139.81 * 2**30


@dataclass(frozen=True)
class Hardware:
    name: str = "H200"
    hbm_bytes_per_s: float = 4.8e12  # H200 datasheet HBM3e bandwidth
    dense_flops_per_s: float = 989e12  # H200 datasheet dense bf16 tensor-core peak
    hbm_capacity_bytes: float = H200_HBM_BYTES  # see H200_HBM_BYTES
    nvlink_bytes_per_s: float = 900e9  # NVLink 4 aggregate bidirectional per GPU as all-reduce bus bw: optimistic
    allreduce_latency_s: float = 10e-6  # ASSUMPTION: the order NCCL reports for small messages on 8 GPUs


H200 = Hardware()


@dataclass(frozen=True)
class StepCost:
    """One forward on one GPU (after the TP division)."""

    weight_bytes: float
    kv_bytes: float
    flops: float
    comm_s: float  # the TP all-reduces' time
    seconds: float
    bound: str  # "memory", "compute" or "communication": the largest of the three times


def _check(ints=(), positive=()) -> None:
    """ints: (name, value, least allowed integer); positive: (name, bytes that must be > 0)."""
    for name, value, low in ints:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} = {value!r}; expected an integer >= {low}")
    for name, value in positive:
        if not value > 0:
            raise ValueError(f"{name} = {value!r}; expected bytes > 0")


def _attn_params(m: MLADims, hidden: int, in_dim: int) -> int:
    """One MLA block: q (LoRA or direct), kv_a, kv_b, o_proj and its norms (q_a, kv_a, 2 layer norms)."""
    heads, qk = m.num_attention_heads, m.qk_head_dim
    q = in_dim * qk * heads if m.q_lora_rank is None else m.q_lora_rank * (in_dim + qk * heads + 1)
    kv = in_dim * m.cache_row + m.kv_lora_rank * (1 + heads * (m.qk_nope_head_dim + m.v_head_dim))
    return q + kv + heads * m.v_head_dim * hidden + 2 * hidden


def _attn_flops(m: MLADims, layers: int, b: int, new: int, context: int) -> float:
    """Score (2*(L+R)) and latent sum (2*L) per head per (new token, visible key) pair."""
    pairs = b * (new * context + new * (new + 1) // 2)
    return layers * m.num_attention_heads * pairs * (2 * m.cache_row + 2 * m.kv_lora_rank)


def _verifier_params(vcfg: VerifierConfig) -> tuple[int, int, int]:
    """(dense parts read whole by every forward, embedding excluded; one routed expert; MoE layers)."""
    h, layers = vcfg.hidden_size, vcfg.num_hidden_layers
    moe = sum(vcfg.is_moe_layer(i) for i in range(layers))
    expert = 3 * h * vcfg.moe_intermediate_size
    dense = (layers * _attn_params(vcfg, h, h) + h * (vcfg.vocab_size + 1)  # lm_head + final norm
             + (layers - moe) * 3 * h * vcfg.intermediate_size
             + moe * (vcfg.n_shared_experts * expert + (vcfg.n_routed_experts or 1) * h))  # shared + router
    return dense, expert, moe


def _draft_params(dcfg: DraftConfig) -> int:
    h = dcfg.hidden_size
    return (3 * dcfg.target_hidden_size * h + 2 * h  # fc; hidden_norm and the final norm
            + _attn_params(dcfg, h, 2 * h) + 3 * h * dcfg.intermediate_size + h * dcfg.draft_vocab_size)


def _allreduce_s(tokens: int, hidden: int, count: int, hw: Hardware, tp: int) -> float:
    """`count` ring all-reduces of tokens x hidden bf16 activations (none without TP)."""
    ring = 2 * (tp - 1) / tp * tokens * hidden * ACT_BYTES / hw.nvlink_bytes_per_s
    return count * (ring + hw.allreduce_latency_s) if tp > 1 else 0.0


def _cost(params: float, kv_values: float, flops: float, comm_s: float, hw: Hardware, tp: int,
          weight_bytes: float, kv_bytes: int, fixed_s: float) -> StepCost:
    if not fixed_s >= 0:
        raise ValueError(f"fixed_s = {fixed_s!r}; expected seconds >= 0")
    w, kv, f = params * weight_bytes / tp, kv_values * kv_bytes, flops / tp  # latent cache replicated
    times = {"memory": (w + kv) / hw.hbm_bytes_per_s, "compute": f / hw.dense_flops_per_s,
             "communication": comm_s}
    seconds = max(times["memory"], times["compute"]) + comm_s + fixed_s
    return StepCost(w, kv, f, comm_s, seconds, max(times, key=times.get))


def verify_cost(vcfg: VerifierConfig, B: int, k: int, context: int, hw: Hardware = H200, tp: int = 8,
                weight_bytes: float = 1.0, kv_bytes: int = 2, fixed_s: float = 0.0, comm: bool = True) -> StepCost:
    """The verifier's forward over k+1 new tokens for each of B sequences (k=0: plain decoding)."""
    _check((("B", B, 1), ("k", k, 0), ("context", context, 0), ("tp", tp, 1)),
           (("weight_bytes", weight_bytes), ("kv_bytes", kv_bytes)))
    n, layers = B * (k + 1), vcfg.num_hidden_layers
    dense, expert, moe = _verifier_params(vcfg)
    e, top = vcfg.n_routed_experts or 1, vcfg.num_experts_per_tok
    touched = e * (1 - (1 - top / e) ** n)  # uniform routing: expected distinct experts per layer
    rows = B * (context + k + 1) + n  # read every visible row once, write the n new ones
    flops = 2 * (dense + moe * top * expert) * n + _attn_flops(vcfg, layers, B, k + 1, context)
    comm_s = _allreduce_s(n, vcfg.hidden_size, ALLREDUCES_PER_LAYER * layers, hw, tp) if comm else 0.0
    return _cost(dense + moe * touched * expert, rows * bytes_per_token(vcfg, 1), flops, comm_s, hw, tp,
                 weight_bytes, kv_bytes, fixed_s)


def draft_cost(dcfg: DraftConfig, vcfg: VerifierConfig, B: int, context: int, hw: Hardware = H200,
               tp: int = 8, weight_bytes: float = 2.0, kv_bytes: int = 2, fixed_s: float = 0.0,
               comm: bool = True) -> StepCost:
    """One draft forward over B tokens (weight_bytes 2.0: the published MLA drafts are bf16)."""
    if dcfg.attention != "mla" or dcfg.hidden_size != vcfg.hidden_size:
        raise ValueError(f"dcfg: attention {dcfg.attention!r}, hidden_size {dcfg.hidden_size}; "
                         f"expected an MLA draft of the verifier's width {vcfg.hidden_size}")
    _check((("B", B, 1), ("context", context, 0), ("tp", tp, 1)),
           (("weight_bytes", weight_bytes), ("kv_bytes", kv_bytes)))
    params = _draft_params(dcfg)
    flops = 2 * params * B + _attn_flops(dcfg, 1, B, 1, context)
    rows = B * (context + 1) + B
    comm_s = _allreduce_s(B, dcfg.hidden_size, ALLREDUCES_PER_LAYER, hw, tp) if comm else 0.0
    return _cost(params, rows * bytes_per_token(dcfg, 1), flops, comm_s, hw, tp, weight_bytes, kv_bytes, fixed_s)


def weights_per_gpu(vcfg: VerifierConfig, dcfg: DraftConfig, tp: int = 8, weight_bytes: float = 1.0,
                    draft_weight_bytes: float = 2.0) -> float:
    """Bytes of every verifier parameter (embedding included) and every draft one, split by TP."""
    _check([("tp", tp, 1)], (("weight_bytes", weight_bytes), ("draft_weight_bytes", draft_weight_bytes)))
    dense, expert, moe = _verifier_params(vcfg)
    verifier = dense + moe * (vcfg.n_routed_experts or 0) * expert + vcfg.vocab_size * vcfg.hidden_size
    return (verifier * weight_bytes + _draft_params(dcfg) * draft_weight_bytes) / tp


def max_batch(vcfg: VerifierConfig = KIMI_K2, dcfg: DraftConfig = KIMI_K2_MLA_DRAFT, context: int = 4096,
              k: int = 0, hw: Hardware = H200, tp: int = 8, weight_bytes: float = 1.0, draft_weight_bytes: float = 2.0,
              kv_bytes: int = 2, gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION) -> int:
    """The largest B whose weights and latent caches fit per GPU; ValueError if not even B = 1 does."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization = {gpu_memory_utilization!r}; expected a fraction in (0, 1]")
    _check((("k", k, 0), ("context", context, 0)), [("kv_bytes", kv_bytes)])
    weights = weights_per_gpu(vcfg, dcfg, tp, weight_bytes, draft_weight_bytes)
    one = (context + k + 1) * (bytes_per_token(vcfg, kv_bytes) + bytes_per_token(dcfg, kv_bytes))  # replicated
    budget = gpu_memory_utilization * hw.hbm_capacity_bytes
    if weights >= budget:
        raise ValueError(f"no batch fits: the weights alone take {weights / 1e9:.1f} GB per GPU at tp = {tp}, "
                         f"over {gpu_memory_utilization} x {hw.hbm_capacity_bytes / 1e9:.1f} GB of {hw.name}")
    b = int((budget - weights) // one)
    if b < 1:
        raise ValueError(f"no batch fits: one sequence of {context} + {k + 1} tokens needs {one / 1e9:.2f} GB "
                         f"of latent cache per GPU, {(budget - weights) / 1e9:.2f} GB is left after the weights")
    return b


@dataclass(frozen=True)
class GpuModel:
    """The model's table (one row per (B, k)), best k per feasible B and the crossovers; plain data."""

    hardware: Hardware
    tp: int
    context: int
    cond_rates: tuple[float, ...]
    table: list[dict] = field(default_factory=list)
    best_k: dict[int, int] = field(default_factory=dict)  # feasible B only
    crossover: int | None = None
    crossover_per_k: dict[int, int | None] = field(default_factory=dict)
    max_batch: int = 0  # the largest B at which every k of the grid fits at this context
    weight_bytes_per_gpu: float = 0.0
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        hw, per_k = self.hardware, ", ".join(f"k={k}: {x}" for k, x in sorted(self.crossover_per_k.items()))
        return (f"Roofline MODEL, not a measurement: MLA verifier + EAGLE-3 MLA draft on {hw.name} x{self.tp} "
                f"(TP, latent KV replicated per rank), context {self.context}, per forward max(bytes / "
                f"{hw.hbm_bytes_per_s:.3g} B/s, FLOPs / {hw.dense_flops_per_s:.3g} FLOP/s) + {ALLREDUCES_PER_LAYER} "
                f"ring all-reduces per layer ({hw.nvlink_bytes_per_s:.3g} B/s, {hw.allreduce_latency_s * 1e6:.3g} us"
                f" each) + any fixed seconds given, uniform expert routing, conditional acceptance "
                f"{list(self.cond_rates)}. Feasible B: 1..{self.max_batch} (weights "
                f"{self.weight_bytes_per_gpu / 1e9:.1f} GB per GPU of {self.gpu_memory_utilization} x "
                f"{hw.hbm_capacity_bytes / 1e9:.1f} GB; "
                f"{len(self.best_k)} of the grid's B fit every k; rows that do not have fits=False). "
                + (f"Speculation stops paying from B = {self.crossover} on" if self.crossover
                   else "Speculation still pays at the largest feasible B modelled (no crossover)")
                + f" (first B from which each k stops paying: {per_k}; None: never on the feasible grid).")


def _crossover(pays: dict[int, bool]) -> int | None:
    """The smallest B from which on nothing pays; None if the largest B still pays."""
    last_paying = max((b for b, p in pays.items() if p), default=0)
    return min((b for b in pays if b > last_paying), default=None)


def gpu_model(vcfg: VerifierConfig = KIMI_K2, dcfg: DraftConfig = KIMI_K2_MLA_DRAFT,
              batch_sizes=range(1, 1025), ks=range(0, 6), context: int = 4096,
              cond_rates=KIMI_MLA_COND_RATES, hw: Hardware = H200, tp: int = 8,
              weight_bytes: float = 1.0, draft_weight_bytes: float = 2.0, kv_bytes: int = 2,
              fixed_s: float = 0.0, draft_fixed_s: float = 0.0, comm: bool = True,
              gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION) -> GpuModel:
    """speedup(B, k) = E(k) * t_decode(B) / t_step(B, k) on every B of the grid (every integer 1..1024);
    rows past max_batch(k) have fits=False and take no part in best_k or the crossovers."""
    rates = tuple(cond_rates)
    expected_accept_length(list(rates), max(len(rates), 1))  # raises on no rates or one outside [0, 1]
    ks = sorted(set(ks) | {0})
    mem = dict(hw=hw, tp=tp, weight_bytes=weight_bytes, draft_weight_bytes=draft_weight_bytes,
               kv_bytes=kv_bytes, gpu_memory_utilization=gpu_memory_utilization)
    limit = {k: max_batch(vcfg, dcfg, context, k, **mem) for k in ks}  # raises if B = 1 does not fit
    feasible = limit[ks[-1]]  # every k of the grid fits
    common = dict(hw=hw, tp=tp, kv_bytes=kv_bytes, comm=comm)
    verify = dict(common, weight_bytes=weight_bytes, fixed_s=fixed_s)
    table, best_k, pays = [], {}, {k: {} for k in ks if k > 0}
    for b in sorted(set(batch_sizes)):
        t_draft = draft_cost(dcfg, vcfg, b, context, weight_bytes=draft_weight_bytes, fixed_s=draft_fixed_s,
                             **common).seconds
        t_decode = verify_cost(vcfg, b, 0, context, **verify).seconds
        best = (1.0, 0)
        for k in ks:
            v = verify_cost(vcfg, b, k, context, **verify)
            t_step = v.seconds + k * t_draft
            speedup = expected_accept_length(list(rates), k) * t_decode / t_step
            fits = b <= limit[k]
            table.append({"B": b, "k": k, "t_verify_ms": v.seconds * 1e3, "t_draft_ms": t_draft * 1e3,
                          "t_step_ms": t_step * 1e3, "t_decode_ms": t_decode * 1e3, "comm_ms": v.comm_s * 1e3,
                          "speedup": speedup, "bound": v.bound, "fits": fits})
            if k and b <= feasible:
                pays[k][b] = speedup > 1
                best = max(best, (speedup, k))
        if b <= feasible:
            best_k[b] = best[1]
    weights = weights_per_gpu(vcfg, dcfg, tp, weight_bytes, draft_weight_bytes)
    return GpuModel(hw, tp, context, rates, table, best_k, _crossover({b: k > 0 for b, k in best_k.items()}),
                    {k: _crossover(p) for k, p in pays.items()}, feasible, weights, gpu_memory_utilization)
