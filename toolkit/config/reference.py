"""The config reference, generated from the schema's field docs.

    python -m toolkit.config.reference            # writes docs/config-reference.md and the README section
    python -m toolkit.config.reference --check    # exit 1 when either is stale

The README section is the text between `<!-- config-reference:start -->` and
`<!-- config-reference:end -->`; without the markers the README is left alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from omegaconf import MISSING

from toolkit.config.families import FAMILY_SPECS
from toolkit.config.schema import RunConfig

REPO = Path(__file__).resolve().parents[2]
DOC_PATH = Path("docs/config-reference.md")
README_PATH = Path("README.md")
START_MARKER = "<!-- config-reference:start -->"
END_MARKER = "<!-- config-reference:end -->"

_GENERATED = ("Generated from the schema in `toolkit/config/schema.py` by `python -m toolkit.config.reference` "
              "(do not edit by hand; a test fails when this is stale).")
_LAYERS = """\
Values come from layers, later wins: schema defaults < arch preset < your YAML files (in order)
< `key=value` overrides on the command line. `./start_toolkit.sh validate my.yaml` prints each
value and where it came from. Unknown keys and wrong types are errors.
"""


def _type_name(annotation) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if text.startswith("Optional[") and text.endswith("]"):
        return f"{text[len('Optional['):-1]} or null"
    if text.startswith("Union[") and text.endswith("]"):
        return " or ".join(part.strip() for part in text[len("Union["):-1].split(","))
    if text.startswith("List[") and text.endswith("]"):
        return f"list of {text[len('List['):-1]}"
    return "any" if text == "Any" else text


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is MISSING or value == MISSING:
        return "**required**"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str) and not value:
        return '`""`'
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _description(f: dataclasses.Field) -> str:
    meta = f.metadata
    text = meta.get("doc", "")
    if "choices" in meta:
        text += " One of " + ", ".join(f"`{c}`" for c in meta["choices"]) + "."
    if "min" in meta and "max" in meta:
        text += f" From {meta['min']:g} to {meta['max']:g}."
    elif "min" in meta:
        text += f" At least {meta['min']:g}."
    if meta.get("resume_safe"):
        text += " A resumed run may change it."
    return _cell(text)


def _table(prefix: str, schema: type) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for f in dataclasses.fields(schema):
        lines.append(f"| `{prefix}.{f.name}` | {_cell(_type_name(f.type))} | {_cell(_default(f))} | {_description(f)} |")
    return lines


def _sections(level: int) -> list[str]:
    """The per-section tables, with headings at `level` (data: one table per family schema)."""
    heading = "#" * level
    lines: list[str] = []
    for section in dataclasses.fields(RunConfig):
        if section.name == "data":
            lines += [f"{heading} data", "",
                      "The `data` section's keys depend on `model.family`.", ""]
            families_by_schema: dict[type, list[str]] = {}
            for family, schema in ((f, spec.data_schema) for f, spec in FAMILY_SPECS.items()):
                families_by_schema.setdefault(schema, []).append(family)
            for schema, families in families_by_schema.items():
                lines += [f"{heading}# data for model.family: {', '.join(families)}", ""]
                lines += _table("data", schema) + [""]
            continue
        schema = section.default_factory().__class__
        lines += [f"{heading} {section.name}", ""] + _table(section.name, schema) + [""]
    return lines


def render_reference() -> str:
    """docs/config-reference.md."""
    lines = ["# Config reference", "", f"Every key of a run's YAML. {_GENERATED}", "", _LAYERS]
    return "\n".join(lines + _sections(level=2)).rstrip() + "\n"


def render_readme_section() -> str:
    """The README text between the markers (markers excluded)."""
    lines = ["## Config reference", "",
             f"Every key of a run's YAML (the same tables are in `{DOC_PATH.as_posix()}`). {_GENERATED}", "", _LAYERS]
    return "\n".join(lines + _sections(level=3)).rstrip() + "\n"


def readme_with_section(readme: str) -> str | None:
    """The README with its config-reference section regenerated; None when it has no markers."""
    start, end = readme.find(START_MARKER), readme.find(END_MARKER)
    if start < 0 or end < start:
        return None
    return readme[:start + len(START_MARKER)] + "\n" + render_readme_section() + readme[end:]


def stale_files(root: Path = REPO) -> list[Path]:
    """The generated files that differ from what the schema gives now."""
    stale = []
    doc = root / DOC_PATH
    if not doc.exists() or doc.read_text(encoding="utf-8") != render_reference():
        stale.append(doc)
    readme = root / README_PATH
    if readme.exists():
        text = readme.read_text(encoding="utf-8")
        updated = readme_with_section(text)
        if updated is not None and updated != text:
            stale.append(readme)
    return stale


def write_reference(root: Path = REPO) -> list[Path]:
    """Write docs/config-reference.md and the README section; returns the files changed."""
    changed = stale_files(root)
    doc = root / DOC_PATH
    if doc in changed:
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(render_reference(), encoding="utf-8")
    readme = root / README_PATH
    if readme in changed:
        readme.write_text(readme_with_section(readme.read_text(encoding="utf-8")), encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.config.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1 when any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale: {path} (run python -m toolkit.config.reference)", file=sys.stderr)
        return 1 if stale else 0
    changed = write_reference()
    for path in changed:
        print(f"wrote {path}")
    if not changed:
        print("config reference up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
