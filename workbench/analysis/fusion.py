"""What each verifier aux layer contributes to the draft's fused state, and what acceptance owes it.

EAGLE-3's `fc` maps concat(h_lo, h_mid, h_hi) [3H] to H. Splitting fc.weight into its three
column blocks W_s (one per aux source s) writes the fused state as a sum of terms,
    fused = W_lo h_lo + W_mid h_mid + W_hi h_hi = sum_s t_s,
so per token the *norm share* of source s is ||t_s|| / sum_s ||t_s|| (shares sum to 1).
Alongside: ||W_s||_F per block, cos(fused, h_s), the RMS of each captured state, how the
shares relate to which proposals the verifier accepted, and an ablation that zeroes or
shuffles one source of fc's input (on a weight-sharing variant of the draft) and measures the
acceptance change.

Aux ids follow vLLM's convention: id k is the residual stream *entering* decoder layer k
(transformers' `hidden_states[k]`); a draft trained on "output of layer k" is off by one.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from workbench.analysis.degeneracy import AcceptSplit, accept_split, detect_loop
from workbench.decoding.engine import SpecDecoder

CONVENTION = "id k = the residual stream entering decoder layer k (vLLM; transformers' hidden_states[k])"
ABLATION_MODES = ("zero", "shuffle")


def _draft_with_fc(pair):
    draft = getattr(pair, "draft", None)
    if draft is None:
        raise ValueError("fusion: the pair has no draft; expected a verifier + EAGLE-3 draft pair")
    if not hasattr(draft, "fc"):
        raise ValueError(f"fusion: draft {getattr(draft, 'source', '')} has no fc (use_aux_hidden_state = false); "
                         "expected an EAGLE-3 draft that fuses verifier aux states")
    return draft


def fc_blocks(draft) -> list[torch.Tensor]:
    """fc.weight [H, S*Ht] split into its S column blocks W_s [H, Ht], in aux-id order."""
    w = draft.fc.weight.detach()
    n = len(draft.config.aux_layer_ids)
    if w.shape[1] % n:
        raise ValueError(f"draft fc.weight has {w.shape[1]} input columns; expected a multiple of the "
                         f"{n} aux layer ids {list(draft.config.aux_layer_ids)}")
    return list(w.split(w.shape[1] // n, dim=1))


def _pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson correlation (point-biserial when y is 0/1); None when either side is constant."""
    n = len(x)
    if n < 2:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    if sxx <= 0 or syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy)


@dataclass
class AcceptanceRelation:
    """Per judged proposal: was it accepted, and the shares of the fused state it was drafted after.

    A proposal for position p is drafted after the fused state of position p-1 (the verifier's
    view of the last verified token, or of the context the chain extends). Tokens the verifier
    added without a proposal (the prefill token, a bonus after all k accepted) are left out.
    """

    positions: list[int]  # absolute position of each judged proposal
    depth: list[int]  # 0 for the first proposal of a step, 1 for the next, ...
    accepted: list[bool]
    shares: list[list[float]]  # [n][S]: shares at position p-1
    mean_share_accepted: list[float | None]  # per source; None when nothing was accepted
    mean_share_rejected: list[float | None]
    correlation: list[float | None]  # per source: Pearson(share_s, accepted); None if undefined


@dataclass
class FusionReport:
    prompt: str
    aux_layer_ids: list[int]
    convention: str
    tokens: list[int]  # prompt + generated
    token_texts: list[str]
    num_prompt_tokens: int
    block_norms: list[float]  # ||W_s||_F per source
    term_norms: list[list[float]]  # [T][S] ||W_s h_s|| per token
    shares: list[list[float]]  # [T][S] norm share of each source
    mean_shares: list[float]  # per source, over all tokens
    cosine: list[list[float]] | None  # [T][S] cos(fused, h_s); None when target_hidden_size != hidden_size
    rms: list[list[float]]  # [T][S] RMS of each captured aux state
    accept_length: float
    relation: AcceptanceRelation
    loop: dict = field(default_factory=dict)  # the continuation's loop verdict (`analysis.degeneracy.detect_loop`)

    @property
    def accept_length_clean(self) -> float | None:
        """The accept length when the continuation does not loop; None when it does (a loop is easy text)."""
        return None if self.loop.get("degenerate") else self.accept_length

    def to_dict(self) -> dict:
        return {**asdict(self), "accept_length_clean": self.accept_length_clean}


