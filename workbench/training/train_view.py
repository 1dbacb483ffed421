"""A training twin of the verifier: the same weights laid out for fast training on a CPU.

The plain `Verifier` is the reference; this is a transform beside it, as the fast inference paths
are. It shares every weight with the reference model except the routed experts, which it stacks
into one [E, ...] tensor per projection so that the tokens of all experts are gathered once,
sorted by expert, and each expert runs on a contiguous slice (the reference loops over experts
with a gather and a scatter each). `write_back` copies the stacked experts into the reference's
`mlp.experts.{e}` modules, so what is saved is the reference layout that every loader reads.

What differs from the reference forward, and why:
- attention without a cache uses SDPA's causal kernel instead of an explicit boolean mask (the
  mask forces the math path, which materialises [B, N, T, T] scores and is several times slower);
- matmuls run in bf16 where `bf16=True` (the CPU's matrix units, AMX or AVX512-BF16, run bf16
  5-15x faster than fp32 here), with norms' statistics, routing, softmax and the loss in fp32;
- tokens are grouped by expert with one sort and one gather, and scattered back with one `index_add_`;
- the loss is a chunked linear + cross-entropy (`LinearCrossEntropy`): fp32 softmax per chunk, the
  [tokens, vocab] logits never stored, their gradient formed in place of a second pass;
- with `compiled=True` the norms run as one torch.compile graph each (`Ops`).
The forward equals the reference's to bf16 rounding (tested in tests/test_pretrain.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models import Verifier
from workbench.models.mla import MLAttention, attend_heads
from workbench.models.moe import MLP, MoE
from workbench.models.norm import RMSNorm


class StackedExperts(nn.Module):
    """The routed experts of one MoE layer as [E, I, H] / [E, H, I] parameters, run as one bmm each."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.stack([e.gate_proj.weight.detach().float() for e in moe.experts]))
        self.w_up = nn.Parameter(torch.stack([e.up_proj.weight.detach().float() for e in moe.experts]))
        self.w_down = nn.Parameter(torch.stack([e.down_proj.weight.detach().float() for e in moe.experts]))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], routing weights and expert ids [N, k] -> the weighted sum of each token's experts [N, H]."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        token = order // k
        grouped = x[token]  # one gather; each expert's tokens are then a contiguous slice
        counts = torch.bincount(flat, minlength=self.w_gate.shape[0]).tolist()
        dt, outs, at = x.dtype, [], 0
        for e, n in enumerate(counts):  # slices, not padded groups: no work on padding
            if n:
                seg = grouped[at:at + n]
                h = F.silu(F.linear(seg, self.w_gate[e].to(dt))) * F.linear(seg, self.w_up[e].to(dt))
                outs.append(F.linear(h, self.w_down[e].to(dt)))
                at += n
        y = torch.cat(outs) * weights.reshape(-1)[order, None].to(dt)
        return torch.zeros_like(x).index_add_(0, token, y)

    @torch.no_grad()
    def write_back(self, moe: MoE) -> None:
        for e, mlp in enumerate(moe.experts):
            mlp.gate_proj.weight.copy_(self.w_gate[e])
            mlp.up_proj.weight.copy_(self.w_up[e])
            mlp.down_proj.weight.copy_(self.w_down[e])


def _rms(weight: torch.Tensor, x: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm with fp32 statistics, handed on in the compute dtype (the reference returns fp32
    under autocast, which costs a cast before every matmul)."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * weight).to(dtype)


@dataclass(frozen=True)
class Ops:
    """The view's norm: eager, or one torch.compile graph (`Ops.compiled`) that fuses its cast,
    statistics, scale and cast back into one pass, forward and backward. (SwiGLU's product compiled
    as well measured no faster: the experts' slices vary in length.)"""

    rms: Callable = _rms

    @classmethod
    def compiled(cls) -> "Ops":
        return cls(torch.compile(_rms))


def _norm(norm: RMSNorm, x: torch.Tensor, dtype: torch.dtype, ops: Ops) -> torch.Tensor:
    return ops.rms(norm.weight, x, norm.eps, dtype)


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight.to(x.dtype))


