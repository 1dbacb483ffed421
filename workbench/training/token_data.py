"""A built corpus as token arrays: tokenized once, cached as .npy, sampled as training windows.

Documents are shuffled with the run's seed before they are concatenated (the corpus is written in
package order, and a window should not see one package for an hour), each as [bos] + ids + [eos].
Chat documents (`chat_train.jsonl`, rendered through the chat template) are mixed in as documents
of their own. The eval split keeps each document's start, so evaluation windows begin at a file's
first token and position means position in the file.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

STDLIB = "python-stdlib"  # the corpus' name for the standard library's part


def _read_texts(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
            if not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{n}: field 'text' missing; expected the document's text as a string")
            rows.append(row)
    return rows


def _encode(texts: list[str], tokenizer: Tokenizer, bos: int, eos: int, chunk: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """(token ids [N] uint16, document start offsets [D]) of [bos] + ids + [eos] per text."""
    parts, starts, at = [], [], 0
    for s in range(0, len(texts), chunk):
        for enc in tokenizer.encode_batch(texts[s:s + chunk], add_special_tokens=False):
            ids = np.asarray([bos, *enc.ids, eos], dtype=np.uint16)
            starts.append(at)
            at += len(ids)
            parts.append(ids)
    return (np.concatenate(parts) if parts else np.zeros(0, np.uint16)), np.asarray(starts, dtype=np.int64)


@dataclass
class TokenData:
    train: np.ndarray  # uint16 token ids, every train document concatenated
    eval: np.ndarray  # uint16, the held-out packages' documents concatenated
    eval_starts: np.ndarray  # each eval document's offset in `eval`

    @property
    def train_tokens(self) -> int:
        return int(self.train.size)

    @property
    def eval_tokens(self) -> int:
        return int(self.eval.size)

    def eval_document(self, i: int) -> np.ndarray:
        end = self.eval_starts[i + 1] if i + 1 < len(self.eval_starts) else self.eval.size
        return self.eval[self.eval_starts[i]:end]

    def sample(self, batch: int, seq: int, rng: random.Random) -> torch.Tensor:
        """[batch, seq + 1] windows at random offsets of the train stream."""
        if self.train.size <= seq + 1:
            raise ValueError(f"the train split has {self.train.size} tokens; a window needs {seq + 2}")
        starts = [rng.randrange(0, self.train.size - seq - 1) for _ in range(batch)]
        return torch.from_numpy(np.stack([self.train[s:s + seq + 1] for s in starts]).astype(np.int64))

    @classmethod
    def build(cls, corpus: Path, tokenizer: Tokenizer, cache: Path, seed: int = 0,
              bos: int = 0, eos: int = 1, log: Callable[[str], None] = print,
              eval_only: bool = False) -> "TokenData":
        """Tokenize `corpus` (train.jsonl, eval.jsonl, chat_train.jsonl if present) or read the cache.

        The held-out split is the corpus' eval packages without the standard library's eval files,
        so evaluation is on third-party code that no training document comes from. `eval_only`
        leaves the train split empty (an evaluation needs none of it).
        """
        files = [corpus / "train.jsonl", corpus / "eval.jsonl"]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{missing}: missing; expected a corpus built by "
                                    f"`workbench build-corpus --out {corpus}`")
        chat = corpus / "chat_train.jsonl"
        files += [chat] if chat.is_file() else []
        key = hashlib.sha1(tokenizer.to_str().encode())
        for f in files:
            key.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
        key.update(f"seed={seed}".encode() + (b" eval_only" if eval_only else b""))
        where = Path(cache) / key.hexdigest()[:16]
        if (where / "eval_starts.npy").is_file():
            load = lambda n: np.load(where / f"{n}.npy", allow_pickle=False)  # noqa: E731
            return cls(load("train"), load("eval"), load("eval_starts"))
        docs = [] if eval_only else _read_texts(files[0]) + (_read_texts(chat) if chat.is_file() else [])
        random.Random(seed).shuffle(docs)
        if docs:
            log(f"tokenizing {len(docs):,} train documents")
        train, _ = _encode([d["text"] for d in docs], tokenizer, bos, eos)
        held = sorted((d for d in _read_texts(files[1]) if d.get("package") != STDLIB),
                      key=lambda d: (d.get("package", ""), d.get("path", "")))
        ev, starts = _encode([d["text"] for d in held], tokenizer, bos, eos)
        where.mkdir(parents=True, exist_ok=True)
        for name, arr in (("train", train), ("eval", ev), ("eval_starts", starts)):
            np.save(where / f"{name}.npy", arr, allow_pickle=False)
        return cls(train, ev, starts)
