"""Sampling is lossless: what the acceptors emit is distributed exactly as plain sampling.

Statistical tests compare an empirical distribution with the exact one by total variation
(TV). For n i.i.d. draws from p over m outcomes, E[TV] ~ 1/2 sum_i sqrt(2 p_i (1 - p_i) / (pi n))
(each |p^_i - p_i| is about half-normal). Each bound here is the largest TV among 20,000
simulated experiments of a *correct* sampler with the same p and n (exact multinomial draws):
about the 1 - 5e-5 quantile, roughly 3x the mean. Generators are seeded, so
every test is deterministic; the bound says a correct sampler would fail for ~1 seed in 20,000,
and `test_the_bounds_separate_the_bugs` checks that the bugs these tests target move TV by
several times the bound.
"""
from __future__ import annotations

import math

import pytest
import torch
from tests.helpers import make_random_pair
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import workbench as wb
from workbench.decoding.sampling import check_finite, sample


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def empirical(samples: list[int] | torch.Tensor, m: int) -> torch.Tensor:
    counts = torch.bincount(torch.as_tensor(samples, dtype=torch.long), minlength=m).double()
    return counts / counts.sum()


def multinomial_freqs(p: torch.Tensor, n: int, reps: int, g: torch.Generator) -> torch.Tensor:
    """[reps, m] empirical frequencies of n draws from p, exactly, by the binomial chain
    c_i ~ Binomial(n - c_<i, p_i / (1 - p_<i))."""
    p = p.double() / p.double().sum()
    left = torch.full((reps,), float(n), dtype=torch.float64)
    rest, counts = 1.0, []
    for pi in p[:-1].tolist():
        share = min(max(pi / rest, 0.0), 1.0) if rest > 0 else 0.0
        c = torch.binomial(left, torch.full_like(left, share), generator=g)
        counts.append(c)
        left, rest = left - c, rest - pi
    return torch.stack(counts + [left], 1) / n


def null_tv_max(p: torch.Tensor, n: int, n_other: int | None = None, reps: int = 20_000) -> float:
    """The largest TV among `reps` simulated correct experiments: n draws from p against p itself,
    or against a second independent sample of n_other draws."""
    g = torch.Generator().manual_seed(1234)
    other = p.double()[None] / p.double().sum() if n_other is None else multinomial_freqs(p, n_other, reps, g)
    return float(0.5 * (multinomial_freqs(p, n, reps, g) - other).abs().sum(-1).max())


# ---------------------------------------------------------------------------------------------
# The rejection acceptor on fixed distributions.

P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])  # verifier, proposal position
P_BONUS = torch.tensor([0.10, 0.10, 0.10, 0.10, 0.10, 0.50])  # verifier, after an accepted proposal
Q = torch.tensor([0.05, 0.10, 0.10, 0.25, 0.30, 0.20])  # draft
N_DRAWS = 200_000  # the figure: TV < 0.01 over 200k draws
# At n = 200k: E[TV] ~ 0.0018 and the simulated bound ~ 0.0055, so a correct sampler clears both
# 0.01 and the bound. The bugs below move TV by 0.065 and 0.125.


def test_the_bounds_separate_the_bugs():
    bound = null_tv_max(P, N_DRAWS)
    assert 0.003 < bound < 0.01
    assert tv(P, Q) == pytest.approx(0.5)  # emitting the draft's token without the accept test
    x = int(Q.argmax())  # a greedy proposal, and on rejection a resample from p instead of the residual:
    wrong = (1 - P[x]) * P
    wrong[x] += P[x]
    assert tv(wrong, P) > 5 * bound  # 0.065
    # sampled q with the same bug: P(x) = q(x) min(1, p/q) + (1 - beta) p(x)
    beta = torch.minimum(P, Q).sum()
    wrong = torch.minimum(P, Q) + (1 - beta) * P
    assert tv(wrong, P) > 10 * bound  # 0.125


