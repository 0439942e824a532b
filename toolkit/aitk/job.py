"""Reading an ai-toolkit job file, and the bookkeeping of its translation.

An ai-toolkit (github.com/ostris/ai-toolkit) job is YAML or JSON: `job: extension` and `config: {name, process:
[{type: sd_trainer, network, save, datasets, train, model, sample, ...}]}`; each section's keys and defaults are
those of ai-toolkit's toolkit/config_modules.py. `Translation` holds this toolkit's config as it is built, and
every ai-toolkit setting that could not be carried over with the reason; a `Section` hands out one ai-toolkit
section's keys and reports those nobody took.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.config.families import applies_to
from toolkit.errors import ConfigError, UserError

TRAINER_TYPES = ("sd_trainer", "ui_trainer", "diffusion_trainer")  # ai-toolkit's LoRA trainer processes
NO_EQUIVALENT = "no equivalent setting in this toolkit"
_ABSENT = object()


@dataclass
class Skipped:
    key: str       # the ai-toolkit setting, as a path inside config.process[0] (e.g. train.timestep_type)
    value: Any
    reason: str


@dataclass
class Translation:
    family: str
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # settings carried over with a change the user should know
    as_here: list[Skipped] = field(default_factory=list)  # settings that ask for what this toolkit does anyway
    accounted: set[str] = field(default_factory=set)  # the job's keys (paths) translated, skipped or as here

    def set(self, key: str, value: Any, source: str, source_value: Any = None) -> None:
        """This toolkit's dotted `key` = `value`, read from ai-toolkit's `source`; a setting the family does not
        read is skipped instead (the config would refuse it)."""
        if not applies_to(key, self.family):
            self.skip(source, source_value if source_value is not None else value,
                      f"{key} does not apply to model.family {self.family}")
            return
        self.accounted.add(source)
        section, name = key.split(".", 1)
        self.config.setdefault(section, {})[name] = value

    def read(self, *keys: str) -> None:
        """The job's `keys` went into a setting set() under another key's name (rank or linear -> network.rank)."""
        self.accounted.update(keys)

    def skip(self, key: str, value: Any, reason: str = NO_EQUIVALENT) -> None:
        self.accounted.add(key)
        self.skipped.append(Skipped(key, value, reason))

    def same(self, key: str, value: Any, reason: str) -> None:
        """The job's `key` asks for what this toolkit does anyway: nothing to set, but listed, not dropped."""
        self.accounted.add(key)
        self.as_here.append(Skipped(key, value, reason))

    def note(self, key: str, text: str) -> None:
        self.notes.append(f"{key}: {text}")


class Section:
    """One ai-toolkit section (a mapping): `take` hands out its keys; `done` reports every key not taken."""

    def __init__(self, out: Translation, path: str, data: Any):
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
        self.out, self.path, self.rest = out, path, dict(data)
        self.given = frozenset(self.rest)  # the keys the job gave, taken or not

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def take(self, name: str, default: Any = None) -> Any:
        return self.rest.pop(name, default)

    def has(self, name: str) -> bool:
        return name in self.rest

    def skip(self, name: str, reason: str = NO_EQUIVALENT, when: Any = _ABSENT) -> None:
        """Report `name` as not translated; at `when` (a value that asks for what this toolkit does anyway), as the
        same here, with the same reason."""
        if name in self.rest:
            value = self.rest.pop(name)
            if when is _ABSENT or value != when:
                self.out.skip(self.key(name), value, reason)
            else:
                self.out.same(self.key(name), value, reason)

    def same(self, name: str, reason: str) -> None:
        """Report `name`, when given, as what this toolkit does anyway."""
        if name in self.rest:
            self.out.same(self.key(name), self.rest.pop(name), reason)

    def done(self) -> None:
        for name, value in self.rest.items():
            self.out.skip(self.key(name), value)
        self.rest = {}


UNKNOWN = "not a setting import-aitk knows: check what it does in ai-toolkit, and set its equivalent here if any"


def leaf_keys(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, value) of every setting in a job section: mappings by key (a.b), lists of mappings by index (a[0].b);
    other values, lists of them and empty mappings are settings themselves."""
    if isinstance(data, dict) and data:
        return [kv for key, value in data.items() for kv in leaf_keys(value, f"{prefix}.{key}" if prefix else str(key))]
    if isinstance(data, list) and data and all(isinstance(item, dict) for item in data):
        return [kv for i, item in enumerate(data) for kv in leaf_keys(item, f"{prefix}[{i}]")]
    return [(prefix, data)]


def account_for_every_key(out: Translation, process: dict) -> None:
    """Every setting of the job is translated, not translated or the same here: any other (a key read and dropped
    without a word) is listed as not translated."""

    def covered(path: str) -> bool:
        parts = path.replace("[", ".[").split(".")
        return any(".".join(parts[:n]).replace(".[", "[") in out.accounted for n in range(1, len(parts) + 1))

    for path, value in leaf_keys(process):
        if not covered(path):
            out.skip(path, value, UNKNOWN)


def read_job(path: str | Path) -> tuple[str, dict[str, Any], list[Any]]:
    """(config.name, config.process[0], the other processes) of an ai-toolkit job file; anything else is a
    UserError naming the file."""
    from toolkit.config.layers import read_yaml_layer

    layer = read_yaml_layer(path)
    if layer.problems:
        raise ConfigError(layer.problems, header=f"{path}: not a valid job file")
    data = layer.data
    config = data.get("config")
    processes = config.get("process") if isinstance(config, dict) else None
    if not isinstance(processes, list) or not processes or not isinstance(processes[0], dict):
        raise UserError(f"{path}: not an ai-toolkit job file: it has no config.process list of settings\n  fix: give "
                        "an ai-toolkit job (job: extension, config: {name: ..., process: [{type: sd_trainer, ...}]})")
    process = processes[0]
    kind = process.get("type")
    if kind not in TRAINER_TYPES:
        raise UserError(f"{path}: config.process[0].type is {kind!r}, not a LoRA trainer ({', '.join(TRAINER_TYPES)}); "
                        "only training jobs translate")
    return str(config.get("name") or Path(path).stem), process, processes[1:]


def as_float(value: Any, key: str) -> float:
    """A number from YAML: PyYAML reads `1e-4` (no dot) as a string, which ai-toolkit's own loader accepts."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"{key}: expected a number, got {value!r}") from None


def as_int(value: Any, key: str) -> int:
    number = as_float(value, key)
    if number != int(number):
        raise UserError(f"{key}: expected a whole number, got {value!r}")
    return int(number)
