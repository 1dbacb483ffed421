"""One tokenizer interface for the engine, the CLI and the apps.

Two on-disk formats are read: `tokenizer.json` (Hugging Face `tokenizers`: the embedded pair,
DeepSeek-V3) and Kimi's `tiktoken.model` (base64 token ranks, encoded with `tiktoken`; special
tokens placed after the ranks as Kimi's tokenization_kimi.py places them). Both are byte-level
BPE, so every token is a byte string. `token_texts` streams text from those bytes through an
incremental UTF-8 decoder, so a character split across tokens is shown once, whole, on the token
that completes it.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import functools
import json
from collections.abc import Callable, Iterator
from datetime import datetime
from functools import cached_property
from pathlib import Path

# Kimi's pre-tokenizer split (tokenization_kimi.py, `pat_str`): Han runs; words with case
# classes that exclude Han; digits in threes; punctuation runs; newlines; spaces. The `&&`
# class intersections are understood by tiktoken's regex engine (Rust `fancy-regex`).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256  # Kimi reserves this many + 2 ids after the ranks
# tiktoken can fail on very long inputs or very long runs (openai/tiktoken#195); Kimi encodes
# in chunks of at most this many characters and runs of at most this many (non-)spaces.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000

_FILES = "tokenizer.json (Hugging Face tokenizers) or tiktoken.model (Kimi tiktoken)"


class Tokenizer:
    """Text <-> token ids for one checkpoint directory; build with `Tokenizer.from_dir`."""

    def __init__(self, *, directory: Path, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], token_bytes: Callable[[int], bytes],
                 token_to_id: Callable[[str], int | None], vocab_size: int,
                 config: dict, chat_template: str | None) -> None:
        self.directory = directory
        # each id's bytes once: token_texts runs for every emitted token and every step's proposals
        self._encode, self._decode, self._token_bytes = encode, decode, functools.lru_cache(maxsize=None)(token_bytes)
        self.vocab_size = vocab_size
        self.chat_template = chat_template
        self._special_names = {k: _token_content(config.get(k))
                               for k in ("bos_token", "eos_token", "pad_token")}
        ids = {}
        for field, name in self._special_names.items():
            ids[field] = None if name is None else token_to_id(name)
            if name is not None and ids[field] is None:
                raise ValueError(f"{directory / 'tokenizer_config.json'}: field {field!r} is "
                                 f"{name!r}, which is not a token of this vocabulary")
        self.bos_token_id: int | None = ids["bos_token"]
        self.eos_token_id: int | None = ids["eos_token"]
        self.pad_token_id: int | None = ids["pad_token"]

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Load tokenizer.json (preferred) or tiktoken.model, plus tokenizer_config.json."""
        directory = Path(directory)
        config = _read_config(directory)
        if (directory / "tokenizer.json").is_file():
            backend = _tokenizers_backend(directory / "tokenizer.json")
        elif (directory / "tiktoken.model").is_file():
            backend = _tiktoken_backend(directory / "tiktoken.model", config)
        else:
            raise FileNotFoundError(f"no tokenizer in {directory}: expected {_FILES}")
        template = _chat_template(directory, config)
        return cls(directory=directory, config=config, chat_template=template, **backend)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their special ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self._encode(text)
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError(f"tokenizer at {self.directory} has no bos_token "
                                 "(tokenizer_config.json field 'bos_token')")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included; invalid UTF-8 becomes U+FFFD."""
        self._check_ids(ids)
        return self._decode(list(ids))

    def token_texts(self, ids: list[int], prefix: list[int] | None = None) -> list[str]:
        """The text each of `ids` adds after `prefix`, one string per id.

        The pieces concatenate to decode(prefix + ids)[len(decode(prefix)):] whenever prefix
        and prefix + ids end on character boundaries. A token that ends inside a multi-byte
        character gets "" and the token that completes it gets the whole character; if
        `prefix` ends inside one, its first bytes are carried into the first piece.
        """
        self._check_ids(ids)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if prefix:
            self._check_ids(prefix[-3:])
            # An unfinished UTF-8 character is at most 3 bytes long, and every token is at
            # least one byte, so the last 3 tokens' last 3 bytes fix the decoder's state.
            decoder.decode(b"".join(self._token_bytes(i) for i in prefix[-3:])[-3:])
        return [decoder.decode(self._token_bytes(i)) for i in ids]

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes of token `i` (a token may hold part of a UTF-8 character)."""
        self._check_ids([i])
        return self._token_bytes(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` with the checkpoint's Jinja chat template, as transformers does."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer at {self.directory} has no chat template (expected "
                             "tokenizer_config.json field 'chat_template' or chat_template.jinja)")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m
                                                     for m in messages):
            raise ValueError("messages must be a list of dicts with a 'role' key")
        names = {k: v for k, v in self._special_names.items() if v is not None}
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **names)

    def format_prompt(self, messages: str | list[dict]) -> str:
        """The text to feed the model: the chat template when there is one, else the last user
        message as plain text to continue (the embedded pair is a code-continuation model)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if self.chat_template is not None:
            return self.apply_chat_template(messages, add_generation_prompt=True)
        users = [m for m in messages if m.get("role") == "user"]
        if not users:
            raise ValueError("format_prompt needs at least one message with role 'user'")
        return str(users[-1]["content"])

    @cached_property
    def _compiled_template(self):
        try:
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:
            raise ImportError("apply_chat_template needs jinja2 (pip install jinja2)") from e
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def _check_ids(self, ids: list[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary of {self.directory} "
                             f"(expected 0 <= id < {self.vocab_size})")

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.directory)!r}, vocab_size={self.vocab_size})"


# ---- tokenizer.json (Hugging Face tokenizers) ----------------------------------------------

def _tokenizers_backend(path: Path) -> dict:
    from tokenizers import Tokenizer as HFTokenizer

    decoder = json.loads(path.read_text(encoding="utf-8")).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    if "ByteLevel" not in kinds:
        raise ValueError(f"{path}: field 'decoder' is {decoder.get('type')!r}; expected a "
                         "ByteLevel decoder (byte-level BPE, as in DeepSeek-V3)")
    tok = HFTokenizer.from_file(str(path))
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}

    def token_bytes(i: int) -> bytes:
        piece = tok.id_to_token(i)
        if piece is None:
            raise ValueError(f"token id {i} has no entry in {path}")
        # Mirrors the ByteLevel decoder: a piece with a character outside the byte alphabet
        # (an added token such as "<｜begin▁of▁sentence｜>") is emitted as its UTF-8 text.
        try:
            return bytes(byte_of[c] for c in piece)
        except KeyError:
            return piece.encode("utf-8")

    return {
        "encode": lambda text: tok.encode(text, add_special_tokens=False).ids,
        "decode": lambda ids: tok.decode(ids, skip_special_tokens=False),
        "token_bytes": token_bytes,
        "token_to_id": tok.token_to_id,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of ByteLevel token strings."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


# ---- tiktoken.model (Kimi) ------------------------------------------------------------------

def _tiktoken_backend(path: Path, config: dict) -> dict:
    import tiktoken

    ranks = _read_tiktoken_ranks(path)
    n_base = len(ranks)
    added = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        added[int(key)] = _token_content(entry)
    # As tokenization_kimi.py: ids n_base .. n_base + 257 are special, named by
    # added_tokens_decoder or else <|reserved_token_{id}|>.
    special = {added.get(i, f"<|reserved_token_{i}|>"): i
               for i in range(n_base, n_base + KIMI_NUM_RESERVED_SPECIAL_TOKENS + 2)}
    enc = tiktoken.Encoding(name=path.name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                            special_tokens=special)

    def encode(text: str) -> list[int]:
        return [i for chunk in _tiktoken_chunks(text)
                for i in enc.encode(chunk, allowed_special="all")]

    def token_bytes(i: int) -> bytes:
        try:
            return enc.decode_single_token_bytes(i)
        except KeyError:
            raise ValueError(f"token id {i} has no entry in {path}") from None

    return {
        "encode": encode,
        "decode": enc.decode,  # UTF-8 with errors="replace"
        "token_bytes": token_bytes,
        "token_to_id": special.get,  # config token names (bos/eos/pad) are special tokens
        "vocab_size": enc.n_vocab,
    }


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken rank file: one `<base64 token> <rank>` per line."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"{path}: line {n} is not '<base64 token> <rank>': "
                             f"{line[:80]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: not byte-level; {len(missing)} single-byte tokens missing "
                         f"(first: {missing[0]:#04x})")
    return ranks


def _tiktoken_chunks(text: str) -> Iterator[str]:
    """Cut `text` as Kimi does: blocks of _TIKTOKEN_MAX_CHARS, then no run of whitespace or
    of non-whitespace longer than _TIKTOKEN_MAX_RUN."""
    for start in range(0, len(text), _TIKTOKEN_MAX_CHARS):
        block = text[start:start + _TIKTOKEN_MAX_CHARS]
        cut, run, space = 0, 0, block[0].isspace()
        for i, ch in enumerate(block):
            if ch.isspace() != space:
                run, space = 1, ch.isspace()
            else:
                run += 1
                if run > _TIKTOKEN_MAX_RUN:
                    yield block[cut:i]
                    cut, run = i, 1
        yield block[cut:]


# ---- tokenizer_config.json and chat templates ---------------------------------------------

def _read_config(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _chat_template(directory: Path, config: dict) -> str | None:
    """chat_template.jinja when present (newer transformers layout), else the config field,
    which may also be a list of named templates (then the one named 'default')."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{directory / 'tokenizer_config.json'}: field 'chat_template' "
                             f"lists {sorted(map(str, named))}; expected one named 'default'")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory / 'tokenizer_config.json'}: field 'chat_template' must "
                         f"be a string, got {type(template).__name__}")
    return template


def _token_content(value: object) -> str | None:
    """A token given as a string or as an AddedToken dict ({"content": ...})."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` filter (Kimi's template passes separators)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")
