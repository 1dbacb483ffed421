"""The dense SwiGLU MLP and DeepSeek-V3's mixture of experts.

Routing (DeepSeek-V3 `noaux_tc`, as Kimi-K2 uses it): sigmoid scores; the bias
`e_score_correction_bias` only chooses experts (it never weights them); experts are first
narrowed to the `topk_group` groups whose two best biased scores sum highest, then the top
`num_experts_per_tok` are taken; weights are the unbiased scores, renormalised when
`norm_topk_prob`, times `routed_scaling_factor`. Shared experts always run.
Routing math runs in fp32 (as transformers and vLLM do) so bf16 never flips an expert choice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import VerifierConfig
from workbench.kernels import cpu


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu.serves(x) and x.dtype == self.down_proj.weight.dtype:
            return self.kernel_block()(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def kernel_block(self) -> cpu.FfnBlock:
        """This MLP as one `cpu.FfnBlock` call (gate|up as one projection), kept until a weight changes."""
        return cpu.derived(self, "block", lambda: (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight),
                           lambda: cpu.FfnBlock(torch.cat([self.gate_proj.weight, self.up_proj.weight]),
                                                self.down_proj.weight, 1))


class Router(nn.Module):
    """DeepSeek routing as `topk_method` and `scoring_func` say (V2: greedy / group_limited_greedy,
    V3: noaux_tc), to (weights, expert ids) per token, in fp32.

    - greedy: the top_k scores. group_limited_greedy: only the topk_group groups whose *best*
      score is highest stay. noaux_tc: scores + `e_score_correction_bias` choose, the groups
      ranked by the sum of their two best biased scores; the weights stay the unbiased scores.
    - V2 (greedy, group_limited_greedy), as DeepSeek-V2's own modeling code: weights are
      renormalised when `norm_topk_prob`, *else* times `routed_scaling_factor`. V3 (noaux_tc):
      renormalised when `norm_topk_prob`, *then* times it. (transformers' DeepseekV2 never
      renormalises and vLLM scales after renormalising; all agree whenever norm_topk_prob is
      false, as in every published V2 config.)
    Dropped groups are -inf, so they are never chosen.
    """

    def __init__(self, cfg: VerifierConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        bias = torch.zeros(cfg.n_routed_experts) if cfg.topk_method == "noaux_tc" else None
        self.register_buffer("e_score_correction_bias", bias)  # None: V2 checkpoints carry none
        self.topk_method, self.scoring_func = cfg.topk_method, cfg.scoring_func
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.sigmoid = cfg.scoring_func == "sigmoid"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, top_k] fp32, expert ids [N, top_k])."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        bias = self.e_score_correction_bias
        choice = scores if bias is None else scores + bias.float()
        if self.n_group > 1 and self.topk_method != "greedy":
            grouped = choice.view(x.shape[0], self.n_group, -1)
            if self.topk_method == "noaux_tc":
                group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
            else:
                group_scores = grouped.amax(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False)[1], True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        if self.training:  # tokens per expert, for the auxiliary-loss-free bias update
            self.last_load = torch.bincount(ids.flatten(), minlength=self.weight.shape[0]).float()
        weights = scores.gather(1, ids)
        renorm = self.norm_topk_prob and self.top_k > 1
        if renorm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.topk_method == "noaux_tc" or not renorm:
            weights = weights * self.scaling
        return weights, ids


class MoE(nn.Module):
    def __init__(self, cfg: VerifierConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        # Few experts, each token using at least a quarter of them (the embedded pair: top-2 of 8):
        # eager inference runs every expert on every token, unchosen ones weighted by exact zeros. At
        # most 4x the arithmetic, in two GEMMs instead of gathers or a loop of small ops (eager, the
        # embedded pair's routed experts, medians over its 7 MoE layers: 449 vs 438 us gathered for
        # 1 token, 478 vs 738 for 4, 819 vs 3314 for a 29-token prompt, where a loop takes 1741).
        # Compiled graphs still gather (in place, fused): there dense sped speculation up and slowed
        # the 1-token decodes of the baseline about as much (both compiled in one process, 16
        # prompts: speculative 511 vs 485 tok/s, autoregressive 382 vs 411). Many experts (Kimi-K2:
        # top-8 of 384) would pay up to 48x: those always gather or loop.
        self.dense_inference = cfg.n_routed_experts <= 4 * cfg.num_experts_per_tok
        self._stacked: dict[bool, tuple] = {}  # inference-time stacked expert weights per layout, see stacked()

    def stacked(self, dense: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weights in one of `_stack`'s layouts, rebuilt whenever one changed in place."""
        params = [e.weight for m in self.experts for e in (m.gate_proj, m.up_proj, m.down_proj)]
        versions = tuple((p._version, p.data_ptr(), p.dtype) for p in params)
        if dense not in self._stacked or self._stacked[dense][0] != versions:
            gate_up, down = self._stack(dense)
            self._stacked[dense] = (versions, gate_up.detach(), down.detach())
        return self._stacked[dense][1], self._stacked[dense][2]

    def _stack(self, dense: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered: [E, 2I, H] gate|up and [E, H, I] down. Dense: [E*2I, H] and [H, E*I], one GEMM each."""
        gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
        if dense:
            return gate_up.flatten(0, 1), torch.cat([e.down_proj.weight for e in self.experts], dim=1)
        return gate_up, torch.stack([e.down_proj.weight for e in self.experts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.dense_inference and cpu.serves(x) and x.dtype == self.experts[0].down_proj.weight.dtype:
            return self.kernel_block()(x).view(shape)
        weights, ids = self.gate(x)
        if torch.is_grad_enabled():
            out = self._loop_experts(x, weights, ids)
        elif self.dense_inference and not torch.compiler.is_compiling():
            out = self._dense_experts(x, weights, ids)
        elif x.shape[0] > 32:
            out = self._loop_experts(x, weights, ids)
        else:
            out = self._gathered_experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def kernel_block(self) -> cpu.FfnBlock:
        """The dense experts as one `workbench.kernels.cpu` call: routing, every routed expert and
        the shared ones (as groups of moe_intermediate_size, weighted 1) in one gate|up and one down
        projection, the routing weights applied between them (a zero weight gives exact zeros).
        Kept until a weight or a routing setting changes."""
        g = self.gate
        settings = (g.top_k, g.n_group, g.topk_group, g.norm_topk_prob, g.scaling, g.sigmoid)
        return cpu.derived(self, "dense", self._kernel_sources, self._build_kernel_block, settings)

    def _kernel_sources(self) -> list[torch.Tensor]:
        mlps = [*self.experts, *([self.shared_experts] if self.shared_experts is not None else [])]
        return [self.gate.weight, self.gate.e_score_correction_bias,
                *(m.weight for e in mlps for m in (e.gate_proj, e.up_proj, e.down_proj))]

    def _build_kernel_block(self) -> cpu.FfnBlock:
        """[gate_g | up_g] per group and the down projections side by side; the shared experts'
        MLP splits into groups of the routed experts' width (each weighted 1)."""
        I = self.experts[0].down_proj.weight.shape[1]
        gate_up, down = [], []
        for e in [*self.experts, *([self.shared_experts] if self.shared_experts is not None else [])]:
            for g in range(e.down_proj.weight.shape[1] // I):
                rows = slice(g * I, (g + 1) * I)
                gate_up += [e.gate_proj.weight[rows], e.up_proj.weight[rows]]
                down.append(e.down_proj.weight[:, rows])
        return cpu.FfnBlock(torch.cat(gate_up), torch.cat(down, dim=1), len(down), router=self.gate)

    def _loop_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One matmul per expert that has tokens (training; a many-expert model's prefill)."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](x[token]) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out

    def _dense_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token (`dense_inference`, eager); the routing weight scales each
        expert's activations before the down projection, so one GEMM sums the chosen experts."""
        gate_up, down = self.stacked(dense=True)
        n, E = x.shape[0], len(self.experts)
        h = F.linear(x, gate_up).view(n, E, 2, -1)
        act = F.silu(h[:, :, 0]) * h[:, :, 1]  # [n, E, I]
        dense_w = torch.zeros(n, E, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)[:, :, None]
        # Unchosen experts become exact zeros (a where, not a multiply: 0 * inf would be NaN).
        act = torch.where(dense_w > 0, act.float() * dense_w, 0.0).to(x.dtype)
        return F.linear(act.reshape(n, -1), down)

    def _gathered_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Few tokens (decode, verify; every compiled graph): the chosen experts' weights, a handful of batched ops."""
        # Traced by torch.compile: stack from the parameters (freezing folds it into constants).
        gate_up, down = self._stack(dense=False) if torch.compiler.is_compiling() else self.stacked(dense=False)
        n, k = ids.shape
        h = torch.bmm(gate_up[ids.flatten()], x.repeat_interleave(k, 0)[:, :, None])  # [n*k, 2I, 1]
        g, u = h.squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(down[ids.flatten()], (F.silu(g) * u)[:, :, None]).squeeze(-1)  # [n*k, H]
        return (y.view(n, k, -1) * weights[:, :, None].to(x.dtype)).sum(1)
