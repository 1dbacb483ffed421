"""`workbench bench`: speculative against autoregressive decoding on the same prompts, in one run.

Both paths run the same verifier, cache and dtype; each prompt is decoded both ways back to
back (alternating which goes first), so drift on a shared machine hits both alike. Speed is
total tokens / total time per method, and the per-prompt speedup median is reported beside it.
Losslessness: greedy outputs must be identical. In bf16 the k+1-token verify pass rounds
differently from one-token decoding, so a near-tie can flip; every divergence is reported with
the verifier's logit gap between the two candidates, and the run counts as lossless only if
each gap, read from the autoregressive run's own logits, is within the dtype's rounding
(`tie_tolerance`).

The report also says what the speedup is made of (`step_cost`, from the same runs): a step's
cost in autoregressive decodes, the tokens it yields, and so what speculation gives once the
prefills are left out, and at most, were every proposal accepted at that cost. A ratio alone
cannot tell a weak draft from an expensive step; these can.

Accept lengths come with the loops set apart (`workbench.analysis.degeneracy`): each prompt's
continuation is flagged `degenerate` by the repeated-6-gram rule, and the report gives the loop
count, the accept length over the clean continuations, the per-request mean and the accept length
by decode position beside the pooled figure. It warns about prompts that look random and calls a
draft below accept length 1.2 dead.

A pair whose kernels hold int8 or bf16 weights (`ModelPair.weights`) computes other logits than the
models it was quantised from, so its speed comes with its greedy agreement with the fp32 pair on
the same prompts (`greedy_agreement`): how many continuations are identical, and how many of the
fp32 tokens come before the first difference. Losslessness is judged as ever, against plain
decoding with the same int8 weights.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from workbench.analysis.degeneracy import accept_split, dead_draft_note, detect_loop, random_prompt_warning
from workbench.decoding.stats import compute_stats
from workbench.decoding.engine import SpecDecoder, generate_autoregressive
from workbench.kernels import cpu
from workbench.machine import machine

EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def tie_tolerance(logit: float, dtype: torch.dtype, roundings: int = 4) -> float:
    """A few units in the last place of the logit's magnitude in `dtype`: what rounding alone can move."""
    return roundings * EPS.get(dtype, 2.0 ** -23) * max(abs(logit), 1.0)


@torch.inference_mode()
def divergence(pair, prompt_ids: list[int], a: list[int], b: list[int], attention: str = "auto") -> dict | None:
    """Where greedy continuation `b` first leaves the autoregressive `a`, and a's own logit gap there.

    The gap is read from a replay of the autoregressive run itself (same prefill, same one-token
    steps, so the same kernels and roundings that chose a[j]): if that run's own margin between
    the two tokens is within rounding, another rounding of the same math may pick either.
    """
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        return None
    pair = pair.with_attention(attention)
    cache = pair.verifier_cache(len(prompt_ids) + j + 1)
    step = lambda ids: pair.verifier(torch.tensor([ids], device=pair.device), cache,  # noqa: E731
                                     logits_to_keep=1).logits[0, -1].float()
    logits = step(prompt_ids)
    for t in a[:j]:
        logits = step([t])
    la, lb = float(logits[a[j]]), float(logits[b[j]])
    tol = tie_tolerance(max(abs(la), abs(lb)), pair.dtype)
    return {"position": j, "autoregressive_token": a[j], "speculative_token": b[j], "logit_ar": la,
            "logit_spec": lb, "gap": abs(la - lb), "tolerance": tol, "tie": abs(la - lb) <= tol}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Where greedy continuations `a` and `b` first differ (the shorter's length where one is a
    prefix of the other), or None where they are equal."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return n if n is not None or len(a) == len(b) else min(len(a), len(b))


def fp32_reference(pair):
    """The fp32 pair with the checkpoint's own weights beside `pair`, for greedy plain decoding: the
    same plain verifier on native weights where `pair` is fp32, else the verifier loaded again in
    fp32 (without its draft). Either runs where its path chooses (the CPU kernels where they run)."""
    from workbench.pair import ModelPair, load_pair

    if pair.dtype == torch.float32:
        plain = ModelPair(pair.plain[0], None, pair.tokenizer, pair.verifier_dir, None, dict(pair.info))
        return plain.with_path("auto", "auto", "native")
    return load_pair(pair.verifier_dir, device=pair.device, dtype=torch.float32, no_draft=True)


