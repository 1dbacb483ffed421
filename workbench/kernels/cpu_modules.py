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
| Verifier           | KernelVerifier          | `forward` from the token ids: the embedding and RoPE rows, every layer (norms, the two blocks, residual adds, aux captures), the final norm, the lm_head |

A `KernelVerifier` is made where every layer's attention and FFN have twins; the calls it does not
serve (no cache, path "naive", or any its layers' twins decline) run the layers' twins one by one,
as does every call with `accelerate(..., stack=False)` or `WORKBENCH_CPU_STACK=0` (which make no
`KernelVerifier`): the per-module path, whose bits the stack equals.

The packed copies are the weights as they were at `accelerate`. A weight changed in place since
(a training step, `load_state_dict`) makes the next kernel call raise `StaleWeightsError`: apply
`accelerate` again to the plain model.

`accelerate(..., weights="int8")` (or "int8-b32", `cpu.WEIGHTS`) packs every linear the twins run
in int8, quantised once, here, from the plain weights (the absorbed MLA products from their fp32
values): the attention projections, the experts and shared experts, the dense MLPs, the lm_heads
and the draft's fc. Norms, routers (fp32) and embeddings stay as they are, and so do the plain
models: a call the kernels do not serve (autograd, a prompt over `cpu.MAX_ROWS` tokens) runs the
plain module with its own weights. An MoE's down projection is one matrix over every expert's
columns: "int8" gives each of its output rows one scale across the experts, "int8-b32" one per 32
columns, which stay within an expert where its width is a multiple of 32. `weights="bf16"` packs
the same linears of fp32 models in bf16 (rounded once, from fp32, as the absorbed products are
formed), everything else staying fp32; for bf16 models it is their native packing.
"""
from __future__ import annotations

import math
import operator
import os

import torch
from torch import Tensor, nn

from workbench.cache import KVCache
from workbench.kernels import cpu
from workbench.models.draft import Eagle3Draft
from workbench.models.mla import MLAttention
from workbench.models.moe import MLP, MoE
from workbench.models.norm import RMSNorm
from workbench.models.rope import RotaryEmbedding
from workbench.models.verifier import Verifier, VerifierOutput
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
    def of(cls, m: nn.Linear, weights: str = "native") -> "KernelLinear | None":
        if m.bias is not None or m.weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        new = _twin(m, cls)
        new.packed = cpu.PackedLinear(m.weight, weights)
        new.sources = Sources(f"linear {tuple(m.weight.shape)}", [m.weight])
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
    def of(cls, m: MLAttention, weights: str = "native") -> "KernelMLAttention | None":
        if m.kv_a_proj_with_mqa.weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        new = _twin(m, cls)
        q = (m.q_proj,) if m.q_lora is None else (m.q_a_proj, m.q_b_proj, m.q_a_layernorm)
        parts = (*q, m.kv_a_proj_with_mqa, m.kv_a_layernorm, m.kv_b_proj, m.o_proj)
        new.block, new.tables = _mla_block(m, weights), RopeTables(m.rotary)
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


def _mla_block(m: MLAttention, weights: str = "native") -> cpu.MlaBlock:
    """The absorbed projections, packed.

    "a" maps x to [c_q (q_lora) | c_kv | k_pe as `rope_rows`' two halves] (with q_lora), "q" maps
    c_q (or x) to [q_lat = q_nope W_UK per head (L) | q_pe's two halves per head], and "o" maps the
    heads' latent outputs to the hidden size through W_UV and o_proj at once. Products are formed
    in fp32 and rounded to the weights' dtype once (or quantised to int8 from fp32).
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
    return cpu.MlaBlock(a, None if m.q_lora is None else q, o, q_norm, (m.kv_a_layernorm.weight, m.kv_a_layernorm.eps),
                        m.scale, N, L, m.rope, weights, dtype)


def _mlp_weights(m: MLP) -> list[Tensor]:
    return [m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]


class KernelMLP(MLP):
    """Packed on its first kernel call: an MoE's experts run alone only in prompts too long for
    `KernelMoE`, and most models never pack them."""

    @classmethod
    def of(cls, m: MLP, weights: str = "native") -> "KernelMLP | None":
        if m.down_proj.weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        new = _twin(m, cls)
        new._block, new.sources, new.packing = None, Sources("MLP", _mlp_weights(m)), weights
        return new

    @property
    def block(self) -> cpu.FfnBlock:
        self.sources.check()
        if self._block is None:
            with torch.no_grad():
                self._block = cpu.FfnBlock(torch.cat([self.gate_proj.weight, self.up_proj.weight]),
                                           self.down_proj.weight, 1, weights=self.packing)
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
    def of(cls, m: MoE, weights: str = "native") -> "KernelMoE | None":
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
            new.block = cpu.FfnBlock(torch.cat(gate_up), torch.cat(down, dim=1), len(down), router=g, weights=weights)
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
        new.chain, new.chain_sources = None, []  # built on first use, once the layer's twins exist
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
        after the draft) in one call of its C++ transform, `wb_eagle_chain` (from the aux states,
        `wb_eagle_chain_aux`: fc's fusion and the gather of each sequence's own positions as well, where
        fc is a twin with no fc_norm); `chain` itself where the kernels do not serve it."""
        kernel = self._chain(cache.max_len)
        aux = isinstance(hidden, (tuple, list))
        h = hidden[0] if aux else hidden
        if kernel is None or h.dtype != kernel.dtype or not cpu.serves(h, rows=input_ids.shape[1]):
            return chain(self, input_ids, hidden, cache, k, counts, stop_below)
        B, T = input_ids.shape
        starts = cache.lengths
        cache.check_room(T + k - 1)
        if aux and kernel.fc is not None:  # fc's fusion and the real positions' gather in the same call
            counts = [T] * B if counts is None else counts
            tokens, probs = kernel.from_aux(input_ids, hidden, cache.layer(0), starts, k, counts, stop_below)
            cache.set_lengths([s + n + tokens.shape[1] - 1 for s, n in zip(starts, counts)])
            return tokens if tokens.device == input_ids.device else tokens.to(input_ids.device), probs
        if aux:
            hidden = self.combine_hidden_states(hidden)
        if counts is None:  # no padding: every position is real
            counts, ids, hidden = [T] * B, input_ids.reshape(-1), hidden.reshape(B * T, -1)
        else:
            real = torch.arange(T) < torch.tensor(counts)[:, None]  # [B, T]: each sequence's own positions
            ids, hidden = input_ids[real], hidden[real]
        tokens, probs = kernel(ids, hidden, cache.layer(0), starts, k, counts, stop_below)
        cache.set_lengths([s + n + tokens.shape[1] - 1 for s, n in zip(starts, counts)])
        return tokens.to(input_ids.device), probs

    def run_accept_and_draft(self, fallback, logits: Tensor, aux: tuple[Tensor, ...], x: Tensor, n: Tensor,
                             cache: KVCache, k: int):
        """The fused greedy step's acceptance and drafting (`fallback`:
        `workbench.decoding.fused.accept_and_draft`, its arguments after the draft) in one call of its
        C++ transform, `wb_accept_and_draft`, for one sequence without padding (the same results; the
        proposals and the draft rows up to the accepted count's are the unfused chain's bits);
        `fallback` itself where the kernels do not serve it. The cache's length advances by x's T, as
        `fallback`'s first pass advances it (the caller then sets it to the accepted positions)."""
        kernel = self._chain(cache.max_len)
        B, T = x.shape
        if (kernel is None or kernel.fc is None or B != 1 or int(n[0]) != T - 1 or logits.dim() != 3
                or aux[0].dtype != kernel.dtype or not cpu.serves(aux[0], rows=T)):
            return fallback(self, logits, aux, x, n, cache, k)
        ints, floats, finite = kernel.accept_and_draft(logits[0], x, aux, cache.layer(0)[0], cache.lengths[0], k)
        cache.advance(T)
        return ints[None], floats[None], torch.full((1, T), bool(finite))

    def _chain(self, limit: int) -> cpu.EagleChain | None:
        """The chain over the layer's twins, rebuilt when a longer cache needs longer RoPE tables;
        None when a part has no twin (an MHA layer, a head in another dtype). A chain built already
        holds its own tables: each call then only checks the packed weights (`Sources`)."""
        chain = self.chain
        if chain is not None and limit <= chain.limit:
            for src in self.chain_sources:
                src.check()
            return chain
        layer, head, embed = self.layers[0], self.part("lm_head"), self.part("embed_tokens")
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, self.norm)
        if not (isinstance(attn, KernelMLAttention) and isinstance(mlp, KernelMLP) and isinstance(head, KernelLinear)
                and embed.weight.dtype == head.weight.dtype == attn.block.dtype == mlp.down_proj.weight.dtype):
            return None
        fc = self._modules.get("fc")  # fused in the chain's call where it is a twin and no fc_norm comes first
        fc = fc if isinstance(fc, KernelLinear) and self._modules.get("fc_norm") is None else None
        sources = [part.sources for part in (attn, head, mlp, fc) if part is not None]
        for src in sources:
            src.check()
        cos2, sin2 = attn.tables.get(embed.weight.dtype, limit)
        self.chain = cpu.EagleChain(attn.block, mlp.block, [(n.weight, n.eps) for n in norms], embed.weight,
                                    head.packed, getattr(self, "d2t", None), cos2, sin2,
                                    layer.norm_before_residual, self.norm_output, fc.packed if fc else None)
        self.chain_sources = sources
        return self.chain


