"""`workbench ...`: the command line. Each subcommand is a small typed function; `--json` prints one object.

Every command takes `--verifier DIR --draft DIR` (default: the embedded tiny-kimi pair) and
`--attention torch|triton|auto`. Errors print one clear line and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
APPS = REPO / "apps"


def default_dtype(device: str) -> str:
    """bf16 on CUDA and on CPUs with native bf16 arithmetic; fp32 elsewhere (AVX2 has no bf16 FMA)."""
    if device.startswith("cuda"):
        return "bfloat16"
    from workbench.machine import machine

    return "bfloat16" if machine()["fast_bf16"] else "float32"


def _pair_args(p: argparse.ArgumentParser, dtype_default: str | None = "float32") -> None:
    p.add_argument("--verifier", help="verifier checkpoint dir (default: embedded tiny-kimi)")
    p.add_argument("--draft", help="draft checkpoint dir (default: the embedded draft)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=dtype_default, help="float32 | bfloat16 | float16")
    p.add_argument("--attention", default="auto", choices=["torch", "triton", "auto"])
    p.add_argument("--fast", default="auto", choices=["auto", "cpu", "compile", "off"],
                   help="the path the models run on: the CPU kernels (auto, where they run), torch.compile'd "
                        "per-token graphs (minutes to start on a small CPU), or plain PyTorch")
    p.add_argument("--compile", action="store_true", help="the same as --fast compile")
    p.add_argument("--weights", default="native", choices=["native", "int8", "int8-b32", "bf16"],
                   help="how the CPU kernels hold the linears' weights: in --dtype (native), or in int8 with a "
                        "scale per output channel (int8) or per output channel and 32 inputs (int8-b32), "
                        "activations staying in --dtype, or in bf16 under fp32 activations (bf16, with --dtype "
                        "float32; with bfloat16 it is native); these need the CPU kernels")


def _fused_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fused", default="auto", choices=["auto", "on", "off"],
                   help="verify, accept and draft the next proposals in one call per step (greedy EAGLE "
                        "on a compiled pair; auto: wherever that applies)")


_FUSED = {"auto": None, "on": True, "off": False}


def _load(args):
    import workbench as wb

    dtype = args.dtype or default_dtype(args.device)
    fast = "compile" if args.compile else args.fast
    return wb.load_pair(verifier=args.verifier, draft=args.draft, device=args.device, dtype=dtype, fast=fast,
                        attention=args.attention, weights=args.weights)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    _acceptance_args(p)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--allowed-token-ids", default=None, help="comma-separated ids: only these may be sampled")
    p.add_argument("--banned-token-ids", default=None, help="comma-separated ids that may never be sampled")
    p.add_argument("--bad-words", action="append", default=[], help="a string never to emit (repeatable)")


def _acceptance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--acceptor", default=None, choices=["greedy", "rejection", "block"],
                   help="the acceptance rule (default: greedy at temperature 0, rejection sampling above)")
    p.add_argument("--draft-sampling", default="greedy", choices=["greedy", "sample"],
                   help="draft proposals as argmaxes (vLLM's default; one-hot q) or sampled with their real q")


def _constraints(args) -> dict:
    """vLLM's penalties and token constraints from the flags (SamplingParams checks their ranges)."""
    ids = {f: _numbers(f"--{f.replace('_', '-')}", getattr(args, f), int) if getattr(args, f) else None
           for f in ("allowed_token_ids", "banned_token_ids")}
    return {"repetition_penalty": args.repetition_penalty, "frequency_penalty": args.frequency_penalty,
            "presence_penalty": args.presence_penalty, "allowed_token_ids": ids["allowed_token_ids"],
            "banned_token_ids": ids["banned_token_ids"] or (), "bad_words": tuple(args.bad_words)}


