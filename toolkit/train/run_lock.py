"""The lock a run holds on its folder, so that two runs never write into one folder.

The lock is a file beside the run folder, `<parent>/.<name>.lock` (beside, not inside: a fresh start moves the
folder aside while the lock stays on its name). It holds the holder's pid, host and start time as JSON, and the
holder keeps an exclusive flock on it for as long as it runs; the kernel drops that flock when the process dies,
however it dies. So:
- a lock that is flocked, or names a live pid on this host, is a live run's: the newcomer refuses, naming it;
- a lock that is not flocked and names a dead pid on this host is a dead run's: it is taken over, with a note;
- a lock that is not flocked and names another host cannot be proven dead from here: refused, with the fix.
Only the main process of a run takes the lock; the other processes never touch it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from toolkit.errors import UserError


def lock_path(run_root: Path) -> Path:
    return run_root.parent / f".{run_root.name}.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _describe(holder: dict) -> str:
    started = holder.get("started")
    since = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if started else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}"


def lock_holder(run_root: Path) -> tuple[dict | None, bool]:
    """The lock file's holder (None when there is no lock) and whether it is alive: a live pid on this host, or a
    lock from another host, which cannot be proven dead from here. Read only: never flocked, so a run starting at
    this moment is never refused because someone looked (the web UI's runs page)."""
    try:
        holder = json.loads(lock_path(run_root).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, False
    except (OSError, ValueError):
        return {}, True  # being written by a run that is starting
    if not isinstance(holder, dict):
        return {}, True
    if holder.get("host") != socket.gethostname():
        return holder, True
    try:
        return holder, _pid_alive(int(holder.get("pid", 0)))
    except (TypeError, ValueError):
        return holder, True


def live_holder_refusal(run_root: Path) -> UserError | None:
    """The error `RunLock.acquire` would raise for a run folder that a live run holds, found without taking the
    lock (a look must never make a starting run fail); None when no live run holds it."""
    lock = RunLock(run_root)
    try:
        fd = os.open(lock.path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        holder = lock._read(fd)
    finally:
        os.close(fd)
    if not holder:
        return lock._refusal(holder, "it is running")  # its holder is still writing its name
    if holder.get("host") != socket.gethostname():
        return lock._refusal(holder, "it may still be running")
    return lock._refusal(holder, "it is running") if _pid_alive(int(holder.get("pid", 0))) else None


class RunLock:
    """An exclusive lock on a run folder: acquire() before anything in the folder is read or moved."""

    def __init__(self, run_root: Path):
        self.run_root = run_root
        self.path = lock_path(run_root)
        self._fd: int | None = None

    def acquire(self, notice: Callable[[str], None]) -> None:
        """Take the lock, or raise a UserError naming the live run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # the file may be removed by its holder between our open and our flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._read(fd)
                os.close(fd)
                raise self._refusal(holder, "it is running") from None
            try:
                same_file = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same_file = False
            if not same_file:
                os.close(fd)
                continue
            holder = self._read(fd)
            if holder:
                here = holder.get("host") == socket.gethostname()
                if not here or (holder.get("pid") != os.getpid() and _pid_alive(int(holder.get("pid", 0)))):
                    os.close(fd)
                    raise self._refusal(holder, "it may still be running" if not here else "it is running")
                notice(f"note: {self.path} was left by a run that is no longer running ({_describe(holder)}); "
                       "taken over")
            self._write(fd)
            self._fd = fd
            return
        raise UserError(f"could not take the lock {self.path} for {self.run_root}: it kept changing; another run "
                        "is starting there\n  fix: wait for it, or set run.output_dir to another folder")

    def release(self) -> None:
        """Remove the lock file (while still holding its flock) and let go."""
        if self._fd is None:
            return
        try:
            if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                self.path.unlink()
        except OSError:
            pass  # already gone: nothing is left to release but the descriptor
        os.close(self._fd)
        self._fd = None

    def _refusal(self, holder: dict, state: str) -> UserError:
        who = _describe(holder) if holder else "a process that is still writing its name"
        fix = ("wait for it to finish, stop it, or set run.output_dir to another folder"
               if state == "it is running" else
               f"if that run has ended, remove {self.path}; else set run.output_dir to another folder")
        return UserError(f"run folder {self.run_root} is in use by another run ({who}; {state}); two runs in one "
                         f"folder would mix their checkpoints\n  lock: {self.path}\n  fix: {fix}")

    @staticmethod
    def _read(fd: int) -> dict:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096)
        try:
            holder = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        except ValueError:
            return {}
        return holder if isinstance(holder, dict) else {}

    @staticmethod
    def _write(fd: int) -> None:
        text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                           "command": " ".join(sys.argv)}) + "\n"
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, text.encode("utf-8"))
        os.fsync(fd)
