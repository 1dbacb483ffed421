"""Bits per byte by position: how well a model predicts held-out code, and whether that holds deep
into a long file.

Bits per byte, not loss per token, so tokenizers compare: the summed negative log-likelihood of
the targets in bits, over the UTF-8 bytes those targets stand for. Windows start at a file's
first token, so the buckets (target positions 0-256, 256-1,024, 1,024-2,048) say how quality
changes with the context the model has read of that file.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

BUCKETS = ((0, 256), (256, 1024), (1024, 2048))


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """[V] UTF-8 bytes each token id stands for; special tokens stand for none.

    A byte-level BPE token's string has one character per byte (GPT-2's byte-to-unicode map)."""
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    out = np.zeros(tokenizer.get_vocab_size(), dtype=np.int64)
    for token, i in tokenizer.get_vocab().items():
        out[i] = 0 if token in special else len(token)
    return out


def eval_windows(data, seq: int, count: int) -> list[torch.Tensor]:
    """The first seq + 1 tokens of the first `count` held-out documents that are that long."""
    out = []
    for i in range(len(data.eval_starts)):
        doc = data.eval_document(i)
        if doc.size >= seq + 1:
            out.append(torch.from_numpy(doc[:seq + 1].astype(np.int64))[None])
            if len(out) == count:
                break
    if not out:
        raise ValueError(f"no held-out document has {seq + 1} tokens; evaluate with a shorter window")
    return out


def bucket_name(lo: int, hi: int) -> str:
    return f"{lo}-{hi}"


@torch.no_grad()
def bits_per_byte(logits_fn: Callable[[torch.Tensor], torch.Tensor], windows: list[torch.Tensor],
                  byte_len: np.ndarray, buckets=BUCKETS) -> dict[str, float]:
    """{"0-256": bpb, ...} over `windows` ([1, T+1] each), with `logits_fn(ids [1, T]) -> [1, T, V]`."""
    nats = {b: 0.0 for b in buckets}
    nbytes = {b: 0 for b in buckets}
    lengths = torch.from_numpy(byte_len)
    for w in windows:
        logits = logits_fn(w[:, :-1]).float()
        nll = F.cross_entropy(logits[0], w[0, 1:], reduction="none")
        size = lengths[w[0, 1:]]
        for lo, hi in buckets:
            nats[(lo, hi)] += float(nll[lo:hi].sum())
            nbytes[(lo, hi)] += int(size[lo:hi].sum())
    return {bucket_name(*b): round(nats[b] / math.log(2) / max(1, nbytes[b]), 4) for b in buckets
            if nbytes[b] > 0}