def run_acceptor(draft_probs: torch.Tensor | None, n: int, params=wb.SamplingParams(1.0),
                 logits: torch.Tensor | None = None, seed: int = 0) -> tuple[list[int], list[int]]:
    """n one-proposal verifications; (first emitted token, bonus token or -1 when rejected)."""
    logits = torch.stack([P.log(), P_BONUS.log()]) if logits is None else logits
    g = torch.Generator().manual_seed(seed)
    if draft_probs is None:
        proposals = [int(Q.argmax())] * n
        dq = None
    else:
        proposals = torch.multinomial(draft_probs, n, replacement=True, generator=g).tolist()
        dq = draft_probs[None]
    verify = wb.RejectionAcceptor().verify
    first, bonus = [0] * n, [-1] * n
    for i, x in enumerate(proposals):
        v = verify([x], dq, logits, params, g)
        if v.num_accepted:
            first[i], bonus[i] = x, v.next_token
        else:
            first[i] = v.next_token
    return first, bonus


@pytest.mark.parametrize("draft", ["sampled q", "greedy (q one-hot)"])
def test_rejection_sampling_emits_p(draft):
    first, bonus = run_acceptor(Q if draft == "sampled q" else None, N_DRAWS)
    assert tv(empirical(first, 6), P) < min(0.01, null_tv_max(P, N_DRAWS))
    # After an acceptance the next token is the bonus, drawn from the next position's p.
    accepted = [b for b in bonus if b >= 0]
    expected_rate = float(torch.minimum(P, Q).sum()) if draft == "sampled q" else float(P[Q.argmax()])
    assert len(accepted) / N_DRAWS == pytest.approx(expected_rate, abs=4 * math.sqrt(0.25 / N_DRAWS))
    n = len(accepted)
    assert tv(empirical(accepted, 6), P_BONUS) < null_tv_max(P_BONUS, n)


def test_rejection_sampling_with_temperature_top_k_top_p():
    """p is the processed distribution; tokens outside it are never emitted, even when q proposes them."""
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, -0.5, 0.9])
    params = wb.SamplingParams(temperature=0.7, top_k=4, top_p=0.85)
    p = wb.probs_from_logits(logits, params)
    assert (p == 0).sum() == 3  # top-k removes two tokens, top-p one more
    n = 6_000
    first, _ = run_acceptor(Q, n, params, torch.stack([logits, logits]), seed=1)
    emp = empirical(first, 6)
    assert float(emp[p == 0].sum()) == 0.0
    assert tv(emp, p) < null_tv_max(p, n)


def test_rejection_acceptor_edge_cases():
    g = torch.Generator().manual_seed(0)
    params = wb.SamplingParams(1.0)
    acc = wb.RejectionAcceptor()
    logits = torch.tensor([[0.0, -math.inf, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # p(x) = 0: always rejected, whatever q says; the correction then comes from p.
    for _ in range(200):
        v = acc.verify([1, 2], torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]), logits, params, g)
        assert v.num_accepted == 0 and v.next_token in (0, 2) and v.verifier_probs[0] == 0.0
    # q == p: never rejected (the residual is empty).
    p0, p1 = (wb.probs_from_logits(logits[i], params) for i in range(2))
    for _ in range(200):
        v = acc.verify([0, 1], torch.stack([p0, p1]), logits, params, g)
        assert v.num_accepted >= 1
        if v.num_accepted == 2:
            assert v.next_token_prob == pytest.approx(float(wb.probs_from_logits(logits[2], params)[v.next_token]))


def test_greedy_acceptor_verdicts():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])  # argmax 1, 0, 2
    acc, params = wb.GreedyAcceptor(), wb.SamplingParams()
    for proposals, accepted, nxt in (([1, 0], 2, 2), ([1, 2], 1, 0), ([0, 0], 0, 1), ([1], 1, 0)):
        v = acc.verify(proposals, None, logits[:len(proposals) + 1], params, None)
        assert (v.num_accepted, v.next_token) == (accepted, nxt)
        assert v.verifier_probs == pytest.approx([float(logits[i].softmax(-1)[t]) for i, t in enumerate(proposals)])
        assert v.next_token_prob == pytest.approx(float(logits[accepted].softmax(-1)[nxt]))  # the row it came from
    hot = wb.SamplingParams(temperature=0.5, top_k=2)  # a greedy acceptor under processed p shows processed p
    v = acc.verify([1, 2], None, logits, hot, None)
    assert v.verifier_probs[1] == pytest.approx(float(wb.probs_from_logits(logits[1], hot)[2]))
    assert v.next_token_prob == pytest.approx(float(wb.probs_from_logits(logits[1], hot)[0]))