def cmd_generate(args) -> int:
    import workbench as wb

    constraints = _constraints(args)
    pair = _load(args)
    prompt = args.prompt
    if args.chat:  # one user turn through the checkpoint's chat template (plain completion otherwise)
        if pair.tokenizer.chat_template is None:
            raise ValueError(f"{pair.verifier_dir}: --chat needs a chat template (tokenizer_config.json field "
                             "'chat_template'); this checkpoint continues text only, so drop --chat")
        prompt = pair.tokenizer.format_prompt([{"role": "user", "content": args.prompt}])
    if args.no_draft:
        res = wb.generate_autoregressive(pair, prompt, args.max_new_tokens, args.temperature, args.top_p,
                                         args.top_k, args.seed, stop=args.stop, attention=args.attention,
                                         heal=args.heal, **constraints)
    else:
        dec = wb.SpecDecoder(pair, args.k, args.temperature, args.top_p, args.top_k, args.seed,
                             proposer=args.proposer, attention=args.attention, fused=_FUSED[args.fused],
                             acceptor=args.acceptor, draft_sampling=args.draft_sampling, **constraints)
        res = dec.generate(prompt, args.max_new_tokens, stop=args.stop, heal=args.heal)
    from workbench.analysis.degeneracy import detect_loop

    loop = detect_loop(res.tokens)  # a looping answer's accept length says little about the draft
    if args.json:
        print(json.dumps({**res.to_dict(), "loop": loop.to_dict(),
                          "accept_length_clean": None if loop.degenerate else res.stats.accept_length}))
    else:
        print(res.text if args.chat else args.prompt + res.text)
        s = res.stats
        clean = (f"clean n/a: it loops from token {loop.loop_start}, {loop.share:.0%} of its 6-grams repeat"
                 if loop.degenerate else f"clean {s.accept_length:.2f}, no loop")
        print(f"\n[{len(res.tokens)} tokens, accept length {s.accept_length:.2f} ({clean}), "
              f"{s.tokens_per_s:.1f} tok/s, finish: {res.finish_reason}, acceptance: {res.acceptance_rule}]",
              file=sys.stderr)
    return 0


PROMPT_EXAMPLE = '{"prompt": "def f(x):"}'


def parse_prompts(text: str, name: str) -> list[str]:
    """The prompts of JSONL text, {"prompt": ...} per line (an upload's, say); errors name `name` and the line."""
    from workbench.jsonl import parse_records

    return [r["prompt"] for r in parse_records(text, name, "prompt", PROMPT_EXAMPLE, "prompts")]


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    from workbench.jsonl import read_records

    prompts = [r["prompt"] for r in read_records(path, "prompt", PROMPT_EXAMPLE, "prompts")]
    return prompts[:limit] if limit else prompts


def cmd_bench(args) -> int:
    from workbench.analysis.bench import run_bench

    if args.threads is not None:  # before anything compiles: inductor's C++ keeps the count it was generated with
        import torch

        if args.threads < 1:
            raise ValueError(f"--threads = {args.threads}; expected an integer >= 1 (torch's intra-op threads)")
        torch.set_num_threads(args.threads)
    pair = _load(args)
    prompts = read_prompts(args.prompts, args.limit)
    report = run_bench(pair, prompts, k=args.k, max_new_tokens=args.max_new_tokens, attention=args.attention,
                       peers=not args.no_peers and args.peer == "transformers", peer_prompts=args.peer_prompts,
                       repeats=args.repeats, fused=_FUSED[args.fused], components=args.components, heal=args.heal,
                       agreement={"auto": None, "on": True, "off": False}[args.agreement])
    report["prompts_file"] = str(args.prompts)
    text = None if args.json else _bench_text(report)
    if args.peer == "llama.cpp":
        from workbench.integrations.llama_cpp_bench import llama_cpp_bench, llama_cpp_text

        peer = llama_cpp_bench(pair, prompts, args.max_new_tokens, args.k, rounds=args.peer_rounds,
                               attention=args.attention)
        report.setdefault("peers", {})["llama.cpp"] = peer
        text = None if args.json else f"{text}\n{llama_cpp_text(peer)}"
    print(json.dumps(report) if args.json else text)
    return 0


