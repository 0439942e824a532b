"""Where a LoRA to load comes from, and a private copy of its files.

A LoRA is named by a run folder (its final/, or one of its checkpoints), a checkpoint folder, a final/ or adapter
folder, or a LoRA file. `sample` reads a run's own LoRA (run_lora); `network.init_from` reads any of them
(lora_source). Either way the files are first copied (hard-linked where the disk allows) into a temporary folder
(LoraSnapshot): a run that goes on training may remove a checkpoint (save.keep_last), and `train --fresh` moves
its run folder aside, while the files are still to be read. A checkpoint's files are checked against its
meta.json after the copy, so a checkpoint that is being written or removed is never read half-way. Nothing in the
run folder is written, and its lock is not taken: a running run can be read.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserError
from toolkit.train.checkpoint import META, _sha256, list_checkpoints, step_dir_name, verify_checkpoint

# What a folder's copy takes: LoRA weights and their configs, in the folder or one level down (Wan 2.2's experts).
LORA_SUFFIXES = (".safetensors", ".json", ".bin")


@dataclass(frozen=True)
class LoraSource:
    path: Path          # a file or a folder of LoRA files
    label: str          # what it is, for the log: "final/ of outputs/x", "checkpoint step 20 of outputs/x", ...
    files: dict[str, str] | None = None   # a checkpoint's LoRA files (relative to path) and their sha256 in its
                                          # meta.json; None: every file in path
    tag: str = "file"   # short name for output folders: final, step-000020, file


def _listing(folder: Path, most: int = 12) -> str:
    """What `folder` holds, for a message: the first names (folders with a /), and how many there are."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not names:
        return "nothing"
    return ", ".join(names[:most]) + (f", ... ({len(names)} entries)" if len(names) > most else "")


def _checkpoint_source(path: Path, run_label: str = "") -> LoraSource:
    checkpoint, problem = verify_checkpoint(path)
    if checkpoint is None:
        raise UserError(f"{path}: not a complete checkpoint: {problem}\n  fix: give a finished checkpoint (its "
                        "meta.json is written last)")
    files = {name: checkpoint.meta["files"][name]["sha256"] for name in checkpoint.meta.get("lora_files", [])}
    if not files:
        raise UserError(f"{path} is a checkpoint from before checkpoints held the LoRA files (it has only the "
                        "trainer's own tensors)\n  fix: use the run's final/ or a checkpoint written since")
    label = f"checkpoint step {checkpoint.step}{run_label}" if run_label else f"checkpoint {path}"
    return LoraSource(path, label, files, step_dir_name(checkpoint.step))


def run_lora(run_dir: Path, step: int | None = None, log=print) -> LoraSource:
    """The LoRA of a run folder: its checkpoint of `step`, or its final/, or (no final/ yet: a run that is still
    training) its latest finished checkpoint. A UserError names the folder and what it holds."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        where = f"; {run_dir.parent} holds: {_listing(run_dir.parent)}" if run_dir.parent.is_dir() else ""
        raise UserError(f"run folder {run_dir} does not exist{where}\n  fix: give a run folder (run.output_dir, "
                        "e.g. outputs/<run.name>)")
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    steps = ", ".join(str(s) for s, _ in sorted(checkpoints)) or "none"
    if step is not None:
        path = run_dir / "checkpoints" / step_dir_name(step)
        if not path.is_dir():
            raise UserError(f"{run_dir} has no checkpoint of step {step} ({path}); its checkpoints: steps {steps}"
                            "\n  fix: --checkpoint one of those steps, or leave it out for final/")
        return _checkpoint_source(path, f" of {run_dir}")
    if (run_dir / "final").is_dir():
        return LoraSource(run_dir / "final", f"final/ of {run_dir}", tag="final")
    for _, path in checkpoints:
        checkpoint, problem = verify_checkpoint(path)
        if checkpoint is None:
            log(f"warning: skipping checkpoint {path}: {problem}")
            continue
        log(f"{run_dir} has no final/ yet (a run still training, or one that stopped): using its latest finished "
            f"checkpoint, {path.name}")
        return _checkpoint_source(path, f" of {run_dir}")
    raise UserError(f"{run_dir} has no final/ and no finished checkpoint (it holds: {_listing(run_dir)})\n"
                    "  fix: give the folder of a run that has saved a checkpoint (save.every) or finished")


def lora_source(path: Path, log=print, key: str = "network.init_from") -> LoraSource:
    """What `path` (the value of setting `key`) names: a LoRA file, a checkpoint folder, a run folder (its final/,
    see run_lora), or a folder of LoRA files (final/, a PEFT adapter folder)."""
    path = Path(path)
    if path.is_file():
        return LoraSource(path, f"file {path}")
    if not path.is_dir():
        relative = "" if path.is_absolute() else f" (relative paths are taken from {Path.cwd()})"
        raise UserError(f"{key}: {path} does not exist{relative}\n  fix: give a LoRA file (.safetensors), an "
                        "adapter folder, a run folder or a checkpoint folder")
    try:
        if (path / META).is_file():
            return _checkpoint_source(path)
        if (path / "final").is_dir() or (path / "checkpoints").is_dir():
            return run_lora(path, log=log)
    except UserError as err:
        raise UserError(f"{key}: {err}") from None
    return LoraSource(path, f"folder {path}", tag=path.name)


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the file system allows (instant, and the file survives a rename or removal of its
    original), else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


class LoraSnapshot:
    """A private copy of a LoraSource's files in a temporary folder; `path` is where to load them from (the
    folder, or the file for a file source). Remove it with close() (or use it as a context manager)."""

    def __init__(self, source: LoraSource):
        self.source = source
        self.folder = Path(tempfile.mkdtemp(prefix="toolkit-lora-"))
        try:
            self.path = self._take()
        except BaseException:
            self.close()
            raise

    def _take(self) -> Path:
        source = self.source
        if source.path.is_file():
            _link_or_copy(source.path, self.folder / source.path.name)
            return self.folder / source.path.name
        names = list(source.files) if source.files else [
            p.relative_to(source.path).as_posix() for p in sorted(source.path.rglob("*"))
            if p.is_file() and p.suffix in LORA_SUFFIXES and len(p.relative_to(source.path).parts) <= 2]
        try:
            for name in names:
                _link_or_copy(source.path / name, self.folder / name)
        except FileNotFoundError as err:
            raise UserError(f"{source.label}: {err.filename} went away while it was read (a run rotating its "
                            "checkpoints?)\n  fix: run the command again, or name another checkpoint") from None
        changed = [name for name, digest in (source.files or {}).items() if _sha256(self.folder / name) != digest]
        if changed:  # a checkpoint: the copies must be the files its meta.json describes
            raise UserError(f"{source.label} changed while it was read ({', '.join(changed)} no longer match its "
                            "meta.json)\n  fix: run the command again, or name another checkpoint")
        return self.folder

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "LoraSnapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
