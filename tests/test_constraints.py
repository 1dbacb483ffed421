"""Sampling as vLLM serves it: penalties and token constraints stay lossless, block verification
samples p, and injected uniforms make recovered tokens reproducible.

The distribution tests use test_sampling's bounds: the largest TV among 20,000 simulated correct
experiments with the same distribution and number of draws (`null_tv_max`), so a correct sampler
fails for about one seed in 20,000, and each test also shows that the bug it targets moves TV past
its bound.
"""
from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable

import pytest
import torch

import workbench as wb
from tests.helpers import make_random_pair
from tests.test_sampling import empirical, null_tv_max, tv
from workbench.decoding.logits import Context, SamplingParams, adjust, probs_from_logits
from workbench.decoding.sampling import BlockAcceptor, GeneratorDraws, RejectionAcceptor, block_verify


class FixedDraws:
    """Given uniforms, used in order: a sample is the inverse CDF at the next one, so a test can
    compute every accept and every recovered token directly (vLLM's tests share noise the same way)."""

    def __init__(self, uniforms: Iterable[float]) -> None:
        self.uniforms = iter(uniforms)
        self.used = 0

    def uniform(self) -> float:
        self.used += 1
        return float(next(self.uniforms))

    def sample(self, probs: torch.Tensor) -> int:
        cdf = probs.double().cumsum(0)
        return int(torch.searchsorted(cdf, self.uniform() * cdf[-1], right=True).clamp(max=probs.shape[0] - 1))


V = 4


def tables(seed: int, depth: int, spread: float = 1.5) -> dict[tuple[int, ...], torch.Tensor]:
    """A logit row for every prefix of up to `depth` tokens over V: a toy model whose next-token
    distribution depends on what came before."""
    g = torch.Generator().manual_seed(seed)
    return {pre: torch.randn(V, generator=g) * spread for n in range(depth + 1)
            for pre in itertools.product(range(V), repeat=n)}


def joint(p_of, length: int) -> torch.Tensor:
    """The exact distribution of the first `length` tokens, p_of(prefix) the next token's."""
    out = torch.zeros(V ** length, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=length):
        pr = 1.0
        for j in range(length):
            pr *= float(p_of(seq[:j])[seq[j]])
        out[sum(t * V ** (length - 1 - j) for j, t in enumerate(seq))] = pr
    return out


def speculate(acceptor, p_logits, q_probs, params, context_of, n: int, k: int, length: int, seed: int) -> list[int]:
    """n runs of speculative sampling until `length` tokens: proposals drawn from q, judged by `acceptor`
    against the toy verifier's rows; each run's first `length` tokens as one index."""
    picks = random.Random(seed)  # the proposals' draws (plain Python: the acceptor's are the generator's)
    draws = GeneratorDraws(torch.Generator().manual_seed(seed))
    cum = {pre: list(itertools.accumulate(q.tolist())) for pre, q in q_probs.items()}
    stacked: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for _ in range(n):
        seq: list[int] = []
        while len(seq) < length:
            props: list[int] = []
            for _ in range(k):
                props += picks.choices(range(V), cum_weights=cum[tuple(seq + props)])
            key = tuple(seq + props)
            if key not in stacked:
                stacked[key] = (torch.stack([p_logits[key[:len(seq) + i]] for i in range(k + 1)]),
                                torch.stack([q_probs[key[:len(seq) + i]] for i in range(k)]))
            rows, qs = stacked[key]
            v = acceptor.verify(props, qs, rows, params, draws, context_of(seq))
            seq += props[:v.num_accepted] + [v.next_token]
        out.append(sum(t * V ** (length - 1 - j) for j, t in enumerate(seq[:length])))
    return out


