"""run.output_dir before any model loads: a folder (or one that can be created) the toolkit can write in, beside
which its lock file can be written, on a disk with room."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.disk import MIN_FREE_BYTES, format_bytes, free_bytes, nearest_existing, write_problem

FIX_ELSEWHERE = "set run.output_dir to a folder you can write in"


def output_problems(output_dir: str, where: str) -> list[str]:
    """What keeps the run from writing its folder `output_dir` (set in `where`)."""
    key = f"'run.output_dir' in {where}"
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        return [f"{key}: {out} is a file, not a folder; {FIX_ELSEWHERE} (it is created when missing), or move the file"]
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