# ---------------------------------------------------------------------------------------------
# probs_from_logits against a direct statement of temperature, top-k and top-p.

def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Softmax(logits / T) over the k largest logits, then the smallest prefix (by probability)
    whose mass reaches top_p, renormalised. Temperature 0: one-hot argmax."""
    V = len(logits)
    if temperature == 0:
        best = max(range(V), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(V)]
    z = [x / temperature for x in logits]
    keep = set(range(V))
    if 0 < top_k < V:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = {i for i in range(V) if z[i] >= kth}
    zmax = max(z[i] for i in keep)
    w = {i: math.exp(z[i] - zmax) for i in keep}
    total = sum(w.values())
    probs = {i: w[i] / total for i in keep}
    if top_p < 1:
        order = sorted(keep, key=lambda i: -probs[i])
        chosen, mass = [], 0.0
        for i in order:
            chosen.append(i)
            mass += probs[i]
            if mass >= top_p:
                break
        total = sum(probs[i] for i in chosen)
        probs = {i: probs[i] / total for i in chosen}
    return [probs.get(i, 0.0) for i in range(V)]


def _near_a_cutoff(logits: list[float], temperature: float, top_k: int, top_p: float) -> bool:
    """Top-p's cut is discontinuous: skip cases that fp32 and float64 could decide differently."""
    if temperature == 0 or top_p >= 1:
        return False

    def support(tp: float) -> int:
        return sum(x > 0 for x in reference_probs(logits, temperature, top_k, tp))

    n = support(top_p)
    p = sorted(reference_probs(logits, temperature, top_k, 1.0), reverse=True)
    near_tie = n < len(p) and p[n - 1] - p[n] < 1e-6  # which of two near-equal tokens is kept
    return support(top_p - 1e-4) != support(top_p + 1e-4) or near_tie


@settings(max_examples=60, deadline=None)
@given(logits=st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=2, max_size=12),
       temperature=st.sampled_from([0.0, 0.25, 0.7, 1.0, 1.8]), top_k=st.integers(0, 14),
       top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.3, 0.05]))
def test_probs_from_logits_matches_the_definition(logits, temperature, top_k, top_p):
    assume(len(set(logits)) == len(logits))  # ties make "the k largest" ambiguous
    assume(not _near_a_cutoff(logits, temperature, top_k, top_p))
    got = wb.probs_from_logits(torch.tensor(logits), wb.SamplingParams(temperature, top_p, top_k))
    want = reference_probs(logits, temperature, top_k, top_p)
    assert got.dtype == torch.float32 and got.shape == (len(logits),)
    assert got.tolist() == pytest.approx(want, abs=2e-6)
    assert ((got > 0) == torch.tensor([w > 0 for w in want])).all()


