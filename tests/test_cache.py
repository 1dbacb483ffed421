"""The KV cache, and rollback after a rejection: what the caches hold is what a fresh prefill of
the verified tokens would hold.

Rollback is `truncate(n)`; rows past n stay in memory and the next write overwrites them. So
after every speculation step the verifier cache's valid rows must equal a fresh prefill of the
accepted sequence, and the draft cache's rows below `proposer.seen` a fresh first pass of the
draft over it. A step that truncated to the wrong length, or a draft pass fed the wrong aux
states, shows up as a mismatch here even when the emitted tokens are still right.
"""
from __future__ import annotations

import pytest
import torch
from tests.test_engine import ScriptedProposer, greedy_chain, random_pair

import workbench as wb


# ---------------------------------------------------------------------------------------------
# KVCache on its own.

def test_write_advance_truncate_reset():
    c = wb.KVCache(num_layers=2, row_width=5, max_len=8, name="unit cache")
    assert (c.num_layers, c.row_width, c.max_len, c.length) == (2, 5, 8, 0)
    rows = torch.arange(3 * 5, dtype=torch.float32).view(1, 3, 5)
    for layer in range(2):
        valid = c.write(layer, rows + layer)
        assert torch.equal(valid, rows + layer)  # the layer's rows up to the end of the write
    assert c.length == 0  # writing does not move the length; the model advances once per forward
    c.advance(3)
    assert c.length == 3 and c.valid().shape == (2, 1, 3, 5)
    assert torch.equal(c.valid()[1], rows + 1) and torch.equal(c.layer(0)[:, :3], rows)
    c.truncate(1)  # rollback: rows 1..2 are stale, not erased
    assert c.length == 1 and torch.equal(c.valid()[0], rows[:, :1])
    assert torch.equal(c.layer(0)[:, 1:3], rows[:, 1:3])
    new = torch.full((1, 2, 5), -1.0)
    assert torch.equal(c.write(0, new), torch.cat([rows[:, :1], new], 1))  # overwrites the stale rows
    c.advance(2)
    assert torch.equal(c.valid()[0], torch.cat([rows[:, :1], new], 1))
    c.truncate(3)  # truncating to the current length is a no-op
    c.reset()
    assert c.length == 0 and c.valid().shape == (2, 1, 0, 5)


def test_bytes():
    c = wb.KVCache(3, 10, 16, batch=2, dtype=torch.bfloat16)
    assert c.bytes_per_token == 3 * 2 * 10 * 2
    assert c.nbytes_allocated == 16 * c.bytes_per_token == c.rows.numel() * 2
    assert c.nbytes_used == 0
    c.advance(5)
    assert c.nbytes_used == 5 * 120
    assert "[5, 5]/16 tokens" in repr(c)
    # Kimi-shaped MLA rows: one [c_kv | k_pe] row of 512 + 64 values per token and layer.
    kimi = wb.KVCache(61, 576, 1, dtype=torch.bfloat16)
    assert kimi.bytes_per_token == 70272


def test_past_the_context_is_an_error_not_a_wrap():
    c = wb.KVCache(1, 4, 6, name="verifier cache")
    c.write(0, torch.ones(1, 5, 4))
    c.advance(5)
    with pytest.raises(wb.ContextLengthError, match=r"verifier cache: 5 tokens \+ 2 new would exceed the context of 6"):
        c.advance(2)
    assert c.length == 5
    before = c.rows.clone()
    with pytest.raises(wb.ContextLengthError, match="verifier cache: writing up to position 7 exceeds the context"):
        c.write(0, torch.full((1, 2, 4), 9.0))
    assert torch.equal(c.rows, before)  # nothing written, nothing wrapped to the start
    with pytest.raises(wb.ContextLengthError):
        c.check_room(2)
    c.check_room(1)
    assert issubclass(wb.ContextLengthError, ValueError)
    for bad in (-1, 6):
        with pytest.raises(ValueError, match=f"cannot truncate to {bad}; it holds 5 tokens"):
            c.truncate(bad)


