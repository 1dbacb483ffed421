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


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        out = self.routed_experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def routed_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One matmul per expert that has tokens, each token's outputs weighted by its routing weight."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](x[token]) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out