def test_probs_from_logits_worked_examples():
    lp = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()
    f = wb.probs_from_logits
    assert f(lp, wb.SamplingParams(1.0)).tolist() == pytest.approx([0.5, 0.25, 0.15, 0.1])
    assert f(lp, wb.SamplingParams(1.0, top_p=0.7)).tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0])
    assert f(lp, wb.SamplingParams(1.0, top_p=0.8)).tolist() == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    assert f(lp, wb.SamplingParams(1.0, top_p=0.45)).tolist() == pytest.approx([1, 0, 0, 0])
    assert f(lp, wb.SamplingParams(1.0, top_k=3)).tolist() == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    assert f(lp, wb.SamplingParams(1.0, top_k=1)).tolist() == [1, 0, 0, 0]
    root = torch.tensor([0.5, 0.25, 0.15, 0.1]).sqrt()
    assert f(lp, wb.SamplingParams(2.0)).tolist() == pytest.approx((root / root.sum()).tolist())
    assert f(lp, wb.SamplingParams(0.0)).tolist() == [1, 0, 0, 0]
    batch = torch.stack([lp, lp.flip(0)])  # rows are processed independently
    assert f(batch, wb.SamplingParams(1.0, top_k=2))[1].tolist() == pytest.approx([0, 0, 1 / 3, 2 / 3])


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="1"), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
])
def test_bad_sampling_params(kw, field):
    with pytest.raises(wb.SamplingError, match=f"^{field} = .*; expected"):
        wb.SamplingParams(**kw)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_unusable_logits_are_refused(bad):
    for dtype in (torch.float32, torch.bfloat16):  # one reduction finds it wherever it sits, beside any value
        for width, at in ((5, 2), (37, 0), (37, 36), (8192, 4097)):
            logits = torch.randn(3, width).to(dtype)
            logits[1, at] = bad
            logits[1, (at + 1) % width] = 1e4
            logits[2] = -math.inf  # only checked once row 1 is fine
            logits[2, 0] = 0.0
            with pytest.raises(wb.SamplingError, match=r"step 3: the logits contain NaN or \+inf"):
                check_finite(logits, "step 3")
    with pytest.raises(wb.SamplingError, match="no finite value"):
        check_finite(torch.full((5,), -math.inf), "step 3")
    check_finite(torch.tensor([0.0, -math.inf, 1.0]), "a masked vocabulary is fine")


def test_sample_follows_the_generator():
    p = torch.tensor([0.2, 0.0, 0.8])
    a = [sample(p, torch.Generator().manual_seed(3)) for _ in range(3)]
    assert len(set(a)) == 1 and a[0] != 1
    assert sample(torch.tensor([0.0, 1.0, 0.0]), None) == 1


# ---------------------------------------------------------------------------------------------
# End to end: the first two sampled tokens of speculative and plain decoding, over many seeds.

VOCAB, END = 16, 16  # outcome END: generation ended (EOS) before a second token
PROMPT = [5, 9, 3, 12]


@pytest.fixture(scope="module")
def peaked_pair(tmp_path_factory):
    """A random pair over 16 tokens whose verifier (and, sharing it, the draft's) lm_head is scaled
    up, so each next-token distribution sits on a few tokens and a few hundred runs resolve it."""
    vdir, ddir = make_random_pair(tmp_path_factory.mktemp("peaked"), seed=11, hidden=32, layers=3, vocab=VOCAB,
                                  aux_layer_ids=(0, 1, 2))
    pair = wb.load_pair(vdir, ddir, dtype="float32", fast="off")
    with torch.no_grad():
        pair.verifier.lm_head.weight.mul_(12.0)
    return pair.with_path("auto")  # the default path, built from the edited weights


