"""The disk under the run folder: can the toolkit write there, how much room is left, was an error a full disk."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

# Checked before any model loads, when the size of the LoRA (and so of a checkpoint) is not known yet: room for
# the logs, samples and a small LoRA's checkpoint. The checkpoint's real size is checked once the LoRA is built.
MIN_FREE_BYTES = 100 * 2**20

# A full disk, or a full quota: the same fix.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in DISK_FULL


def nearest_existing(path: Path) -> Path:
    """`path`, or the closest of its parents that exists (what a mkdir -p of `path` would write into)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes free for this user on the disk that holds `path` (or its nearest existing parent)."""
    return shutil.disk_usage(nearest_existing(path)).free


def write_problem(folder: Path) -> str | None:
    """Why a file cannot be created in the existing `folder` (a small write probe), or None when it can."""
    probe = folder / f".toolkit-write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as err:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
        return err.strerror or str(err)
    return None


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
