"""The config reference is generated from the schema, and the committed copies are current."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from conftest import REPO
from toolkit.config.reference import (DOC_PATH, END_MARKER, START_MARKER, render_reference, stale_files,
                                      write_reference)
from toolkit.config.families import FAMILY_SPECS
from toolkit.config.schema import RunConfig


def test_committed_reference_is_current():
    stale = stale_files(REPO)
    assert not stale, (f"{', '.join(map(str, stale))} out of date with toolkit/config/schema.py: "
                       "run `python -m toolkit.config.reference` and commit the result")


def test_check_flag_through_the_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "toolkit.config.reference", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_every_field_has_a_documented_row():
    text = render_reference()
    sections = {f.name: f.default_factory().__class__ for f in dataclasses.fields(RunConfig) if f.name != "data"}
    schemas = [(name, schema) for name, schema in sections.items()] + [("data", s) for s in {spec.data_schema for spec in FAMILY_SPECS.values()}]
    for prefix, schema in schemas:
        for f in dataclasses.fields(schema):
            assert f.metadata.get("doc"), f"{prefix}.{f.name} has no doc"
            assert f"| `{prefix}.{f.name}` |" in text, f"{prefix}.{f.name} missing from the reference"
    assert "| `train.lr` | float | `0.0001` | Peak learning rate. At least 0. |" in text
    assert "| `model.family` | str | **required** |" in text
    assert "One of " + ", ".join(f"`{family}`" for family in FAMILY_SPECS) + "." in text
    assert "One of `llm`, `sd`, `sdxl`, `flux`, `sd3`, `wan21`, `wan22`" in text
    assert "| `log.profile` | bool | `false` |" in text
    assert "| `data.num_frames` |" in text.split("### data for model.family: wan21, wan22")[1]
    assert "### data for model.family: llm" in text and "| `data.max_seq_len` | int | `512` |" in text


def test_readme_section_is_replaced_between_markers_only(tmp_path):
    before, after = "# My project\n\nintro text\n\n", "\n\n## After\nkept as is\n"
    readme = tmp_path / "README.md"
    readme.write_text(f"{before}{START_MARKER}\nold generated text\n{END_MARKER}{after}", encoding="utf-8")
    changed = write_reference(tmp_path)
    assert changed == [tmp_path / DOC_PATH, readme]
    assert (tmp_path / DOC_PATH).read_text(encoding="utf-8") == render_reference()
    text = readme.read_text(encoding="utf-8")
    assert text.startswith(f"{before}{START_MARKER}\n## Config reference\n")
    assert text.endswith(f"{END_MARKER}{after}")
    assert "old generated text" not in text and "### train" in text and "| `train.steps` |" in text
    assert write_reference(tmp_path) == []  # idempotent

    plain = tmp_path / "other"
    plain.mkdir()
    (plain / "README.md").write_text("no markers here\n", encoding="utf-8")
    assert write_reference(plain) == [plain / DOC_PATH]
    assert (plain / "README.md").read_text(encoding="utf-8") == "no markers here\n"


def test_resume_safe_fields_say_so():
    text = render_reference()
    assert "| `train.steps` | int | `1000` | Optimizer steps to train. At least 1. A resumed run may change it. |" in text
    assert "| `train.lr` | float | `0.0001` | Peak learning rate. At least 0. |" in text
