"""Config layers: one YAML file, a preset, or the command line, each with its origin and key lines."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from toolkit.config.yaml_errors import yaml_error_message
from toolkit.errors import ConfigError, UserError
from toolkit.text_files import read_text


@dataclass
class Layer:
    """One source of config values, merged in order (later wins)."""

    label: str                      # shown to users: "my.yaml", "preset gfx1151", "command line"
    data: dict
    lines: dict[str, int] = field(default_factory=dict)  # dotted key -> line number in the file
    preset: bool = False            # an arch preset: it sets keys for every family, so none is an error
    problems: list[str] = field(default_factory=list)  # keys given twice: reported with the merged config's

    def where(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.label}:{line}" if line else self.label


def _key_lines(node: yaml.Node, prefix: str = "") -> Iterator[tuple[str, int]]:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            yield key, key_node.start_mark.line + 1
            yield from _key_lines(value_node, key + ".")


def _duplicate_keys(node: yaml.Node, path: Path, prefix: str = "") -> Iterator[str]:
    """A key given twice in one mapping: YAML keeps the last silently, dropping the first block."""
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
            if key in first:
                yield (f"'{key}' is given twice in {path}: lines {first[key]} and {line} (YAML would silently keep "
                       f"only the second); merge them into one block")
            else:
                first[key] = line
            yield from _duplicate_keys(value_node, path, key + ".")
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from _duplicate_keys(item, path, prefix)


class _MergingLoader(yaml.SafeLoader):
    """safe_load, except that a mapping key given twice merges its two blocks (the second wins key by key) instead of
    dropping the first: the duplicate is reported, and the rest of the file is checked as the user meant it, so
    that a second `model:` block does not also bring "'model.family' is required"."""

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, yaml.MappingNode):
            return super().construct_mapping(node, deep=deep)
        self.flatten_mapping(node)
        mapping: dict = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            value = self.construct_object(value_node, deep=True)
            if isinstance(mapping.get(key), dict) and isinstance(value, dict):
                value = {**mapping[key], **value}
            mapping[key] = value
        return mapping


def read_yaml_layer(path: str | Path, label: str | None = None) -> Layer:
    """Read a YAML config file; a missing file or bad YAML is a UserError naming the file and line(s). Keys given
    twice are in the layer's `problems` (merge_layers reports them with the rest)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}\n  fix: check the path (relative paths are taken from {Path.cwd()})")
    text = read_text(path)
    try:
        data = yaml.load(text, Loader=_MergingLoader)  # noqa: S506 (a SafeLoader)
        tree = yaml.compose(text) if data else None
        lines = dict(_key_lines(tree)) if tree is not None else {}
        duplicates = list(_duplicate_keys(tree, path)) if tree is not None else []
    except yaml.YAMLError as err:
        raise UserError(yaml_error_message(path, text, err)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a config file must be a mapping of sections (run:, model:, train:, ...), "
                        f"not a {type(data).__name__}")
    return Layer(label or str(path), data, lines, problems=duplicates)


def parse_scalar(text: str) -> Any:
    """Parse a command-line value the way YAML would ('5e-5' is a float, 'true' a bool, '[a, b]' a list)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    # YAML 1.1 reads '5e-5' as a string; users mean a number.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in ".e") else value
        except ValueError:
            return value
    return value


def dotlist_layer(overrides: list[str]) -> Layer:
    """The command-line layer from `key.path=value` arguments."""
    data: dict = {}
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"command line: '{item}' is not key=value (example: train.lr=5e-5)")
            continue
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"command line: '{key}' sets a value inside a non-mapping key")
                break
        else:
            node[parts[-1]] = parse_scalar(raw)
    if problems:
        raise ConfigError(problems)
    return Layer("command line", data)


def peek(layers: list[Layer], dotted: str, default: Any = None) -> Any:
    """The value of a key as the last layer that sets it gives it (before validation)."""
    value = default
    for layer in layers:
        node: Any = layer.data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            value = node
    return value
