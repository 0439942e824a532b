"""Reading training records (dicts) from local jsonl, json, parquet and txt files."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from toolkit.errors import UserError
from toolkit.text_files import decode_text, read_text

SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


def read_records(path: str | Path, key: str = "data.path") -> list[dict]:
    """All records of a data file. txt files give one {"text": line} per non-empty line.

    A malformed line is a UserError naming the file and line number.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{key}: data file not found: {path}\n  fix: check the path (relative paths are taken from {Path.cwd()})")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = _read_jsonl(path, key)
    elif suffix == ".json":
        records = _read_json(path, key)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq
        rows = pq.read_table(path).to_pylist()
        records = [{**record, "__line__": f"row {index}"} for index, record in enumerate(rows)]
    elif suffix == ".txt":
        records = [{"text": line} for line in read_text(path, key).splitlines() if line.strip()]
    else:
        raise UserError(f"{key}: {path} has an unsupported extension; use one of {', '.join(SUFFIXES)}")
    if not records:
        raise UserError(f"{key}: {path} holds no samples")
    return records


def first_record(path: str | Path, key: str = "data.path") -> dict:
    """The file's first record; a UTF-8 .jsonl is read no further than its first non-empty line (`validate` reads
    the format from it)."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".jsonl":
        with path.open("rb") as file:
            utf16 = file.read(2) in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
            file.seek(0)
            # Split on newlines only (binary lines do), as _read_jsonl does.
            for number, raw in enumerate([] if utf16 else file, start=1):
                if raw.strip():
                    return _jsonl_record(decode_text(raw, path, key), number, path)
    return read_records(path, key)[0]


def _jsonl_record(line: str, number: int, path: Path) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}:{number}: each line must be a JSON object, got {type(record).__name__}")
    record["__line__"] = number
    return record


def _read_jsonl(path: Path, key: str) -> list[dict]:
    # Split on newlines only: U+2028 and friends may stand unescaped inside a JSON string.
    return [_jsonl_record(line, number, path) for number, line in enumerate(read_text(path, key).split("\n"), start=1)
            if line.strip()]


def _read_json(path: Path, key: str) -> list[dict]:
    try:
        data = json.loads(read_text(path, key))
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), None) if len(data) == 1 else None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise UserError(f"{path}: expected a JSON list of objects (or an object holding one such list)")
    for index, record in enumerate(data):
        record["__line__"] = f"item {index}"
    return data


def where(path: str | Path, record: dict) -> str:
    """'file:line' for messages about one record."""
    line = record.get("__line__")
    return f"{path}:{line}" if isinstance(line, int) else (f"{path} ({line})" if line else str(path))
