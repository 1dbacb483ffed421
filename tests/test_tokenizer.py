"""The tokenizer wrapper (tokenizer.json and Kimi tiktoken.model) and the BPE trainer."""

import base64
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.tokenizer import Tokenizer, _bytes_to_unicode, _tiktoken_chunks
from workbench.training import corpus
from workbench.training import tokenizer as bpe

VERIFIER = Path(__file__).resolve().parents[1] / "assets" / "tiny-kimi-v1" / "verifier"  # the stdlib tokenizer
FAST = settings(max_examples=60, deadline=None)

# Text that stresses byte-level round trips: tabs, CRLF, trailing spaces, deep indentation,
# accents, CJK, emoji (4-byte; ZWJ sequences spanning several tokens), NUL, BOM.
TRICKY = [
    "def f(x):\n\tif x:\n\t\treturn x  \r\n\n",
    "class A:\n    def m(self):\n        '''Doc — naïve café.'''\n        return {'k': [1]}\n",
    "s = '世界 你好' + \"😀👩‍👩‍👧\"  # ☃\n",
    "\x00\ufeff\u200b x\n" + " " * 40 + "y\n",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(VERIFIER)


# ---- the first pair's tokenizer (stdlib, no chat markers; assets/tiny-kimi-v1) ---------------

def test_stdlib_tokenizer_ids_and_config(tok):
    assert tok.vocab_size == 8192
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.chat_template is None
    assert tok.encode("<|eos|>") == [1]
    assert tok.encode("x", add_bos=True) == [0, *tok.encode("x")]
    config = json.loads((VERIFIER / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] == 2048 and "chat_template" not in config
    spec = json.loads((VERIFIER / "tokenizer.json").read_text())
    assert spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == bpe.CODE_PATTERN


def test_stdlib_tokenizer_keeps_newline_and_indentation_together(tok):
    ids = tok.encode("):\n        return")
    assert tok.token_texts(ids) == ["):", "\n        ", "return"]


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_is_exact_on_tricky_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_is_exact_on_the_whole_eval_split(tok):
    texts = corpus.load_split("eval")
    assert len(texts) > 10
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


@FAST
@given(st.text(), st.lists(st.integers(0, 1000), max_size=4))
def test_token_texts_stream_any_text_exactly(tok, text, cuts):
    ids = tok.encode(text)
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    pieces = []
    for lo, hi in zip(bounds, bounds[1:]):  # stream in chunks, each with its prefix
        chunk = tok.token_texts(ids[lo:hi], prefix=ids[:lo])
        assert len(chunk) == hi - lo
        pieces += chunk
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in text


@FAST
@given(st.text(alphabet=st.characters(min_codepoint=0x80, codec="utf-8"), min_size=1))
def test_token_texts_matches_decode_at_character_boundaries(tok, text):
    ids = tok.encode(text)
    for k in range(len(ids)):
        head = tok.decode(ids[:k])
        if "\ufffd" in head:  # prefix ends mid-character: the formula is not defined there
            continue
        assert "".join(tok.token_texts(ids[k:], prefix=ids[:k])) == text[len(head):]


def test_token_ending_mid_character_gets_empty_then_whole_character(tok):
    emoji = "😀"  # F0 9F 98 80: no merge covers it, so it is four byte tokens
    ids = tok.encode(emoji)
    assert len(ids) > 1
    assert tok.token_texts(ids) == [""] * (len(ids) - 1) + [emoji]
    assert tok.token_texts(ids[2:], prefix=ids[:2]) == [""] * (len(ids) - 3) + [emoji]


@FAST
@given(st.lists(st.integers(0, 8191), max_size=30))
def test_token_texts_agree_with_decode_on_arbitrary_ids(tok, ids):
    # Arbitrary ids make invalid UTF-8; an ASCII token at the end closes any open character,
    # after which the streamed pieces must equal the library's lossy decode exactly.
    ids = ids + tok.encode("\n")
    assert "".join(tok.token_texts(ids)) == tok.decode(ids)


def test_out_of_range_ids_are_rejected(tok):
    with pytest.raises(ValueError, match="token id 8192 is outside"):
        tok.decode([5, 8192])
    with pytest.raises(ValueError, match="token id -1"):
        tok.token_texts([-1])


def test_byte_alphabet_matches_tokenizers():
    from tokenizers import pre_tokenizers

    assert sorted(_bytes_to_unicode().values()) == sorted(pre_tokenizers.ByteLevel.alphabet())


# ---- errors and configs -------------------------------------------------------------------

def test_empty_directory_names_the_directory_and_expected_files(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(err.value)
    assert "tokenizer.json" in str(err.value) and "tiktoken.model" in str(err.value)


def _copy_with_config(tmp_path: Path, **config) -> Path:
    shutil.copy(VERIFIER / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_unknown_bos_token_is_a_clear_error(tmp_path):
    _copy_with_config(tmp_path, bos_token="<s>")
    with pytest.raises(ValueError, match="field 'bos_token' is '<s>'"):
        Tokenizer.from_dir(tmp_path)


def test_add_bos_without_bos_token_is_a_clear_error(tmp_path):
    tok = Tokenizer.from_dir(_copy_with_config(tmp_path))
    assert tok.bos_token_id is None
    with pytest.raises(ValueError, match="no bos_token"):
        tok.encode("x", add_bos=True)


CHAT = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}"
        "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant"
        "<|im_middle|>{% endif %}")


def test_chat_template_from_tokenizer_config(tmp_path):
    tok = Tokenizer.from_dir(_copy_with_config(tmp_path, bos_token="<|bos|>", chat_template=CHAT))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi<|im_end|>")
    assert tok.format_prompt("Hi") == (
        "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_chat_template_helpers_and_jinja_file(tmp_path):
    _copy_with_config(tmp_path, bos_token="<|bos|>", chat_template="unused")
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{{ messages | tojson(separators=(',', ':')) }}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '<|bos|>[{"role":"user","content":"é"}]')
    with pytest.raises(ValueError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)


def test_without_a_template_format_prompt_continues_the_last_user_message(tok):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "def f():\n"}]
    assert tok.format_prompt(messages) == "def f():\n"
    assert tok.format_prompt("import os\n") == "import os\n"
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(messages)