def two_tokens_by_blocks(p_of, q_of, n: int, seed: int, first_failure: bool = False) -> torch.Tensor:
    """n generations of two tokens by `block_verify` steps of k = 2 (a second step where the first
    kept no proposal), all n at once; `first_failure` ends a block at its first failed test (a bug)."""
    g = torch.Generator().manual_seed(seed)
    tokens, need = torch.zeros(n, 2, dtype=torch.long), torch.ones(n, dtype=torch.bool)
    first = torch.zeros(n, 1, dtype=torch.long)
    for step in range(2):
        rows = need.nonzero()[:, 0]
        pre = first[rows] if step else torch.empty(len(rows), 0, dtype=torch.long)
        x1 = torch.multinomial(q_of(pre), 1, generator=g)
        x2 = torch.multinomial(q_of(torch.cat([pre, x1], 1)), 1, generator=g)
        x = torch.cat([x1, x2], 1)
        p = torch.stack([p_of(torch.cat([pre, x[:, :i]], 1)) for i in range(3)], 1)
        q = torch.stack([q_of(torch.cat([pre, x[:, :i]], 1)) for i in range(2)], 1)
        eta = torch.rand(len(rows), 2, generator=g, dtype=torch.float64)
        u = torch.rand(len(rows), generator=g, dtype=torch.float64)
        if first_failure:  # every test after a failed one fails too
            h = block_verify(p, q, x, eta, u).tests
            eta = torch.where((eta <= h).cumprod(1).bool(), eta, 2.0)
        out = block_verify(p, q, x, eta, u)
        emitted = torch.cat([x, out.next_token[:, None]], 1)
        emitted[torch.arange(len(rows)), out.accepted] = out.next_token  # the kept proposals, then the next token
        if step == 0:
            tokens[rows] = emitted[:, :2]
            need = out.accepted == 0  # one token so far
            first = emitted[:, :1]
        else:
            tokens[rows, 1] = emitted[:, 0]
    return tokens[:, 0] * V + tokens[:, 1]