def _terms(draft, aux: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-source terms [S, T, H] and the fused state [T, H] (= fc output) for aux [1, T, Ht] each."""
    blocks = fc_blocks(draft)
    if len(aux) != len(blocks):
        raise ValueError(f"fusion: the verifier captured {len(aux)} aux states; the draft's fc has "
                         f"{len(blocks)} blocks")
    terms = torch.stack([h[0].float() @ w.float().T for h, w in zip(aux, blocks)])
    return terms, draft.combine_hidden_states(aux)[0].float()


@torch.inference_mode()
def inspect_fusion(pair, prompt: str, max_new_tokens: int = 32, k: int = 3, attention: str = "auto") -> FusionReport:
    """Generate greedily, then read the fused state of every token of prompt + output."""
    draft = _draft_with_fc(pair)
    res = SpecDecoder(pair, num_speculative_tokens=k, temperature=0.0, attention=attention).generate(
        prompt, max_new_tokens)
    ids = res.prompt_tokens + res.tokens
    out = pair.with_attention(attention).verifier(torch.tensor([ids], device=pair.device), logits_to_keep=1)
    aux = out.aux_hidden_states
    terms, fused = _terms(draft, aux)
    term_norms = terms.norm(dim=-1).T  # [T, S]
    shares = term_norms / term_norms.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    states = torch.stack([h[0].float() for h in aux], dim=1)  # [T, S, Ht]
    cosine = None  # with target_hidden_size != hidden_size the two live in different spaces
    if states.shape[-1] == fused.shape[-1]:
        cosine = torch.nn.functional.cosine_similarity(fused[:, None, :], states, dim=-1).tolist()
    rms = states.pow(2).mean(-1).sqrt()
    texts = pair.tokenizer.token_texts(res.prompt_tokens) + [t for e in res.events for t in e.emitted_text]
    return FusionReport(
        prompt=prompt, aux_layer_ids=list(pair.verifier.aux_layer_ids), convention=CONVENTION, tokens=ids,
        token_texts=texts[:len(ids)], num_prompt_tokens=len(res.prompt_tokens),
        block_norms=[float(w.float().norm()) for w in fc_blocks(draft)],
        term_norms=term_norms.tolist(), shares=shares.tolist(), mean_shares=shares.mean(0).tolist(),
        cosine=cosine, rms=rms.tolist(), accept_length=res.stats.accept_length,
        relation=_relation(res.events, shares), loop=detect_loop(res.tokens).to_dict(),
    )


def _relation(events, shares: torch.Tensor) -> AcceptanceRelation:
    positions, depth, accepted = [], [], []
    for e in events:
        if e.kind != "spec":
            continue
        for i, status in enumerate(e.emitted_status):
            if status == "bonus":
                continue
            positions.append(e.position + i)
            depth.append(i)
            accepted.append(status == "accepted")
    rows = [shares[p - 1].tolist() for p in positions]
    S = shares.shape[1]

    def mean(sel: bool, s: int) -> float | None:
        vals = [r[s] for r, a in zip(rows, accepted) if a == sel]
        return sum(vals) / len(vals) if vals else None

    y = [1.0 if a else 0.0 for a in accepted]
    return AcceptanceRelation(
        positions=positions, depth=depth, accepted=accepted, shares=rows,
        mean_share_accepted=[mean(True, s) for s in range(S)],
        mean_share_rejected=[mean(False, s) for s in range(S)],
        correlation=[_pearson([r[s] for r in rows], y) for s in range(S)],
    )


# ---- ablation ------------------------------------------------------------------------------


def _shuffled(h: torch.Tensor, bank: list[torch.Tensor], gen: torch.Generator) -> torch.Tensor:
    """Each row of h [B, T, H] replaced by another token's row of the same source.

    The pool is every row seen so far in this ablation plus this call's rows, and a row never
    draws itself. Decoding calls fc on one or a few tokens at a time, so a permutation inside
    one call would mostly be the identity; drawing from the whole run's states keeps the
    source's scale and statistics while cutting its link to the current token.
    """
    rows = h.reshape(-1, h.shape[-1])
    pool = torch.cat([*bank, rows]) if bank else rows
    n, base = pool.shape[0], pool.shape[0] - rows.shape[0]
    if n == 1:  # nothing else to draw from: the only uninformative choice left is zero
        out = torch.zeros_like(rows)
    else:
        pick = torch.randint(0, n - 1, (rows.shape[0],), generator=gen)
        own = torch.arange(base, n)
        pick = pick + (pick >= own).long()  # skip the row itself
        out = pool[pick]
    bank.append(rows.clone())
    return out.reshape(h.shape)


class SourceAblation(nn.Module):
    """The draft's fc with one aux source of its input [..., S*W] zeroed or shuffled (`_shuffled`):
    what an ablated draft puts in fc's place. The inner projection keeps the name `fc`."""

    def __init__(self, fc: nn.Linear, source: int, width: int, mode: str, seed: int) -> None:
        super().__init__()
        self.fc, self.source, self.width, self.mode = fc, source, width, mode
        self.gen = torch.Generator().manual_seed(seed)
        self.bank: list[torch.Tensor] = []

    @property
    def weight(self) -> torch.Tensor:
        return self.fc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cols = slice(self.source * self.width, (self.source + 1) * self.width)
        h = x[..., cols]
        x = x.clone()
        x[..., cols] = torch.zeros_like(h) if self.mode == "zero" else _shuffled(h, self.bank, self.gen)
        return self.fc(x)


def ablated(pair, source: int, mode: str = "zero", seed: int = 0):
    """A variant of `pair` (`ModelPair.variant`, weights shared) whose draft sees aux source
    `source` zeroed or shuffled; the pair given is unchanged."""
    draft = _draft_with_fc(pair)
    n = len(draft.config.aux_layer_ids)
    if isinstance(source, bool) or not isinstance(source, int) or not 0 <= source < n:
        raise ValueError(f"ablation: source = {source!r}; expected an aux source index in [0, {n - 1}]")
    if mode not in ABLATION_MODES:
        raise ValueError(f"ablation: mode = {mode!r}; expected one of {ABLATION_MODES}")
    plain = pair.plain[1]
    fc = SourceAblation(plain.fc, source, plain.config.target_hidden_size, mode, seed)
    return pair.variant(draft={"fc": fc})


@dataclass
class AblationEntry:
    source: int
    layer_id: int
    mode: str
    accept_length: float
    delta: float  # accept_length - baseline (negative: the source was helping)
    accept_length_clean: float | None = None  # over the continuations that do not loop (None: all loop)
    degenerate: int = 0  # continuations that loop


@dataclass
class AblationReport:
    k: int
    max_new_tokens: int
    num_prompts: int
    aux_layer_ids: list[int]
    baseline: float  # greedy accept length with every source intact
    entries: list[AblationEntry]
    baseline_clean: float | None = None  # the same over the continuations that do not loop
    baseline_degenerate: int = 0  # the intact draft's continuations that loop

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        lines = [f"ablation at k={self.k}, {self.num_prompts} prompts: baseline accept length {self.baseline:.3f} "
                 f"({_clean(self.baseline_clean, self.baseline_degenerate, self.num_prompts)})"]
        for e in self.entries:
            lines.append(f"  {e.mode:>7} source {e.source} (layer {e.layer_id}): {e.accept_length:.3f} "
                         f"({e.delta:+.3f}; {_clean(e.accept_length_clean, e.degenerate, self.num_prompts)})")
        return "\n".join(lines)


def _clean(clean: float | None, loops: int, n: int) -> str:
    return f"clean {'n/a' if clean is None else f'{clean:.3f}'}, {loops} of {n} loop"


def greedy_split(pair, prompts: Sequence[str], k: int, max_new_tokens: int, attention: str = "auto") -> AcceptSplit:
    """Greedy accept lengths over prompts (pooled exactly over every prompt's events, and clean)."""
    dec = SpecDecoder(pair, num_speculative_tokens=k, temperature=0.0, attention=attention)
    return accept_split([dec.generate(p, max_new_tokens).events for p in prompts])


def greedy_accept_length(pair, prompts: Sequence[str], k: int, max_new_tokens: int, attention: str = "auto") -> float:
    """Greedy accept length over prompts, from every prompt's events together (exact pooling)."""
    return greedy_split(pair, prompts, k, max_new_tokens, attention).pooled


def ablation_study(pair, prompts: Sequence[str], k: int = 3, max_new_tokens: int = 32,
                   modes: Sequence[str] = ABLATION_MODES, seed: int = 0, attention: str = "auto",
                   progress=None) -> AblationReport:
    """Greedy accept length with each source zeroed / shuffled in turn, against the intact draft."""
    draft = _draft_with_fc(pair)
    if isinstance(prompts, str) or not prompts:
        raise ValueError("ablation_study: argument 'prompts'; expected a non-empty list of strings")
    bad = [m for m in modes if m not in ABLATION_MODES]
    if bad or not modes:
        raise ValueError(f"ablation_study: modes = {list(modes)!r}; expected some of {ABLATION_MODES}")
    ids = list(draft.config.aux_layer_ids)
    total = 1 + len(ids) * len(modes)
    if progress:
        progress(0, total, "intact draft")
    base = greedy_split(pair, prompts, k, max_new_tokens, attention)
    entries = []
    for mode in modes:
        for s, layer in enumerate(ids):
            if progress:
                progress(len(entries) + 1, total, f"{mode} source {s} (layer {layer})")
            a = greedy_split(ablated(pair, s, mode, seed), prompts, k, max_new_tokens, attention)
            entries.append(AblationEntry(s, layer, mode, a.pooled, a.pooled - base.pooled, a.clean, a.num_degenerate))
    if progress:
        progress(total, total, "done")
    return AblationReport(k, max_new_tokens, len(prompts), ids, base.pooled, entries, base.clean, base.num_degenerate)
