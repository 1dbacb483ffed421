"""llama.cpp beside us on the same verifier, the same token ids and the same thread count.

For each prompt, three arms run interleaved, the first arm rotating each round: our plain decoding,
our speculative decoding (k proposals a step) and llama.cpp's plain decoding of the same verifier
written as GGUF (`workbench.integrations.llama_cpp`) at the pair's precision (bf16 or f32), and
again with Q8_0 weights. Each request is timed end to end (prefill and decode); the figures are
medians over requests with their min and max. Before any timing, llama.cpp's greedy tokens are
compared with ours prompt by prompt: a peer that decodes something else is not a peer.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from workbench.analysis.bench import first_difference
from workbench.decoding.engine import SpecDecoder, generate_autoregressive

GGUF_OF = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


_first_difference = first_difference  # the bench's rule: where two greedy continuations part


def llama_cpp_bench(pair, prompts: list[str], max_new_tokens: int = 128, k: int = 3, rounds: int = 3,
                    attention: str = "auto", q8: bool = True, workdir: str | Path | None = None) -> dict:
    """Tokens/s per request of the three arms (module docstring) and llama.cpp's agreement with our greedy output."""
    from workbench.integrations.llama_cpp import LlamaCppPeer, export_gguf

    if pair.dtype not in GGUF_OF:
        raise ValueError(f"dtype {pair.dtype}: the llama.cpp peer runs bf16 or float32 pairs")
    threads = torch.get_num_threads()
    eos = set(pair.eos_token_ids)
    ids = [pair.encode(p) for p in prompts]
    context = max(len(i) for i in ids) + max_new_tokens + 1
    dec = SpecDecoder(pair, num_speculative_tokens=k, attention=attention)
    ours = {"plain": lambda i: generate_autoregressive(pair, i, max_new_tokens, attention=attention),
            f"speculative k={k}": lambda i: dec.generate(i, max_new_tokens)}
    report = {"threads": threads, "dtype": str(pair.dtype).removeprefix("torch."), "rounds": rounds,
              "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "gguf": {}}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        kinds = [GGUF_OF[pair.dtype]] + (["q8_0"] if q8 else [])
        # Q8_0 runs without llama.cpp's repacked buffers: on an AMX CPU they abort its MLA graph (LlamaCppPeer)
        peers = {kind: LlamaCppPeer(export_gguf(pair.verifier_dir, Path(tmp) / f"v-{kind}.gguf", kind), threads, context,
                                    extra_buffers=kind != "q8_0") for kind in kinds}
        reference = [ours["plain"](i).tokens for i in ids]
        for kind, peer in peers.items():
            runs = [peer.greedy(i, max_new_tokens, eos).tokens for i in ids]
            diffs = [_first_difference(r, t) for r, t in zip(reference, runs)]
            report["gguf"][kind] = {"same_tokens": sum(d is None for d in diffs), "first_difference": diffs,
                                    "extra_buffers": peer.extra_buffers}
        arms = {**{f"ours {n}": f for n, f in ours.items()},
                **{f"llama.cpp {kind} plain": (lambda i, p=p: p.greedy(i, max_new_tokens, eos)) for kind, p in peers.items()}}
        rates: dict[str, list[float]] = {a: [] for a in arms}
        names = list(arms)
        for r in range(rounds):
            for j, i in enumerate(ids):
                shift = (r + j) % len(names)
                for name in names[shift:] + names[:shift]:  # each arm first equally often
                    t = time.perf_counter()
                    res = arms[name](i)
                    n = len(res.tokens)
                    rates[name].append(n / (time.perf_counter() - t))
    report["tokens_per_s"] = {a: _spread(v) for a, v in rates.items()}
    base = statistics.median(rates[f"llama.cpp {GGUF_OF[pair.dtype]} plain"])
    report["over_llama_cpp_same_precision"] = {a: statistics.median(v) / base for a, v in rates.items()}
    return report


def llama_cpp_text(r: dict) -> str:
    lines = [f"llama.cpp peer: {r['num_prompts']} prompts x {r['rounds']} rounds, {r['max_new_tokens']} new tokens, "
             f"{r['threads']} threads, ours in {r['dtype']}; tokens/s per request, end to end (median [min, max])"]
    for kind, g in r["gguf"].items():
        lines.append(f"  llama.cpp {kind}: greedy tokens equal ours on {g['same_tokens']} of {r['num_prompts']} prompts")
    for a, s in r["tokens_per_s"].items():
        lines.append(f"  {a:28s} {s['median']:8.1f}  [{s['min']:.1f}, {s['max']:.1f}]  "
                     f"{r['over_llama_cpp_same_precision'][a]:.2f}x llama.cpp at our precision")
    return "\n".join(lines)
