"""Measurements behind `auto` decisions: records in bench/results/evidence.json, cited by id.

A rule that decides from a measurement names its evidence id; the reason a run prints then states the figure and
the file that holds the measurement (`cite`). The figures live with the benchmarks' results, not in product code:
a new measurement changes evidence.json and the files it names, and every rule citing it says so at once.
tests/test_evidence.py checks that every id the rules cite exists and that every file a record names is there.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

EVIDENCE_FILE = Path(__file__).resolve().parents[2] / "bench" / "results" / "evidence.json"


@cache
def evidence() -> dict[str, dict]:
    """id -> {"figure": ..., "files": [...], "command": ..., "device": ..., "date": ...}; empty when the toolkit is
    installed without its bench/ folder (a wheel), where reasons then cite the id alone."""
    if not EVIDENCE_FILE.is_file():
        return {}
    return json.loads(EVIDENCE_FILE.read_text(encoding="utf-8"))


def cite(evidence_id: str) -> str:
    """The figure of `evidence_id` and where it is recorded, for a decision's reason."""
    record = evidence().get(evidence_id)
    if record is None:
        return f"measured (evidence {evidence_id}, bench/results/evidence.json)"
    files = ", ".join(record["files"])
    return f"{record['figure']} ({record['command']}, {record['device']}, {record['date']}: {files})"
