"""Checkpoints: written to a temporary folder, fsynced, renamed; verified by checksum when read.

    checkpoints/step-000200/
        lora.safetensors      the exact trainable tensors
        ema.safetensors       the EMA of those tensors (only when train.ema_decay > 0)
        optimizer.pt          optimizer state (8-bit states as plain tensors)
        trainer_state.pt      step, scheduler, grad scaler, RNG states (python, numpy, torch CPU and device),
                              data order position, NaN streak
        config.yaml           the resolved config of the run
        meta.json             written last: step, config hash, versions, size and sha256 of each file

"Latest" is the highest step whose meta.json exists and whose files match it; never a file time.
A save interrupted by a crash leaves only a `.tmp-step-*` folder, which is never taken for a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from toolkit import __version__

STEP_DIR = re.compile(r"^step-(\d{6,})$")
META = "meta.json"
EMA_FILE = "ema.safetensors"


@dataclass
class Checkpoint:
    path: Path
    step: int
    meta: dict


@dataclass
class CheckpointState:
    """What a checkpoint holds, loaded: the tensors and states the trainer restores."""

    lora: dict[str, torch.Tensor]
    optimizer: dict
    trainer: dict
    ema: dict[str, torch.Tensor] | None


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(checkpoints_dir: Path, step: int, lora: dict[str, torch.Tensor], optimizer_state: dict,
                    trainer_state: dict, config_yaml: str, config_hash: str,
                    ema: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a complete checkpoint atomically and return its folder."""
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / step_dir_name(step)
    tmp = checkpoints_dir / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in lora.items()}, str(tmp / "lora.safetensors"))
    if ema is not None:
        save_file({k: v.detach().contiguous().cpu() for k, v in ema.items()}, str(tmp / EMA_FILE))
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(trainer_state, tmp / "trainer_state.pt")
    (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
    files = {}
    for path in sorted(tmp.iterdir()):
        _fsync_file(path)
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    meta = {"step": step, "config_hash": config_hash, "time": time.time(), "files": files,
            "versions": {"toolkit": __version__, "torch": torch.__version__, "python": sys.version.split()[0]}}
    (tmp / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    _fsync_file(tmp / META)
    _fsync_dir(tmp)
    if final.exists():  # a checkpoint of the same step from an interrupted save: keep it aside, never delete
        final.rename(checkpoints_dir / f".replaced-{step_dir_name(step)}-{int(time.time())}")
    tmp.rename(final)
    _fsync_dir(checkpoints_dir)
    return final


def verify_checkpoint(path: Path) -> tuple[Checkpoint | None, str]:
    """The checkpoint in `path` if complete and intact, else None and what is wrong."""
    meta_path = path / META
    if not meta_path.is_file():
        return None, "no meta.json (the save did not finish)"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        files = meta["files"]
        step = int(meta["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        return None, f"meta.json is unreadable ({err})"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return None, f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return None, f"{name} has {file.stat().st_size} bytes, expected {expected['bytes']}"
        if _sha256(file) != expected["sha256"]:
            return None, f"{name} does not match its checksum"
    return Checkpoint(path, step, meta), ""


def list_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Step folders by step number, highest first (not verified)."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for child in checkpoints_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def find_latest_checkpoint(checkpoints_dir: Path, warn=print) -> Checkpoint | None:
    """The highest complete, intact checkpoint; broken ones are skipped with a message."""
    if checkpoints_dir.is_dir():
        for unfinished in sorted(checkpoints_dir.glob(".tmp-step-*")):
            warn(f"warning: ignoring {unfinished}: a checkpoint save that did not finish")
    for _, path in list_checkpoints(checkpoints_dir):
        checkpoint, problem = verify_checkpoint(path)
        if checkpoint is not None:
            return checkpoint
        warn(f"warning: skipping checkpoint {path}: {problem}")
    return None


def rotate_checkpoints(checkpoints_dir: Path, keep_last: int) -> list[Path]:
    """Remove the oldest step folders beyond keep_last; returns what was removed."""
    removed = []
    for _, path in list_checkpoints(checkpoints_dir)[keep_last:]:
        shutil.rmtree(path)
        removed.append(path)
    return removed


def set_aside_checkpoints_after(checkpoints_dir: Path, step: int) -> list[Path]:
    """Rename step folders above `step` to .abandoned-step-*: a run resumed from an earlier step makes them stale.

    They are kept (never deleted) but no longer count as checkpoints, so "latest" stays on this run's path.
    """
    moved = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for found_step, path in list_checkpoints(checkpoints_dir):
        if found_step > step:
            target = checkpoints_dir / f".abandoned-{path.name}-{stamp}"
            path.rename(target)
            moved.append(target)
    return moved


def load_checkpoint_files(checkpoint: Checkpoint) -> CheckpointState:
    """The tensors and states of a verified checkpoint (on the CPU)."""
    lora = load_file(str(checkpoint.path / "lora.safetensors"))
    optimizer_state = torch.load(checkpoint.path / "optimizer.pt", map_location="cpu", weights_only=False)
    trainer_state = torch.load(checkpoint.path / "trainer_state.pt", map_location="cpu", weights_only=False)
    ema_path = checkpoint.path / EMA_FILE
    ema = load_file(str(ema_path)) if ema_path.is_file() else None
    return CheckpointState(lora, optimizer_state, trainer_state, ema)
