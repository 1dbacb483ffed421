"""The CPU kernels as a transform of a plain model: `accelerate(verifier, draft)`.

`accelerate` returns copies of the models (sharing every weight tensor, `workbench.variants`) in
which each module the kernels can run is a kernel-backed twin: a subclass of the model's own
module that packs its weights once, at `accelerate`, and answers the calls the kernels serve
(eager inference on the CPU, up to `cpu.MAX_ROWS` tokens a sequence and `cpu.MAX_BATCH_ROWS`
over a batch of sequences) with one library call. Every other call (autograd, a long prompt)
goes to the model's own forward, which is also what the tests compare each twin against.

| the model's module | its twin                | what one call does                                   |
|--------------------|-------------------------|------------------------------------------------------|
| MLAttention        | KernelMLAttention       | projections, norms, RoPE, cache write, attention     |
| MLP                | KernelMLP               | gate|up, SwiGLU, down                                 |
| MoE (few experts)  | KernelMoE               | routing, every expert weighted (zeros unchosen), shared experts |
| RMSNorm            | KernelRMSNorm           | the norm                                             |
| lm_head, fc        | KernelLinear            | the projection                                       |
| Eagle3Draft (MLA)  | KernelEagle3Draft       | the engine's greedy chain: first pass, k-1 passes and argmaxes |

The packed copies are the weights as they were at `accelerate`. A weight changed in place since
(a training step, `load_state_dict`) makes the next kernel call raise `StaleWeightsError`: apply
`accelerate` again to the plain model.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from workbench.cache import KVCache
from workbench.kernels import cpu
from workbench.models.draft import Eagle3Draft
from workbench.models.mla import MLAttention
from workbench.models.moe import MLP, MoE
from workbench.models.norm import RMSNorm
from workbench.models.rope import RotaryEmbedding
from workbench.variants import copy_modules, shallow_copy



class StaleWeightsError(RuntimeError):
    """A kernel-backed module whose weights changed after they were packed."""


class Sources:
    """The tensors a twin packed, with their versions then: `check()` raises if one changed since."""

    def __init__(self, owner: str, tensors: list[Tensor]) -> None:
        self.owner = owner
        # inference-mode tensors keep no version counter: an in-place change to them cannot be seen
        self.tensors = [(t, t._version) for t in tensors if t is not None and not t.is_inference()]

    def check(self) -> None:
        for t, version in self.tensors:
            if t._version != version:
                raise StaleWeightsError(f"{self.owner}: a weight changed in place after workbench.kernels.cpu_modules."
                                        "accelerate packed it; accelerate the plain model again")


def _twin(module: nn.Module, cls: type) -> nn.Module:
    new = shallow_copy(module)
    new.__class__ = cls
    return new


# ---- RoPE as two rows of a projection ---------------------------------------------------------


def rope_rows(rotary: RotaryEmbedding, w: Tensor) -> tuple[Tensor, Tensor]:
    """A projection's rope rows w [dim, in] as two: (a, b) with a x = [x1 | x2] and b x = [-x2 | x1]
    (the pairs `RotaryEmbedding.forward` rotates), so that forward(w x) = (a x) * cos2 + (b x) * sin2."""
    if rotary.interleave:
        x1, x2 = w[0::2], w[1::2]
    else:
        half = w.shape[0] // 2
        x1, x2 = w[:half], w[half:]
    return torch.cat([x1, x2]), torch.cat([-x2, x1])


class RopeTables:
    """[cos | cos] and [sin | sin] [limit, dim] per dtype, from `RotaryEmbedding.cos_sin`'s own formula
    (so the same values), grown when a longer cache asks."""

    def __init__(self, rotary: RotaryEmbedding) -> None:
        self.rotary, self.tables = rotary, {}

    def get(self, dtype: torch.dtype, limit: int) -> tuple[Tensor, Tensor]:
        table = self.tables.get(dtype)
        if table is None or table[0].shape[0] < limit:
            cos, sin = self.rotary.cos_sin(torch.arange(max(limit, 64)), dtype)
            table = self.tables[dtype] = (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
        return table

    def at(self, positions: Tensor, dtype: torch.dtype, limit: int) -> tuple[Tensor, Tensor]:
        cos2, sin2 = self.get(dtype, limit)
        return cos2[positions], sin2[positions]


# ---- the twins --------------------------------------------------------------------------------


class KernelLinear(nn.Linear):
    @classmethod
    def of(cls, m: nn.Linear) -> "KernelLinear | None":
        if m.bias is not None or m.weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        new = _twin(m, cls)
        new.packed, new.sources = cpu.PackedLinear(m.weight), Sources(f"linear {tuple(m.weight.shape)}", [m.weight])
        return new

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype and cpu.serves(x):
            self.sources.check()
            return self.packed(x)
        return super().forward(x)


class KernelRMSNorm(RMSNorm):
    @classmethod
    def of(cls, m: RMSNorm) -> "KernelRMSNorm":
        return _twin(m, cls)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype and cpu.serves(x):  # one call, the same roundings
            return cpu.rms_norm(x, self.weight.detach(), self.eps)
        return super().forward(x)


class KernelMLAttention(MLAttention):
    @classmethod
    def of(cls, m: MLAttention) -> "KernelMLAttention | None":
        if m.kv_a_proj_with_mqa.weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        new = _twin(m, cls)
        q = (m.q_proj,) if m.q_lora is None else (m.q_a_proj, m.q_b_proj, m.q_a_layernorm)
        parts = (*q, m.kv_a_proj_with_mqa, m.kv_a_layernorm, m.kv_b_proj, m.o_proj)
        new.block, new.tables = _mla_block(m), RopeTables(m.rotary)
        new.sources = Sources("MLA attention", [p.weight for p in parts])
        return new

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache | None = None, layer: int = 0,
                path: str = "auto") -> Tensor:
        if (cache is not None and path != "naive" and x.dtype == self.block.dtype
                and cpu.serves(x)):  # any T the kernels take: their attention is absorbed
            self.sources.check()
            cache.check_room(x.shape[1])  # the new rows go straight into the cache
            B, T = x.shape[:2]  # each sequence's T tokens at its own length (positions [B, T])
            cos2, sin2 = self.tables.at(positions.expand(B, T).reshape(-1), x.dtype, cache.max_len)
            out = self.block(x.reshape(B * T, -1), cache.layer(layer), cache.lengths, cos2, sin2, [T] * B)
            return out.view(B, T, -1)
        return super().forward(x, positions, cache, layer, path)


def _mla_block(m: MLAttention) -> cpu.MlaBlock:
    """The absorbed projections, packed.

    "a" maps x to [c_q (q_lora) | c_kv | k_pe as `rope_rows`' two halves] (with q_lora), "q" maps
    c_q (or x) to [q_lat = q_nope W_UK per head (L) | q_pe's two halves per head], and "o" maps the
    heads' latent outputs to the hidden size through W_UV and o_proj at once. Products are formed
    in fp32 and rounded to the weights' dtype once.
    """
    N, P, L = m.n_heads, m.nope, m.kv_lora
    dtype = m.kv_a_proj_with_mqa.weight.dtype
    with torch.no_grad():
        w_uk, w_uv = (w.float() for w in m.absorbed_weights())
        wq = (m.q_proj if m.q_lora is None else m.q_b_proj).weight.float().view(N, P + m.rope, -1)
        q_lat = torch.einsum("npl,npi->nli", w_uk, wq[:, :P]).reshape(N * L, -1)
        pe = [rope_rows(m.rotary, wq[h, P:]) for h in range(N)]
        q = torch.cat([q_lat, *(a for a, _ in pe), *(b for _, b in pe)])
        kv = m.kv_a_proj_with_mqa.weight.float()
        a = torch.cat([kv[:L], *rope_rows(m.rotary, kv[L:])])
        a = torch.cat([q if m.q_lora is None else m.q_a_proj.weight.float(), a])
        wo = m.o_proj.weight.float().view(-1, N, m.v_dim)
        o = torch.einsum("hnv,nvl->hnl", wo, w_uv).reshape(wo.shape[0], N * L)
    q_norm = None if m.q_lora is None else (m.q_a_layernorm.weight, m.q_a_layernorm.eps)
    return cpu.MlaBlock(a.to(dtype), None if m.q_lora is None else q.to(dtype), o.to(dtype), q_norm,
                        (m.kv_a_layernorm.weight, m.kv_a_layernorm.eps), m.scale, N, L, m.rope)


def _mlp_weights(m: MLP) -> list[Tensor]:
    return [m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]


class KernelMLP(MLP):
    """Packed on its first kernel call: an MoE's experts run alone only in prompts too long for
    `KernelMoE`, and most models never pack them."""

    @classmethod
    def of(cls, m: MLP) -> "KernelMLP | None":
        if m.down_proj.weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        new = _twin(m, cls)
        new._block, new.sources = None, Sources("MLP", _mlp_weights(m))
        return new

    @property
    def block(self) -> cpu.FfnBlock:
        self.sources.check()
        if self._block is None:
            with torch.no_grad():
                self._block = cpu.FfnBlock(torch.cat([self.gate_proj.weight, self.up_proj.weight]),
                                           self.down_proj.weight, 1)
        return self._block

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.down_proj.weight.dtype and cpu.serves(x):
            return self.block(x)
        return super().forward(x)


def kernel_routes(router) -> bool:
    """Whether `wb_moe_route` computes this router: V3's noaux_tc (groups ranked by their two best
    biased scores, renormalised then scaled), or V2's greedy over one group, scaled, not renormalised."""
    if router.topk_method == "noaux_tc":
        return True
    return (router.topk_method == "greedy" and router.n_group <= 1
            and not (router.norm_topk_prob and router.top_k > 1))


class KernelMoE(MoE):
    """Every routed expert on every token, unchosen ones weighted by exact zeros: at most 4x the
    arithmetic (few experts, each token using a quarter of them or more), in two projections."""

    @classmethod
    def of(cls, m: MoE) -> "KernelMoE | None":
        g = m.gate
        dtype = m.experts[0].down_proj.weight.dtype
        if len(m.experts) > 4 * g.top_k or not kernel_routes(g) or dtype not in (torch.float32, torch.bfloat16):
            return None
        new = _twin(m, cls)
        mlps = [*m.experts, *([m.shared_experts] if m.shared_experts is not None else [])]
        I = m.experts[0].down_proj.weight.shape[1]
        gate_up, down = [], []
        for e in mlps:  # the shared experts split into groups of the routed experts' width, each weighted 1
            for j in range(e.down_proj.weight.shape[1] // I):
                rows = slice(j * I, (j + 1) * I)
                gate_up += [e.gate_proj.weight[rows], e.up_proj.weight[rows]]
                down.append(e.down_proj.weight[:, rows])
        with torch.no_grad():
            new.block = cpu.FfnBlock(torch.cat(gate_up), torch.cat(down, dim=1), len(down), router=g)
        bias = getattr(g, "e_score_correction_bias", None)
        new.sources = Sources("MoE", [g.weight, bias, *(w for e in mlps for w in _mlp_weights(e))])
        return new

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.block.dtype and cpu.serves(x):
            self.sources.check()
            return self.block(x.reshape(-1, x.shape[-1])).view(x.shape)
        return super().forward(x)


class KernelEagle3Draft(Eagle3Draft):
    """An MLA draft whose greedy chain is one call (`cpu.EagleChain`), made of the same kernels its
    layer's twins call one by one (so the same bits)."""

    @classmethod
    def of(cls, m: Eagle3Draft) -> "KernelEagle3Draft":
        new = _twin(m, cls)
        new.chain = None  # built on first use, once the layer's twins exist
        new.d2t_list = m.d2t.tolist() if hasattr(m, "d2t") else None
        return new

    def greedy_pick(self, post: Tensor) -> tuple[Tensor, Tensor]:
        head = self.part("lm_head")
        if isinstance(head, KernelLinear) and cpu.serves(post):  # one pass over each sequence's row, as the chain's
            mx, d, lse = cpu.row_stats(head(post.to(head.weight.dtype)).reshape(post.shape[0], -1))
            if self.d2t_list is not None:
                d = [i + self.d2t_list[i] for i in d]
            probs = [math.exp(m - s) for m, s in zip(mx, lse)]
            return torch.tensor(d, device=post.device)[:, None], torch.tensor(probs)[:, None]
        return super().greedy_pick(post)

    def run_greedy_chain(self, chain, input_ids: Tensor, hidden, cache: KVCache, k: int,
                         counts: list[int] | None = None, stop_below: float | None = None) -> tuple[Tensor, Tensor]:
        """The engine's greedy chain (`chain`: `workbench.decoding.drafters.greedy_chain`, its arguments
        after the draft) in one call of its C++ transform, `wb_eagle_chain`; `chain` itself where the
        kernels do not serve it."""
        kernel = self._chain(cache.max_len)
        h = hidden[0] if isinstance(hidden, (tuple, list)) else hidden
        if kernel is None or h.dtype != kernel.dtype or not cpu.serves(h, rows=input_ids.shape[1]):
            return chain(self, input_ids, hidden, cache, k, counts, stop_below)
        B, T = input_ids.shape
        starts = cache.lengths
        cache.check_room(T + k - 1)
        if isinstance(hidden, (tuple, list)):
            hidden = self.combine_hidden_states(hidden)
        if counts is None:  # no padding: every position is real
            counts, ids, hidden = [T] * B, input_ids.reshape(-1), hidden.reshape(B * T, -1)
        else:
            real = torch.arange(T) < torch.tensor(counts)[:, None]  # [B, T]: each sequence's own positions
            ids, hidden = input_ids[real], hidden[real]
        tokens, probs = kernel(ids, hidden, cache.layer(0), starts, k, counts, stop_below)
        cache.set_lengths([s + n + tokens.shape[1] - 1 for s, n in zip(starts, counts)])
        return tokens.to(input_ids.device), probs

    def _chain(self, limit: int) -> cpu.EagleChain | None:
        """The chain over the layer's twins, rebuilt when a longer cache needs longer RoPE tables;
        None when a part has no twin (an MHA layer, a head in another dtype)."""
        layer, head, embed = self.layers[0], self.part("lm_head"), self.part("embed_tokens")
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, self.norm)
        if not (isinstance(attn, KernelMLAttention) and isinstance(mlp, KernelMLP) and isinstance(head, KernelLinear)
                and embed.weight.dtype == head.weight.dtype == attn.block.dtype == mlp.down_proj.weight.dtype):
            return None
        for part in (attn, head):
            part.sources.check()
        cos2, sin2 = attn.tables.get(embed.weight.dtype, limit)
        if self.chain is None or self.chain.limit < limit or self.chain.tensors[-2] is not cos2:
            self.chain = cpu.EagleChain(attn.block, mlp.block, [(n.weight, n.eps) for n in norms], embed.weight,
                                        head.packed, getattr(self, "d2t", None), cos2, sin2,
                                        layer.norm_before_residual, self.norm_output)
        return self.chain


def _kernel_twin(module: nn.Module, name: str) -> nn.Module | None:
    if isinstance(module, Eagle3Draft):
        return KernelEagle3Draft.of(module)
    if isinstance(module, MLAttention):
        return KernelMLAttention.of(module)
    if isinstance(module, MoE):
        return KernelMoE.of(module)
    if isinstance(module, MLP):
        return KernelMLP.of(module)
    if isinstance(module, RMSNorm):
        return KernelRMSNorm.of(module)
    if isinstance(module, nn.Linear) and name in ("lm_head", "fc"):
        return KernelLinear.of(module)
    return None


def accelerate(*models: nn.Module, memo: dict | None = None) -> tuple[nn.Module, ...]:
    """Copies of `models` (a verifier, then its draft) with kernel-backed twins where the kernels
    can run them; the models given are unchanged. `memo` (id(original) -> copy, see
    `workbench.variants.copy_modules`) lets a draft share an already accelerated verifier's
    modules. Raises RuntimeError where the kernels cannot run here (`cpu.status()` says why)."""
    if not cpu.available():
        raise RuntimeError(f"workbench.kernels.cpu_modules.accelerate: the CPU kernels cannot run here: {cpu.status()}")
    memo = {} if memo is None else memo  # one copy of a module both models hold (the draft borrows the lm_head)
    with torch.no_grad():
        return tuple(copy_modules(m, _kernel_twin, memo) for m in models)
