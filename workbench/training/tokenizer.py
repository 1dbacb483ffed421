"""Byte-level BPE training for the embedded pair's tokenizer.

Byte-level so that every string, whatever its whitespace or script, encodes and decodes back
exactly: the 256 byte symbols are all in the vocabulary and the ByteLevel decoder undoes the
byte-to-unicode mapping. The pre-tokenizer decides which pieces BPE may merge across; for code
the choice that matters is what happens to a newline and the indentation after it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 0, 1, 2
MODEL_MAX_LENGTH = 2048

# GPT-4's (cl100k) split: words with one leading non-letter, digits in threes, punctuation runs,
# newlines, and runs of spaces that leave their last space to the following word.
GPT4_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4's split changed for code in two ways: `_` counts as a letter, so snake_case names and
# dunders (`__init__`, `max_bytes`) are one piece; and a line break keeps the next line's
# indentation with it, so "\n        return" is two pieces ("\n        ", "return"), not three.
# Chosen for the embedded pair because it encodes the stdlib eval split in the fewest tokens
# of the splits tried, outside the two generated codec tables (numbers in docs/TRAINING.md).
CODE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}_]?[\p{L}_]+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+|\s*[\r\n][ \t]*|\s+(?!\S)|\s+"
)


def build_tokenizer(pattern: str | None = CODE_PATTERN) -> Tokenizer:
    """An untrained byte-level BPE tokenizer; `pattern=None` uses ByteLevel's GPT-2 regex."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_config(model_max_length: int = MODEL_MAX_LENGTH) -> dict:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast; no chat template,
    because the embedded verifier is a plain code-continuation model."""
    bos, eos, pad = SPECIAL_TOKENS
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,  # keep decode exact for code
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, *, out_dir: str | Path,
                    pattern: str | None = CODE_PATTERN) -> Path:
    """Train byte-level BPE on `texts`; write tokenizer.json and tokenizer_config.json to
    `out_dir` and return `out_dir`. Special tokens <|bos|>, <|eos|>, <|pad|> get ids 0, 1, 2."""
    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be at least {floor} (3 special + 256 byte tokens), "
                         f"got {vocab_size}")
    tok = build_tokenizer(pattern)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknowns
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = json.dumps(tokenizer_config(), indent=2) + "\n"
    (out_dir / "tokenizer_config.json").write_text(config, encoding="utf-8")
    return out_dir


def bytes_per_token(tok: Tokenizer, texts: Sequence[str]) -> float:
    """UTF-8 bytes per token over `texts` (higher is better compression)."""
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=False))
    return n_bytes / max(n_tokens, 1)


if __name__ == "__main__":
    # python -m workbench.training.tokenizer assets/tiny-kimi/verifier
    from workbench.training.corpus import load_split

    start = time.perf_counter()
    out = train_tokenizer(load_split("train"), 8192, out_dir=sys.argv[1])
    seconds = time.perf_counter() - start
    bpt = bytes_per_token(Tokenizer.from_file(str(out / "tokenizer.json")), load_split("eval"))
    print(json.dumps({"out_dir": str(out), "train_seconds": round(seconds, 1),
                      "eval_bytes_per_token": round(bpt, 3)}))