def _bench_text(r: dict) -> str:
    m = r["machine"]
    lines = [_loops_line(r), *(f"! {w}" for w in r["warnings"]),
             f"k={r['k']} dtype={r['dtype']} weights={r['weights']} prompts={r['num_prompts']} max_new_tokens={r['max_new_tokens']} "
             f"threads={r['threads']} compiled={r['compiled']} fused={r['fused']} (warm-up {r['warmup_s']:.1f} s, untimed"
             + (", graphs: {hits} from inductor's cache, {misses} compiled, {bypasses} not cacheable".format(**r["graph_cache"])
                if r["compiled"] else "") + ")",
             f"on {m['cpu'] or 'an unknown CPU'} ({m['cores']} cores, {m['torch_cpu_capability']}, "
             f"fast bf16: {m['fast_bf16']}), torch {m['torch']}; models: {r['fast_path']}",
             f"accept length {r['accept_length']:.3f} pooled, {_opt(r['accept_length_per_request'])} per request; "
             "by decode position " + ", ".join(f"{b} {_opt(v['accept_length'])}"
                                               for b, v in r["accept_length_by_position"].items()),
             f"per-position acceptance {[round(x, 3) for x in r['per_position_acceptance']]} (falls with k by "
             "arithmetic alone: never rank k by it)",
             f"speculative {r['spec_tokens_per_s']:.1f} tok/s  autoregressive {r['ar_tokens_per_s']:.1f} tok/s  "
             f"speedup {r['speedup']:.2f}x (median per prompt {r['speedup_median']:.2f}x)",
             f"lossless {r['lossless']}  ties {len(r['ties'])}"]
    if a := r.get("agreement_with_fp32"):
        from workbench.analysis.bench import agreement_text

        lines.append(agreement_text(a))
    c = r.get("step_cost") or {}
    if c.get("decodes_per_step") is not None:
        lines.append(f"a step costs {c['decodes_per_step']:.2f} decodes ({c['spec_step_ms']:.2f} ms against "
                     f"{c['ar_decode_ms']:.2f} ms) and yields {c['tokens_per_step']:.2f} tokens: "
                     f"{c['decode_speedup']:.2f}x with the prefills left out, at most "
                     f"{c['speedup_if_all_accepted']:.2f}x were every proposal accepted")
    if p := r.get("components"):
        lines.append(f"alone at position {p['position']} (medians of {p['repeats']}): a decode {p['decode_ms']:.2f} ms, "
                     f"a verify of {r['k'] + 1} {p['verify_ms']:.2f} ms ({p['verify_decodes']:.2f} decodes), drafting "
                     f"{p['draft_ms']:.2f} ms ({p['draft_decodes']:.2f}), a step {p['step_ms']:.2f} ms "
                     f"({p['step_decodes']:.2f}): at most {p['speedup_if_all_accepted']:.2f}x; "
                     f"its own verify and drafting {p['verify_then_draft_ms']:.2f} ms "
                     f"({p['verify_then_draft_decodes']:.2f}), the rest host work")
    for name, peer in r.get("peers", {}).items():
        lines.append(f"peer {name}: {peer.get('tokens_per_s', float('nan')):.1f} tok/s; ours/peer "
                     f"{peer.get('ours_over_peer', float('nan')):.2f}x {peer.get('note', '')}")
    return "\n".join(lines)


def _opt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _loops_line(r: dict) -> str:
    """The bench's first line: how many continuations loop, and the accept length without them."""
    return (f"{r['degenerate_prompts']} of {r['num_prompts']} continuations loop (>= 30% of their 6-grams repeat); "
            f"accept length over the clean ones {_opt(r['accept_length_clean'])} (pooled over all: "
            f"{r['accept_length']:.3f})")


def cmd_sweep(args) -> int:
    if args.batch_sizes:
        return _batch_sweep(args)
    from workbench.analysis.sweep import run_sweep

    ks = _numbers("--ks", args.ks, int)
    temps = _numbers("--temperatures", args.temperatures, float)
    rates = _numbers("--synthetic-rates", args.synthetic_rates, float) if args.synthetic_rates else None
    prompts = read_prompts(args.prompts, args.limit)
    pair = _load(args)
    res = run_sweep(pair, prompts, ks=ks, temperatures=temps, max_new_tokens=args.max_new_tokens,
                    attention=args.attention, seed=args.seed, repeats=args.repeats, synthetic_rates=rates,
                    k_max=args.k_max, draft_name=args.draft_name, warmup=not args.no_warmup,
                    acceptor=args.acceptor, draft_sampling=args.draft_sampling)
    print(json.dumps(res.to_dict()) if args.json else res.summary())
    return 0


