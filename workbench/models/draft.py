"""The EAGLE-3 draft with an MLA layer (vLLM's `Eagle3DeepseekV2ForCausalLM`), or MHA to compare.

What EAGLE-3 changes against a verifier layer (eagle3_mla.md §3):
- `fc` fuses the verifier's three aux states [h_lo | h_mid | h_hi] (3H -> H), once per
  verified token, before the first draft pass; later steps feed back the draft's own state.
- the single decoder layer takes a 2H input `[input_layernorm(embed) | hidden_norm(h)]`
  (embedding first) into q_a_proj and kv_a_proj_with_mqa (or q/k/v_proj for MHA);
  the residual is h itself; the MLP is dense SwiGLU.
- it returns the post-norm state (for logits) and the pre-norm residual sum h + a + y, which
  is what vLLM feeds back (`norm_output` feeds back the post-norm state: EAGLE-3.1).
- EAGLE-3.1's `fc_norm` (SGLang's kimi_k25_eagle3.py): one RMSNorm per aux state (width
  target_hidden_size, eps rms_norm_eps, weights `fc_norm.{i}.weight`) on each state before fc.
- embedding and lm_head are the verifier's unless the checkpoint ships its own; a reduced
  draft vocabulary maps back through `d2t` (target id = i + d2t[i]).
Variants are bound once at construction (the doctor probes others on weight-sharing copies).
"""
from __future__ import annotations

import torch
from torch import nn

from workbench.cache import KVCache
from workbench.config import DraftConfig
from workbench.models.mla import MLAttention, attend_heads, causal_mask
from workbench.models.moe import MLP
from workbench.models.norm import RMSNorm
from workbench.models.rope import RotaryEmbedding


