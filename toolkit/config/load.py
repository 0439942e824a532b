"""Layered config loading: defaults < preset < user YAML files < command line, validated strictly.

Every problem (unknown key, wrong type, value out of range, missing required value, broken
interpolation, a family setting set for a family that does not read it, an optimizer argument the optimizer
does not take, a save format the family does not write) is collected with the file and line it came from,
then reported together.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from toolkit.config.layers import Layer, peek
from toolkit.config.local_paths import is_section, make_absolute
from toolkit.config.objectives import OBJECTIVE_SETTINGS
from toolkit.config.families import FAMILY_SCOPED_SETTINGS, FAMILY_SPECS
from toolkit.config.foreign_keys import foreign_key_hint
from toolkit.config.schema import SAVE_FORMATS, RunConfig, family_sections
from toolkit.optim.specs import OPTIMIZER_NAMES, optimizer_args_problem
from toolkit.errors import ConfigError

DEFAULTS_LABEL = "default"

# Checks of what the config points at (data, model, output location): (merged config, sources) -> problems.
PathCheck = Callable[[DictConfig, dict], list]


@dataclass
class LoadedConfig:
    """The merged, validated config and where each value came from."""

    cfg: DictConfig
    sources: dict[str, str]                 # dotted key -> layer label (with line) that set it
    layers: list[Layer] = field(default_factory=list)


def schema_defaults(family: str | None) -> dict[str, Any]:
    """Dotted key -> default value of the schema for `family` (interpolations left as written)."""
    return dict(flatten(OmegaConf.to_container(schema_for(family), resolve=False)))


def schema_for(family: str | None) -> DictConfig:
    """The structured config for a family: its typed sections (family_sections: each shared section with only the
    family-scoped settings the family reads) and its data section. Without a known family, every setting."""
    if family not in FAMILY_SPECS:
        cfg = OmegaConf.structured(RunConfig)
        cfg.data = {}
        return cfg
    cfg = OmegaConf.structured(family_sections(family))
    cfg.data = OmegaConf.structured(FAMILY_SPECS[family].data_schema)
    return cfg


def field_meta(section_cls: type, name: str) -> dict:
    for f in dataclasses.fields(section_cls):
        if f.name == name:
            return dict(f.metadata)
    return {}


def iter_schema_fields(cfg: DictConfig, prefix: str = "") -> Iterator[tuple[str, dict]]:
    """Yield (dotted key, field metadata) for every leaf field of a structured config."""
    section_cls = OmegaConf.get_type(cfg)
    for key in cfg.keys():
        node = cfg._get_node(key)
        dotted = f"{prefix}{key}"
        if isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node)):
            yield from iter_schema_fields(node, dotted + ".")
        else:
            meta = field_meta(section_cls, key) if dataclasses.is_dataclass(section_cls) else {}
            yield dotted, meta


def _suggest(key: str, cfg: DictConfig, prefix: str) -> str:
    """A did-you-mean for an unknown key: another trainer's name for a toolkit key (foreign_keys.py), a close
    sibling, or the same name in another section."""
    root = cfg._get_root()
    known = [d for d, _ in iter_schema_fields(root)]
    foreign = foreign_key_hint(key, not prefix, set(known))
    if foreign:
        return foreign
    siblings = [str(k) for k in cfg.keys()]
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    elsewhere = [d for d in known if d.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"; did you mean '{elsewhere[0]}'?"
    if siblings:
        return f"; valid keys here: {', '.join(siblings)}"
    return ""


def _apply_layer(cfg: DictConfig, layer: Layer, sources: dict[str, str], problems: list[str],
                 scoped: list[tuple[str, Any]], prefix: str = "") -> list[str]:
    """Merge one layer into cfg key by key, so every bad key is reported, not just the first; returns the
    dotted keys it set. Settings of other families go to `scoped` (key, value), checked by _check_family_settings."""
    applied: list[str] = []

    def walk(node: DictConfig, data: dict, prefix: str) -> None:
        for key, value in data.items():
            key = str(key)
            dotted = f"{prefix}{key}"
            if key not in node.keys():
                if dotted in FAMILY_SCOPED_SETTINGS:  # another family's setting: _check_family_settings says so
                    scoped.append((dotted, value))
                    continue
                problems.append(f"unknown key '{dotted}' in {layer.where(dotted)}{_suggest(key, node, prefix)}")
                continue
            child = node._get_node(key)
            if is_section(child):
                if isinstance(value, dict):
                    walk(child, value, dotted + ".")
                else:
                    problems.append(f"'{dotted}' in {layer.where(dotted)} must be a mapping of keys, "
                                    f"got {type(value).__name__} {value!r}")
                continue
            if isinstance(child, DictConfig) and isinstance(value, dict):
                # A free-form mapping (train.optimizer_args): merged key by key, later layers win per key.
                for name, item in value.items():
                    child[str(name)] = item
                    sources[f"{dotted}.{name}"] = layer.where(f"{dotted}.{name}")
                    applied.append(f"{dotted}.{name}")
                continue
            element = getattr(getattr(child, "_metadata", None), "element_type", None)
            if isinstance(value, list) and dataclasses.is_dataclass(element):
                value = _entries(element, value, dotted, layer, problems)
                if value is None:
                    continue
            if _expected_type(node, key) == "a number":
                value = _as_float(value)
            try:
                node[key] = value
            except OmegaConfBaseException as err:
                expected = _expected_type(node, key)
                hint = ""
                if expected and expected.startswith("a list") and isinstance(value, str) and layer.where(dotted) \
                        == "command line":  # the shell took the brackets, or they were never written
                    hint = f": write it as '{dotted}=[\"...\", \"...\"]' (the quotes keep the shell off the brackets)"
                problems.append(f"'{dotted}' in {layer.where(dotted)}: expected {expected}, got {value!r}{hint}"
                                + ("" if expected else f" ({str(err).splitlines()[0]})"))
                continue
            sources[dotted] = layer.where(dotted)
            applied.append(dotted)

    walk(cfg, layer.data, prefix)
    return applied


def _entries(element: type, value: list, dotted: str, layer: Layer, problems: list[str]) -> list | None:
    """A list of mappings for a list-of-sections field (data.datasets), each checked key by key like a section;
    None (with the problems said) when any entry is not a mapping."""
    entries = []
    for n, item in enumerate(value):
        where = f"{dotted}[{n}]"
        if not isinstance(item, dict):
            problems.append(f"'{where}' in {layer.where(dotted)} must be a mapping of keys, got {item!r}")
            return None
        entry = OmegaConf.structured(element)
        _apply_layer(entry, dataclasses.replace(layer, data=dict(item)), {}, problems, [], prefix=f"{where}.")
        checked: list[str] = []
        _check_values(entry, {}, checked)
        problems += [p.replace("'", f"'{where}.", 1).replace(DEFAULTS_LABEL, layer.label) for p in checked]
        problems += [f"'{where}.{key}' in {layer.where(dotted)} is required: each dataset names its {key}"
                     for key in _missing_keys(entry)]
        entries.append(entry)
    return entries


def _as_float(value: Any) -> Any:
    """YAML reads `alpha: 16` as an int and `lr: 1e-4` as a string; a float field means a number."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)):
        try:
            return float(value)
        except ValueError:
            return value  # reported as a type error by OmegaConf
    return value


