"""Configs in the UI: the examples and presets to start from, a key set in YAML text without losing its comments,
and YAML text checked by the same validator as `validate` (load_run with the path checks), each problem at its
line."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import yaml

from toolkit.errors import ConfigError, UserError
from toolkit.ui.runs import RUN_NAME

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "configs" / "examples"
UI_LABEL = "the UI (outputs root)"


def example_names() -> list[str]:
    """The example configs beside the toolkit (none when it is installed without its repository)."""
    return sorted(p.name for p in EXAMPLES_DIR.glob("*.yaml")) if EXAMPLES_DIR.is_dir() else []


def preset_list() -> list[dict]:
    from toolkit.config.presets import load_presets

    return [{"name": p.name, "description": p.description} for p in load_presets().values()]


def _render(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).rstrip("\n")
    return text.removesuffix("\n...")


def _block(parts: list[str], value: Any, indent: int) -> str:
    lines = []
    for depth, part in enumerate(parts):
        tail = f" {_render(value)}" if depth == len(parts) - 1 else ""
        lines.append(" " * (indent + 2 * depth) + f"{part}:{tail}\n")
    return "".join(lines)


def set_yaml_key(text: str, dotted: str, value: Any) -> str:
    """`text` with the key `dotted` set to `value`: its value replaced in place, or its line added to its section,
    so that the comments stay. A layout it cannot edit in place (flow style) is rewritten whole."""
    try:
        tree = yaml.compose(text)
    except yaml.YAMLError as err:
        raise UserError(f"the YAML does not parse ({getattr(err, 'problem', err)})\n  fix: correct it first") from None
    parts = dotted.split(".")
    if tree is None:
        return text + ("" if not text or text.endswith("\n") else "\n") + _block(parts, value, 0)
    node = tree
    for depth, part in enumerate(parts):
        if not isinstance(node, yaml.MappingNode) or node.flow_style or not node.value:
            break
        child = next((v for k, v in node.value if k.value == part), None)
        if child is None:
            last = node.value[-1][1]
            line = last.end_mark.line + (1 if last.end_mark.column > 0 else 0)
            lines = text.splitlines(keepends=True)
            if line >= len(lines) and lines and not lines[-1].endswith("\n"):
                lines[-1] += "\n"
            lines.insert(line, _block(parts[depth:], value, node.value[0][0].start_mark.column))
            return "".join(lines)
        if depth == len(parts) - 1:
            if isinstance(child, yaml.ScalarNode) or child.flow_style:
                start, end = child.start_mark.index, child.end_mark.index
                return text[:start] + (" " if start == end and not text[start - 1:start].isspace() else "") + \
                    _render(value) + text[end:]
            break
        node = child
    data = yaml.safe_load(text) or {}  # a layout the in-place edit does not handle
    target = data
    for part in parts[:-1]:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    target[parts[-1]] = value
    return yaml.safe_dump(data, sort_keys=False)


def _user_keys(text: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def output_override(text: str, root: Path) -> list[str]:
    """The run folder goes under the UI's outputs root, named after run.name, unless the YAML sets run.output_dir."""
    run = _user_keys(text).get("run")
    if isinstance(run, dict) and "output_dir" in run:
        return []
    return [f"run.output_dir={root.resolve()}/${{run.name}}"]


def _located(problem: str, path: Path) -> dict:
    """A problem of the validator, with the line of the YAML it names and the temporary file's name taken out."""
    where = re.escape(str(path))
    line = None
    match = re.search(where + r":(\d+)", problem) or re.search(where + r": lines \d+ and (\d+)", problem)
    if match:
        line = int(match.group(1))
    message = re.sub(where + r":(\d+)(?::\d+)?", r"line \1", problem)
    message = re.sub(where, "the YAML", message).replace(" in command line", f" in {UI_LABEL}")
    return {"line": line, "message": message}


def _source(source: str, path: Path) -> str:
    return UI_LABEL if source == "command line" else _located(source, path)["message"]


def validate_text(text: str, root: Path) -> dict:
    """Check YAML text as `validate` would (load_run with the data, model and output checks): {ok, problems (each
    with its line or None), rows (key, value, source), run (the folder's name under the root)}."""
    from toolkit.plan.run import load_run
    from toolkit.preflight import path_checks

    with tempfile.TemporaryDirectory(prefix="toolkit-ui-") as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            run = load_run([path], output_override(text, root), check_paths=path_checks())
        except ConfigError as err:
            return {"ok": False, "problems": [_located(p, path) for p in err.problems], "rows": [], "run": None}
        except UserError as err:
            return {"ok": False, "problems": [_located(str(err), path)], "rows": [], "run": None}
        rows = [{"key": k, "value": v, "source": _source(s, path)} for k, v, s in run.provenance()]
        lines = next((layer.lines for layer in run.layers if layer.label == str(path)), {})
    folder_path = Path(run.cfg.run.output_dir)
    problems = []
    if folder_path.resolve().parent != root.resolve():
        problems.append({"line": lines.get("run.output_dir"),
                         "message": f"run.output_dir {folder_path} is not a folder directly under the UI's outputs "
                                    f"root {root}, so the UI could not show the run\n  fix: remove run.output_dir "
                                    f"(the run goes to {root}/<run.name>), or start the UI with --outputs "
                                    f"{folder_path.parent}"})
    elif not RUN_NAME.fullmatch(folder_path.name):
        problems.append({"line": lines.get("run.name"),
                         "message": f"run.name '{folder_path.name}': the run folder's name may hold letters, digits "
                                    "and . _ + - (starting with a letter or digit)\n  fix: rename the run"})
    return {"ok": not problems, "problems": problems, "rows": rows, "run": folder_path.name}
