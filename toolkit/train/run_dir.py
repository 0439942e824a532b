"""The run folder's layout, and moving an old run aside (never deleting it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


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

    def move_aside(self) -> Path:
        """Rename the run folder to <name>.old-<timestamp>[-n] and return the new path."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.root.with_name(f"{self.root.name}.old-{stamp}")
        n = 1
        while target.exists():
            target = self.root.with_name(f"{self.root.name}.old-{stamp}-{n}")
            n += 1
        self.root.rename(target)
        return target
