"""JSONL files of records that each carry one non-empty string field (prompts, documents)."""
from __future__ import annotations

import json
from pathlib import Path


def read_records(path: str | Path, field: str, example: str, what: str = "records") -> list[dict]:
    """`parse_records` of a file; one that cannot be read is an error naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}; expected JSONL lines like {example}") from None
    return parse_records(text, str(path), field, example, what)


def parse_records(text: str, name: str, field: str, example: str, what: str = "records") -> list[dict]:
    """Every line's object of JSONL `text` (from `name`, a file or an upload), each with a non-empty
    string `field`; blank lines are skipped. A bad line is an error naming the source, the line and
    the field; `example` shows a good line, `what` names the records in the message for none."""
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}, line {n}: not valid JSON ({e.msg}); expected a line like {example}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str) or not obj[field].strip():
            raise ValueError(f"{name}, line {n}: field \"{field}\" missing or empty; expected a non-empty string")
        records.append(obj)
    if not records:
        raise ValueError(f"{name}: no {what}; expected JSONL lines like {example}")
    return records
