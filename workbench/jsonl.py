"""JSONL files of records that each carry one non-empty string field (prompts, documents)."""
from __future__ import annotations

import json
from pathlib import Path


def read_records(path: str | Path, field: str, example: str) -> list[dict]:
    """Every line's object of a JSONL file, each with a non-empty string `field`; blank lines are
    skipped. A bad file is an error naming it, the line and the field; `example` shows a good line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}; expected JSONL lines like {example}") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {n}: not valid JSON ({e.msg}); expected a line like {example}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str) or not obj[field].strip():
            raise ValueError(f"{path}, line {n}: field \"{field}\" missing or empty; expected a non-empty string")
        records.append(obj)
    if not records:
        raise ValueError(f"{path}: no records; expected JSONL lines like {example}")
    return records