def forced_picks(pair, prompt_ids: list[int], tokens: list[int], chunk: int = 64) -> list[int]:
    """The verifier's greedy pick (argmax, the first of equal logits) for each of `tokens`' positions
    when fed `prompt_ids` and the `tokens` before it (teacher forcing), through the cache in chunks
    of `chunk` tokens, so that the CPU kernels serve every call as they serve decoding."""
    ids = list(prompt_ids) + list(tokens)
    cache = pair.verifier_cache(len(ids))
    picks: list[int] = []
    for i in range(0, len(ids) - 1, chunk):
        part = ids[i:min(i + chunk, len(ids) - 1)]
        picks += pair.verifier(torch.tensor([part], device=pair.device), cache).logits[0].float().argmax(-1).tolist()
    return picks[len(prompt_ids) - 1:]


@torch.inference_mode()
def greedy_agreement(pair, prompts: list[str], max_new_tokens: int = 128, tokens: list[list[int]] | None = None,
                     reference=None, heal: bool = False) -> dict:
    """`pair`'s greedy continuations of `prompts` (`tokens` where already decoded, else plain
    decoding now) against `reference`'s (default `fp32_reference(pair)`), prompt by prompt.

    `same_tokens`: the continuations that are identical; `first_difference`: where each first
    differs (None: nowhere); `prefix_share`: the reference's tokens before the first difference over
    all of its tokens (past a difference each continuation follows its own text, so this figure
    falls with the length asked). `token_agreement`: the share of the reference's tokens that
    `pair` picks itself when fed the reference's text before each (`forced_picks`), which does not
    compound: the per-token figure. With `heal` the forced picks leave out the first token's
    constraint."""
    reference = fp32_reference(pair) if reference is None else reference
    if tokens is None:
        tokens = [generate_autoregressive(pair, p, max_new_tokens, heal=heal).tokens for p in prompts]
    runs = [generate_autoregressive(reference, p, max_new_tokens, heal=heal) for p in prompts]
    want = [list(r.tokens) for r in runs]
    diffs = [first_difference(w, t) for w, t in zip(want, tokens, strict=True)]
    total = sum(len(w) for w in want)
    agreed = sum(len(w) if d is None else d for w, d in zip(want, diffs))
    forced = sum(sum(a == b for a, b in zip(forced_picks(pair, list(r.prompt_tokens), w), w))
                 for r, w in zip(runs, want) if w)
    return {"reference": f"{str(reference.dtype).removeprefix('torch.')}, {reference.weights} weights "
                         f"({reference.status()})",
            "weights": pair.weights, "dtype": str(pair.dtype).removeprefix("torch."), "num_prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "same_tokens": sum(d is None for d in diffs),
            "first_difference": diffs, "prefix_share": agreed / total if total else 1.0,
            "token_agreement": forced / total if total else 1.0, "reference_tokens": total}


def agreement_text(a: dict) -> str:
    """One line for `greedy_agreement`'s figures."""
    return (f"greedy agreement with {a['reference'].split(' (')[0]} ({a['weights']} weights, {a['dtype']} "
            f"activations): {a['same_tokens']} of {a['num_prompts']} continuations identical, "
            f"{a['prefix_share']:.1%} of its {a['reference_tokens']} tokens before the first difference, "
            f"{a['token_agreement']:.1%} of them picked alike when fed its text")


def step_cost(k: int, spec_s: float, spec_prefill_s: float, spec_tokens: int, spec_steps: int, ar_s: float,
              ar_prefill_s: float, ar_tokens: int, num_requests: int) -> dict:
    """Where a speedup comes from: a speculative step against one autoregressive decode.

    Each request's prefill (one verifier forward over the prompt, which emits the first token)
    costs both methods the same and is left out, so `decode_speedup` is the speedup of the
    decoding itself. `speedup_if_all_accepted` is k+1 tokens a step at the measured step cost:
    what a perfect draft would give at this cost, so a target above it needs a cheaper step, not
    a better draft (a fused step always drafts k, so its cost does not depend on acceptance;
    unfused, a step's draft pass covers one more position per accepted token, a small change).
    A step's time includes its drafting and host work, and each request's first step includes
    the draft's pass over the prompt.
    """
    shares = {"prefill_share_spec": spec_prefill_s / spec_s if spec_s > 0 else None,
              "prefill_share_ar": ar_prefill_s / ar_s if ar_s > 0 else None}
    decoded_ar, decoded_spec = ar_tokens - num_requests, spec_tokens - num_requests
    if spec_steps == 0 or decoded_ar <= 0:  # every request ended at its first token
        return {"ar_decode_ms": None, "spec_step_ms": None, "decodes_per_step": None, "tokens_per_step": None,
                "decode_speedup": None, "speedup_if_all_accepted": None, **shares}
    ar_decode = (ar_s - ar_prefill_s) / decoded_ar
    spec_step = (spec_s - spec_prefill_s) / spec_steps
    decodes, tokens = spec_step / ar_decode, decoded_spec / spec_steps
    return {"ar_decode_ms": ar_decode * 1e3, "spec_step_ms": spec_step * 1e3, "decodes_per_step": decodes,
            "tokens_per_step": tokens, "decode_speedup": tokens / decodes, "speedup_if_all_accepted": (k + 1) / decodes,
            **shares}


