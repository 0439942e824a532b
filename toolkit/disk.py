"""The disk under the run folder: can the toolkit write there, how much room is left, was an error a full disk.

Every writer the toolkit uses says "disk full" its own way: an OSError with ENOSPC or EDQUOT (Python files, PIL,
PyAV, TensorBoard's writer thread, json and yaml dumps), safetensors' SafetensorError with the OS's text in its
message, torch.save's RuntimeError raised while the OSError is handled (when it writes to a Python file object).
`is_disk_full` recognises them all; `disk_full_named` turns one into a UserError that names what was being
written, the disk (its mount point and device, as `df` shows them), the room needed and the room left.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from toolkit.errors import UserError

# Checked before any model loads, when the size of the LoRA (and so of a checkpoint) is not known yet: room for
# the logs, samples and a small LoRA's checkpoint. The checkpoint's real size is checked once the LoRA is built.
MIN_FREE_BYTES = 100 * 2**20

# A full disk, or a full quota: the same fix.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


# How writers that raise no OSError of their own say it: safetensors ("I/O error: No space left on device (os error
# 28)"), and the OS's own texts quoted in other libraries' messages.
DISK_FULL_TEXTS = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    """`err` and the errors it was raised from or while handling, innermost last (each once)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` (or an error it was raised from or while handling) says the disk or the quota is full."""
    for link in _chain(err):
        if isinstance(link, OSError) and link.errno in DISK_FULL:
            return True
        if any(text in str(link).lower() for text in DISK_FULL_TEXTS):
            return True
    return False


def failed_file(err: BaseException) -> str | None:
    """The file a disk-full error names, when one of its chain does (an OSError's filename)."""
    for link in _chain(err):
        if isinstance(link, OSError) and link.filename:
            return str(link.filename)
    return None


def disk_of(path: Path) -> str:
    """The disk that holds `path` as `df` names it: its mount point, and the device or file system mounted there."""
    mount = Path(os.path.realpath(nearest_existing(path)))
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    source = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[1].replace("\\040", " ") == str(mount):
                source = fields[0] if fields[0] == fields[2] else f"{fields[0]}, {fields[2]}"  # the last mount wins
    return f"the disk mounted at {mount}" + (f" ({source})" if source else "")


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


RESUME_FIX = ("free space on that disk (or set run.output_dir on another disk and move the run folder there), then "
              "run the same command: it resumes from the last checkpoint")


class DiskFull(UserError):
    """A write found the disk full: what was written and where, the room `needed_by` needs (when known), the room
    left and on which disk, what was done about it (`done`), and the fix. Exit 2, like every UserError."""

    def __init__(self, what: str, folder: Path, needed: int | None = None, needed_by: str = "it", done: str = "",
                 fix: str = RESUME_FIX):
        self.what, self.folder, self.needed, self.needed_by, self.done, self.fix = \
            what, Path(folder), needed, needed_by, done, fix
        need = f"{needed_by} needs about {format_bytes(needed)}, " if needed else ""
        super().__init__(f"disk full while writing {what} in {folder}: {need}{format_bytes(free_bytes(folder))} is "
                         f"free on {disk_of(folder)}{'; ' + done if done else ''}\n  fix: {fix}")

    def needing(self, needed: int | None, needed_by: str) -> DiskFull:
        """The same message with the room needed, where the writer could not know it (a log line, a sample)."""
        if self.needed is not None or needed is None:
            return self
        return DiskFull(self.what, self.folder, needed, needed_by, self.done, self.fix)


def as_disk_full(err: BaseException, folder: Path) -> DiskFull | None:
    """`err` as a DiskFull (a writer's own full-disk error, named by the file it names or as `folder`'s files), or
    None when it is not one."""
    if isinstance(err, DiskFull):
        return err
    if isinstance(err, UserError) or not is_disk_full(err):
        return None
    file = failed_file(err)
    return DiskFull(Path(file).name, Path(file).parent) if file else DiskFull("the run's files", folder)


@contextlib.contextmanager
def disk_full_named(what: str, folder: Path, needed: int | None = None, needed_by: str = "it",
                    remove: Path | None = None, fix: str = RESUME_FIX) -> Iterator[None]:
    """A full disk inside the block becomes a DiskFull (exit 2, no traceback); `remove` (a temporary file or folder
    the block writes) is removed whatever stopped the block."""
    try:
        yield
    except BaseException as err:
        if remove is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(remove) if remove.is_dir() and not remove.is_symlink() else remove.unlink(missing_ok=True)
        if isinstance(err, UserError) or not is_disk_full(err):
            raise
        raise DiskFull(what, folder, needed, needed_by, "its temporary files were removed" if remove else "",
                       fix) from None


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed into place (a reader never sees half of it); a full disk
    is named."""
    tmp = path.with_name(f".{path.name}.tmp")
    with disk_full_named(path.name, path.parent, len(text.encode()), remove=tmp):
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