def _mlp(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    return _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


def _attention(a: MLAttention, x: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, ops: Ops) -> torch.Tensor:
    """The reference's cacheless MLA (naive path), causal by SDPA's own kernel."""
    B, T, _ = x.shape
    if a.q_lora is None:
        q = _linear(a.q_proj, x)
    else:
        q = _linear(a.q_b_proj, _norm(a.q_a_layernorm, _linear(a.q_a_proj, x), dtype, ops))
    q = q.view(B, T, a.n_heads, a.nope + a.rope)
    q_nope, q_pe = q.split([a.nope, a.rope], dim=-1)
    c_kv, k_pe = _linear(a.kv_a_proj_with_mqa, x).split([a.kv_lora, a.rope], dim=-1)
    cos, sin = a.rotary.cos_sin(positions, dtype)
    q_pe, k_pe = a.rotary(q_pe, cos, sin), a.rotary(k_pe, cos, sin)
    kv = _linear(a.kv_b_proj, _norm(a.kv_a_layernorm, c_kv, dtype, ops)).view(B, T, a.n_heads, a.nope + a.v_dim)
    k_nope, v = kv.split([a.nope, a.v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, T, a.n_heads, a.rope)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    o = attend_heads(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, a.scale, causal=True)
    return _linear(a.o_proj, o.transpose(1, 2).reshape(B, T, a.n_heads * a.v_dim))


class TrainVerifier(nn.Module):
    """The verifier's weights, trained fast: shares all but the routed experts with `model`."""

    def __init__(self, model: Verifier, bf16: bool = True, compiled: bool = False) -> None:
        super().__init__()
        self.model = model
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.ops = Ops.compiled() if compiled else Ops()
        self.experts = nn.ModuleDict({str(i): StackedExperts(layer.mlp) for i, layer in enumerate(model.model.layers)
                                      if isinstance(layer.mlp, MoE)})
        for moe_experts in (layer.mlp.experts for layer in model.model.layers if isinstance(layer.mlp, MoE)):
            moe_experts.requires_grad_(False)  # trained through the stacked copy

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def moes(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.model.layers if isinstance(layer.mlp, MoE)]

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] from position 0 -> the final normed hidden states [B, T, H] in the compute dtype."""
        m, dt, ops = self.model.model, self.dtype, self.ops
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        h = m.embed_tokens(input_ids).float()  # the residual stream stays fp32
        for i, layer in enumerate(m.layers):
            h = h + _attention(layer.self_attn, _norm(layer.input_layernorm, h, dt, ops), positions, dt, ops).float()
            x = _norm(layer.post_attention_layernorm, h, dt, ops)
            if isinstance(layer.mlp, MoE):
                flat = x.reshape(-1, x.shape[-1])
                weights, ids = layer.mlp.gate(flat)  # fp32 routing, as the reference
                y = self.experts[str(i)](flat, weights, ids)
                if layer.mlp.shared_experts is not None:
                    y = y + _mlp(layer.mlp.shared_experts, flat)
                y = y.view_as(x)
            else:
                y = _mlp(layer.mlp, x)
            h = h + y.float()
        return _norm(m.norm, h, dt, ops)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] in the compute dtype."""
        return _linear(self.model.lm_head, self.hidden(input_ids))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) over batch [B, T+1]."""
        h = self.hidden(batch[:, :-1]).flatten(0, 1)
        return LinearCrossEntropy.apply(h, self.model.lm_head.weight, batch[:, 1:].flatten())

    @torch.no_grad()
    def write_back(self) -> Verifier:
        """Copy the stacked experts into the reference model and return it."""
        for i, layer in enumerate(self.model.model.layers):
            if str(i) in self.experts:
                self.experts[str(i)].write_back(layer.mlp)
        return self.model


def train_kernels(x: torch.Tensor):
    """The CPU kernels (`workbench.kernels.cpu`) for a training loss over `x` where they run (a CPU
    tensor in fp32 or bf16, the library loaded, WORKBENCH_TRAIN_KERNELS not 0), else None: the
    losses then take torch's operations."""
    import os

    if not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if os.environ.get("WORKBENCH_TRAIN_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    from workbench.kernels import cpu

    return cpu if cpu.available() else None


class LinearCrossEntropy(torch.autograd.Function):
    """mean_i CE(h_i W^T, target_i), with the logits made and dropped chunk by chunk.

    The plain way stores [tokens, vocab] logits, upcasts them, takes log_softmax and its backward:
    five passes over the largest tensor of the step (8192 x 8192 here). Here each chunk's logits
    are formed once, softmaxed in fp32, turned into their gradient (softmax - onehot) / N at once,
    and used for both gradients; only h's and W's gradients are kept. Where the CPU kernels run,
    the softmax, the loss and the gradient are one call that reads each row while it is in cache
    and writes the gradient over the logits (`cpu.xent_grad_`).
    """

    CHUNK = 1024

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        w = weight.to(h.dtype)
        n = h.shape[0]
        total = torch.zeros((), dtype=torch.float32)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32)
        kernel = getattr(train_kernels(h), "xent_grad_", None)
        for s in range(0, n, LinearCrossEntropy.CHUNK):
            hs, ts = h[s:s + LinearCrossEntropy.CHUNK], target[s:s + LinearCrossEntropy.CHUNK]
            if kernel is not None:  # the loss and the gradient in the logits' own buffer, a row at a time
                g = F.linear(hs, w)
                total += kernel(g, ts, 1.0 / n).sum()
            else:
                logp = torch.log_softmax(F.linear(hs, w), dim=-1, dtype=torch.float32)
                total -= logp.gather(1, ts[:, None]).sum()
                g = logp.exp_()
                g.scatter_add_(1, ts[:, None], torch.full((len(ts), 1), -1.0))
                g = (g / n).to(h.dtype)
            grad_h[s:s + LinearCrossEntropy.CHUNK] = g @ w
            grad_w += (g.t() @ hs).float()
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None