def _expected_type(node: DictConfig, key: str) -> str:
    section_cls = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(section_cls):
        return ""
    for f in dataclasses.fields(section_cls):
        if f.name == key:
            hint = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
                    "List[str]": "a list of strings", "List[float]": "a list of numbers",
                    "Union[int, str]": "an integer or 'auto'", "Union[bool, str]": "true, false or 'auto'",
                    "Optional[str]": "a string or null", "Optional[int]": "an integer or null",
                    "Dict[str, Any]": "a mapping"}.get(hint, hint)
    return ""


def _missing_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Required fields still at ??? (without resolving interpolations, which may be broken)."""
    missing = []
    for key in cfg.keys():
        node = cfg._get_node(key)
        if isinstance(node, DictConfig):
            missing += _missing_keys(node, f"{prefix}{key}.")
        elif node._is_missing():
            missing.append(f"{prefix}{key}")
    return missing


def _check_values(cfg: DictConfig, sources: dict[str, str], problems: list[str]) -> None:
    """Choices and bounds from the schema metadata, checked after interpolation."""
    for dotted, meta in iter_schema_fields(cfg):
        if "choices" not in meta and "min" not in meta and "max" not in meta:
            continue
        try:
            value = OmegaConf.select(cfg, dotted, throw_on_missing=False)
        except OmegaConfBaseException:
            continue  # interpolation problems are reported separately
        if value is None or OmegaConf.is_missing(cfg, dotted):
            continue
        where = sources.get(dotted, DEFAULTS_LABEL)
        if "choices" in meta and value not in meta["choices"]:
            close = difflib.get_close_matches(str(value), [str(c) for c in meta["choices"]], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            problems.append(f"'{dotted}' in {where}: '{value}' is not one of {', '.join(map(str, meta['choices']))}{hint}")
        if "min" in meta and isinstance(value, str) and value != "auto":
            # A number-or-auto field (data.bucket_step): the schema's Union[int, str] lets any word through.
            problems.append(f"'{dotted}' in {where}: expected a number or auto, got {value!r}")
        if "min" in meta and isinstance(value, (int, float)) and value < meta["min"]:
            problems.append(f"'{dotted}' in {where}: {value} is below the minimum {meta['min']}")
        if "max" in meta and isinstance(value, (int, float)) and value > meta["max"]:
            problems.append(f"'{dotted}' in {where}: {value} is above the maximum {meta['max']}")


def _check_family_settings(family: str, scoped: list[tuple[str, Any, Layer]], problems: list[str]) -> None:
    """A family-scoped setting, set by a user layer to other than its default, for a family that does not read it
    (its value is dropped: the family's typed sections do not have it; a preset sets such keys for every family)."""
    defaults = schema_defaults(None)
    for key, value, layer in sorted(scoped, key=lambda found: found[0]):
        if layer.preset or value == defaults[key]:
            continue
        readers = ", ".join(name for name, spec in FAMILY_SPECS.items() if key in spec.settings)
        problems.append(f"'{key}' in {layer.where(key)} has no effect for model.family {family}; remove it "
                        f"(it applies to: {readers})")


def _check_objective_settings(cfg: DictConfig, sources: dict[str, str], problems: list[str]) -> None:
    """A setting that only some objectives read (config/objectives.py), set to other than its default for a
    train.objective that does not read it."""
    objective = OmegaConf.select(cfg, "train.objective", throw_on_missing=False)
    if objective is None:  # not an LLM family: the family check reports the key
        return
    defaults = schema_defaults(None)
    for key, readers in OBJECTIVE_SETTINGS.items():
        if key not in sources or objective in readers:
            continue
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        if value != defaults[key]:
            problems.append(f"'{key}' in {sources[key]} has no effect with train.objective={objective}; remove it, "
                            f"or set train.objective to one that reads it: {', '.join(readers)}")


def _check_optimizer_args(cfg: DictConfig, sources: dict[str, str], problems: list[str]) -> None:
    """train.optimizer_args against what train.optimizer accepts (an unknown optimizer is reported by its choices)."""
    name = OmegaConf.select(cfg, "train.optimizer", throw_on_missing=False)
    if name not in OPTIMIZER_NAMES:
        return
    for key in cfg.train.optimizer_args:
        problem = optimizer_args_problem(name, str(key))
        if problem:
            dotted = f"train.optimizer_args.{key}"
            problems.append(f"'{dotted}' in {sources.get(dotted, DEFAULTS_LABEL)}: {problem}")


def _check_save_format(cfg: DictConfig, family: str, sources: dict[str, str], problems: list[str]) -> None:
    """save.format against the formats the family writes; a DoRA network only fits the family's own format."""
    fmt = OmegaConf.select(cfg, "save.format", throw_on_missing=False)
    written = FAMILY_SPECS[family].save_formats
    where = sources.get("save.format", DEFAULTS_LABEL)
    if fmt not in SAVE_FORMATS:
        return  # reported by the choices check
    if fmt != "auto" and fmt not in written:
        problems.append(f"'save.format' in {where}: {fmt} is not available for model.family {family}; use one of "
                        f"{', '.join(('auto',) + written)}")
    elif fmt not in ("auto", written[0]) and cfg.network.type == "dora":
        problems.append(f"'save.format' in {where}: {fmt} files hold plain LoRA weights, and network.type is dora "
                        f"({sources.get('network.type', DEFAULTS_LABEL)}); use save.format={written[0]} (or auto), "
                        "or network.type=lora")


def _data_list_as_mapping(layer: Layer) -> Layer:
    """A `data:` list (several datasets) read as its first entry, with the others in data.datasets."""
    datasets = layer.data.get("data")
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) for d in datasets):
        return layer
    first = dict(datasets[0])
    if "datasets" in first:
        return layer  # reported as a type problem: data.datasets inside a data list
    return dataclasses.replace(layer, data={**layer.data, "data": {**first, "datasets": [dict(d) for d in datasets[1:]]}})


