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
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 0, 1, 2
# Kimi's chat markers, special tokens of the chat-capable verifier (issue 42): ids 3 .. 7.
CHAT_TOKENS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
CHAT_SPECIAL_TOKENS = SPECIAL_TOKENS + CHAT_TOKENS
MODEL_MAX_LENGTH = 2048

# Kimi-K2-Instruct's chat layout, for text turns: each message is
# `<|im_{user,assistant,system}|>{name or role}<|im_middle|>{content}<|im_end|>` (any role other
# than user/assistant opens with <|im_system|>), a default system turn is put first when the
# conversation does not start with one, and the generation prompt is
# `<|im_assistant|>assistant<|im_middle|>`. No BOS/EOS: the template emits only <|im_*|>
# markers. Written for this project (not copied): Kimi's own template also renders tool
# declarations, tool calls and images, which the embedded verifier never sees. Every turn is
# closed with <|im_end|>, as in the original K2-Instruct release (K2-Instruct-0905 leaves the
# last turn open when add_generation_prompt is false, for prefills); a training document needs
# the closing marker so the model learns where an answer ends.
KIMI_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
KIMI_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + KIMI_DEFAULT_SYSTEM + "<|im_end|>"
    "{%- endif -%}"
    "{%- set role_name = message.get('name') or message['role'] -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>"
    "{%- endif -%}"
    "{{ role_name }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

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


def tokenizer_config(model_max_length: int = MODEL_MAX_LENGTH,
                     special_tokens: Sequence[str] = SPECIAL_TOKENS,
                     chat_template: str | None = None) -> dict:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast. The first three special
    tokens are bos, eos, pad. No chat template by default (the first embedded verifier is a
    plain code-continuation model); the chat verifier passes KIMI_CHAT_TEMPLATE."""
    bos, eos, pad = special_tokens[:3]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,  # keep decode exact for code
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(special_tokens)
        },
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, *, out_dir: str | Path,
                    pattern: str | None = CODE_PATTERN,
                    special_tokens: Sequence[str] = SPECIAL_TOKENS,
                    chat_template: str | None = None) -> Path:
    """Train byte-level BPE on `texts`; write tokenizer.json and tokenizer_config.json to
    `out_dir` and return `out_dir`. Special tokens get ids 0, 1, ... in order (<|bos|>, <|eos|>,
    <|pad|>, then e.g. CHAT_TOKENS); they are never split or merged with text."""
    floor = len(special_tokens) + 256
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be at least {floor} ({len(special_tokens)} special "
                         f"+ 256 byte tokens), got {vocab_size}")
    tok = build_tokenizer(pattern)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknowns
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(special_tokens=special_tokens, chat_template=chat_template)
    config = json.dumps(config, indent=2) + "\n"
    (out_dir / "tokenizer_config.json").write_text(config, encoding="utf-8")
    return out_dir


def bytes_per_token(tok: Tokenizer, texts: Sequence[str]) -> float:
    """UTF-8 bytes per token over `texts` (higher is better compression)."""
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=False))
    return n_bytes / max(n_tokens, 1)


def corpus_texts(path: str | Path, max_bytes: int | None = None) -> Iterator[str]:
    """The `text` of each document of a corpus JSON-lines file (corpus_build's train.jsonl,
    eval.jsonl, chat_train.jsonl ...), stopping before `max_bytes` of UTF-8 when given."""
    total = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            total += len(text.encode("utf-8"))
            if max_bytes is not None and total > max_bytes:
                return
            yield text


def count_tokens(tok: Tokenizer, texts: Iterable[str], batch: int = 512) -> tuple[int, int]:
    """(UTF-8 bytes, tokens) over `texts`, encoded in batches without special tokens."""
    n_bytes = n_tokens = 0
    chunk: list[str] = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == batch:
            n_tokens += sum(len(e.ids) for e in tok.encode_batch(chunk, add_special_tokens=False))
            n_bytes += sum(len(t.encode("utf-8")) for t in chunk)
            chunk = []
    if chunk:
        n_tokens += sum(len(e.ids) for e in tok.encode_batch(chunk, add_special_tokens=False))
        n_bytes += sum(len(t.encode("utf-8")) for t in chunk)
    return n_bytes, n_tokens


def train_on_corpus(corpus_dir: str | Path, out_dir: str | Path, vocab_size: int = 8192,
                    files: Sequence[str] = ("train.jsonl",)) -> Path:
    """The chat verifier's tokenizer: byte-level BPE over the corpus's train documents, with
    CHAT_SPECIAL_TOKENS and KIMI_CHAT_TEMPLATE. Code only by default: the chat pairs are cut
    from the same files, and leaving them out keeps the tokenizer fixed however the chat
    share is tuned later."""
    corpus_dir = Path(corpus_dir)
    paths = [corpus_dir / f for f in files if (corpus_dir / f).is_file()]

    def texts() -> Iterator[str]:
        for path in paths:
            yield from corpus_texts(path)

    return train_tokenizer(texts(), vocab_size, out_dir=out_dir,
                           special_tokens=CHAT_SPECIAL_TOKENS, chat_template=KIMI_CHAT_TEMPLATE)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m workbench.training.tokenizer")
    parser.add_argument("out_dir")
    parser.add_argument("--corpus", default=None,
                        help="a corpus_build output directory: train the chat verifier's "
                             "tokenizer on it (default: the stdlib, as the first verifier)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.corpus is None:
        from workbench.training.corpus import load_split

        out = train_tokenizer(load_split("train"), args.vocab_size, out_dir=args.out_dir)
        eval_texts = load_split("eval")
    else:
        out = train_on_corpus(args.corpus, args.out_dir, args.vocab_size)
        eval_texts = list(corpus_texts(Path(args.corpus) / "eval.jsonl"))
    seconds = time.perf_counter() - start
    bpt = bytes_per_token(Tokenizer.from_file(str(out / "tokenizer.json")), eval_texts)
    print(json.dumps({"out_dir": str(out), "train_seconds": round(seconds, 1),
                      "eval_bytes_per_token": round(bpt, 3)}))
    return 0


if __name__ == "__main__":
    # python -m workbench.training.tokenizer assets/tiny-kimi/verifier            (stdlib)
    # python -m workbench.training.tokenizer data/tokenizer --corpus data/corpus
    sys.exit(main())
