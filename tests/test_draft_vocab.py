"""A reduced draft vocabulary (d2t): the kept rows keep their logits, proposals stay in the
kept set, the checkpoint round-trips in SpecForge/vLLM's layout, and decoding stays lossless."""
from __future__ import annotations

import json

import pytest
import torch
from tests.test_engine import ID_PROMPTS, autoregressive, random_pair

import workbench as wb
from workbench.analysis.doctor import static_checks
from workbench.decoding.drafters import greedy_chain
from workbench.pair import save_model
from workbench.training.draft_vocab import count_tokens, main, reduce_draft_vocab, select_tokens


def test_count_tokens_and_select(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"ids": ids}) for ids in ([5, 5, 5, 2, 9], [9, 5, 7], [])) + "\n\n")
    counts = count_tokens([data], 12)
    assert counts.tolist() == [0, 0, 1, 0, 0, 4, 0, 1, 0, 2, 0, 0]
    assert select_tokens(counts, 3).tolist() == [2, 5, 9]  # 5 (4x), 9 (2x), then 2 before 7 (tie: lower id)
    assert select_tokens(counts, 3, always=(1,)).tolist() == [1, 5, 9]  # EOS kept whatever its count
    with pytest.raises(ValueError, match=r"draft vocabulary size = 13; expected .* at most the vocabulary's 12"):
        select_tokens(counts, 13)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": [1, 2]}\n{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: field 'ids' missing"):
        count_tokens([bad], 12)
    bad.write_text('{"ids": [1, 12]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: 'ids' holds ids outside \[0, 12\)"):
        count_tokens([bad], 12)


def _keep(vocab: int, size: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].sort().values


@pytest.mark.parametrize("attention", ["mla", "mha"])
def test_reduced_draft_is_the_full_draft_restricted_to_the_kept_tokens(attention):
    pair = random_pair(seed=2, attention=attention)  # built outside inference mode: it is cached for other tests
    with torch.inference_mode():
        _check_restricted(pair.reference())  # the reduction is a transform of the plain draft


def _check_restricted(pair):
    full, vocab = pair.draft, pair.verifier.config.vocab_size
    keep = _keep(vocab, 96, seed=3)
    small = reduce_draft_vocab(full, keep)
    assert small.config.draft_vocab_size == 96 and torch.equal(torch.arange(96) + small.d2t, keep)
    out = pair.verifier(torch.tensor([ID_PROMPTS[2]]))
    ids = torch.tensor([ID_PROMPTS[2][1:] + [int(keep[7])]])
    hidden = full.combine_hidden_states(out.aux_hidden_states)
    assert torch.equal(small.combine_hidden_states(out.aux_hidden_states), hidden)
    c_full, c_small = full.new_cache(64), small.new_cache(64)
    post, state = full(ids, hidden, c_full)
    dropped = torch.ones(vocab, dtype=torch.bool)
    dropped[keep] = False
    k, tokens, probs = 4, [], []
    for i in range(k):  # the full draft, its logits outside `keep` masked: what the reduced one must do
        logits = full.compute_logits(post)[0, -1].float().masked_fill(dropped, float("-inf"))
        p = logits.softmax(-1)
        tokens.append(int(p.argmax())), probs.append(float(p.max()))
        if i + 1 < k:
            post, state = full(torch.tensor([[tokens[-1]]]), state[:, -1:], c_full)
    chain, chain_probs = greedy_chain(small, ids, hidden, c_small, k)
    assert chain[0].tolist() == tokens and all(t in keep for t in tokens)
    torch.testing.assert_close(chain_probs[0], torch.tensor(probs), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(c_small.valid(), c_full.valid(), rtol=0, atol=0)
    # compute_logits (the sampled proposer's path) scatters the same rows through d2t
    row = small.compute_logits(post)[0, -1]
    assert torch.isneginf(row[dropped]).all()
    torch.testing.assert_close(row[keep], full.compute_logits(post)[0, -1][keep], rtol=0, atol=0)
    with pytest.raises(ValueError, match="already reduced"):
        reduce_draft_vocab(small, keep)
    with pytest.raises(ValueError, match="increasing distinct ids"):
        reduce_draft_vocab(full, keep.flip(0))


def test_cli_writes_a_checkpoint_that_loads_passes_the_doctor_and_decodes_losslessly(tmp_path, capsys):
    pair = random_pair(seed=4)
    vdir, ddir = pair.verifier_dir, pair.draft_dir
    data = tmp_path / "text.jsonl"
    rows = [autoregressive(pair, p, 24).tokens + p for p in ID_PROMPTS]
    data.write_text("".join(json.dumps({"ids": r}) + "\n" for r in rows))
    out = tmp_path / "small"
    assert main(["--verifier", vdir, "--draft", ddir, "--data", str(data), "--size", "64", "--out", str(out),
                 "--dtype", "float32"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft_vocab_size"] == 64 and 0 < report["coverage"] <= 1
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["vocab_size"] == 512
    small = wb.load_pair(vdir, out, dtype="float32")
    d2t = small.draft.d2t
    assert d2t.dtype == torch.int64 and d2t.shape == (64,)
    keep = torch.arange(64) + d2t
    eos = pair.verifier.config.eos_token_id
    assert bool((keep[1:] > keep[:-1]).all()) and eos in keep.tolist()
    counts = count_tokens([data], 512)
    frequent = keep[keep != eos]  # every kept id but EOS is at least as frequent as any dropped id
    assert counts[frequent].min() >= counts[~torch.isin(torch.arange(512), keep)].max()
    torch.testing.assert_close(small.draft.lm_head.weight, pair.verifier.lm_head.weight[keep], rtol=0, atol=0)
    checks = {c.name: c for c in static_checks(small)}
    assert checks["d2t"].status == "ok"
    for prompt in ID_PROMPTS:
        spec = wb.SpecDecoder(small, 3).generate(prompt, 24)
        assert spec.tokens == autoregressive(pair, prompt, 24).tokens  # lossless, whatever the draft vocab
        assert all(t in keep.tolist() for e in spec.events for t in e.proposed)


def test_save_model_round_trips_the_reduced_draft(tmp_path):
    pair = random_pair(seed=2)
    small = reduce_draft_vocab(pair.draft, _keep(512, 40, seed=9))
    save_model(small, tmp_path / "d")
    again = wb.load_draft(tmp_path / "d", pair.verifier)
    assert torch.equal(again.d2t, small.d2t) and torch.equal(again.lm_head.weight, small.lm_head.weight)


@pytest.mark.parametrize("reduced", [False, True])
def test_a_draft_in_its_own_dtype_decodes_losslessly(reduced, tmp_path):
    """The draft only proposes, so it may run in another dtype than the verifier (the shared
    embedding, aux states and head are cast at the boundary); output stays the verifier's."""
    pair = random_pair(seed=4)  # fp32 verifier
    ddir = pair.draft_dir
    if reduced:
        save_model(reduce_draft_vocab(pair.draft, _keep(512, 64, seed=5)), tmp_path / "d")
        ddir = tmp_path / "d"
    draft = wb.load_draft(ddir, pair.verifier, dtype="bfloat16")
    assert draft.fc.weight.dtype == torch.bfloat16 and pair.verifier.lm_head.weight.dtype == torch.float32
    mixed = wb.ModelPair(pair.verifier, draft, pair.tokenizer, pair.verifier_dir, str(ddir))
    for prompt in ID_PROMPTS[:2]:
        res = wb.SpecDecoder(mixed, 3).generate(prompt, 24)
        assert res.tokens == autoregressive(pair, prompt, 24).tokens
        assert sum(len(e.proposed) for e in res.events) > 0