def merge_layers(layers: list[Layer], problems: list[str] | None = None,
                 check_paths: PathCheck | None = None) -> LoadedConfig:
    """Merge layers over the schema defaults and validate; raises ConfigError with every problem (those found
    before, `problems`, first; `check_paths`' last)."""
    problems = list(problems or [])
    for layer in layers:
        problems += [p for p in layer.problems if p not in problems]  # a file given twice reports its keys once
    family = peek(layers, "model.family")
    if not isinstance(family, str) or family not in FAMILY_SPECS:
        family = None  # reported by the type or choices check on model.family (a list is not even hashable)
    cfg = schema_for(family)
    sources: dict[str, str] = {}
    scoped: list[tuple[str, Any, Layer]] = []  # settings of other families, with the layer that set them
    for layer in layers:
        layer = _data_list_as_mapping(layer)
        if family is None and "data" in layer.data:
            # Without a family the data section has no schema yet; report the family instead.
            layer = dataclasses.replace(layer, data={k: v for k, v in layer.data.items() if k != "data"})
        found: list[tuple[str, Any]] = []
        _apply_layer(cfg, layer, sources, problems, found)
        scoped += [(key, value, layer) for key, value in found]

    for dotted in _missing_keys(cfg):
        problems.append(f"'{dotted}' is required: set it in your YAML or on the command line ({dotted}=...)")
    if not problems:
        try:
            OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        except OmegaConfBaseException as err:
            key = getattr(err, "full_key", "") or "?"
            problems.append(f"'{key}' in {sources.get(key, DEFAULTS_LABEL)}: {str(err).splitlines()[0]}")
        else:
            make_absolute(cfg)  # config.yaml then names the same files from any working folder
    _check_values(cfg, sources, problems)
    _check_optimizer_args(cfg, sources, problems)
    _check_objective_settings(cfg, sources, problems)
    if family is not None:
        _check_family_settings(family, scoped, problems)
        _check_save_format(cfg, family, sources, problems)
        if check_paths is not None:
            problems += check_paths(cfg, sources)
    if problems:
        raise ConfigError(problems)
    return LoadedConfig(cfg=cfg, sources=sources, layers=list(layers))


def resolved_container(cfg: DictConfig) -> dict:
    """The config as plain, fully interpolated Python data (a family's config holds only its own settings)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def as_text(value: Any) -> Any:
    """Resolved data (resolved_container) with every `${` left in its strings escaped, for a config made from it
    again: text (a prompt's "${name}"), not an interpolation to resolve a second time."""
    if isinstance(value, dict):
        return {k: as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_text(v) for v in value]
    return value.replace("${", "\\${") if isinstance(value, str) and "${" in value else value


def flatten(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Dotted (key, value) pairs of nested dicts; lists and empty dicts are leaves."""
    if isinstance(data, dict) and data:
        for key, value in data.items():
            yield from flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], data
