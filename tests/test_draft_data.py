"""The draft's training mix: looping continuations cut to their prompts, corpus documents added."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from workbench.training import draft_data as dd


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_looping_continuation_keeps_only_its_prompt():
    prompt = list(range(100, 140))
    loop = [7, 8, 9, 10, 11, 12] * 20  # every 6-gram after the first period repeats
    fresh = list(range(200, 320))
    counts = Counter()
    got = dd.clean_records([{"ids": prompt + loop, "prompt_tokens": 40, "kind": "code", "temperature": 0.0},
                            {"ids": prompt + fresh, "prompt_tokens": 40, "kind": "code", "temperature": 0.7}], counts)
    assert got == [{"ids": prompt}, {"ids": prompt + fresh}]
    assert counts == {"code T=0.0 prompt only": 1, "code T=0.7 kept": 1}
    counts.clear()  # --loops keep: the verifier's loops are what a bench or the chat serves
    got = dd.clean_records([{"ids": prompt + loop, "prompt_tokens": 40, "kind": "chat", "temperature": 0.0}], counts,
                           keep_loops=True)
    assert got == [{"ids": prompt + loop}] and counts == {"chat T=0.0 loop kept": 1}


def test_mix_draws_corpus_documents_and_chats_with_the_seed(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write(corpus / "train.jsonl", [{"text": f"def f{i}(): pass"} for i in range(50)])
    _write(corpus / "chat_train.jsonl", [{"text": f"<|im_user|>q{i}<|im_end|>"} for i in range(20)])
    regen = _write(tmp_path / "regen.jsonl", [{"ids": [1, 2, 3, 4], "prompt_tokens": 2}])
    rows = dd.draft_data([regen], corpus, docs=5, chats=3, seed=1)
    assert len(rows) == 9 and {"ids": [1, 2, 3, 4]} in rows
    texts = [r["text"] for r in rows if "text" in r]
    assert sum(t.startswith("def ") for t in texts) == 5 and sum(t.startswith("<|im_user|>") for t in texts) == 3
    assert rows == dd.draft_data([regen], corpus, docs=5, chats=3, seed=1)  # reproducible
    assert rows != dd.draft_data([regen], corpus, docs=5, chats=3, seed=2)


def test_cli_writes_rows_the_trainer_reads(tmp_path, capsys):
    from workbench.tokenizer import Tokenizer
    from workbench.training.eagle3 import corpus_stream
    from tests.helpers import EMBEDDED

    regen = _write(tmp_path / "regen.jsonl", [{"ids": [5, 6, 7], "prompt_tokens": 1, "kind": "chat",
                                               "temperature": 0.7}])
    out = tmp_path / "mix.jsonl"
    assert dd.main(["--regen", str(regen), "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().err)["regenerated"] == {"chat T=0.7 kept": 1}
    tok = Tokenizer.from_dir(EMBEDDED / "verifier")
    stream = corpus_stream(tok, str(out))
    assert stream.tolist() == [tok.bos_token_id, 5, 6, 7, tok.eos_token_id]
    looping = _write(tmp_path / "loop.jsonl", [{"ids": [5] + [1, 2, 3] * 30, "prompt_tokens": 1}])
    for mode, kept in (("prompt", [5]), ("keep", [5] + [1, 2, 3] * 30)):
        assert dd.main(["--regen", str(looping), "--loops", mode, "--out", str(out)]) == 0
        assert json.loads(out.read_text()) == {"ids": kept}
    capsys.readouterr()


def test_bad_rows_name_the_file_and_the_fields(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", [{"text": "no ids"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: record 1: fields 'ids'.*'prompt_tokens'"):
        dd.draft_data([bad], None, 0, 0)
    (tmp_path / "broken.jsonl").write_text('{"ids": [1\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:1: not valid JSON"):
        dd.read_jsonl(tmp_path / "broken.jsonl")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        dd.read_jsonl(tmp_path / "list.jsonl")
    with pytest.raises(FileNotFoundError, match="train.jsonl: missing"):
        dd.corpus_sample(tmp_path, 1, 0)