def _batch_sweep(args) -> int:
    """`sweep --batch-sizes`: every k (0 = the batched baseline) at every batch size (`analysis.batching`)."""
    from workbench.analysis.batching import run_batch_sweep

    sizes = _numbers("--batch-sizes", args.batch_sizes, int)
    ks = _numbers("--ks", args.ks, int)
    prompts = read_prompts(args.prompts, args.limit)
    if args.temperatures != "0" or args.synthetic_rates or args.acceptor:
        raise ValueError("--batch-sizes measures greedy decoding with the draft; expected no --temperatures, "
                         "--synthetic-rates or --acceptor with it")
    res = run_batch_sweep(_load(args), prompts, sizes, ks, args.max_new_tokens, args.repeats,
                          warmup=not args.no_warmup)
    print(json.dumps(res.to_dict()) if args.json else res.summary())
    return 0


def cmd_adaptive(args) -> int:
    """Adaptive k against every static k on the same prompts, the goodput rule's step costs measured
    first on other prompts (`--cost-prompts`) at the same batch size."""
    from workbench.analysis.batching import compare_policies, default_policies, run_batch_sweep
    from workbench.decoding.adaptive import ConfidenceStop

    ks = _numbers("--ks", args.ks, int)
    pair = _load(args)
    calibration = read_prompts(args.cost_prompts)
    calibration = (calibration * args.batch_size)[:max(args.batch_size, len(calibration))]  # a full batch at least
    costs = run_batch_sweep(pair, calibration, [args.batch_size], ks, args.max_new_tokens, repeats=2,
                            gpu=False).step_costs()
    policies = default_policies(costs, max(ks))
    if args.confidence is not None:
        policies = {**{f"confidence {t:g}": ConfidenceStop(t) for t in _numbers("--confidence", args.confidence, float)},
                    "goodput EMA": policies["goodput EMA"]}
    out = compare_policies(pair, read_prompts(args.prompts, args.limit), policies, ks, args.batch_size,
                           args.max_new_tokens, args.repeats)
    rows = {n: {"tokens_per_s": r.tokens_per_s.to_dict(), "speedup": r.speedup.to_dict(),
                "vs_best_static": r.vs_best_static.to_dict() if r.vs_best_static else None,
                "accept_length": r.accept_length, "accept_length_clean": r.accept_length_clean,
                "degenerate": r.degenerate, "mean_k": r.mean_k, "matches_baseline": r.matches_baseline}
            for n, r in out["results"].items()}
    report = {k: v for k, v in out.items() if k not in ("results", "measurements")}
    report.update(results=rows, costs={f"{b},{k}": c for (b, k), c in costs.points.items()})
    if args.json:
        print(json.dumps(report))
    else:
        print(f"adaptive k: {out['num_prompts']} prompts x {out['repeats']} repeats, batch size {out['batch_size']}, "
              f"best static {out['best_static']}; decode tok/s, speedup over plain decoding, minus the best static's")
        for n, r in out["results"].items():
            diff = f"{r.vs_best_static.pooled:+.3f} [{r.vs_best_static.lo:+.3f}, {r.vs_best_static.hi:+.3f}]" \
                if r.vs_best_static else ""
            print(f"{n:>16} {r.tokens_per_s.median:8.0f} tok/s  {r.speedup.pooled:6.3f}x  accept {r.accept_length:5.3f}"
                  f" (clean {_opt(r.accept_length_clean)}, {r.degenerate}/{out['num_prompts']} loop)"
                  f"  mean k {r.mean_k:4.2f}  {diff}  identical {r.matches_baseline}/{out['num_prompts']}")
    return 0


def _numbers(flag: str, text: str, kind: type) -> list:
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} = {text!r}; expected comma-separated {kind.__name__}s, e.g. 1,2,3") from None


