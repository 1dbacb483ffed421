"""The new verifier's report card, printed by the pipeline and recorded in docs/TRAINING.md.

- bits per byte on held-out packages by position (0-256, 256-1,024, 1,024-2,048);
- the greedy loop rate: continuations of held-out functions cut after their docstrings, 128 new
  tokens, judged by the workbench's loop rule (`workbench.analysis.degeneracy`), beside the
  same rule over what each file itself says next (how often real code trips it);
- a few chat answers, verbatim, through the tokenizer's chat template.

    python -m workbench.training.verifier_eval --verifier runs/verifier-v2/final --corpus data/corpus --json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from workbench.models import Verifier

CHAT_REQUESTS = (
    "Write a Python function `is_palindrome(text)` that returns True when text reads the same backwards, "
    "ignoring case and spaces.",
    "Write a Python function `chunks(items, size)` that yields successive lists of `size` items.",
    "Write the method `Stack.pop(self)` of class `Stack`: Remove and return the top item; raise IndexError "
    "when the stack is empty.",
)


@torch.no_grad()
def greedy(model: Verifier, prompt: list[int], new_tokens: int, eos: int) -> list[int]:
    """Plain greedy decoding with the latent cache: the model's own continuation of `prompt`."""
    cache = model.new_cache(len(prompt) + new_tokens + 1)
    x, out = torch.tensor([prompt]), []
    for _ in range(new_tokens):
        tok = int(model(x, cache, logits_to_keep=1).logits[0, -1].argmax())
        if tok == eos:
            break
        out.append(tok)
        x = torch.tensor([[tok]])
    return out


def held_out_prompts(corpus: Path, limit: int = 48, max_chars: int = 400) -> list[dict]:
    """Functions of the held-out packages cut after their docstrings, round-robin over packages so
    the set spans them all (deterministic for a given corpus)."""
    from workbench.training.corpus import _docstring_cuts
    from workbench.training.token_data import STDLIB

    per_package: dict[str, list[dict]] = {}
    with (corpus / "eval.jsonl").open(encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            if doc["package"] == STDLIB:
                continue
            for lineno, source in _docstring_cuts(doc["text"]):
                if len(source) < max_chars:
                    # Without the final newline: a prompt that ends in a bare newline token reads as
                    # the end of a file to a byte-level BPE that merges newlines with indentation.
                    after = doc["text"].index(source) + len(source) - 1
                    per_package.setdefault(doc["package"], []).append(
                        {"prompt": source[:-1], "source": f"{doc['package']}/{doc['path']}:{lineno}",
                         "truth": doc["text"][after:after + 4000]})  # what the file itself says next
    out: list[dict] = []
    for rank in range(max((len(v) for v in per_package.values()), default=0)):
        for name in sorted(per_package):
            if rank < len(per_package[name]) and len(out) < limit:
                out.append(per_package[name][rank * 7 % len(per_package[name])])  # spread within a package
    return out


def loop_rate(model: Verifier, tokenizer, prompts: list[dict], new_tokens: int = 128) -> dict:
    from workbench.analysis.degeneracy import detect_loop

    rows = []
    for p in prompts:
        prompt = tokenizer.encode(p["prompt"], add_bos=True)
        ids = greedy(model, prompt, new_tokens, model.config.eos_token_id)
        verdict = detect_loop(ids)
        # the same rule over the file's own next tokens: how often real code "loops" by it
        truth = detect_loop(tokenizer.encode(p["prompt"] + p["truth"], add_bos=True)[len(prompt):][:new_tokens])
        rows.append({"source": p["source"], "tokens": len(ids), "degenerate": verdict.degenerate,
                     "repeated_share": round(verdict.share, 3), "truth_degenerate": truth.degenerate,
                     "truth_repeated_share": round(truth.share, 3)})
    loops, truth = sum(r["degenerate"] for r in rows), sum(r["truth_degenerate"] for r in rows)
    return {"prompts": len(rows), "loops": loops, "rate": round(loops / max(1, len(rows)), 3),
            "truth_loops": truth, "truth_rate": round(truth / max(1, len(rows)), 3), "rows": rows}


def chat_answers(model: Verifier, tokenizer, requests=CHAT_REQUESTS, new_tokens: int = 160) -> list[dict]:
    out = []
    for r in requests:
        text = tokenizer.format_prompt([{"role": "user", "content": r}])
        ids = greedy(model, tokenizer.encode(text, add_bos=True), new_tokens, model.config.eos_token_id)
        answer = tokenizer.decode(ids)
        out.append({"request": r, "answer": answer.split("<|im_end|>")[0]})
    return out


def evaluate(verifier: Path, corpus: Path, windows: int = 64, prompts: int = 48, seq: int = 2048) -> dict:
    from tokenizers import Tokenizer as HFTokenizer

    from workbench.pair import load_verifier
    from workbench.tokenizer import Tokenizer
    from workbench.training.lm_eval import bits_per_byte, eval_windows, token_byte_lengths
    from workbench.training.token_data import TokenData

    t0 = time.time()
    model = load_verifier(verifier, dtype=torch.float32).eval()
    hf = HFTokenizer.from_file(str(Path(verifier) / "tokenizer.json"))
    tok = Tokenizer.from_dir(verifier)
    # the token cache goes beside the corpus (data, never a checkpoint folder)
    data = TokenData.build(corpus, hf, cache=Path(corpus) / "tokens", eval_only=True, log=lambda s: None)
    bpb = bits_per_byte(lambda ids: model(ids).logits, eval_windows(data, seq, windows), token_byte_lengths(hf))
    report = {"verifier": str(verifier), "windows": windows, "bits_per_byte": bpb,
              "loops": loop_rate(model, tok, held_out_prompts(corpus, prompts)),
              "chat": chat_answers(model, tok) if tok.chat_template else [],
              "seconds": round(time.time() - t0)}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    report = evaluate(Path(args.verifier), Path(args.corpus), args.windows, args.prompts)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"bits per byte: {report['bits_per_byte']}")
        lp = report["loops"]
        print(f"greedy loops at 128 tokens: {lp['loops']} of {lp['prompts']} ({lp['rate']:.0%}); the held-out "
              f"files' own next 128 tokens: {lp['truth_loops']} ({lp['truth_rate']:.0%})")
        for c in report["chat"]:
            print(f"--- {c['request']}\n{c['answer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