def step_components(dec, prompt: str | list[int], max_new_tokens: int = 128, repeats: int = 50) -> dict:
    """One speculative step's parts, each timed alone against one decode, at one position.

    `step_cost` reads a step from the bench's loop; this repeats one step of the decoder's own
    engine (`dec.engine.step`, the loop that serves) `repeats` times at the same position (the rows,
    caches and drafting put back with `BatchDecoder.mark` before each call; medians), beside the
    verifier's 1-token decode and k+1-token verify at that position. The position is half-way
    through the prompt's greedy continuation, prefilled as one forward and then one step taken, so
    the step timed drafts as it does in the loop. `draft_ms` and `step_verify_ms` are the step's own
    split of its time; `verify_then_draft_ms` their sum, so `step_ms` above it is the step's host work.
    """

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"step components: repeats = {repeats!r}; expected an integer >= 1")
    pair, k, engine = dec.pair, dec.k, dec.engine
    ar = generate_autoregressive(pair, prompt, max_new_tokens)
    seq = ar.prompt_tokens + ar.tokens[: max(0, len(ar.tokens) - 1) // 2]
    if len(seq) + 2 * (k + 1) > pair.context_length:
        raise ValueError(f"step components: {len(seq)} positions leave no room for two steps of k = {k} in the "
                         f"{pair.context_length}-token context; expected a shorter prompt or fewer max_new_tokens")

    def median_ms(fn) -> float:
        return statistics.median(_timed(fn)[1] for _ in range(repeats)) * 1e3

    rid = dec.submit(seq, max_new_tokens)
    try:
        engine.step()  # the prefill, then a step into the steady state: the next draft covers one step's rows
        with torch.inference_mode():
            vcache, row = engine.vcache.view(0), engine.rows[0]
            n, restore = vcache.length, engine.mark()
            x1 = torch.tensor([[row.verified[-1]]], device=pair.device)
            xk = torch.tensor([[row.verified[-1]] * (k + 1)], device=pair.device)
            events = []

            def decode():
                pair.verifier(x1, vcache, logits_to_keep=1)
                vcache.truncate(n)

            def verify():
                pair.verifier(xk, vcache)
                vcache.truncate(n)

            def step():
                restore()
                events.extend(ev for _, ev in engine.step())

            t = {"decode_ms": median_ms(decode), "verify_ms": median_ms(verify), "step_ms": median_ms(step)}
            restore()
    finally:
        engine.cancel(rid)
    t["draft_ms"] = statistics.median(e.draft_time for e in events) * 1e3
    t["step_verify_ms"] = statistics.median(e.verify_time for e in events) * 1e3
    t["verify_then_draft_ms"] = statistics.median(e.draft_time + e.verify_time for e in events) * 1e3
    per = {f"{name[:-3]}_decodes": t[name] / t["decode_ms"]
           for name in ("verify_ms", "draft_ms", "step_ms", "verify_then_draft_ms")}
    return {"position": n, "repeats": repeats, "fused": dec.fused is not None, **t, **per,
            "speedup_if_all_accepted": (k + 1) / per["step_decodes"]}


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _graph_cache_counts() -> dict[str, int]:
    """Inductor's on-disk graph cache so far in this process: graphs loaded (hits), compiled and
    stored (misses), compiled and not storable (bypasses). A warm-up's length depends on them."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"hits": inductor["fxgraph_cache_hit"], "misses": inductor["fxgraph_cache_miss"],
            "bypasses": inductor["fxgraph_cache_bypass"]}


def run_bench(pair, prompts: list[str], k: int = 3, max_new_tokens: int = 128, attention: str = "auto",
              peers: bool = True, peer_prompts: int = 8, repeats: int = 1, progress: bool = True,
              fused: bool | None = None, components: int = 0, heal: bool = False,
              agreement: bool | None = None) -> dict:
    """Every prompt speculatively and autoregressively, alternating which goes first; with
    `components` > 0, also `step_components` on the first prompt, that many calls of each part.
    `heal` heals each prompt's last token (`workbench.decoding.healing`) in both methods.
    `agreement`: the autoregressive continuations' `greedy_agreement` with the fp32 pair, untimed
    (None: where the pair's weights are int8)."""
    # long: the timing loop and the report it fills share their locals; split, they would travel as arguments

    dec = SpecDecoder(pair, num_speculative_tokens=k, attention=attention, fused=fused)
    ar_fn = lambda p: generate_autoregressive(pair, p, max_new_tokens, attention=attention, heal=heal)  # noqa: E731
    # Warm-up, outside the timing: with a compiled pair this is where every graph compiles
    # (verify and draft steps of 1 and of several tokens both occur within 32 tokens).
    cache_before = _graph_cache_counts()
    _, warmup_s = _timed(lambda: (dec.generate(prompts[0], max_new_tokens=32, heal=heal), ar_fn(prompts[0])))
    graph_cache = {k: v - cache_before[k] for k, v in _graph_cache_counts().items()}
    spec_events, spec_tok, spec_t, ar_tok, ar_t, ratios, ties, per_prompt = [], 0, 0.0, 0, 0.0, [], [], []
    ar_runs = []  # each prompt's autoregressive tokens (greedy_agreement's)
    requests = []  # each prompt's speculative steps, for the accept lengths with the loops set apart
    ar_prefill_t = 0.0
    bar = _bar(len(prompts), "bench", progress)
    for i, prompt in enumerate(prompts):
        runs_s, runs_a = [], []
        for r in range(repeats):
            order = [("s", lambda: dec.generate(prompt, max_new_tokens, heal=heal)), ("a", lambda: ar_fn(prompt))]
            for tag, fn in (order if (i + r) % 2 == 0 else order[::-1]):
                (runs_s if tag == "s" else runs_a).append(_timed(fn))
        spec, ts = runs_s[0][0], statistics.median(t for _, t in runs_s)
        ar, ta = runs_a[0][0], statistics.median(t for _, t in runs_a)
        ar_runs.append(list(ar.tokens))
        spec_events += spec.events
        requests.append(spec.events)
        ar_prefill_t += ar.events[0].verify_time
        spec_tok, spec_t, ar_tok, ar_t = spec_tok + len(spec.tokens), spec_t + ts, ar_tok + len(ar.tokens), ar_t + ta
        ratios.append((len(spec.tokens) / ts) / (len(ar.tokens) / ta))
        if spec.tokens != ar.tokens:
            d = divergence(pair, ar.prompt_tokens, ar.tokens, spec.tokens, attention)
            ties.append({"prompt_index": i, **(d or {"position": min(len(ar.tokens), len(spec.tokens)),
                                                      "tie": False, "note": "same prefix, different lengths"})})
        loop = detect_loop(spec.tokens)
        per_prompt.append({"spec_tokens": len(spec.tokens), "ar_tokens": len(ar.tokens), "spec_s": ts, "ar_s": ta,
                           "accept_length": spec.stats.accept_length, "identical": spec.tokens == ar.tokens,
                           "degenerate": loop.degenerate, "repeated_6gram_share": loop.share,
                           "loop_start": loop.loop_start, "token_ids": list(spec.tokens)})
        _tick(bar, f"AL {spec.stats.accept_length:.2f}")
    _close(bar)
    stats = compute_stats(spec_events, elapsed=spec_t, num_tokens=spec_tok)
    split = accept_split(requests)
    spec_steps = sum(e.kind == "spec" for e in spec_events)
    report = {
        "k": k, "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "dtype": str(pair.dtype).replace("torch.", ""),
        "device": str(pair.device), "machine": machine(), "fast_path": dec.pair.status(), "cpu_kernels": cpu.status(),
        "attention": dec.attention, "heal": heal, "weights": pair.weights,
        "threads": torch.get_num_threads(), "repeats": repeats,
        "compiled": pair.compiled, "fused": dec.fused is not None, "engine": dec.engine_report(), "warmup_s": warmup_s, "graph_cache": graph_cache,
        "verifier": pair.verifier_dir, "draft": pair.draft_dir,
        **hygiene(pair, prompts, split),
        "accept_length": stats.accept_length, "per_position_acceptance": stats.per_position_acceptance,
        "conditional_acceptance": stats.conditional_acceptance,
        "accepted_length_histogram": stats.accepted_length_histogram,
        "spec_tokens_per_s": spec_tok / spec_t, "ar_tokens_per_s": ar_tok / ar_t,
        "speedup": (spec_tok / spec_t) / (ar_tok / ar_t), "speedup_median": statistics.median(ratios),
        # Where a speculative run's time goes: its steps' draft and verify time, and per request the
        # prompt's prefill (the same work as the autoregressive run's first forward, also reported).
        "spec_steps": spec_steps, "draft_time_s": stats.draft_time,
        "verify_time_s": stats.verify_time, "prefill_time_s": stats.prefill_time, "ar_prefill_time_s": ar_prefill_t,
        # With repeats, the times are medians per prompt and the prefills are the first run's.
        "step_cost": step_cost(k, spec_t, stats.prefill_time, spec_tok, spec_steps, ar_t, ar_prefill_t, ar_tok,
                               len(prompts)),
        "lossless": all(t.get("tie") for t in ties), "identical": not ties, "ties": ties, "per_prompt": per_prompt,
    }
    if agreement or (agreement is None and pair.weights != "native"):
        report["agreement_with_fp32"] = greedy_agreement(pair, prompts, max_new_tokens, ar_runs, heal=heal)
    if components:
        report["components"] = step_components(dec, prompts[0], max_new_tokens, components)
    if peers:
        report["peers"] = peer_bench(pair, prompts[:peer_prompts], max_new_tokens, k, attention, progress)
    return report


def hygiene(pair, prompts: list[str], split) -> dict:
    """The accept lengths with the loops set apart, and the warnings a reader needs before any figure:
    prompts that look random, a dead draft, figures that rest mostly on looping text."""
    dead = dead_draft_note(split.pooled)
    warnings = [w for w in (random_prompt_warning(prompts, pair.encode), dead) if w]
    if split.mostly_loops:
        warnings.append(f"{split.num_degenerate} of {split.num_requests} continuations loop: the pooled accept "
                        "length rests mostly on looping text; read the clean figure")
    return {**split.to_dict(), "dead_draft": dead is not None, "warnings": warnings}


def peer_bench(pair, prompts: list[str], max_new_tokens: int, k: int, attention: str, progress: bool) -> dict:
    """transformers' own `generate` on the same checkpoint (greedy, and prompt lookup), beside ours."""
    try:
        import transformers
    except ImportError:
        return {"transformers": {"note": "transformers not installed"}}

    model = transformers.AutoModelForCausalLM.from_pretrained(pair.verifier_dir, dtype=pair.dtype).to(pair.device).eval()
    out = {}
    ours_tok, ours_t = 0, 0.0
    for p in prompts:
        r, t = _timed(lambda: generate_autoregressive(pair, p, max_new_tokens, attention=attention))
        ours_tok, ours_t = ours_tok + len(r.tokens), ours_t + t
    for name, extra in (("transformers_generate", {}), ("transformers_prompt_lookup", {"prompt_lookup_num_tokens": k})):
        toks, secs, same = 0, 0.0, 0
        bar = _bar(len(prompts), name, progress)
        for p in prompts:
            ids = torch.tensor([pair.encode(p)], device=pair.device)
            with torch.inference_mode():
                gen, t = _timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                       max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                                       pad_token_id=pair.tokenizer.eos_token_id, **extra))
            toks, secs = toks + gen.shape[1] - ids.shape[1], secs + t
            _tick(bar, "")
        _close(bar)
        out[name] = {"tokens_per_s": toks / secs, "ours_ar_tokens_per_s": ours_tok / ours_t,
                     "ours_over_peer": (ours_tok / ours_t) / (toks / secs), "num_prompts": len(prompts),
                     "transformers_version": transformers.__version__}
    return out


def _bar(total: int, desc: str, on: bool):
    if not on:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


def _tick(bar, note: str) -> None:
    if bar is not None:
        bar.set_postfix_str(note)
        bar.update(1)


def _close(bar) -> None:
    if bar is not None:
        bar.close()