def cmd_pd(args) -> int:
    from workbench.analysis.context import load_documents
    from workbench.analysis.pd import document_cuts, pd_study

    prompts = read_prompts(args.prompts, args.limit)
    pair = _load(args)
    if pair.draft is None:
        raise ValueError("workbench pd: the pair has no draft; expected --draft DIR (or the embedded pair)")
    pairs = {pair.draft.attention_kind: pair}
    if args.mha_draft:
        pairs["mha"] = pair.with_draft(args.mha_draft)
    sets = {"short": prompts}
    longs = _numbers("--long-tokens", args.long_tokens, int) if args.long_tokens else []
    docs = [d["text"] for d in load_documents(args.documents)] if longs else []
    for n in longs:
        if not 1 < n < pair.context_length - args.max_new_tokens:
            raise ValueError(f"--long-tokens = {n}; expected 2..{pair.context_length - args.max_new_tokens - 1}"
                             f" (the context is {pair.context_length} tokens, {args.max_new_tokens} of them to generate)")
        sets[f"long-{n}"] = document_cuts(pair, docs, n, args.long_count)
    report = pd_study(pairs, sets, k=args.k, max_new_tokens=args.max_new_tokens)
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0


def cmd_context(args) -> int:
    from workbench.analysis.context import context_compare, load_documents

    docs = load_documents(args.documents)[: args.limit or None]
    others = {}
    for spec in args.vs_draft or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or name == "draft":
            raise SystemExit(f"--vs-draft {spec!r}: expected NAME=DIR (a name other than 'draft')")
        others[name] = path
    pair = _load(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    pairs = {"draft": pair, **{name: pair.with_draft(path) for name, path in others.items()}}
    reports = context_compare(pairs, [d["text"] for d in docs], lengths=_numbers("--lengths", args.lengths, int),
                              k=args.k, temperatures=_numbers("--temperatures", args.temperatures, float),
                              new_tokens=args.new_tokens, seed=args.seed,
                              progress=None if args.json else lambda line: print(line, file=sys.stderr))
    if not others:
        out = reports["draft"].to_dict() | {"pair": pair.status()}
        print(json.dumps(out) if args.json else reports["draft"].summary())
        return 0
    if args.json:
        print(json.dumps({"drafts": {n: r.to_dict() | {"path": pairs[n].status()} for n, r in reports.items()}}))
    else:
        print("\n\n".join(f"== {n} ({pairs[n].draft_dir or 'draft'})\n{r.summary()}" for n, r in reports.items()))
    return 0


def cmd_doctor(args) -> int:
    from workbench.analysis.doctor import diagnose

    pair = _load(args)
    prompts = read_prompts(args.prompts, args.limit)
    report = diagnose(pair, prompts, k=args.k, max_new_tokens=args.max_new_tokens)
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0 if report.ok else 1


def cmd_chat(args) -> int:
    sys.path.insert(0, str(APPS))
    import chat  # apps/chat.py

    return chat.main(sys.argv[2:])


def cmd_build_corpus(args) -> int:
    from workbench.training import corpus_build

    argv = ["--out", args.out, *(["--packages", args.packages] if args.packages else []),
            *(["--cache", args.cache] if args.cache else []),
            *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
            *(["--no-chat"] if args.no_chat else []), *(["--count-only"] if args.count_only else [])]
    return corpus_build.main(argv)


def cmd_dashboard(args) -> int:
    cmd = [sys.executable, "-m", "streamlit", "run", str(APPS / "dashboard.py"), "--server.port", str(args.port),
           "--server.address", args.host, "--server.headless", "true", "--browser.gatherUsageStats", "false"]
    extra = [a for a in ("--verifier", args.verifier, "--draft", args.draft) if a] if args.verifier else []
    return subprocess.call(cmd + (["--", *extra] if extra else []))


def cmd_export_vllm(args) -> int:
    from workbench.integrations.vllm import export_draft

    import workbench as wb

    pair = wb.load_pair(verifier=args.verifier, draft=args.draft, dtype="float32")
    out = export_draft(pair, args.out, dtype=args.export_dtype, rope_from="draft" if args.draft_rope else "verifier")
    print(json.dumps({"out": str(out)}) if args.json else f"wrote {out}")
    return 0


def cmd_export_gguf(args) -> int:
    from workbench.integrations.llama_cpp import export_gguf, read_gguf
    from workbench.pair import EMBEDDED

    out = export_gguf(args.verifier or EMBEDDED / "verifier", args.out, args.dtype)
    meta, tensors = read_gguf(out)  # read back: what llama.cpp will load
    summary = {"out": str(out), "bytes": out.stat().st_size, "tensors": len(tensors), "dtype": args.dtype,
               "architecture": meta["general.architecture"]}
    print(json.dumps(summary) if args.json else
          f"wrote {out}: {summary['architecture']}, {summary['tensors']} tensors, {summary['bytes'] / 2**20:.1f} MiB "
          f"({args.dtype})")
    return 0


def cmd_vllm_command(args) -> int:
    from workbench.integrations.vllm import serve_command

    print(serve_command(args.verifier_name, args.draft_name, k=args.k, tp=args.tp, schedule=args.schedule))
    return 0


def cmd_sglang_command(args) -> int:
    from workbench.integrations.sglang import serve_command

    print(serve_command(args.verifier_name, args.draft_name, k=args.k, tp=args.tp, port=args.port,
                        metrics=not args.no_metrics))
    return 0


def cmd_bench_kernels(args) -> int:
    from workbench.kernels.bench_cli import main as bench_main

    return bench_main(sys.argv[2:])  # its own parser: the bench, --aot and --gpu-report options


def cmd_pretrain(args) -> int:
    from workbench.training.pretrain import PretrainArgs, pretrain

    report = pretrain(PretrainArgs(
        out=Path(args.out), corpus=Path(args.corpus), tokenizer=Path(args.tokenizer),
        init=Path(args.init) if args.init else None, resume=args.resume, max_minutes=args.max_minutes,
        batch=args.batch, seq=args.seq, lr=args.lr, warmup=args.warmup, seed=args.seed,
        eval_every=args.eval_every, eval_windows=args.eval_windows, bf16=not args.fp32, compiled=args.compile, threads=args.threads,
        procs=args.procs, schedule_steps=args.schedule_steps))
    print(json.dumps({k: v for k, v in report.items() if k not in ("history", "segments")}))
    return 0


def cmd_train_draft(args) -> int:
    from workbench.training.eagle3 import main as train_main

    return train_main(sys.argv[2:])


def build_parser() -> argparse.ArgumentParser:
    # long: one add_argument per flag, every subcommand's flags read top to bottom
    ap = argparse.ArgumentParser(prog="workbench", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("generate", help="speculative generation, with per-step events in --json")
    _pair_args(p)
    _sampling_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user turn through the checkpoint's chat template")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--heal", action="store_true",
                   help="token healing: back off the prompt's last token and let the first one extend it "
                        "(for prompts that end in a newline, indentation or a space)")
    p.add_argument("--proposer", default="eagle", choices=["eagle", "ngram"])
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
    _fused_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("bench", help="speculative vs autoregressive on a prompt set, same run")
    _pair_args(p, dtype_default=None)
    p.add_argument("--prompts", default=str(REPO / "assets/prompts/code.jsonl"))
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method (median kept)")
    p.add_argument("--no-peers", action="store_true", help="skip transformers' generate")
    p.add_argument("--peer-prompts", type=int, default=8, help="prompts timed with transformers (slow)")
    p.add_argument("--peer", choices=("transformers", "llama.cpp"), default="transformers",
                   help="llama.cpp: its plain decoding of the verifier as GGUF, on every prompt, beside ours "
                        "(needs the llama extra)")
    p.add_argument("--peer-rounds", type=int, default=3, help="interleaved rounds of the llama.cpp comparison")
    p.add_argument("--components", type=int, default=0, metavar="N",
                   help="also time a step's parts alone (decode, verify, drafting, the step, verify then "
                        "drafting back to back), N calls each")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch's intra-op threads for both methods, which the CPU kernels follow "
                        "(default: torch's own choice)")
    p.add_argument("--heal", action="store_true",
                   help="heal each prompt's last token in both methods (as the chat does), for prompts that end "
                        "mid-token or in whitespace")
    p.add_argument("--agreement", default="auto", choices=["auto", "on", "off"],
                   help="also decode each prompt with the fp32 pair (native weights, untimed) and report how far "
                        "the greedy continuations agree (auto: with int8 or bf16 --weights)")
    _fused_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("sweep", help="measured sweep over k (and temperatures)")
    _pair_args(p, dtype_default=None)
    p.add_argument("--prompts", default=str(REPO / "assets/prompts/code.jsonl"))
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--ks", default="1,2,3,4,5,6")
    p.add_argument("--temperatures", default="0")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts (after a warm-up)")
    p.add_argument("--no-warmup", action="store_true", help="time every arm's first, cold generation too")
    _acceptance_args(p)
    p.add_argument("--synthetic-rates", default=None,
                   help="accept with these unconditional per-position rates instead of the draft's (timing "
                        "only, not lossless), e.g. 0.9,0.8,0.7")
    p.add_argument("--k-max", type=int, default=None, help="how far the step-cost model extrapolates")
    p.add_argument("--draft-name", default=None, help="the draft's name in the printed speculative_config")
    p.add_argument("--batch-sizes", default=None,
                   help="e.g. 1,2,4,8,16: measure every k at each batch size through the batched engine (the "
                        "baseline batched alike), the crossover and vLLM's num_speculative_tokens_per_batch_size")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("adaptive", help="adaptive k (confidence stop, goodput EMA) against every static k")
    _pair_args(p, dtype_default=None)
    p.add_argument("--prompts", default=str(REPO / "assets/prompts/code.jsonl"))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--cost-prompts", default=str(REPO / "assets/prompts/smoke.jsonl"),
                   help="prompts on which the goodput rule's step costs are measured first")
    p.add_argument("--ks", default="1,2,3,4,5,6", help="the static ks; the adaptive rules draft up to the largest")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--confidence", default=None,
                   help="the confidence rule's thresholds, comma-separated (default 0.5)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_adaptive)

    p = sub.add_parser("pd", help="prefill/decode disaggregation: acceptance and bytes per hand-over mode")
    _pair_args(p, dtype_default=None)
    p.add_argument("--prompts", default=str(REPO / "assets/prompts/code.jsonl"))
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--mha-draft", default=str(REPO / "assets/tiny-kimi/draft-mha"),
                   help="an MHA draft of the same verifier to compare ('' for none)")
    p.add_argument("--long-tokens", default="",
                   help="also prompts of these many tokens, comma-separated (e.g. 512,1024,1920), cut from --documents")
    p.add_argument("--long-count", type=int, default=4, help="long prompts per length")
    p.add_argument("--documents", default=str(REPO / "assets/documents/long.jsonl"),
                   help="JSONL of long documents ({\"text\": ...}) the long prompts are cut from")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_pd)

    p = sub.add_parser("context", help="accept length, step time and speedup by context length (long prompts)")
    _pair_args(p, dtype_default=None)
    p.add_argument("--documents", default=str(REPO / "assets/documents/long.jsonl"),
                   help="JSONL of long documents ({\"text\": ...}), each cut at every --lengths")
    p.add_argument("--limit", type=int, default=0, help="first N documents only (0: all)")
    p.add_argument("--lengths", default="192,448,960,1920", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--vs-draft", action="append", metavar="NAME=DIR",
                   help="another draft of the verifier, measured side by side with --draft (repeatable)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch's (and the CPU kernels') threads (0: torch's choice)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_context)

    p = sub.add_parser("doctor", help="probe a draft/verifier pairing for silent misconfiguration")
    _pair_args(p)
    p.add_argument("--prompts", default=str(REPO / "assets/prompts/code.jsonl"))
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_doctor)

    p = sub.add_parser("chat", help="the Gradio chat (flags: see apps/chat.py --help)", add_help=False)
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("build-corpus", help="the chat verifier's PyPI + stdlib corpus, chat pairs, token counts")
    p.add_argument("--out", default="data/corpus", help="output folder (git ignores data/)")
    p.add_argument("--packages", default=None, help="default: workbench/training/corpus_packages.txt")
    p.add_argument("--cache", default=None, help="downloaded wheels/sdists (default OUT/wheels)")
    p.add_argument("--tokenizer", default=None, help="count tokens with it (trained there first if absent)")
    p.add_argument("--no-chat", action="store_true")
    p.add_argument("--count-only", action="store_true")
    p.set_defaults(fn=cmd_build_corpus)

    p = sub.add_parser("dashboard", help="the Streamlit dashboard")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--verifier")
    p.add_argument("--draft")
    p.set_defaults(fn=cmd_dashboard)

    p = sub.add_parser("export-gguf", help="write the verifier as GGUF for llama.cpp's deepseek2 (a bench peer)")
    p.add_argument("out")
    p.add_argument("--verifier", help="a verifier directory (default: the embedded one)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f32", "q8_0"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_export_gguf)

    p = sub.add_parser("export-vllm", help="write the draft as vLLM's and SGLang's Eagle3DeepseekV2ForCausalLM load it")
    p.add_argument("out")
    p.add_argument("--verifier")
    p.add_argument("--draft")
    p.add_argument("--export-dtype", default="bfloat16")
    p.add_argument("--draft-rope", action="store_true",
                   help="keep the draft's rope_theta, rope_scaling and max_position_embeddings (default: the verifier's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_export_vllm)

    p = sub.add_parser("vllm-command", help="the `vllm serve` command for a pair")
    p.add_argument("--verifier-name", default="moonshotai/Kimi-K2.7-Code")
    p.add_argument("--draft-name", default="k-l-lambda/kimi-k2.7-code-eagle3-mla")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--schedule", default=None,
                   help='k by batch size, vLLM\'s num_speculative_tokens_per_batch_size: {"1-16": 3, "17-64": 1} '
                        "or [[1, 16, 3], [17, 64, 1]] (as `sweep --batch-sizes` prints it)")
    p.set_defaults(fn=cmd_vllm_command)

    p = sub.add_parser("sglang-command", help="the `python -m sglang.launch_server` command for a pair")
    p.add_argument("--verifier-name", default="moonshotai/Kimi-K2.7-Code")
    p.add_argument("--draft-name", default="k-l-lambda/kimi-k2.7-code-eagle3-mla")
    p.add_argument("--k", type=int, default=3, help="--speculative-num-steps (chain: topk 1, k + 1 draft tokens)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--no-metrics", action="store_true", help="leave out --enable-metrics (the live view reads it)")
    p.set_defaults(fn=cmd_sglang_command)

    p = sub.add_parser("bench-kernels", add_help=False,
                       help="Triton MLA kernel GB/s and TFLOP/s (CUDA); --aot: compiled for sm_80/90/100 "
                            "(no GPU); --gpu-report OUT.json: parity tests + bench in one JSON")
    p.set_defaults(fn=cmd_bench_kernels)

    p = sub.add_parser("pretrain-verifier", help="pretrain the tiny-kimi verifier on a built Python corpus")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, final/ (bf16) and pretrain_log.json")
    p.add_argument("--corpus", required=True, help="a built corpus (workbench build-corpus)")
    p.add_argument("--tokenizer", default=str(REPO / "assets/corpus/tokenizer"), help="folder with tokenizer.json (default: the corpus tokenizer, Kimi chat tokens)")
    p.add_argument("--init", help="warm restart from these weights, with a fresh schedule")
    p.add_argument("--resume", action="store_true", help="continue --out's checkpoint where it stopped")
    p.add_argument("--max-minutes", type=float, default=30)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--schedule-steps", type=int,
                   help="one cosine over this many steps that outlives the sitting (continue it with --resume); "
                        "default: sized to --max-minutes")
    p.add_argument("--procs", type=int, default=1,
                   help="data-parallel processes, each with --threads threads and --batch windows a step")
    p.add_argument("--fp32", action="store_true", help="fp32 matmuls (default: bf16 with fp32 statistics)")
    p.add_argument("--compile", action="store_true",
                   help="the norms as a torch.compile graph (seconds to compile at the start)")
    p.set_defaults(fn=cmd_pretrain)

    p = sub.add_parser("train-draft", help="online EAGLE-3 training with training-time test", add_help=False)
    p.set_defaults(fn=cmd_train_draft)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    if argv and argv[0] in ("chat", "train-draft", "bench-kernels"):  # they parse their own argv
        args = argparse.Namespace(cmd=argv[0], fn={"chat": cmd_chat, "train-draft": cmd_train_draft,
                                                   "bench-kernels": cmd_bench_kernels}[argv[0]])
        sys.argv = ["workbench", *argv]
    else:
        args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, RuntimeError, FileNotFoundError, OSError) as e:
        if os.environ.get("WORKBENCH_DEBUG"):
            raise
        print(f"workbench {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
