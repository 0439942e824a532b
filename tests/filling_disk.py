"""A disk that fills up mid-run, for in-process runs: every writer the toolkit uses (safetensors, torch.save through
a Python file, pathlib's write_text/write_bytes/open, PIL, matplotlib, TensorBoard's event writer) is counted, and
once the disk is full every write raises what that writer raises on a real full disk (checked against a tmpfs in
tests/test_disk_full.py): an OSError with ENOSPC, safetensors' SafetensorError, torch.save's RuntimeError raised
while the OSError is handled."""

from __future__ import annotations

import errno
import io
import os
import pathlib
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


def enospc(path: object = None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([str(path)] if path is not None else []))


class _CountedFile(io.IOBase):
    """A file opened for writing whose writes are counted (torch.save and metrics.jsonl write through these)."""

    def __init__(self, disk: "FillingDisk", handle, path: Path):
        self._disk, self._handle, self._path = disk, handle, path

    def write(self, data):
        with self._disk.writing("open().write", self._path) as full:
            if full:
                self._handle.write(data[:len(data) // 2])  # part of it, as a real full disk leaves
                raise enospc()
            return self._handle.write(data)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def flush(self):
        return self._handle.flush()

    def close(self):
        return self._handle.close()

    @property
    def closed(self):
        return self._handle.closed

    def writable(self):
        return True

    def fileno(self):
        return self._handle.fileno()


class FillingDisk:
    """Counts writes (`writes`: (writer, path) in order; a writer's own inner writes are not counted again). The disk
    is full from the first write for which `fills(writer, path, n)` is true (n: its 1-based number) on; None: never."""

    def __init__(self, monkeypatch, fills: Callable[[str, str, int], bool] | None = None):
        self.writes: list[tuple[str, str]] = []
        self.fills = fills
        self.failed: tuple[str, str] | None = None  # the write that found the disk full first
        self._local = threading.local()
        self._lock = threading.Lock()
        self._patch(monkeypatch)

    @contextmanager
    def writing(self, writer: str, path: object) -> Iterator[bool]:
        """Around one write: yields whether the disk is full (always False for a write inside another)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            if depth:
                yield False
                return
            with self._lock:
                self.writes.append((writer, str(path)))
                if self.failed is None and self.fills is not None and self.fills(writer, str(path), len(self.writes)):
                    self.failed = (writer, str(path))
                full = self.failed is not None
            yield full
        finally:
            self._local.depth = depth

    def _patch(self, mp) -> None:
        import safetensors.torch
        from matplotlib.figure import Figure
        from PIL import Image
        from safetensors import SafetensorError
        from tensorboard.summary.writer.record_writer import RecordWriter

        disk = self

        def counted(writer: str, original, path_of, fail) -> Callable:
            def write(*args, **kwargs):
                with disk.writing(writer, path_of(*args, **kwargs)) as full:
                    if full:
                        fail(*args, **kwargs)
                    return original(*args, **kwargs)
            return write

        def safetensors_full(tensors, filename, metadata=None):
            open(filename, "wb").close()  # created, then its first write failed
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        def file_full(path, *args, **kwargs):
            path_open(path, "w").close()
            raise enospc()

        def raise_enospc(*args, **kwargs):
            raise enospc()

        path_open = pathlib.Path.open
        mp.setattr(safetensors.torch, "serialize_file", counted("safetensors", safetensors.torch.serialize_file,
                                                                lambda t, name, *a, **k: name, safetensors_full))
        mp.setattr(pathlib.Path, "write_text", counted("write_text", pathlib.Path.write_text,
                                                       lambda path, *a, **k: path, file_full))
        mp.setattr(pathlib.Path, "write_bytes", counted("write_bytes", pathlib.Path.write_bytes,
                                                        lambda path, *a, **k: path, file_full))

        def counted_open(path, mode="r", *args, **kwargs):
            handle = path_open(path, mode, *args, **kwargs)
            return _CountedFile(disk, handle, path) if any(c in mode for c in "wax+") else handle

        mp.setattr(pathlib.Path, "open", counted_open)
        mp.setattr(Image.Image, "save", counted("PIL", Image.Image.save, lambda image, fp, *a, **k: fp, raise_enospc))
        mp.setattr(Figure, "savefig", counted("matplotlib", Figure.savefig, lambda fig, name, *a, **k: name,
                                              raise_enospc))
        # TensorBoard writes in a thread of its own; the error comes back at its next call in the main thread
        mp.setattr(RecordWriter, "write", counted("tensorboard", RecordWriter.write,
                                                  lambda writer, data: writer._writer.filename, raise_enospc))
