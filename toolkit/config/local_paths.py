"""Paths in a config made absolute where the config is read, so that the run folder's config.yaml names the same
files from any working folder (the web UI's resume, `sample` and `train <run>/config.yaml` run elsewhere).

The schema marks each path field (fields.opt(path=...)):
- "local": a file or folder on this machine (data.path, run.output_dir, sample.images, ...), always made absolute
  against the working folder, as every command reads it;
- "existing": a value that may also be a Hub id or a word (model.name_or_path, network.init_from, train.resume),
  made absolute only when it names something that exists here.

Run folders written before this recorded the paths as given; `same_path` lets a resume compare such a relative
path with the absolute one a config gives now.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

LOCAL, EXISTING = "local", "existing"


def _absolute(value: Any, kind: str) -> Any:
    """`value` made absolute (lists of paths, and lists of them, element by element); anything else as it is."""
    if isinstance(value, (list, tuple, ListConfig)):
        return [_absolute(v, kind) for v in value]
    if not isinstance(value, str) or not value or "://" in value or value.startswith("tiny:"):
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    if kind == EXISTING and not path.exists():
        return value  # a Hub id, or a word such as auto
    return os.path.abspath(path)


def is_section(node: Any) -> bool:
    """A node of a structured config that is a section (a dataclass), not a leaf, list or free mapping."""
    return isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))


def _section_paths(node: DictConfig) -> None:
    kind_of = {f.name: f.metadata.get("path") for f in dataclasses.fields(OmegaConf.get_type(node))}
    for key in list(node.keys()):
        child = node._get_node(key)
        if is_section(child):
            _section_paths(child)
        elif isinstance(child, ListConfig) and len(child) and is_section(child._get_node(0)):
            for entry in child:
                _section_paths(entry)
        elif kind_of.get(key):
            value = OmegaConf.select(node, str(key), throw_on_missing=False)
            if isinstance(value, (ListConfig, DictConfig)):
                value = OmegaConf.to_container(value, resolve=True)
            made = _absolute(value, kind_of[key])
            if made != value:
                node[key] = made


def make_absolute(cfg: DictConfig) -> None:
    """Every path field of a merged, structured config made absolute in place (see the module's note)."""
    _section_paths(cfg)


def adopt_recorded_paths(saved: dict, current: dict, schema: DictConfig) -> list[str]:
    """In `saved` (a run's config.yaml), each path that names what `current` names replaced by `current`'s, so that a
    resume compares the files, not how they were written: an older run's relative path (same_path), or an absolute
    one gone since while a file or folder of the same name is there now (the project moved: moved_path). Returns a
    line for each moved one, to say (`schema`: the run's family's structured config, load.schema_for)."""
    moved: list[str] = []
    _adopt(schema, saved, current, "", moved, _old_working_folder(saved, current))
    return moved


def _old_working_folder(saved: dict, current: dict) -> Path | None:
    """The working folder an older run was started from, when its config.yaml kept run.output_dir relative: the
    run folder is the same one now (absolute in `current`), so the folder is what remains of it without that tail."""
    before, after = saved.get("run", {}).get("output_dir"), current.get("run", {}).get("output_dir")
    if not isinstance(before, str) or not isinstance(after, str) or Path(before).is_absolute():
        return None
    tail = Path(os.path.normpath(before)).parts
    if tail in ((), (".",)) or ".." in tail or Path(after).parts[-len(tail):] != tail:
        return None
    return Path(*Path(after).parts[:-len(tail)])


def _adopt(node: DictConfig, saved: dict, current: dict, prefix: str, moved: list[str],
           old_cwd: Path | None) -> None:
    kind_of = {f.name: f.metadata.get("path") for f in dataclasses.fields(OmegaConf.get_type(node))}
    for key in node.keys():
        if key not in saved or key not in current:
            continue
        child, before, after = node._get_node(key), saved[key], current[key]
        if is_section(child):
            if isinstance(before, dict) and isinstance(after, dict):
                _adopt(child, before, after, f"{prefix}{key}.", moved, old_cwd)
        elif isinstance(child, ListConfig) and dataclasses.is_dataclass(child._metadata.element_type):
            if isinstance(before, list) and isinstance(after, list):
                for n, (old, new) in enumerate(zip(before, after)):
                    if isinstance(old, dict) and isinstance(new, dict):
                        entry = OmegaConf.structured(child._metadata.element_type)
                        _adopt(entry, old, new, f"{prefix}{key}[{n}].", moved, old_cwd)
        elif kind_of.get(key) and before != after:
            if same_path(before, after, old_cwd):
                saved[key] = after
            elif moved_path(before, after):
                saved[key] = after
                moved.append(f"{prefix}{key}: {before} is gone; {after}, of the same name, is read in its place")


def moved_path(before: Any, after: Any) -> bool:
    """Whether `before`, an absolute path that no longer exists, and `after`, one that does, name the same file or
    folder moved with its project: the same last two names (data/shapes, data/train.jsonl)."""
    if isinstance(before, list) and isinstance(after, list):
        return len(before) == len(after) and all(b == a or moved_path(b, a) for b, a in zip(before, after))
    if not isinstance(before, str) or not isinstance(after, str) or not Path(before).is_absolute():
        return False
    return not Path(before).exists() and Path(after).exists() and Path(before).parts[-2:] == Path(after).parts[-2:]


def same_path(before: Any, after: Any, old_cwd: Path | None = None) -> bool:
    """Whether a path recorded by an older run (`before`, relative to the folder it was started from) names what
    `after` (absolute, from this toolkit) names. Resolved against `old_cwd` when that folder is known
    (_old_working_folder), or against this one, or by `after` ending with it: with a folder and a name at least, so
    that a bare file name (train.jsonl) is not taken for any file of that name."""
    if isinstance(before, list) and isinstance(after, list):
        return len(before) == len(after) and all(same_path(b, a, old_cwd) for b, a in zip(before, after))
    if not isinstance(before, str) or not isinstance(after, str) or Path(before).is_absolute():
        return False
    before = os.path.expanduser(before)
    if Path(before).is_absolute():
        return os.path.normpath(before) == os.path.normpath(after)
    if old_cwd is not None and os.path.normpath(old_cwd / before) == os.path.normpath(after):
        return True  # else the run folder may have moved without its data: the checks below
    if _absolute(before, LOCAL) == after:
        return True
    tail = Path(os.path.normpath(before)).parts
    return len(tail) >= 2 and ".." not in tail and Path(after).parts[-len(tail):] == tail
