"""The run folder's layout, moving an old run aside, and the cleanup rule for what failed runs leave.

The cleanup rule (run by the main process while it holds the folder's lock, train/run_lock.py) removes only
what the toolkit itself names and writes, never a user's file:
- unfinished saves: `checkpoints/.tmp-step-*`, `.final.tmp` and `.config.yaml.tmp` in the run folder (a run
  that died while writing them; the lock proves that no live run is writing them now);
- failed starts: a run folder that holds nothing but what a start writes before its first step (config.yaml
  and empty checkpoints/, samples/, logs/ folders) is cleared and reused rather than set aside, and `<name>.old-*`
  folders beside it that hold nothing more (set aside by earlier versions) are removed, unless a run holds a
  lock on them.
Anything else, an earlier run with checkpoints, samples, logs or files of the user's, is moved aside to
`<name>.old-<time>` and kept.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path


def name_aside(path: Path, label: str) -> Path:
    """<name>.<label>-<timestamp>, beside `path`, with -1, -2, ... added while that name is taken (two in one
    second: an extended run exported twice, a --fresh start repeated)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = path.with_name(f"{path.name}.{label}-{stamp}"), 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.{label}-{stamp}-{n}"), n + 1
    return target


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def final(self) -> Path:
        return self.root / "final"

    def sample_dir(self, step: int) -> Path:
        return self.samples / f"step-{step:06d}"

    def create(self) -> None:
        for folder in (self.root, self.checkpoints, self.samples, self.logs):
            folder.mkdir(parents=True, exist_ok=True)

    def has_content(self) -> bool:
        return self.root.is_dir() and any(self.root.iterdir())

    def foreign_files(self) -> list[str]:
        """The names that show an existing folder is not a run of this toolkit's (preflight/output_location.py)."""
        from toolkit.preflight.output_location import foreign_files

        return foreign_files(self.root)

    def move_aside(self) -> Path:
        """Rename the run folder to <name>.old-<timestamp>[-n] and return the new path."""
        target = name_aside(self.root, "old")
        self.root.rename(target)
        return target

    def remove_unfinished(self, log) -> None:
        """Remove the temporary files and folders of saves that did not finish (see the module's rule)."""
        leftovers = sorted(self.checkpoints.glob(".tmp-step-*")) if self.checkpoints.is_dir() else []
        leftovers += [p for p in (self.root / ".final.tmp", self.root / ".config.yaml.tmp", self.root / ".plan.json.tmp")
                      if p.exists()]
        for path in leftovers:
            _remove(path)
            log(f"removed {path}: the temporary files of a save that did not finish")

    def holds_only_start_files(self) -> bool:
        """Whether the folder holds only what a start writes before its first step (a start that failed)."""
        return _only_start_files(self.root)

    def clear_start_files(self) -> None:
        """Remove what a failed start wrote (holds_only_start_files() must be true)."""
        for child in self.root.iterdir():
            _remove(child)

    def remove_failed_starts_beside(self, log) -> None:
        """Remove `<name>.old-*` folders beside this one that hold only a failed start's files."""
        from toolkit.train.run_lock import lock_path

        for old in sorted(self.root.parent.glob(f"{self.root.name}.old-*")):
            if old.is_dir() and not old.is_symlink() and not lock_path(old).exists() and _only_start_files(old):
                shutil.rmtree(old)
                log(f"removed {old}: an earlier start that failed before its first step (config.yaml and empty "
                    "folders only)")


START_FILES = ("config.yaml", ".config.yaml.tmp", "plan.json", ".plan.json.tmp", ".final.tmp")
START_FOLDERS = ("checkpoints", "samples", "logs")


def _only_start_files(root: Path) -> bool:
    for child in root.iterdir():
        if child.is_symlink():
            return False
        if child.name in START_FILES:
            continue
        if child.name in START_FOLDERS and child.is_dir() and all(
                c.name.startswith(".tmp-step-") and child.name == "checkpoints" for c in child.iterdir()):
            continue
        return False
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
