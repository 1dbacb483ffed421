"""A draft's training text: the verifier's regenerated continuations that read like code, and the corpus.

A greedy continuation of this verifier usually loops; a draft trained on loops learns to copy, which
is easy and is not what `workbench context` scores (its clean continuations). So by default a
regenerated record whose continuation loops (`degeneracy`'s rule) keeps only its prompt, which is
corpus text, and the rest keep prompt and continuation; `--loops keep` keeps the loops too, since a
looping verifier is what `workbench bench` and the chat serve. Whole corpus documents and chat conversations, drawn with the seed,
add real code at every position of the training window.

    python -m workbench.training.draft_data --regen runs/regen.jsonl,runs/regen2.jsonl \
        --corpus data/corpus --docs 500 --chats 400 --out runs/draft_data.jsonl
"""
from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

from workbench.analysis.degeneracy import is_degenerate


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i}: expected a JSON object per line")
            rows.append(row)
    return rows


def clean_records(records: list[dict], counts: Counter | None = None, source: str = "records",
                  keep_loops: bool = False) -> list[dict]:
    """Regenerated records ({"ids", "prompt_tokens", "kind", "temperature"}) -> {"ids"} rows: a looping
    continuation is cut off at its prompt unless `keep_loops`. `source` names them in errors (their file)."""
    out = []
    for i, r in enumerate(records, 1):
        if not isinstance(r.get("ids"), list) or not isinstance(r.get("prompt_tokens"), int):
            raise ValueError(f"{source}: record {i}: fields 'ids' (list) and 'prompt_tokens' (int) expected, as "
                             "`regenerate --corpus` writes them")
        loops = is_degenerate(r["ids"][r["prompt_tokens"]:])
        if counts is not None:
            label = ("loop kept" if keep_loops else "prompt only") if loops else "kept"
            counts[f"{r.get('kind', '?')} T={r.get('temperature', '?')} {label}"] += 1
        out.append({"ids": r["ids"][:r["prompt_tokens"]] if loops and not keep_loops else r["ids"]})
    return out


def corpus_sample(corpus: str | Path, docs: int, chats: int, seed: int = 0) -> list[dict]:
    """`docs` documents of train.jsonl and `chats` conversations of chat_train.jsonl, as {"text"} rows."""
    corpus = Path(corpus)
    rng = random.Random(seed)
    rows = []
    for name, n in (("train.jsonl", docs), ("chat_train.jsonl", chats)):
        if n <= 0:
            continue
        path = corpus / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; expected a corpus built by `workbench build-corpus`")
        lines = path.read_text(encoding="utf-8").splitlines()
        rows += [{"text": json.loads(lines[j])["text"]} for j in sorted(rng.sample(range(len(lines)), min(n, len(lines))))]
    return rows


def draft_data(regen: list[str | Path], corpus: str | Path | None, docs: int, chats: int, seed: int = 0,
               counts: Counter | None = None, keep_loops: bool = False) -> list[dict]:
    """The mixed rows, shuffled with the seed (the trainer draws windows from their concatenation)."""
    rows = [row for path in regen for row in clean_records(read_jsonl(path), counts, str(path), keep_loops)]
    if corpus is not None:
        rows += corpus_sample(corpus, docs, chats, seed)
    random.Random(seed).shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m workbench.training.draft_data", description=__doc__.split("\n")[0])
    ap.add_argument("--regen", required=True, help="comma-separated JSONL files written by `regenerate --corpus`")
    ap.add_argument("--corpus", help="a built corpus to draw whole documents from")
    ap.add_argument("--docs", type=int, default=0)
    ap.add_argument("--chats", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loops", choices=("prompt", "keep"), default="prompt",
                    help="a looping continuation: keep only its prompt (default), or keep it whole")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    counts: Counter = Counter()
    rows = draft_data(a.regen.split(","), a.corpus, a.docs, a.chats, a.seed, counts, a.loops == "keep")
    with open(a.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(json.dumps({"rows": len(rows), "regenerated": dict(sorted(counts.items()))}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
