"""The speculative decoding engine is lossless and robust (issue #3).

Greedy speculative decoding must emit exactly the tokens plain greedy decoding emits, for any
draft, any k and any prompt: the draft only decides how many verifier forwards it takes.
On random weights a draft is almost never accepted, so besides the real EAGLE and n-gram
drafters a *scripted* drafter feeds the verifier its own greedy continuation for a chosen
number of positions and a certainly-wrong token after them: every accept/correct/bonus path
then runs with a known expected outcome. The tests hold for the random embedded pair and for
a trained one in the same format.
"""
from __future__ import annotations

import atexit
import functools
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from tests.helpers import EMBEDDED, REPO, make_random_pair
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import workbench as wb


def _read_prompts(name: str, n: int | None = None) -> list[str]:
    lines = (REPO / "assets" / "prompts" / name).read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n] if line.strip()]


PROMPTS = _read_prompts("smoke.jsonl") + _read_prompts("code.jsonl", 4)
# For the random pairs (vocabulary 512): fixed id lists of a few lengths.
ID_PROMPTS = [[(31 * i + 7 * j) % 509 + 2 for i in range(n)] for j, n in enumerate((5, 12, 21, 33))]
MAX_NEW = 24


# ---------------------------------------------------------------------------------------------
# Pairs and baselines, each built once per session.

_TMP = Path(tempfile.mkdtemp(prefix="wb-test-engine-"))
atexit.register(shutil.rmtree, _TMP, True)


