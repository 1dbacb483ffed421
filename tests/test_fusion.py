"""The fusion inspector: exact decomposition of fc, shares, acceptance relation, ablation that always restores."""
from __future__ import annotations

import json

import pytest
import torch

import workbench as wb
from tests.helpers import make_random_pair
from tests.test_doctor import PROMPTS, make_copy_pair
from workbench.analysis.fusion import ablated, ablation_study, fc_blocks, inspect_fusion


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    return wb.load_pair(*make_random_pair(tmp_path_factory.mktemp("rand"), layers=4, aux_layer_ids=(1, 2, 3)))


@pytest.fixture(scope="module")
def copy_pair(tmp_path_factory):
    return wb.load_pair(*make_copy_pair(tmp_path_factory.mktemp("copy")))


def test_block_terms_sum_to_fc_output(random_pair):
    draft = random_pair.draft
    blocks = fc_blocks(draft)
    H = random_pair.verifier.config.hidden_size
    assert [tuple(b.shape) for b in blocks] == [(H, H)] * 3
    assert torch.equal(torch.cat(blocks, dim=1), draft.fc.weight.detach())
    aux = [torch.randn(1, 5, H, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    terms = sum(h[0] @ w.T for h, w in zip(aux, blocks))
    torch.testing.assert_close(terms, draft.combine_hidden_states(aux)[0], rtol=1e-5, atol=1e-5)


def test_inspect_random_pair(random_pair):
    r = inspect_fusion(random_pair, "def f(x):", max_new_tokens=6, k=2)
    T = len(r.tokens)
    assert T == r.num_prompt_tokens + 6 and len(r.token_texts) == T
    assert len(r.shares) == len(r.term_norms) == len(r.rms) == len(r.cosine) == T
    for shares, norms in zip(r.shares, r.term_norms):
        assert sum(shares) == pytest.approx(1.0, abs=1e-6)
        assert shares == pytest.approx([n / sum(norms) for n in norms])
    blocks = fc_blocks(random_pair.draft)
    assert r.block_norms == pytest.approx([float(b.norm()) for b in blocks])
    fc_norm = float(random_pair.draft.fc.weight.detach().norm())
    assert sum(n * n for n in r.block_norms) == pytest.approx(fc_norm ** 2, rel=1e-5)
    # independent recomputation from a fresh verifier forward
    with torch.no_grad():
        aux = random_pair.verifier(torch.tensor([r.tokens])).aux_hidden_states
        fused = random_pair.draft.combine_hidden_states(aux)[0]
    rms = torch.stack([h[0].pow(2).mean(-1).sqrt() for h in aux], dim=1)
    torch.testing.assert_close(torch.tensor(r.rms), rms, rtol=1e-5, atol=1e-6)
    cos = torch.stack([torch.nn.functional.cosine_similarity(fused, h[0], dim=-1) for h in aux], dim=1)
    torch.testing.assert_close(torch.tensor(r.cosine), cos, rtol=1e-4, atol=1e-5)
    assert r.aux_layer_ids == [1, 2, 3] and "entering" in r.convention
    rel = r.relation
    assert len(rel.positions) == len(rel.accepted) == len(rel.shares) == len(rel.depth)
    assert all(rel.shares[i] == r.shares[p - 1] for i, p in enumerate(rel.positions))
    json.dumps(r.to_dict())


def test_inspect_copy_pair(copy_pair):
    r = inspect_fusion(copy_pair, PROMPTS[0], max_new_tokens=7, k=2)
    assert r.accept_length == 3.0
    # the copy pair's verifier repeats the last token: 7 equal tokens, the second 6-gram repeats the first
    assert r.loop["degenerate"] and r.loop["loop_start"] == 1 and r.accept_length_clean is None
    assert r.to_dict()["accept_length_clean"] is None
    assert all(s == [0.0, 0.0, 1.0] for s in r.shares)  # fc = [0 | 0 | I]: only the last aux layer counts
    assert r.block_norms[:2] == [0.0, 0.0] and r.block_norms[2] == pytest.approx(64 ** 0.5)
    assert all(c[2] == pytest.approx(1.0, abs=1e-5) for c in r.cosine)  # the fused state *is* h_hi
    rel = r.relation
    assert rel.accepted == [True] * 4 and rel.depth == [0, 1, 0, 1]  # 2 steps x 2 accepted; bonuses left out
    assert rel.mean_share_accepted == [0.0, 0.0, 1.0] and rel.mean_share_rejected == [None] * 3
    assert rel.correlation == [None] * 3  # every proposal accepted: no variation to correlate with


def test_ablation_measures_and_restores(copy_pair):
    draft = copy_pair.draft
    rep = ablation_study(copy_pair, PROMPTS[:1], k=2, max_new_tokens=7)
    assert "combine_hidden_states" not in draft.__dict__
    assert rep.baseline == 3.0 and rep.aux_layer_ids == [1, 2, 4]
    got = {(e.mode, e.source): e for e in rep.entries}
    assert set(got) == {(m, s) for m in ("zero", "shuffle") for s in range(3)}
    for mode in ("zero", "shuffle"):
        for s in (0, 1):  # their fc blocks are zero: ablating them changes nothing
            assert got[mode, s].accept_length == 3.0 and got[mode, s].delta == 0.0
    assert got["zero", 2].accept_length == 1.0 and got["zero", 2].delta == -2.0
    assert got["shuffle", 2].accept_length < 3.0
    assert "zero source 2 (layer 4)" in rep.summary()
    assert (rep.baseline_clean, rep.baseline_degenerate) == (None, 1)  # the copy pair loops
    assert "baseline accept length 3.000 (clean n/a, 1 of 1 loop)" in rep.summary()
    assert got["zero", 0].degenerate == 1 and got["zero", 0].accept_length_clean is None
    json.dumps(rep.to_dict())


def test_shuffle_draws_other_tokens_on_a_variant_and_leaves_the_pair_alone(random_pair):
    """The ablation is a weight-sharing variant of the pair: its fc sees source 1 shuffled (rows
    drawn from other tokens, also from earlier calls) or zeroed; the pair's own draft is unchanged."""
    draft = random_pair.draft
    before = {n: t.clone() for n, t in draft.state_dict().items()}
    fc_type = type(draft.fc)
    H = random_pair.verifier.config.hidden_size
    first = [torch.arange(3 * H, dtype=torch.float32).view(1, 3, H) + 1000 * i for i in range(3)]
    second = [torch.full((1, 1, H), -5.0 - i) for i in range(3)]
    seen = []
    shuffled = ablated(random_pair, 1, "shuffle", seed=0).draft
    shuffled.fc.fc.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    shuffled.combine_hidden_states(first)
    shuffled.combine_hidden_states(second)
    out1, out2 = (x.view(*x.shape[:2], 3, H) for x in seen)
    assert torch.equal(out1[..., 0, :], first[0]) and torch.equal(out1[..., 2, :], first[2])  # other sources untouched
    pool = [first[1][0, t] for t in range(3)]
    for t in range(3):  # every row is another token's row of source 1
        assert any(torch.equal(out1[0, t, 1], pool[j]) for j in range(3) if j != t)
    assert any(torch.equal(out2[0, 0, 1], row) for row in pool)  # a one-token call draws from earlier tokens
    zeroed = ablated(random_pair, 0, "zero").draft
    want = draft.fc(torch.cat([torch.zeros(1, 1, H), second[1], second[2]], dim=-1))
    assert torch.equal(zeroed.combine_hidden_states(second), want)
    for bad in (dict(source=3), dict(source=0, mode="noise")):
        with pytest.raises(ValueError, match="source|mode"):
            ablated(random_pair, **bad)
    assert draft.combine_hidden_states(second).equal(random_pair.draft.fc(torch.cat(second, dim=-1)))
    assert all(torch.equal(before[n], t) for n, t in draft.state_dict().items())
    assert "combine_hidden_states" not in draft.__dict__ and type(draft.fc) is fc_type
