"""A reduced draft vocabulary (EAGLE-3's `d2t`): the draft's lm_head keeps the frequent tokens.

Why: the draft's lm_head runs once per proposal, and with a large vocabulary it is the draft
step's largest matmul; EAGLE-3 drafts for Llama-3 keep 32k of 128k tokens for that reason. A
draft trained against the verifier's frozen head gives, on the rows it keeps, exactly the
logits it had, so its greedy proposal only changes where the full argmax was a dropped token.
(The embedded draft keeps 2048 of 8192 tokens: the same accept length to four digits and, once
compiled, a quarter less draft time per step; see docs/TRAINING.md.)

Conventions (SpecForge writes them, vLLM and SGLang read them): draft ids are the kept target
ids in increasing order; `d2t[i] = target_id - i` (int64), so target id = i + d2t[i]; the
draft then ships its own `lm_head.weight` [draft_vocab_size, H] and `draft_vocab_size` in its
config. `t2d` is derived, never saved.

    python -m workbench.training.draft_vocab --verifier DIR --draft DIR --data A.jsonl [B.jsonl ...] \
        --size 2048 --out DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from workbench.models import Eagle3Draft


def count_tokens(paths: list[str | Path], vocab_size: int) -> torch.Tensor:
    """Occurrences of each token id in jsonl files of `{"ids": [...]}` (what `regenerate` writes)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in paths:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                ids = json.loads(line).get("ids")
                if not isinstance(ids, list):
                    raise ValueError(f"{path}:{i}: field 'ids' missing; expected a list of token ids")
                t = torch.tensor(ids, dtype=torch.long)
                if t.numel() and (t.min() < 0 or t.max() >= vocab_size):
                    raise ValueError(f"{path}:{i}: 'ids' holds ids outside [0, {vocab_size})")
                counts += torch.bincount(t, minlength=vocab_size)
    return counts


def select_tokens(counts: torch.Tensor, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent ids (ties: the lower id), `always` included, in increasing order."""
    vocab = counts.numel()
    if not len(always) < size <= vocab:
        raise ValueError(f"draft vocabulary size = {size}; expected more than the {len(always)} ids kept "
                         f"always and at most the vocabulary's {vocab}")
    score = counts.double().clone()
    score[list(always)] = float("inf")
    order = torch.sort(score, descending=True, stable=True).indices  # stable: ties keep the lower id first
    return order[:size].sort().values


def reduce_draft_vocab(draft: Eagle3Draft, keep: torch.Tensor) -> Eagle3Draft:
    """A copy of `draft` whose lm_head holds only the rows of the target ids `keep` (increasing).

    The draft's own weights are copied; its lm_head rows come from the head it uses now (its own
    or the verifier's shared one), so kept tokens get exactly the logits they had.
    """
    cfg = draft.config
    if cfg.draft_vocab_size != cfg.vocab_size:
        raise ValueError(f"the draft's vocabulary is already reduced ({cfg.draft_vocab_size} of {cfg.vocab_size})")
    keep = keep.to(torch.long).cpu()
    if keep.ndim != 1 or not bool((keep[1:] > keep[:-1]).all()) or keep[0] < 0 or keep[-1] >= cfg.vocab_size:
        raise ValueError(f"keep must be increasing distinct ids in [0, {cfg.vocab_size})")
    head = draft.part("lm_head").weight.detach()
    own_embed = "embed_tokens" in draft._modules
    new = Eagle3Draft(dataclasses.replace(cfg, draft_vocab_size=keep.numel()), own_embed=own_embed, own_lm_head=True)
    new = new.to(device=head.device, dtype=head.dtype)
    state = {n: t for n, t in draft.state_dict().items() if n not in ("lm_head.weight", "d2t")}
    state["lm_head.weight"] = head[keep.to(head.device)].clone()
    state["d2t"] = (keep - torch.arange(keep.numel())).to(head.device)
    new.load_state_dict(state, strict=True)
    if draft._shared:
        new.share(draft._shared["embed_tokens"], draft._shared["lm_head"])
    return new.eval()


def main(argv: list[str] | None = None) -> int:
    from workbench.pair import load_pair
    from workbench.pair import save_model

    p = argparse.ArgumentParser(prog="python -m workbench.training.draft_vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", required=True, help="verifier checkpoint directory")
    p.add_argument("--draft", required=True, help="draft checkpoint directory (full vocabulary)")
    p.add_argument("--data", nargs="+", required=True, help="jsonl files with 'ids' (the draft's training text)")
    p.add_argument("--size", type=int, required=True, help="draft vocabulary size")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the saved weights")
    args = p.parse_args(argv)
    pair = load_pair(args.verifier, args.draft, dtype="float32", fast="off")  # the plain draft is reduced
    counts = count_tokens(args.data, pair.verifier.config.vocab_size)
    keep = select_tokens(counts, args.size, always=tuple(pair.eos_token_ids))  # EOS stays proposable
    reduced = reduce_draft_vocab(pair.draft, keep)
    save_model(reduced, args.out, dtype=getattr(torch, args.dtype))
    covered = counts[keep].sum().item() / max(counts.sum().item(), 1)
    print(json.dumps({"out": args.out, "draft_vocab_size": args.size, "coverage": round(covered, 5),
                      "tokens_counted": int(counts.sum())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