class MHAttention(nn.Module):
    """Llama-style attention over the same 2H input (vLLM's LlamaForCausalLMEagle3 layer 0)."""

    def __init__(self, cfg: DraftConfig, input_size: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(input_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_interleave)
        self.scale = cfg.softmax_scale

    @property
    def row_width(self) -> int:
        return 2 * self.n_kv * self.head_dim

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B,T,2H] -> roped q [B,T,N,D] and cache rows [B,T,2*Nkv*D] = [K | V]."""
        B, T, _ = x.shape
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q = self.rotary(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = self.rotary(self.k_proj(x).view(B, T, self.n_kv, self.head_dim), cos, sin)
        return q, torch.cat([k.reshape(B, T, -1), self.v_proj(x)], dim=-1)

    def attend(self, q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None,
               causal: bool = False, heads=None) -> torch.Tensor:
        """q [B,T,N,D] over cache rows [B,S,2*Nkv*D] (mask and `heads` as `MLAttention.attend_naive`)."""
        B, T = q.shape[:2]
        S = rows.shape[1]
        k, v = rows.view(B, S, 2, self.n_kv, self.head_dim).unbind(2)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = (heads or attend_heads)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.scale, causal)
        return o.transpose(1, 2).reshape(B, T, -1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, path: str = "auto") -> torch.Tensor:
        T = x.shape[1]
        q, new_rows = self.project(x, positions)
        if cache is None:
            return self.o_proj(self.attend(q, new_rows, None, causal=True))
        starts = cache.lengths
        rows = cache.write(layer, new_rows)
        if max(starts) == 0:  # every sequence's first tokens: its rows are the new ones
            return self.o_proj(self.attend(q, rows, None, causal=True))
        return self.o_proj(self.attend(q, rows, causal_mask(T, starts, x.device)))

    def forward_at(self, x: torch.Tensor, position: torch.Tensor, cache: KVCache, layer: int,
                   bound: int) -> torch.Tensor:
        """As `MLAttention.forward_at`: new tokens from a position held on the device (0-d or [B])."""
        T = x.shape[1]
        positions = position.reshape(-1, 1) + torch.arange(T, device=x.device)[None]  # [B or 1, T]
        q, new_rows = self.project(x, positions)
        cache.write_at(layer, position, new_rows)
        mask = torch.arange(bound, device=x.device) <= positions[:, None, :, None]  # [B or 1, 1, T, bound]
        return self.o_proj(self.attend(q, cache.layer(layer)[:, :bound], mask))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.self_attn = MLAttention(cfg, 2 * H, H) if cfg.attention == "mla" else MHAttention(cfg, 2 * H)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None, path: str = "auto") -> torch.Tensor:
        return self.block(embeds, h, lambda x: self.self_attn(x, positions, cache, 0, path))

    def block(self, embeds: torch.Tensor, h: torch.Tensor, attend) -> torch.Tensor:
        """The layer around any attention `attend(x_2H) -> [B,T,H]` (the trainer's TTT attention)."""
        hn = self.hidden_norm(h)
        residual = hn if self.norm_before_residual else h
        x = torch.cat([self.input_layernorm(embeds), hn], dim=-1)  # embedding first
        residual = residual + attend(x)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, own_embed: bool = False, own_lm_head: bool = False) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        if cfg.use_aux_hidden_state:
            self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, H, bias=False)
            if cfg.fc_norm:
                self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                             for _ in cfg.aux_layer_ids)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(cfg)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        if own_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        if own_lm_head:
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        if cfg.draft_vocab_size != cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.norm_output = cfg.norm_output  # feed back post-norm (EAGLE-3.1) instead of pre-norm
        self._shared: dict[str, nn.Module] = {}  # the verifier's embedding / lm_head, not our weights

    def share(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        """Use the verifier's embedding and lm_head wherever this draft ships none."""
        self._shared = {"embed_tokens": embed_tokens, "lm_head": lm_head}

    def part(self, name: str) -> nn.Module:
        if name in self._modules:
            return self._modules[name]
        if name not in self._shared:
            raise RuntimeError(f"draft has no {name} of its own; call share(verifier embed, lm_head) first")
        return self._shared[name]

    @property
    def attention_kind(self) -> str:
        return self.config.attention

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        p = self.fc.weight if hasattr(self, "fc") else self.norm.weight
        return KVCache(1, self.config.cache_row, max_len, batch, p.dtype, p.device, name="draft cache")

    def combine_hidden_states(self, aux: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
        """fc over concat(h_lo, h_mid, h_hi): [B, T, 3H] -> [B, T, H]; with fc_norm, each state normed first."""
        width = self.config.target_hidden_size  # a static width, whatever the inputs' shapes say (traced graphs)
        # the draft may run in its own dtype: cast each state first (a cast is elementwise, so this is the
        # same as casting the concatenation), so that fc_norm's statistics see what fc will
        states = [h.reshape(*h.shape[:-1], width).to(self.fc.weight.dtype) for h in aux]
        norms = self._modules.get("fc_norm")
        if norms is not None:
            if len(states) != len(norms):
                raise ValueError(f"combine_hidden_states: {len(states)} aux states; expected {len(norms)}, one per "
                                 f"fc_norm")
            states = [norm(h) for norm, h in zip(norms, states)]
        return self.fc(torch.cat(states, dim=-1))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, path: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass: tokens [B,T] with states [B,T,H] -> (post-norm, state to feed back).

        With a cache, each sequence's rows go at its length (= the position of its first token)
        and the lengths advance by T.
        """
        return self.draft_pass(input_ids, hidden, cache, positions, path)

    def draft_pass(self, input_ids: torch.Tensor, hidden: torch.Tensor, cache: KVCache | None = None,
                   positions: torch.Tensor | None = None, path: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s body, which the engine's greedy chain calls directly (a fast path may wrap forward alone)."""
        T = input_ids.shape[1]
        if cache is not None:
            cache.check_room(T)
        if positions is None:
            positions = (cache.positions(T, input_ids.device) if cache is not None
                         else torch.arange(T, device=input_ids.device)[None])
        attn = self.layers[0].self_attn
        out = self._pass(input_ids, hidden, lambda x: attn(x, positions, cache, 0, path))
        if cache is not None:
            cache.advance(T)
        return out

    def forward_at(self, input_ids: torch.Tensor, hidden: torch.Tensor, cache: KVCache, position: torch.Tensor,
                   bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` from a position held on the device, 0-d or [B] (the fused step's chain, whose next
        position depends on how many proposals were just accepted); `bound` as in `MLAttention.forward_at`.
        The cache's length is the caller's to set."""
        attn = self.layers[0].self_attn
        return self._pass(input_ids, hidden, lambda x: attn.forward_at(x, position, cache, 0, bound))

    def _pass(self, input_ids: torch.Tensor, hidden: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding, the layer around `attend`, the final norm: (post-norm, state to feed back)."""
        embeds = self.part("embed_tokens")(input_ids).to(self.norm.weight.dtype)
        pre = self.layers[0].block(embeds, hidden, attend)
        post = self.norm(pre)
        return post, (post if self.norm_output else pre)

    def compute_logits(self, post: torch.Tensor) -> torch.Tensor:
        """Logits over the verifier's vocabulary (draft-vocab logits scattered through d2t)."""
        head = self.part("lm_head")
        logits = head(post.to(head.weight.dtype))
        if self.config.draft_vocab_size == self.config.vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        target = torch.arange(self.config.draft_vocab_size, device=logits.device) + self.d2t
        full[..., target] = logits
        return full

    def greedy_pick(self, post: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The argmax of the draft head over post [B, 1, H], as target ids [B, 1], and its softmax probability [B, 1].

        Over the draft's own vocabulary: the same argmax and softmax as compute_logits' scattered
        row (-inf elsewhere), without building a full-vocabulary row per step.
        """
        head = self.part("lm_head")
        logits = head(post.to(head.weight.dtype)).float()
        d = logits.argmax(-1)
        p = logits.softmax(-1).gather(-1, d[..., None])[..., 0]
        return (d + self.d2t[d] if hasattr(self, "d2t") else d), p