_VERSION = operator.attrgetter("_version")


class KernelVerifier(Verifier):
    """A verifier whose forward, where the kernels serve it (eager inference on the CPU with a cache,
    in the stack's dtype, up to `cpu.MAX_ROWS` tokens a sequence and `cpu.MAX_BATCH_ROWS` in all), is
    one `cpu.DecoderStack` call over every layer's twins' plans, from the token ids (their
    embedding rows and RoPE rows gathered in the call); any other call is `Verifier.forward` over
    the twins, one module at a time. The stack
    holds the twins' plans, norms and eps as they were at `accelerate` (as the twins do): change a
    setting on the plain model and accelerate it again. `aux_layer_ids` may be set on it."""

    @classmethod
    def of(cls, v: Verifier) -> "KernelVerifier | None":
        """`v`, an accelerated copy with its layers' twins in place, re-classed; None (v unchanged)
        where a part has no twin or the parts do not share one dtype."""
        layers, head, final = list(v.model.layers), v.lm_head, v.model.norm
        attn, ffn = [layer.self_attn for layer in layers], [layer.mlp for layer in layers]
        norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [final]
        if not (layers and isinstance(head, KernelLinear) and all(isinstance(a, KernelMLAttention) for a in attn)
                and all(isinstance(f, (KernelMoE, KernelMLP)) for f in ffn) and all(isinstance(n, RMSNorm) for n in norms)):
            return None
        rotary = attn[0].rotary  # one RoPE table for every layer: their rotaries must agree
        if any(not torch.equal(a.rotary.inv_freq, rotary.inv_freq) or a.rotary.magnitude != rotary.magnitude
               for a in attn):
            return None
        try:
            stack = cpu.DecoderStack([a.block for a in attn], [f.block for f in ffn],
                                     [(layer.input_layernorm.weight, layer.input_layernorm.eps) for layer in layers],
                                     [(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
                                      for layer in layers], (final.weight, final.eps), head.packed)
        except ValueError:
            return None
        v.__class__ = cls
        v.stack, v.tables = stack, attn[0].tables
        v.sources = [m.sources for m in (*attn, *ffn, head)]
        v.watched = [t for src in v.sources for t, _ in src.tensors]
        v.versions = sum(map(_VERSION, v.watched))  # versions only grow: an equal sum means none changed
        v.aux_key = None
        embed = v.model.embed_tokens  # gathered in the stack's call: a plain embedding (no max_norm) only
        v.embed = embed if type(embed) is nn.Embedding and embed.max_norm is None else None
        return v

    def forward(self, input_ids: Tensor, cache: KVCache | None = None, positions: Tensor | None = None,
                logits_to_keep: int = 0, path: str = "auto") -> VerifierOutput:
        stack = self.stack
        if (cache is None or path == "naive" or logits_to_keep < 0 or not input_ids.shape[-1]
                or torch.is_grad_enabled() or self.embed is None):
            return super().forward(input_ids, cache, positions, logits_to_keep, path)
        weight, rows = self.embed.weight, cache.rows
        B, T = input_ids.shape
        if (weight.dtype != stack.dtype or rows.dtype != stack.dtype or not rows.is_cpu or not weight.is_cpu
                or not input_ids.is_cpu or input_ids.dtype != torch.int64
                or not cpu.serves_rows(stack.dtype, T, B * T)):
            return super().forward(input_ids, cache, positions, logits_to_keep, path)
        if sum(map(_VERSION, self.watched)) != self.versions:
            for src in self.sources:
                src.check()
        cache.check_room(T)
        starts = cache.lengths
        cos2, sin2 = self.tables.get(stack.dtype, cache.max_len)  # read at each token's position in the call
        if positions is not None:
            positions = positions.expand(B, T).reshape(-1).tolist()
        if self.aux_key is not self._aux:  # each aux id once, in order, and which one each entry is
            ids = sorted(set(self._aux))
            self.aux_key, self.aux_ids, self.aux_at = self._aux, ids, [ids.index(i) for i in self._aux]
        keep = min(logits_to_keep, T) if logits_to_keep else T
        aux, hidden, logits = stack(input_ids, weight, rows, starts, cos2, sin2, positions, self.aux_ids, keep)
        cache.advance(T)
        return VerifierOutput(logits, tuple(aux[j] for j in self.aux_at), hidden)


def _kernel_twin(module: nn.Module, name: str, weights: str = "native") -> nn.Module | None:
    if isinstance(module, Eagle3Draft):
        return KernelEagle3Draft.of(module)
    if isinstance(module, MLAttention):
        return KernelMLAttention.of(module, weights)
    if isinstance(module, MoE):
        return KernelMoE.of(module, weights)
    if isinstance(module, MLP):
        return KernelMLP.of(module, weights)
    if isinstance(module, RMSNorm):
        return KernelRMSNorm.of(module)
    if isinstance(module, nn.Linear) and name in ("lm_head", "fc"):
        return KernelLinear.of(module, weights)
    return None


def stack_default() -> bool:
    """Whether `accelerate` makes a `KernelVerifier` when not told: yes unless WORKBENCH_CPU_STACK is 0."""
    return os.environ.get("WORKBENCH_CPU_STACK", "1").strip().lower() not in ("0", "off", "false", "no")


def accelerate(*models: nn.Module, memo: dict | None = None, weights: str = "native",
               stack: bool | None = None) -> tuple[nn.Module, ...]:
    """Copies of `models` (a verifier, then its draft) with kernel-backed twins where the kernels
    can run them; the models given are unchanged. `memo` (id(original) -> copy, see
    `workbench.variants.copy_modules`) lets a draft share an already accelerated verifier's
    modules. `weights` packs the twins' linears in the models' dtype ("native"), in int8
    ("int8", "int8-b32") or in bf16 under fp32 activations ("bf16"; `cpu.WEIGHTS`). `stack` (default: `stack_default()`) makes a verifier whose
    layers all have twins a `KernelVerifier`; False leaves it a `Verifier` over its layers' twins
    (the per-module path, which the stack's tests compare against). Raises RuntimeError where the kernels cannot run here
    (`cpu.status()` says why)."""
    cpu.check_weights(weights)
    if not cpu.available():
        raise RuntimeError(f"workbench.kernels.cpu_modules.accelerate: the CPU kernels cannot run here: {cpu.status()}")
    memo = {} if memo is None else memo  # one copy of a module both models hold (the draft borrows the lm_head)
    stack = stack_default() if stack is None else stack
    with torch.no_grad():
        out = tuple(copy_modules(m, lambda module, name: _kernel_twin(module, name, weights), memo) for m in models)
        if stack:
            for m in out:
                if type(m) is Verifier:
                    KernelVerifier.of(m)  # in place: the memo and a draft borrowing its modules still hold it
        return out
