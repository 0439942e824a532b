"""bench/results/evidence.json: the measurements `auto` decisions cite by id (toolkit/plan/evidence.py).

Every record states its figure, the result files that hold it, the command, device and date; every file it names
exists; every id the product code cites is a record, so a renamed or dropped id fails here rather than printing
"measured (evidence ...)" in a run's reasons.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from toolkit.plan import evidence as evidence_module
from toolkit.plan.evidence import EVIDENCE_FILE, cite

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("figure", "files", "command", "device", "date")
EXPECTED_IDS = {
    "llm-compile", "llm-recompute", "llm-fused-loss", "llm-fuse-projections",
    "sd-compile", "sdxl-compile", "flux-compile", "flux-keeps", "wan21-compile", "wan21-keeps",
    "ddp-graph-splitting", "fp8-compiled", "step-fetch", "checkpoint-offload",
}
ID_SHAPE = r"[a-z0-9]+(?:-[a-z0-9]+)*"
# cite("id"), evidence="id", and the FamilySpec fields that hold an evidence id (compile_auto="llm-compile"):
# only a literal shaped like an id counts, so prose still held in those fields is not taken for one.
CITATIONS = (
    re.compile(r"""\bcite\(\s*(["'])([^"'\\]+)\1\s*\)"""),
    re.compile(r"""\bevidence\s*=\s*(["'])([^"'\\]+)\1"""),
    re.compile(rf"""\b(?:compile_auto|recompute_auto|keeps_auto)\s*=\s*(["'])({ID_SHAPE})\1"""),
)


def records() -> dict[str, dict]:
    return json.loads(EVIDENCE_FILE.read_text(encoding="utf-8"))


def test_the_evidence_file_is_where_cite_reads_it():
    assert EVIDENCE_FILE == ROOT / "bench" / "results" / "evidence.json"
    assert EVIDENCE_FILE.is_file()
    assert isinstance(records(), dict) and records()


def test_every_expected_id_is_a_record():
    missing = EXPECTED_IDS - set(records())
    assert not missing, f"evidence.json lacks {sorted(missing)}"


@pytest.mark.parametrize("evidence_id", sorted(EXPECTED_IDS))
def test_a_record_has_its_five_fields(evidence_id):
    record = records()[evidence_id]
    assert re.fullmatch(ID_SHAPE, evidence_id)
    for name in ("figure", "command", "device", "date"):
        assert isinstance(record.get(name), str) and record[name].strip(), f"{evidence_id}: {name} empty or missing"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"]), f"{evidence_id}: date {record['date']!r}"
    assert record["command"].startswith("bench/"), f"{evidence_id}: command {record['command']!r}"
    files = record.get("files")
    assert isinstance(files, list) and all(isinstance(f, str) and f.strip() for f in files), evidence_id
    if not files:
        note = record.get("note")
        assert isinstance(note, str) and note.strip(), f"{evidence_id}: no files and no note saying why"
    if "note" in record:
        assert isinstance(record["note"], str) and record["note"].strip(), f"{evidence_id}: empty note"
    assert set(record) <= {*FIELDS, "note"}, f"{evidence_id}: unknown fields {sorted(set(record) - {*FIELDS, 'note'})}"


def test_every_record_has_the_five_fields_and_its_files_exist():
    for evidence_id, record in records().items():
        assert all(name in record for name in FIELDS), f"{evidence_id} lacks {[n for n in FIELDS if n not in record]}"
        for name in FIELDS:
            if name != "files":
                assert isinstance(record[name], str) and record[name].strip(), f"{evidence_id}: {name} empty"
        assert record["files"] or record.get("note"), f"{evidence_id}: no files and no note saying why"
        for name in record["files"]:
            assert name.startswith("bench/results/"), f"{evidence_id}: {name} is not under bench/results/"
            assert (ROOT / name).is_file(), f"{evidence_id}: {name} does not exist"


@pytest.mark.parametrize("evidence_id", sorted(EXPECTED_IDS))
def test_cite_states_the_figure_and_every_file(evidence_id):
    record = records()[evidence_id]
    text = cite(evidence_id)
    assert record["figure"] in text
    assert record["command"] in text and record["device"] in text and record["date"] in text
    for name in record["files"]:
        assert name in text


def test_cite_of_an_unknown_id_names_it():
    text = cite("no-such-id")
    assert "no-such-id" in text
    assert "no-such-id" not in evidence_module.evidence()


def cited_ids() -> list[tuple[str, str]]:
    """(id, "path:line") of every evidence id the toolkit's source names as a literal."""
    found = []
    for path in sorted((ROOT / "toolkit").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for pattern in CITATIONS:
            for match in pattern.finditer(source):
                line = source.count("\n", 0, match.start()) + 1
                found.append((match.group(2), f"{path.relative_to(ROOT)}:{line}"))
    return found


def test_the_citation_scan_finds_literals_and_skips_prose():
    text = ('cite("llm-compile") + cite(spec.compile_auto) + cite(f"x-{y}")\n'
            "Decision(k, v, why, evidence='sd-compile')\n"
            'FamilySpec(compile_auto="flux-compile", keeps_auto="every block checkpointed, 0.47 s")\n')
    hits = [m.group(2) for pattern in CITATIONS for m in pattern.finditer(text)]
    assert sorted(hits) == ["flux-compile", "llm-compile", "sd-compile"]


def test_every_id_the_toolkit_cites_is_a_record():
    known = set(records())
    unknown = [f"{where}: {evidence_id!r}" for evidence_id, where in cited_ids() if evidence_id not in known]
    assert not unknown, "cited ids missing from bench/results/evidence.json:\n" + "\n".join(unknown)