def test_models_refuse_to_overflow_their_cache():
    pair = random_pair()
    cache = pair.verifier_cache(6)
    with torch.inference_mode():
        pair.verifier(torch.tensor([[3, 4, 5, 6]]), cache)
        before = cache.rows.clone()
        with pytest.raises(wb.ContextLengthError, match="4 tokens \\+ 3 new would exceed the context of 6"):
            pair.verifier(torch.tensor([[7, 8, 9]]), cache)
        assert cache.length == 4 and torch.equal(cache.rows, before)
        dcache = pair.draft.new_cache(2)
        h = torch.zeros(1, 3, pair.draft.config.hidden_size)
        with pytest.raises(wb.ContextLengthError, match="draft cache: 0 tokens \\+ 3 new"):
            pair.draft(torch.tensor([[1, 2, 3]]), h, dcache)


# ---------------------------------------------------------------------------------------------
# Rollback inside the engine.

class SteeredEagle(wb.EagleDrafter):
    """The real EAGLE drafter (its draft cache and aux bookkeeping run as usual) whose tokens are
    replaced by a script, so that steps accept 0..k proposals on random weights."""

    def __init__(self, pair, script: ScriptedProposer) -> None:
        super().__init__(pair.draft, 1)
        self.script = script

    def admit(self, slot, row, prefill) -> None:
        super().admit(slot, row, prefill)
        self.script.admit(slot, row, prefill)

    def propose(self, rows, ks, stop_below):
        real = super().propose(rows, ks, stop_below)
        return [wb.Proposal(self.script.scripted(r.verified, k), None, p.token_probs) for r, k, p in zip(rows, ks, real)]


@torch.inference_mode()
def fresh_caches(pair: wb.ModelPair, verified: list[int]) -> tuple[wb.KVCache, wb.KVCache]:
    """A fresh verifier prefill of verified[:-1] (the last token is not in the cache yet), and the
    draft's first pass over the same positions: token j+1 with the fused aux states of position j."""
    vcache = pair.verifier.new_cache(len(verified))
    out = pair.verifier(torch.tensor([verified[:-1]]), vcache)
    dcache = pair.draft.new_cache(len(verified))
    hidden = pair.draft.combine_hidden_states(out.aux_hidden_states)
    pair.draft(torch.tensor([verified[1:]]), hidden, dcache)
    return vcache, dcache


@pytest.mark.parametrize("attention, k", [("mla", 3), ("mha", 5)])
def test_caches_equal_a_fresh_prefill_after_every_step(attention, k):
    pair = random_pair(seed=2 if attention == "mla" else 5, attention=attention)
    prompt = [(37 * i + 11) % 500 + 2 for i in range(14)]
    truth = greedy_chain(pair, prompt, 40)
    pattern = [0, 2, k, 1, 0, k, 3]
    proposer = SteeredEagle(pair, ScriptedProposer(prompt, truth, pattern, pair.verifier.config.vocab_size))
    dec = wb.SpecDecoder(pair, k, proposer=proposer)
    verified = list(prompt)
    seen_accepts = set()
    for ev in dec.stream(prompt, max_new_tokens=30):
        before = list(verified)  # what the proposer saw this step
        verified += ev.emitted
        if ev.kind != "spec" or ev.finish_reason:
            continue
        seen_accepts.add(ev.num_accepted)
        vcache = dec.engine.vcache
        assert vcache.length == len(verified) - 1, f"step {ev.step}: verifier cache not rolled back"
        torch.testing.assert_close(vcache.valid(), fresh_caches(pair, verified)[0].valid(), atol=1e-5, rtol=1e-5)
        seen = dec.engine.rows[0].seen
        assert seen == len(before) - 1
        assert proposer.cache.length == seen + ev.k - 1  # the k-1 provisional rows after `seen`
        fresh_draft = fresh_caches(pair, before)[1]
        torch.testing.assert_close(proposer.cache.valid()[:, :, :seen], fresh_draft.valid()[:, :, :seen],
                                   atol=1e-5, rtol=1e-5)
    assert verified[len(prompt):] == truth[:30]
    assert 0 in seen_accepts and k in seen_accepts and len(seen_accepts) >= 3  # rejections, partial runs, bonus