# ---- Kimi tiktoken.model -------------------------------------------------------------------

# A tiny rank file: the 256 bytes (rank = byte value), then merges. "a\xe4" has a lower rank
# than "\xe4\xb8", so it would win if Kimi's split did not separate Latin letters from Han.
MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"o ",
          b"a\xe4", b"\xe4\xb8", "世".encode()]
N_BASE = 256 + len(MERGES)  # 267


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("kimi")
    tokens = [bytes([b]) for b in range(256)] + MERGES
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    added = {str(N_BASE + i): {"content": name, "special": True}
             for i, name in enumerate(["[BOS]", "[EOS]", "<|im_user|>"])}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}, "added_tokens_decoder": added}))
    return tmp_path


def test_tiktoken_ids_follow_kimi_layout(kimi_dir):
    tok = Tokenizer.from_dir(kimi_dir)
    assert tok.vocab_size == N_BASE + 256 + 2
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (N_BASE, N_BASE + 1, None)
    assert tok.encode("<|im_user|>") == [N_BASE + 2]
    assert tok.encode(f"<|reserved_token_{N_BASE + 100}|>") == [N_BASE + 100]
    assert tok.decode([N_BASE, 104]) == "[BOS]h"


def test_tiktoken_split_and_merges(kimi_dir):
    tok = Tokenizer.from_dir(kimi_dir)
    # "hello" | " world": merges apply inside pieces, never across ("o " is not used).
    assert tok.encode("hello world") == [259, 262, ord("l"), ord("d")]
    # "a" | "世": the Han class is cut out of the letter classes (the `&&` intersections).
    assert tok.encode("a世") == [ord("a"), 266]
    assert tok.token_texts([265, 0x96]) == ["", "世"]


@settings(max_examples=40, deadline=None)
@given(st.text())
def test_tiktoken_round_trip_and_streaming(kimi_dir, text):
    tok = Tokenizer.from_dir(kimi_dir)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert "".join(tok.token_texts(ids)) == text


def test_tiktoken_long_runs_are_chunked_like_kimi(kimi_dir):
    text = "a" * 30_000 + " " * 26_000 + "hello"
    # A chunk is cut where a run of spaces or of non-spaces would pass 25,000 characters.
    assert list(_tiktoken_chunks(text)) == ["a" * 25_000, "a" * 5_000 + " " * 25_000,
                                            " " * 1_000 + "hello"]
    tok = Tokenizer.from_dir(kimi_dir)
    assert tok.decode(tok.encode(text)) == text