def valid_aux(layers: int) -> tuple[int, int, int]:
    """Three distinct aux layers (vLLM's default (2, L//2, L-3) collapses for 3-5 layers)."""
    return (0, layers // 2, layers - 1) if layers == 3 else (1, layers // 2, layers - 1)


@functools.cache
def random_pair(seed: int = 0, hidden: int = 64, layers: int = 4, attention: str = "mla", vocab: int | None = 512,
                max_pos: int = 512) -> wb.ModelPair:
    """A small random verifier + draft, written as real checkpoints and loaded in fp32."""
    out = _TMP / f"s{seed}-h{hidden}-l{layers}-{attention}-v{vocab}-p{max_pos}"
    vdir, ddir = make_random_pair(out, seed=seed, attention=attention, hidden=hidden, layers=layers, vocab=vocab,
                                  aux_layer_ids=valid_aux(layers), max_pos=max_pos)
    return wb.load_pair(vdir, ddir, dtype="float32")


_AR: dict = {}


def autoregressive(pair: wb.ModelPair, prompt, max_new: int = MAX_NEW, **kw) -> wb.GenerationResult:
    """Plain decoding, memoised per (pair, prompt, settings)."""
    key = (id(pair), prompt if isinstance(prompt, str) else tuple(prompt), max_new, tuple(sorted(kw.items())))
    if key not in _AR:
        _AR[key] = wb.generate_autoregressive(pair, prompt, max_new, **kw)
    return _AR[key]


_CHAINS: dict = {}


@torch.inference_mode()
def greedy_chain(pair: wb.ModelPair, prompt_ids: list[int], n: int) -> list[int]:
    """The verifier's greedy continuation, ignoring EOS: the truth a scripted proposer reads from.

    The same calls plain decoding makes (prefill keeping one logit, then one token per forward),
    so up to an EOS it is `generate_autoregressive`'s output token for token.
    """
    key = (id(pair), tuple(prompt_ids))
    if len(_CHAINS.get(key, ())) < n:
        cache = pair.verifier_cache(len(prompt_ids) + n)
        x, out = torch.tensor([prompt_ids]), []
        for _ in range(n):
            out.append(int(pair.verifier(x, cache, logits_to_keep=1).logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
        _CHAINS[key] = out
    return _CHAINS[key][:n]


class ScriptedProposer:
    """Proposes the verifier's greedy continuation at the first `pattern[step]` positions of each
    step and a token that differs from it after them, so the accepted count is known in advance.

    Follows the `Drafter` protocol (name, needs_aux, admit, propose, move, reserve), for one row.
    """

    name = "scripted"
    needs_aux = False

    def __init__(self, prompt_ids: list[int], truth: list[int], pattern: list[int], vocab: int) -> None:
        self.prompt_len, self.truth, self.pattern, self.vocab = len(prompt_ids), truth, pattern, vocab
        self.calls = 0

    def admit(self, slot, row, prefill) -> None:
        self.calls = 0

    def move(self, src: int, dst: int) -> None:
        pass

    def reserve(self, max_len: int) -> None:
        pass

    def scripted(self, tokens: list[int], k: int) -> list[int]:
        done = len(tokens) - self.prompt_len  # tokens emitted so far; truth[done] comes next
        good = self.pattern[self.calls % len(self.pattern)]
        self.calls += 1
        out = []
        for i in range(k):
            t = self.truth[done + i] if done + i < len(self.truth) else 0
            out.append(t if i < good else (t + 1) % self.vocab)
        return out

    def propose(self, rows, ks, stop_below) -> list[wb.Proposal]:
        return [wb.Proposal(self.scripted(r.verified, k), None, [1.0] * k) for r, k in zip(rows, ks)]


def expected_accepts(event: wb.StepEvent, truth: list[int], done: int) -> int:
    """Leading proposals equal to the greedy continuation: what a greedy verifier must accept."""
    a = 0
    while a < event.k and done + a < len(truth) and event.proposed[a] == truth[done + a]:
        a += 1
    return a


def check_events(res: wb.GenerationResult, k: int) -> None:
    """Invariants of any generation's event stream (the record the apps and metrics read)."""
    ev = res.events
    assert ev[0].kind == "prefill" and len(ev[0].emitted) == 1 and ev[0].emitted_status == ["bonus"]
    assert [t for e in ev for t in e.emitted] == res.tokens
    assert "".join(p for e in ev for p in e.emitted_text).startswith(res.text)
    assert all(e.finish_reason is None for e in ev[:-1]) and ev[-1].finish_reason == res.finish_reason
    done = 0
    for e in ev:
        assert e.position == len(res.prompt_tokens) + done
        assert len(e.emitted) == len(e.emitted_text) == len(e.emitted_status) == len(e.emitted_verifier_probs)
        if e.kind == "spec":
            a = e.num_accepted
            assert 1 <= e.k <= k and 0 <= a <= e.k and len(e.verifier_probs) == e.k
            full = ["accepted"] * a + ["bonus" if a == e.k else "corrected"]
            assert e.emitted_status == full[:len(e.emitted)]
            assert e.emitted[:a] == e.proposed[:len(e.emitted[:a])]
            assert len(e.emitted) == a + 1 or e is ev[-1]  # only the finishing step is cut short
        done += len(e.emitted)
    s = res.stats
    spec = [e for e in ev if e.kind == "spec"]
    assert s.num_drafts == len(spec) and sum(s.accepted_length_histogram) == len(spec)
    assert s.num_accepted_tokens == sum(e.num_accepted for e in spec)
    assert s.accept_length == pytest.approx(1 + s.num_accepted_tokens / max(len(spec), 1), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# 1. Lossless, greedy.

@pytest.mark.parametrize("k", range(1, 9))
def test_eagle_greedy_is_lossless_on_embedded_pair(embedded_pair, k):
    dec = wb.SpecDecoder(embedded_pair, k)
    for i in range(len(PROMPTS)):
        ar = autoregressive(embedded_pair, PROMPTS[i])
        res = dec.generate(PROMPTS[i], max_new_tokens=MAX_NEW)
        assert res.tokens == ar.tokens, f"prompt {i}, k={k}: speculative output differs from plain decoding"
        assert (res.text, res.finish_reason) == (ar.text, ar.finish_reason)
        check_events(res, k)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_ngram_greedy_is_lossless_on_embedded_pair(embedded_pair, k):
    dec = wb.SpecDecoder(embedded_pair, k, proposer="ngram")
    for i in (k % len(PROMPTS), (k + 4) % len(PROMPTS)):
        res = dec.generate(PROMPTS[i], max_new_tokens=MAX_NEW)
        assert res.tokens == autoregressive(embedded_pair, PROMPTS[i]).tokens, f"prompt {i}, k={k}"
        check_events(res, k)


def test_mha_draft_is_lossless(embedded_pair):
    """The MHA twin of the embedded draft, and a random MHA draft, change nothing but speed."""
    aux = embedded_pair.verifier.aux_layer_ids
    try:  # loading a draft points the shared verifier's aux capture at that draft's layers
        twin = embedded_pair.with_draft(EMBEDDED / "draft-mha")
        assert twin.draft.attention_kind == "mha"
        res = wb.SpecDecoder(twin, 3).generate(PROMPTS[0], max_new_tokens=MAX_NEW)
    finally:
        embedded_pair.verifier.aux_layer_ids = aux
    assert res.tokens == autoregressive(embedded_pair, PROMPTS[0]).tokens
    pair = random_pair(seed=5, attention="mha")
    for k, prompt in ((2, ID_PROMPTS[0]), (5, ID_PROMPTS[2]), (8, ID_PROMPTS[3])):
        res = wb.SpecDecoder(pair, k).generate(prompt, max_new_tokens=MAX_NEW)
        assert res.tokens == autoregressive(pair, prompt).tokens, f"k={k}"
        check_events(res, k)


CONFIGS = [(0, 32, 3, "mla"), (1, 64, 4, "mla"), (2, 32, 5, "mha"), (3, 64, 5, "mla")]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.sampled_from(CONFIGS), prompt=st.lists(st.integers(0, 511), min_size=1, max_size=40),
       k=st.integers(1, 8), proposer=st.sampled_from(["eagle", "eagle", "ngram"]))
def test_greedy_lossless_property(cfg, prompt, k, proposer):
    seed, hidden, layers, attention = cfg
    pair = random_pair(seed=seed, hidden=hidden, layers=layers, attention=attention)
    res = wb.SpecDecoder(pair, k, proposer=proposer).generate(prompt, max_new_tokens=16)
    ar = autoregressive(pair, prompt, 16)
    assert res.tokens == ar.tokens and res.finish_reason == ar.finish_reason
    check_events(res, k)


# ---------------------------------------------------------------------------------------------
# The scripted proposer: accepted counts known in advance.

def scripted_run(pair, prompt: str, k: int, pattern: list[int], max_new: int = MAX_NEW, **kw):
    ids = pair.encode(prompt)
    truth = greedy_chain(pair, ids, max_new + 8)
    prop = ScriptedProposer(ids, truth, pattern, pair.verifier.config.vocab_size)
    return wb.SpecDecoder(pair, k, proposer=prop).generate(prompt, max_new_tokens=max_new, **kw), truth


@pytest.mark.parametrize("k", [1, 3, 8])
def test_scripted_acceptance_is_exact(embedded_pair, k):
    pattern = [0, 1, k, 2, 0, k, 3]
    res, truth = scripted_run(embedded_pair, PROMPTS[0], k, pattern)
    ar = autoregressive(embedded_pair, PROMPTS[0])
    assert res.tokens == ar.tokens and truth[:len(ar.tokens)] == ar.tokens
    check_events(res, k)
    spec = [e for e in res.events if e.kind == "spec"]
    done = 1
    for step, e in enumerate(spec):
        want = min(pattern[step % len(pattern)], e.k)
        assert expected_accepts(e, truth, done) == want  # the script did what it says
        assert e.num_accepted == want, f"step {e.step}: accepted {e.num_accepted}, expected {want}"
        if e is not spec[-1]:
            assert e.emitted_status == ["accepted"] * want + ["bonus" if want == e.k else "corrected"]
            assert e.emitted == truth[done:done + want + 1]
        done += len(e.emitted)
    accepted = sum(e.num_accepted for e in spec)
    assert res.stats.accept_length == pytest.approx(1 + accepted / len(spec))
    assert res.stats.accept_length > 1 and any(e.bonus is not None for e in spec)
    assert len(spec) < MAX_NEW - 1  # accepted proposals saved verifier forwards


# ---------------------------------------------------------------------------------------------
# 4. Stopping.

def _unique_after(seq: list[int], lo: int, hi: int, avoid=()) -> int | None:
    """The largest j in [lo, hi] whose token appears nowhere before it (nor in `avoid`)."""
    for j in range(hi, lo - 1, -1):
        if seq[j] not in seq[:j] and seq[j] not in avoid:
            return j
    return None


def test_eos_inside_an_accepted_run(embedded_pair, monkeypatch):
    ids = embedded_pair.encode(PROMPTS[0])
    truth = greedy_chain(embedded_pair, ids, MAX_NEW + 8)
    j = _unique_after(truth, 2, 7, avoid=embedded_pair.eos_token_ids)
    assert j is not None, f"no token of {truth[:8]} is new at its position; pick another prompt"
    monkeypatch.setattr(embedded_pair.verifier.config, "eos_token_id", truth[j])
    assert truth[j] in embedded_pair.eos_token_ids
    ar = wb.generate_autoregressive(embedded_pair, PROMPTS[0], MAX_NEW)
    assert (ar.tokens, ar.finish_reason) == (truth[:j + 1], "eos")
    res, _ = scripted_run(embedded_pair, PROMPTS[0], 8, [8])  # one step proposes truth[1:9], all correct
    assert (res.tokens, res.finish_reason) == (truth[:j + 1], "eos")
    last = res.events[-1]
    assert last.kind == "spec" and last.num_accepted == 8 and last.emitted == truth[1:j + 1]
    assert last.emitted_status == ["accepted"] * j and len(res.events) == 2
    assert wb.SpecDecoder(embedded_pair, 4).generate(PROMPTS[0], MAX_NEW).tokens == ar.tokens


def _stop_string(res: wb.GenerationResult, lo: int, hi: int) -> tuple[int, str] | None:
    """A token j in [lo, hi] whose text is non-blank and first appears exactly where j starts it."""
    pieces = [p for e in res.events for p in e.emitted_text]
    for j in range(lo, hi + 1):
        s, start = pieces[j], len("".join(pieces[:j]))
        if s.strip() and "".join(pieces).find(s) == start:
            return j, s
    return None


def test_stop_string_inside_an_accepted_run(embedded_pair):
    ar = autoregressive(embedded_pair, PROMPTS[0])
    found = _stop_string(ar, 2, 8)
    assert found is not None, "no usable stop string in the continuation; pick another prompt"
    j, stop = found
    cut = ar.text.find(stop)
    res, truth = scripted_run(embedded_pair, PROMPTS[0], 8, [8], stop=["never appears \x00", stop])
    assert (res.tokens, res.finish_reason, res.text) == (ar.tokens[:j + 1], "stop", ar.text[:cut])
    assert stop not in res.text and res.events[-1].num_accepted == 8 and len(res.events) == 2
    ar_stop = wb.generate_autoregressive(embedded_pair, PROMPTS[0], MAX_NEW, stop=stop)
    assert (ar_stop.tokens, ar_stop.text, ar_stop.finish_reason) == (res.tokens, res.text, "stop")
    eagle = wb.SpecDecoder(embedded_pair, 3).generate(PROMPTS[0], MAX_NEW, stop=stop)
    assert (eagle.tokens, eagle.text, eagle.finish_reason) == (res.tokens, res.text, "stop")


@pytest.mark.parametrize("max_new", [1, 2, 5, 9, 10, 11])
def test_max_new_tokens_inside_an_accepted_run(embedded_pair, max_new):
    res, truth = scripted_run(embedded_pair, PROMPTS[0], 8, [8], max_new=max_new)
    assert len(res.tokens) == max_new and res.tokens == truth[:max_new]
    assert res.finish_reason == "length"
    check_events(res, 8)


def test_context_limit_finishes_cleanly():
    """With room for only a few more tokens the engine shortens k and ends with "context"."""
    pair = random_pair(seed=7, hidden=32, layers=3, max_pos=64)
    g = torch.Generator().manual_seed(0)
    for n in (50, 57, 60, 62, 63):
        prompt = torch.randint(2, 512, (n,), generator=g).tolist()
        ar = wb.generate_autoregressive(pair, prompt, MAX_NEW)
        assert ar.finish_reason == "context" and n + len(ar.tokens) == 64
        truth = greedy_chain(pair, prompt, 64 - n)
        for proposer in ("eagle", "ngram", ScriptedProposer(prompt, truth, [8, 0, 2], 512)):
            res = wb.SpecDecoder(pair, 8, proposer=proposer).generate(prompt, max_new_tokens=MAX_NEW)
            assert (res.tokens, res.finish_reason) == (ar.tokens, "context"), f"prompt of {n}, {proposer}"
            check_events(res, 8)
    # a caller's max_len below the model's context is a context limit too
    res = wb.SpecDecoder(pair, 4).generate(prompt[:20], max_new_tokens=MAX_NEW, max_len=30)
    assert (len(res.tokens), res.finish_reason) == (10, "context")


# ---------------------------------------------------------------------------------------------
# 5. Bad input: a clear error, and the decoder still serves the next request.

@pytest.mark.parametrize("k", [0, 17, -1, 2.5, True, "3", None])
def test_bad_k(k):
    with pytest.raises(wb.RequestError, match=r"num_speculative_tokens = .*expected an integer in \[1, 16\]"):
        wb.SpecDecoder(random_pair(), k)


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
])
def test_bad_sampling_settings(kw, field):
    with pytest.raises(wb.SamplingError, match=f"^{field} = "):
        wb.SpecDecoder(random_pair(), 3, **kw)
    with pytest.raises(wb.SamplingError, match=f"^{field} = "):
        wb.generate_autoregressive(random_pair(), [5, 6], 4, **kw)


def test_bad_requests_then_a_good_one():
    pair = random_pair(seed=7, hidden=32, layers=3, max_pos=64)
    dec = wb.SpecDecoder(pair, 3)
    good = list(range(10, 20))
    cases = [("", "prompt is empty"), ([], "prompt is empty"), (list(range(2, 66)), "64 tokens; the context is 64"),
             (list(range(2, 102)), "100 tokens; the context is 64")]
    for prompt, message in cases:
        with pytest.raises(wb.RequestError, match=message):
            dec.generate(prompt, max_new_tokens=8)
        with pytest.raises(wb.RequestError, match=message):
            wb.generate_autoregressive(pair, prompt, 8)
        assert dec.generate(good, max_new_tokens=8).tokens == autoregressive(pair, good, 8).tokens
    for bad_max in (0, -3, 2.0):
        with pytest.raises(wb.RequestError, match="max_new_tokens"):
            dec.generate(good, max_new_tokens=bad_max)
    with pytest.raises(wb.RequestError, match="12 tokens; the context is 10"):
        dec.generate(list(range(2, 14)), max_new_tokens=8, max_len=10)
    assert dec.generate(good, max_new_tokens=8).tokens == autoregressive(pair, good, 8).tokens


@pytest.mark.parametrize("at_call", [0, 2])
def test_nan_logits_raise_a_clear_error(monkeypatch, at_call):
    """NaN logits (a corrupt checkpoint, an overflow) at prefill or mid-generation."""
    pair = random_pair()
    forward, calls = pair.verifier.forward, []

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        if len(calls) - 1 == at_call:
            out.logits[..., 3] = float("nan")
        return out

    good = [7, 8, 9, 10]
    dec = wb.SpecDecoder(pair, 3)
    monkeypatch.setattr(pair.verifier, "forward", poisoned)
    where = "prompt's last position" if at_call == 0 else "step 2"
    with pytest.raises(wb.SamplingError, match=f"verifier logits at .*{where}.*contain NaN"):
        dec.generate(good, max_new_tokens=8)
    calls.clear()
    with pytest.raises(wb.SamplingError, match="contain NaN"):
        wb.generate_autoregressive(pair, good, 8)
    monkeypatch.undo()
    assert dec.generate(good, max_new_tokens=8).tokens == autoregressive(pair, good, 8).tokens


@pytest.mark.parametrize("proposer", ["eagle", "ngram"])
def test_stream_runs_without_autograd_whatever_the_caller(embedded_pair, proposer, monkeypatch):
    """Called with grad enabled (a notebook, the chat), every forward still runs in inference mode,
    as the autoregressive baseline's do: under autograd the verifier records a graph and routes its
    experts through the training loop, and the bench compared speculation paying that against a
    baseline that did not. Between events the caller's own mode is back. (The greedy chain may run
    as one CPU-kernel call rather than through the draft's modules, so it is watched too.)"""
    from workbench.decoding import drafters

    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: seen.append((name,
                                                                                  torch.is_inference_mode_enabled())))
             for name, model in (("verifier", embedded_pair.verifier), ("draft", embedded_pair.draft))
             for m in model.modules()]
    def watched(f):
        return lambda *a, **kw: (seen.append(("draft", torch.is_inference_mode_enabled())), f(*a, **kw))[1]

    monkeypatch.setattr(drafters, "greedy_chain", watched(drafters.greedy_chain))
    if hasattr(embedded_pair.draft, "run_greedy_chain"):  # the CPU kernels' one call
        monkeypatch.setattr(embedded_pair.draft, "run_greedy_chain", watched(embedded_pair.draft.run_greedy_chain))
    try:
        assert torch.is_grad_enabled()
        dec = wb.SpecDecoder(embedded_pair, 3, proposer=proposer)
        modes = [torch.is_inference_mode_enabled() for _ in dec.stream(PROMPTS[0], max_new_tokens=12)]
        ar = wb.generate_autoregressive(embedded_pair, PROMPTS[0], 12)
    finally:
        for h in hooks:
            h.remove()
    assert not any(modes) and torch.is_grad_enabled()
    calls = {name for name, _ in seen}
    assert calls == ({"verifier"} if proposer == "ngram" else {"verifier", "draft"})
    assert all(inference for _, inference in seen), [c for c in seen if not c[1]]
    assert dec.generate(PROMPTS[0], 12).tokens == ar.tokens