@torch.inference_mode()
def exact_first_two(pair: wb.ModelPair, prompt: list[int], bug=None) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t1) and the marginal P(t2) = sum_t1 P(t1) P(t2 | t1), from full forwards at temperature 1.

    `bug` maps a next-token distribution to what a broken sampler would emit instead at t2."""
    p1 = pair.verifier(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
    conts = torch.tensor([prompt + [t] for t in range(VOCAB)])
    p2_given = pair.verifier(conts).logits[:, -1].double().softmax(-1)  # [t1, t2]
    if bug is not None:
        p2_given = torch.stack([bug(row) for row in p2_given])
    eos = torch.zeros(VOCAB, dtype=torch.bool)
    eos[pair.eos_token_ids] = True
    p2 = torch.zeros(VOCAB + 1, dtype=torch.float64)
    p2[:VOCAB] = (p1[~eos, None] * p2_given[~eos]).sum(0)
    p2[END] = p1[eos].sum()
    return p1, p2


def first_two(events) -> tuple[int, int]:
    toks = []
    for ev in events:
        toks += ev.emitted
        if len(toks) >= 2 or ev.finish_reason:
            break
    return toks[0], toks[1] if len(toks) > 1 else END


class OracleProposer:
    """A draft that proposes the verifier's own most likely next token: a good greedy EAGLE draft
    (vLLM's default, `draft_probs=None`), or with `smoothed=True` a token sampled from
    q = 0.8 onehot(argmax p) + 0.2 uniform, passed as real `draft_probs`. Either way the first
    proposal is accepted about as often as it is rejected, and the residual is far from p.
    A `Drafter` for one row."""

    name, needs_aux = "oracle", False

    def __init__(self, pair: wb.ModelPair, smoothed: bool = False, seed: int = 0) -> None:
        self.pair, self.smoothed, self.g = pair, smoothed, torch.Generator().manual_seed(seed)

    def admit(self, slot, row, prefill) -> None:
        pass

    def move(self, src, dst) -> None:
        pass

    def reserve(self, max_len) -> None:
        pass

    def propose(self, rows, ks, stop_below) -> list[wb.Proposal]:
        (row,), (k,) = rows, ks
        ids, qs = list(row.verified), []
        for _ in range(k):
            p = self.pair.verifier(torch.tensor([ids])).logits[0, -1].float().softmax(-1)
            q = torch.nn.functional.one_hot(p.argmax(), VOCAB).float()
            if self.smoothed:
                q = 0.8 * q + 0.2 / VOCAB
            qs.append(q)
            ids.append(int(torch.multinomial(q, 1, generator=self.g)))
        out = ids[len(row.verified):]
        return [wb.Proposal(out, torch.stack(qs) if self.smoothed else None, [float(q[t]) for q, t in zip(qs, out)])]


def resample_bug(p: torch.Tensor) -> torch.Tensor:
    """What t2 would be if a rejection resampled from p instead of the residual (greedy oracle)."""
    x = int(p.argmax())
    wrong = (1 - p[x]) * p
    wrong[x] += p[x]
    return wrong


def test_sampled_speculative_decoding_matches_plain_sampling(peaked_pair):
    """Over many seeds, (t1, t2) from SpecDecoder and from generate_autoregressive vs the exact law.

    t2 is where speculation acts: the first proposal accepted, or the residual sample. With the
    oracle drafts about half the proposals are accepted, and an acceptor that resampled from p
    instead of the residual would move t2 by 0.22 or more, against the largest TV of 20k correct
    experiments of n = 400 draws (0.121 on an AVX2 CPU); the test checks that separation on the
    exact laws. (The pair's laws depend a little on the CPU that computes them: on the
    AVX2 machine of 2026-12-02, at n = 300, the separation was 0.224 against 0.154, 1.45x, under
    the 1.5x asked.) The random EAGLE draft (almost always rejected)
    checks the real proposer's wiring at temperature 1. ~20 s of CPU here; the acceptor tests
    above are the sharp ones.
    """
    p1, p2 = exact_first_two(peaked_pair, PROMPT)
    assert 0.3 < float(p1.max()) < 0.95  # peaked, but not deterministic
    n_oracle, n_smooth, n_eagle, n_ar = 400, 200, 80, 200
    assert tv(exact_first_two(peaked_pair, PROMPT, resample_bug)[1], p2) > 1.5 * null_tv_max(p2, n_oracle)
    accepted = {True: 0, False: 0}

    def oracle_run(s: int, smoothed: bool) -> tuple[int, int]:
        prop = OracleProposer(peaked_pair, smoothed, seed=10**6 + s)
        events = list(wb.SpecDecoder(peaked_pair, 1, temperature=1.0, seed=s, proposer=prop).stream(PROMPT, 2))
        accepted[smoothed] += sum(e.num_accepted for e in events)
        return first_two(events)

    runs = {
        "oracle draft": [oracle_run(s, False) for s in range(n_oracle)],
        "smoothed oracle draft": [oracle_run(s, True) for s in range(n_smooth)],
        "eagle draft": [first_two(wb.SpecDecoder(peaked_pair, 3, temperature=1.0, seed=s).stream(PROMPT, 8))
                        for s in range(n_eagle)],
        "plain": [tuple((wb.generate_autoregressive(peaked_pair, PROMPT, 2, temperature=1.0, seed=s).tokens
                         + [END])[:2]) for s in range(n_ar)],
    }
    for smoothed, n in ((False, n_oracle), (True, n_smooth)):  # both branches of the rejection test ran often
        assert 0.25 < accepted[smoothed] / n < 0.85
    for name, pairs in runs.items():
        n = len(pairs)
        e1 = empirical([a for a, _ in pairs], VOCAB)
        e2 = empirical([b for _, b in pairs], VOCAB + 1)
        assert tv(e1, p1) < null_tv_max(p1, n), f"{name}: token 1"
        assert tv(e2, p2) < null_tv_max(p2, n), f"{name}: token 2"
    spec2 = empirical([b for _, b in runs["oracle draft"]], VOCAB + 1)
    plain2 = empirical([b for _, b in runs["plain"]], VOCAB + 1)
    assert tv(spec2, plain2) < null_tv_max(p2, n_oracle, n_ar)
    # The same seed gives the same first token: the prefill samples exactly as plain decoding does.
    assert [a for a, _ in runs["eagle draft"]] == [a for a, _ in runs["plain"][:n_eagle]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_verdicts_read_the_same_with_the_cpu_kernels_and_flag_broken_rows(dtype):
    from workbench.decoding.sampling import greedy_verdicts
    from workbench.kernels import cpu

    if not cpu.available():
        pytest.skip(f"CPU kernels: {cpu.status()}")
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 4, 300, generator=g) * 3).to(dtype)
    top = logits.float().argmax(-1)
    props = [top[0, :3].tolist(),                  # all accepted: the bonus
             [int(top[1, 0]), (int(top[1, 1]) + 1) % 300],  # one accepted, then a correction
             [],                                   # a plain decode: only position 0 is its own
             top[3, :2].tolist(), top[4, :3].tolist()]
    logits[2, 1:] = float("nan")  # past row 2's own position: ignored
    logits[3, 1, 7] = float("inf")  # inside row 3's own positions: broken
    logits[4, 3] = float("-inf")  # a row with no finite value: broken
    by_torch, by_kernels = greedy_verdicts(logits, props), greedy_verdicts(logits, props, kernels=True)
    assert [d is None for d in by_torch] == [False, False, False, True, True]
    assert [d is None for d in by_kernels] == [False, False, False, True, True]
    assert [(d.num_accepted, d.next_token) for d in by_torch[:3]] == [(3, int(top[0, 3])), (1, int(top[1, 1])),
                                                                      (0, int(top[2, 0]))]
    for a, b in zip(by_torch[:3], by_kernels[:3]):
        assert (a.num_accepted, a.next_token) == (b.num_accepted, b.next_token)
        assert a.verifier_probs == pytest.approx(b.verifier_probs, rel=1e-5)
        assert a.next_token_prob == pytest.approx(b.next_token_prob, rel=1e-5)
    soft = logits[0].float().softmax(-1)
    assert by_torch[0].verifier_probs == pytest.approx([float(soft[i, t]) for i, t in enumerate(props[0])], rel=1e-5)
