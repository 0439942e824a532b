"""Config layers: one YAML file, a preset, or the command line, each with its origin and key lines."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

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
    notes: list[str] = field(default_factory=list)  # said at the start (a renamed setting read by its old name)

    def where(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.label}:{line}" if line else self.label


# A config's values, counted as YAML aliases expand them: far above any real config, far below what would exhaust
# memory ("billion laughs").
MAX_VALUES = 100_000


def _check_tree(root: yaml.Node, path: Path) -> None:
    """A UserError for a YAML alias inside its own anchor (a value that contains itself: every later walk would
    recurse forever), or for aliases that expand into more than MAX_VALUES values."""
    count = 0
    todo: list[tuple[yaml.Node, frozenset[int]]] = [(root, frozenset())]
    while todo:
        node, above = todo.pop()
        count += 1
        if id(node) in above:
            raise UserError(f"{path}:{node.start_mark.line + 1}: a YAML alias inside its own anchor (&name ... *name) "
                            "makes a value that contains itself\n  fix: write the value out, or use an alias outside "
                            "the anchored block")
        if count > MAX_VALUES:
            raise UserError(f"{path}: its YAML aliases expand to more than {MAX_VALUES:,} values\n  fix: write the "
                            "config without nested aliases")
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        todo += [(child, above | {id(node)}) for child in children]


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


# Settings renamed since they were introduced: old dotted name -> (new name, what the old value is in the new one's
# unit). The old name is still read, with a note; both in one layer is an error.
RENAMED = {"device.timeout_minutes": ("device.collective_timeout", "seconds", lambda minutes: minutes * 60)}


def upgrade_renamed(data: dict, where: Callable[[str], str] | None = None) -> tuple[list[str], list[str]]:
    """Rename the old settings of `data` (a layer's nested dict, or a run's saved config) in place; returns (notes,
    problems). `where(old dotted name)` says where it was set."""
    notes, problems = [], []
    for old, (new, unit, convert) in RENAMED.items():
        (section, old_key), new_key = old.split("."), new.split(".")[1]
        values = data.get(section)
        if not isinstance(values, dict) or old_key not in values:
            continue
        value = values.pop(old_key)
        at = f" in {where(old)}" if where else ""
        if new_key in values:
            problems.append(f"'{old}'{at} is the old name of '{new}', which is set too; remove '{old}'")
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        values[new_key] = convert(value) if number else value  # not a number: the new key's type check says so
        notes.append(f"'{old}'{at} is deprecated: read as {new}={values[new_key]} ({unit}); rename it")
    return notes, problems


def _not_unicode(data: Any, where: Callable[[str], str], prefix: str = "") -> Iterator[str]:
    """Keys and texts holding half of a UTF-16 pair (a YAML or JSON escape like \\ud800, or a command-line byte that
    is not UTF-8): no file name, log line or message could hold them."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    for key, value in items:
        dotted = f"{prefix}{key}" if isinstance(data, dict) else prefix.rstrip(".")
        for text in (key, value):
            if isinstance(text, str) and any("\ud800" <= c <= "\udfff" for c in text):
                shown, name = (t.encode("utf-8", "backslashreplace").decode("utf-8") for t in (text, dotted))
                yield (f"'{name}' in {where(dotted)}: '{shown}' is not valid Unicode text (half of a UTF-16 "
                       "surrogate pair, or a byte that is not UTF-8); write the character itself, in UTF-8")
                break
        else:
            yield from _not_unicode(value, where, f"{dotted}.")


def _renamed(layer: Layer) -> Layer:
    """`layer` with its old setting names read as the new ones (line numbers follow); a ConfigError for text that
    is not Unicode, or for an old name set beside its new one."""
    invalid = list(_not_unicode(layer.data, layer.where))
    if invalid:
        raise ConfigError(invalid)
    notes, problems = upgrade_renamed(layer.data, layer.where)
    if problems:
        raise ConfigError(problems)
    for old, (new, _, _) in RENAMED.items():
        if old in layer.lines:
            layer.lines[new] = layer.lines.pop(old)
    layer.notes += notes
    return layer


def read_yaml_layer(path: str | Path, label: str | None = None) -> Layer:
    """Read a YAML config file; a missing file or bad YAML is a UserError naming the file and line(s). Keys given
    twice are in the layer's `problems` (merge_layers reports them with the rest)."""
    path = Path(path)
    if not path.is_file():
        if re.fullmatch(r"[A-Za-z_]\w*(\.\w+|\[\d+\])+", str(path)) and path.suffix.lower() not in (".yaml", ".yml"):
            raise UserError(f"'{path}' has no value: a setting on the command line is key=value\n  fix: write "
                            f"{path}=VALUE (or, if it is a config file, check the path)")
        raise UserError(f"config file not found: {path}\n  fix: check the path (relative paths are taken from {Path.cwd()})")
    text = read_text(path)
    try:
        tree = yaml.compose(text, Loader=yaml.SafeLoader)
        if tree is not None:
            _check_tree(tree, path)  # before constructing: an alias inside its own anchor is named, not recursed into
        data = yaml.load(text, Loader=_MergingLoader)  # noqa: S506 (a SafeLoader)
        lines = dict(_key_lines(tree)) if tree is not None else {}
        duplicates = list(_duplicate_keys(tree, path)) if tree is not None else []
    except yaml.YAMLError as err:
        raise UserError(yaml_error_message(path, text, err)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a config file must be a mapping of sections (run:, model:, train:, ...), "
                        f"not a {type(data).__name__}")
    return _renamed(Layer(label or str(path), data, lines, problems=duplicates))


def parse_scalar(text: str) -> Any:
    """Parse a command-line value the way YAML would ('5e-5' is a float, 'true' a bool, '[a, b]' a list)."""
    try:
        value = yaml.safe_load(text)
        if value is not None:
            _check_tree(yaml.compose(text), Path("command line"))
    except (yaml.YAMLError, UserError):  # an alias inside its own anchor, too: the text as it was typed
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
    return _renamed(Layer("command line", data))


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