# ---------------------------------------------------------------------------------------------
# 6. Stats from the events.

def test_stats_follow_the_events(embedded_pair):
    k, pattern = 4, [0, 2, 1, 4]
    max_new = 1 + 2 * sum(min(a, k) + 1 for a in pattern)  # two rounds of the pattern, no step shortened
    res, truth = scripted_run(embedded_pair, PROMPTS[0], k, pattern, max_new=max_new)
    spec = [e for e in res.events if e.kind == "spec"]
    assert [e.num_accepted for e in spec] == pattern * 2 and all(e.k == k for e in spec)
    s = res.stats
    assert s.accept_length == 1 + sum(pattern * 2) / 8 == 1 + s.num_accepted_tokens / s.num_drafts
    assert s.accepted_length_histogram == [2, 2, 2, 0, 2] and s.num_draft_tokens == 8 * k
    assert s.accepted_per_pos == [6, 4, 2, 2]
    assert s.per_position_acceptance == [6 / 8, 4 / 8, 2 / 8, 2 / 8]
    assert all(a >= b for a, b in zip(s.per_position_acceptance, s.per_position_acceptance[1:]))
    eagle = wb.SpecDecoder(embedded_pair, 3).generate(PROMPTS[1], MAX_NEW)
    check_events(eagle, 3)
    es = eagle.stats
    assert all(a >= b for a, b in zip(es.accepted_per_pos, es.accepted_per_pos[1:]))
    if all(e.k == 3 for e in eagle.events if e.kind == "spec"):
        assert all(a >= b for a, b in zip(es.per_position_acceptance, es.per_position_acceptance[1:]))
    assert math.isclose(es.accept_length, 1 + es.num_accepted_tokens / es.num_drafts)


