"""run.output_dir before any model loads: a folder (or one that can be created) the toolkit can write in, beside
which its lock file can be written, on a disk with room."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.disk import MIN_FREE_BYTES, format_bytes, free_bytes, nearest_existing, write_problem

FIX_ELSEWHERE = "set run.output_dir to a folder you can write in"


def output_problems(output_dir: str, where: str, data_folders: dict[str, str] | None = None) -> list[str]:
    """What keeps the run from writing its folder `output_dir` (set in `where`): not a folder, a folder of the
    user's that no run wrote (a fresh start would set it aside as an earlier attempt), one of the run's own data
    folders or a folder that holds one (`data_folders`: key -> path; a fresh start would move the data aside with
    the run), no write access, no room. A run folder inside a data folder is fine: data folders are not read
    recursively."""
    key = f"'run.output_dir' in {where}"
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        return [f"{key}: {out} is a file, not a folder; {FIX_ELSEWHERE} (it is created when missing), or move the file"]
    overlap = _data_overlap(out, data_folders or {})
    if overlap:
        return [f"{key}: {overlap}; set run.output_dir to a folder of its own, outside the data (for example "
                f"outputs/<name>)"]
    foreign = foreign_files(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return [f"{key}: {out} holds files that no run of this toolkit wrote ({shown}); a run's folder is new, empty "
                f"or an earlier run's (with its config.yaml); set run.output_dir to a new folder (it is created)"]
    existing = nearest_existing(out)
    if not existing.is_dir():
        return [f"{key}: {out} cannot be created: {existing} is a file, not a folder; {FIX_ELSEWHERE}"]
    problems = []
    # The run writes in its folder, and beside it: its lock file, and a set-aside earlier run.
    for folder in dict.fromkeys([existing, existing.parent] if existing == Path(os.path.abspath(out)) else [existing]):
        why = write_problem(folder)
        if why:
            what = "the folder" if folder == existing else "the folder that holds it (the run's lock file goes there)"
            problems.append(f"{key}: cannot write in {folder}, {what} ({why}); {FIX_ELSEWHERE}, or make it writable")
    free = free_bytes(existing)
    if free < MIN_FREE_BYTES:
        problems.append(f"{key}: only {format_bytes(free)} free on the disk of {existing}; a run needs at least "
                        f"{format_bytes(MIN_FREE_BYTES)} to start (its checkpoints' size is checked once the LoRA is "
                        f"built); free space there, or set run.output_dir on another disk")
    return problems


def _data_overlap(out: Path, data_folders: dict[str, str]) -> str:
    """How run.output_dir overlaps a data folder: the same folder, or holding it ('' when apart or inside it)."""
    run = Path(os.path.abspath(out))
    for key, folder in data_folders.items():
        data = Path(os.path.abspath(folder))
        if run == data:
            return f"{out} is the data folder of '{key}'"
        if run in data.parents:
            return f"{out} holds the data folder of '{key}' ({folder}): a fresh start would move the data aside"
    return ""


RUN_MARKERS = ("config.yaml", "checkpoints", "final")  # a run writes config.yaml first, then these folders


def foreign_files(root: Path) -> list[str]:
    """The names in an existing folder that show it is not a run of this toolkit's: empty when the folder is
    missing, empty (hidden files aside, a desktop's .DS_Store) or a run's. Such a folder is never moved aside or
    cleared (train/resume.py refuses it too)."""
    if not root.is_dir() or any((root / n).exists() for n in RUN_MARKERS):
        return []
    return sorted(c.name for c in root.iterdir() if not c.name.startswith("."))