def test_block_verification_samples_p():
    """200k generations by block verification (k = 2, a prefix-dependent p and q) emit the target's
    joint distribution of the first two tokens; ending a block at its first failed test does not.
    `BlockAcceptor.verify` is this `block_verify` for one block (checked here on the same draws)."""
    p_logits, q_logits = tables(0, 3), tables(1, 3)
    p_tab = {c: torch.softmax(r, -1).double() for c, r in p_logits.items()}
    q_tab = {c: torch.softmax(r, -1).double() for c, r in q_logits.items()}
    p_of = lambda pre: torch.stack([p_tab[tuple(r)] for r in pre.tolist()])  # noqa: E731
    q_of = lambda pre: torch.stack([q_tab[tuple(r)] for r in pre.tolist()])  # noqa: E731
    target = joint(lambda pre: p_tab[pre], 2)
    n = 200_000
    bound = null_tv_max(target, n)
    assert tv(empirical(two_tokens_by_blocks(p_of, q_of, n, seed=3), V ** 2), target) < bound < 0.01
    assert tv(empirical(two_tokens_by_blocks(p_of, q_of, n, seed=4, first_failure=True), V ** 2), target) > 2 * bound
    rows, x = torch.stack([p_logits[()], p_logits[(2,)], p_logits[(2, 1)]]), [2, 1]
    qs = torch.stack([q_tab[()], q_tab[(2,)]]).float()
    for seed in range(50):
        uniforms = torch.rand(3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        v = BlockAcceptor().verify(x, qs, rows, SamplingParams(1.0), FixedDraws(uniforms.tolist()))
        out = block_verify(torch.softmax(rows, -1)[None].double(), qs[None].double(), torch.tensor([x]),
                           uniforms[None, :2], uniforms[2:])
        assert (v.num_accepted, v.next_token) == (int(out.accepted[0]), int(out.next_token[0]))


def test_block_verification_accepts_more_than_rejection():
    """Theorem 2 of Sun et al.: E[accepted] under block verification >= under token-by-token
    rejection. Rejection's expectation is exact (sum over prefixes of prod_j min(p_j, q_j)); block
    verification's is the mean of 200k blocks (standard error about 0.002)."""
    p_tab = {c: torch.softmax(r, -1).double() for c, r in tables(4, 3).items()}
    q_tab = {c: torch.softmax(r * 0.3, -1).double() for c, r in tables(5, 3).items()}
    rejection = sum(math.prod(min(float(p_tab[pre[:j]][pre[j]]), float(q_tab[pre[:j]][pre[j]])) for j in range(i))
                    for i in range(1, 4) for pre in itertools.product(range(V), repeat=i))
    g, n = torch.Generator().manual_seed(0), 200_000
    x = torch.zeros(n, 3, dtype=torch.long)
    for i in range(3):
        q_rows = torch.stack([q_tab[tuple(r)] for r in x[:, :i].tolist()])
        x[:, i] = torch.multinomial(q_rows, 1, generator=g)[:, 0]
    p = torch.stack([torch.stack([p_tab[tuple(r)] for r in x[:, :i].tolist()]) for i in range(4)], 1)
    q = torch.stack([torch.stack([q_tab[tuple(r)] for r in x[:, :i].tolist()]) for i in range(3)], 1)
    out = block_verify(p, q, x, torch.rand(n, 3, generator=g, dtype=torch.float64),
                       torch.rand(n, generator=g, dtype=torch.float64))
    block = float(out.accepted.double().mean())
    assert block > rejection + 0.02, (block, rejection)  # 0.910 against 0.775 of 3 here


PENALTIES = {"repetition": dict(repetition_penalty=2.5), "frequency": dict(frequency_penalty=1.5),
             "presence": dict(presence_penalty=1.5), "allowed": dict(allowed_token_ids=(0, 2, 3)),
             "banned": dict(banned_token_ids=(1,)), "bad words": dict(bad_words=((2, 0),))}


@pytest.mark.parametrize("name", list(PENALTIES))
def test_penalties_and_constraints_stay_lossless(name):
    """Rejection sampling under each penalty and constraint (k = 2, sampled q) emits plain sampling's
    joint of the first three tokens: each draft position's p reads the proposals before it."""
    params = SamplingParams(1.0, **PENALTIES[name])
    prompt = (1, 3)
    p_logits = tables(6, 4, spread=0.8)
    q_probs = {pre: torch.softmax(row, -1) for pre, row in tables(7, 4).items()}
    plain = lambda pre: probs_from_logits(adjust(p_logits[pre], params, Context(prompt, list(pre))), params)  # noqa: E731
    target = joint(plain, 3)
    n = 10_000
    got = empirical(speculate(RejectionAcceptor(), p_logits, q_probs, params, lambda s: Context(prompt, s), n, 2, 3,
                              seed=8), V ** 3)
    bound = null_tv_max(target, n)
    assert tv(got, target) < bound, name
    if name in ("frequency", "bad words"):  # the bug this targets: a step's rows read the step's context alone
        wrong = empirical(speculate(PerStepContext(), p_logits, q_probs, params, lambda s: Context(prompt, s), n, 2, 3,
                                    seed=9), V ** 3)
        assert tv(wrong, target) > 2 * bound  # measured 3.5x (frequency) and 10x (bad words)


class PerStepContext(RejectionAcceptor):
    """Rejection sampling whose every row is adjusted with the step's context, not the proposals before it."""

    def verify(self, proposals, draft_probs, target_logits, params, generator, context=None):
        fixed = torch.stack([adjust(target_logits[i], params, context) for i in range(target_logits.shape[0])])
        return super().verify(proposals, draft_probs, fixed, SamplingParams(params.temperature), generator)


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    vdir, ddir = make_random_pair(tmp_path_factory.mktemp("constraints"), seed=2, layers=2, vocab=512)
    return wb.load_pair(vdir, ddir, dtype="float32")


@pytest.mark.parametrize("name", ["repetition", "frequency", "presence", "allowed", "banned"])
def test_greedy_speculation_under_a_penalty_equals_plain_greedy(small_pair, name):
    kw = {"repetition": dict(repetition_penalty=1.3), "frequency": dict(frequency_penalty=0.7),
          "presence": dict(presence_penalty=0.7), "allowed": dict(allowed_token_ids=tuple(range(0, 512, 3))),
          "banned": dict(banned_token_ids=tuple(range(1, 512, 4)))}[name]
    for prompt in ([5, 9, 5, 9, 5, 9], [17, 300, 41, 17]):
        plain = wb.generate_autoregressive(small_pair, prompt, 24)
        ar = wb.generate_autoregressive(small_pair, prompt, 24, **kw)
        assert ar.tokens != plain.tokens or name in ("allowed", "banned"), name  # the penalty changes the text
        for k in (1, 3):
            spec = wb.SpecDecoder(small_pair, k, **kw).generate(prompt, 24)
            assert spec.tokens == ar.tokens, (name, k)
        if name == "allowed":
            assert set(ar.tokens) <= set(kw["allowed_token_ids"])
        if name == "banned":
            assert not set(ar.tokens) & set(kw["banned_token_ids"])


def test_recovered_tokens_follow_the_injected_uniforms():
    """With the uniforms given, every accept and every recovered token is a direct computation:
    accept x while u <= p(x)/q(x); at the first rejection, the inverse CDF of the residual at the next u."""
    g = torch.Generator().manual_seed(11)
    for case in range(200):
        k, vocab = 1 + case % 4, 3 + case % 5
        logits = torch.randn(k + 1, vocab, generator=g) * 2
        q = torch.softmax(torch.randn(k, vocab, generator=g), -1)
        proposals = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        uniforms = torch.rand(k + 1, generator=g, dtype=torch.float64).tolist()
        params = SamplingParams(0.8)
        v = RejectionAcceptor().verify(proposals, q, logits, params, FixedDraws(uniforms))
        p = probs_from_logits(logits, params).double()
        a = 0
        while a < k and uniforms[a] <= p[a, proposals[a]] / q[a, proposals[a]]:
            a += 1
        dist = p[k] if a == k else (p[a] - q[a].double()).clamp_min(0)
        cdf = (dist / dist.sum()).cumsum(0)
        want = int((cdf > uniforms[min(a + 1, k)]).nonzero()[0])  # the uniform after the tests it took
        assert (v.num_accepted, v.next_token) == (a, want), case


def test_every_run_names_its_acceptance_rule(small_pair):
    assert wb.SpecDecoder(small_pair, 2).generate([5, 6], 4).acceptance_rule == "greedy"
    hot = wb.SpecDecoder(small_pair, 2, temperature=0.7).generate([5, 6], 4)
    assert hot.acceptance_rule == "rejection (greedy draft, one-hot q)" == hot.to_dict()["acceptance_rule"]
    sampled = wb.SpecDecoder(small_pair, 2, temperature=0.7, draft_sampling="sample", acceptor="block")
    assert sampled.acceptance_rule == "block (sampled draft, its real q)"
    assert wb.generate_autoregressive(small_pair, [5, 6], 4).acceptance_rule.startswith("none")


@pytest.mark.parametrize("kw, field", [
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-3), "presence_penalty"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, 600]), "not in the vocabulary"), (dict(banned_token_ids=[-1]), "banned_token_ids"),
    (dict(bad_words=[""]), "bad_words"), (dict(acceptor="blocky"), "acceptor")])
def test_bad_sampling_input_is_a_clear_error(small_pair, kw, field):
    with pytest.raises(wb.SamplingError, match=field):
        wb.SpecDecoder(small_pair, 2, temperature=0.5, **kw)
    if "acceptor" not in kw:
        with pytest.raises(wb.SamplingError, match=field):
            wb.generate_autoregressive(small_pair, [5], 2, **kw)


def test_an_out_of_range_proposal_is_an_error_naming_it():
    logits = torch.randn(2, 5)
    for acceptor in (RejectionAcceptor(), BlockAcceptor(), wb.GreedyAcceptor()):
        with pytest.raises(wb.SamplingError, match=r"proposal ids \[-1\]"):
            acceptor.verify([-1], None, logits, SamplingParams(0.5), torch.Generator())
        with pytest.raises(wb.SamplingError, match=r"proposal ids \[5\]"):
            acceptor.verify([5], None, logits, SamplingParams(0.5), torch.Generator())