@pytest.mark.parametrize("attention", ["mla", "mha"])
def test_greedy_chain_is_the_step_by_step_draft(attention):
    """The engine's `greedy_chain` (argmaxes kept on the device) = first pass + k-1 single steps."""
    from workbench.decoding.drafters import greedy_chain

    pair = random_pair(seed=2, attention=attention)
    draft, k = pair.draft, 4
    with torch.inference_mode():
        out = pair.verifier(torch.tensor([ID_PROMPTS[2]]))
        ids = torch.tensor([ID_PROMPTS[2][1:] + [int(out.logits[0, -1].argmax())]])
        hidden = draft.combine_hidden_states(out.aux_hidden_states)
        c1, c2 = draft.new_cache(64), draft.new_cache(64)
        chain, probs = greedy_chain(draft, ids, hidden, c1, k)
        post, state = draft(ids, hidden, c2)
        tokens, ps = [], []
        for i in range(k):
            p = draft.compute_logits(post)[0, -1].float().softmax(-1)
            tokens.append(int(p.argmax())), ps.append(float(p.max()))
            if i + 1 < k:
                post, state = draft(torch.tensor([[tokens[-1]]]), state[:, -1:], c2)
        c3 = draft.new_cache(64)  # unfused aux states: the chain runs fc itself (the proposer's call)
        chain_aux, probs_aux = greedy_chain(draft, ids, out.aux_hidden_states, c3, k)
    assert chain[0].tolist() == tokens and c1.length == c2.length == ids.shape[1] + k - 1
    torch.testing.assert_close(probs[0], torch.tensor(ps), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(c1.rows[:, :, : c1.length], c2.rows[:, :, : c2.length], rtol=0, atol=0)
    assert torch.equal(chain_aux, chain) and torch.equal(probs_aux, probs)
    torch.testing.assert_close(c3.rows[:, :, : c3.length], c1.rows[:, :, : c1.length], rtol=0, atol=0)