def test_bad_tiktoken_file_names_the_line(tmp_path):
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nnot-base64! 1\n")
    with pytest.raises(ValueError, match="line 2"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 1\n")
    with pytest.raises(ValueError, match="not byte-level"):
        Tokenizer.from_dir(tmp_path)


# ---- training --------------------------------------------------------------------------------

def test_train_tokenizer_small(tmp_path):
    texts = [t for t in TRICKY if t] * 20 + ["def add(a, b):\n    return a + b\n"] * 50
    out = bpe.train_tokenizer(texts, 300, out_dir=tmp_path / "tok")
    tok = Tokenizer.from_dir(out)
    assert tok.vocab_size == 300
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    unseen = "λx: ∑ 🙂\n\t\t  return None\r\n"
    assert tok.decode(tok.encode(unseen)) == unseen
    # Merges were learnt: the training text costs fewer tokens than bytes.
    assert len(tok.encode(texts[-1])) < len(texts[-1].encode()) / 2
    with pytest.raises(ValueError, match="at least 259"):
        bpe.train_tokenizer(texts, 200, out_dir=tmp_path / "bad")


def test_train_tokenizer_with_chat_tokens_keeps_them_atomic(tmp_path):
    chat = ("<|im_user|>user<|im_middle|>Write add.<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>def add(a, b):\n    return a + b\n<|im_end|>")
    texts = [t for t in TRICKY if t] * 20 + ["def add(a, b):\n    return a + b\n"] * 50
    out = bpe.train_tokenizer(texts + [chat] * 20, 320, out_dir=tmp_path / "tok",
                              special_tokens=bpe.CHAT_SPECIAL_TOKENS,
                              chat_template=bpe.KIMI_CHAT_TEMPLATE)
    tok = Tokenizer.from_dir(out)
    assert tok.vocab_size == 320
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    ids = {t: tok.encode(t) for t in bpe.CHAT_SPECIAL_TOKENS}
    assert ids == {t: [i] for i, t in enumerate(bpe.CHAT_SPECIAL_TOKENS)}
    # Atomic wherever they stand, glued to text on both sides; round trip exact.
    glued = "x<|im_end|>y<|im_user|><|im_middle|>\n<|im_end|>"
    got = tok.encode(glued)
    assert [i for i in got if i < len(bpe.CHAT_SPECIAL_TOKENS)] == [7, 4, 6, 7]
    assert tok.decode(got) == glued
    encoded = tok.encode(chat)
    assert encoded[0] == 4 and encoded[-1] == 7 and encoded.count(6) == 2
    # A partial marker is plain text.
    assert all(i >= len(bpe.CHAT_SPECIAL_TOKENS) for i in tok.encode("<|im_end|"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == bpe.KIMI_CHAT_TEMPLATE
    assert [config["added_tokens_decoder"][str(i)]["content"] for i in range(8)] == list(
        bpe.CHAT_SPECIAL_TOKENS)
    assert tok.format_prompt("Write add.") == (
        f"<|im_system|>system<|im_middle|>{bpe.KIMI_DEFAULT_SYSTEM}<|im_end|>"
        "<|im_user|>user<|im_middle|>Write add.<|im_end|><|im_assistant|>assistant<|im_middle|>")
    with pytest.raises(ValueError, match=r"at least 264 \(8 special"):
        bpe.train_tokenizer(texts, 263, out_dir=tmp_path / "bad",
                            special_tokens=bpe.CHAT_SPECIAL_TOKENS)


def test_corpus_helpers(tmp_path):
    rows = [{"text": "a = 1\n"}, {"text": "é\n"}, {"text": "b = 2\n"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert list(bpe.corpus_texts(path)) == ["a = 1\n", "é\n", "b = 2\n"]
    assert list(bpe.corpus_texts(path, max_bytes=9)) == ["a = 1\n", "é\n"]
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(VERIFIER / "tokenizer.json"))
    n_bytes, n_tokens = bpe.count_tokens(hf, bpe.corpus_texts(path), batch=2)
    assert n_bytes == 15
    assert n_tokens == sum(len(hf.encode(r["text"]).ids) for r in rows)


# ---- the chat verifier's tokenizer (issue 42), trained on the PyPI + stdlib corpus ------------

CHAT_TOKENIZER = VERIFIER.parents[1] / "corpus" / "tokenizer"


def test_committed_chat_tokenizer():
    tok = Tokenizer.from_dir(CHAT_TOKENIZER)
    assert tok.vocab_size == 8192
    assert [tok.encode(t) for t in bpe.CHAT_SPECIAL_TOKENS] == [[i] for i in range(8)]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.chat_template == bpe.KIMI_CHAT_TEMPLATE
    spec = json.loads((CHAT_TOKENIZER / "tokenizer.json").read_text())
    assert spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == bpe.CODE_PATTERN
    for text in TRICKY:
        assert tok.decode(tok.encode(text)) == text
    assert tok.token_texts(tok.encode("):\n        return")) == ["):", "\n        ", "return"]
    prompt = tok.format_prompt("Write a Python function `add(a, b)`.")
    ids = tok.encode(prompt)
    tail = [5, *tok.encode("assistant"), 6]  # <|im_assistant|>assistant<|im_middle|>
    assert ids[0] == 3 and ids[-len(tail):] == tail
    assert tok.decode(ids) == prompt
    shipped = VERIFIER.parents[1] / "tiny-kimi" / "verifier"  # the embedded verifier speaks it
    assert (shipped / "tokenizer.json").read_bytes() == (CHAT_TOKENIZER / "tokenizer.json").read_bytes()
    assert Tokenizer.from_dir(shipped).chat_template == bpe.KIMI_CHAT_TEMPLATE
