"""Checkpoints: written to a temporary folder, fsynced, renamed; verified by checksum when read.

    checkpoints/step-000200/
        trainable_state.safetensors   the exact trainable tensors (keys under trainable_state.): for resuming,
                              not a LoRA file (older checkpoints called it lora.safetensors; it is read as well)
        pytorch_lora_weights.safetensors, adapter_model.safetensors, ...
                              the LoRA files, the same as final/ holds (meta.json lists them as lora_files),
                              so any checkpoint can be loaded, sampled from or merged
        ema.safetensors       the EMA of those tensors (only when train.ema_decay > 0)
        optimizer.pt          optimizer state (8-bit states as plain tensors)
        trainer_state.pt      step, scheduler, grad scaler, every process's RNG states (python, numpy, torch
                              CPU and device), number of processes, data order position, NaN streak
        config.yaml           the run's config as asked (auto where the user left it)
        plan.json             what each auto setting became and why (toolkit/plan); older checkpoints have none
        meta.json             written last: step, config hash, versions, size and sha256 of each file

The trainer hands `save_checkpoint` named dicts: tensors ({"trainable_state": ..., "ema": ...} ->
<name>.safetensors) and states ({"optimizer": ..., "trainer_state": ..., "adapter_state": ...} -> <name>.pt),
and a function that writes the LoRA files into the folder; what a checkpoint
holds is whatever it was given, listed in meta.json. `upgrade_trainer_state` brings the trainer state of
older checkpoints to today's keys, in one place.

"Latest" is the highest step whose meta.json exists and whose files match it; never a file time.
A save interrupted by a crash leaves only a `.tmp-step-*` folder, which is never taken for a checkpoint (and is
removed by the next run that holds the folder's lock, train/run_dir.py); a save that fails removes its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from toolkit import __version__
from toolkit.disk import DiskFull, is_disk_full
from toolkit.errors import UserError
from toolkit.untrusted import load_state

STEP_DIR = re.compile(r"^step-(\d{6,})$")
META = "meta.json"
TRAINABLE = "trainable_state"  # the tensors resume restores
LEGACY_TRAINABLE = "lora"      # their name in checkpoints written before the LoRA files were


def trainable_file_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainable tensors with their keys under `trainable_state.`, as the checkpoint file holds them: PEFT's
    own names (`...to_q.lora_A.default.weight`) would load as a LoRA at scale 1 in ComfyUI (it reads them for
    Qwen-Image), so the trainer's copy carries names no LoRA loader maps."""
    return {f"{TRAINABLE}.{key}": tensor for key, tensor in state.items()}


def trainable_from_file(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainable tensors of a checkpoint file by their parameter names (older files have no prefix)."""
    return {key.removeprefix(f"{TRAINABLE}."): tensor for key, tensor in state.items()}


@dataclass
class Checkpoint:
    path: Path
    step: int
    meta: dict


@dataclass
class CheckpointContents:
    """What a checkpoint holds, loaded: named tensor dicts and named states (absent names are not there)."""

    tensors: dict[str, dict[str, torch.Tensor]]
    states: dict[str, object]


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


def _tmp_dir(checkpoints_dir: Path, step: int) -> Path:
    return checkpoints_dir / f".tmp-{step_dir_name(step)}-{os.getpid()}"


def save_checkpoint(checkpoints_dir: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                    states: dict[str, object], texts: dict[str, str], config_hash: str,
                    write_lora: Callable[[Path], object] | None = None) -> Path:
    """Write a complete checkpoint atomically and return its folder: tensors[name] -> <name>.safetensors,
    states[name] -> <name>.pt, texts[file name] -> that file (config.yaml, plan.json), and `write_lora(folder)`'s
    files (verified like the rest). A save that fails
    leaves no temporary folder; a full disk is a UserError that names the folder and the space needed (the
    earlier checkpoints are untouched)."""
    try:
        return _write_checkpoint(checkpoints_dir, step, tensors, states, texts, config_hash, write_lora)
    except BaseException as err:  # a half-written save is never left behind, whatever stopped it
        shutil.rmtree(_tmp_dir(checkpoints_dir, step), ignore_errors=True)
        if is_disk_full(err):
            raise _disk_full(checkpoints_dir, step, tensors, states) from None
        raise


def _disk_full(checkpoints_dir: Path, step: int, tensors: dict, states: dict) -> UserError:
    """The message for a save that ran out of disk space (its temporary folder already removed)."""
    needed = sum(v.numel() * v.element_size() for d in tensors.values() for v in d.values())
    needed += sum(_state_bytes(state) for state in states.values())
    kept = [path.name for _, path in list_checkpoints(checkpoints_dir)]
    return DiskFull(f"checkpoint {step_dir_name(step)}", checkpoints_dir, needed,
                    done=f"its temporary files were removed, the earlier checkpoints are as they were "
                         f"({', '.join(kept) or 'none yet'})")


def _state_bytes(state: object) -> int:
    """The bytes of the tensors inside a (nested) state dict: what its .pt file mostly holds."""
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def _write_checkpoint(checkpoints_dir: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                      states: dict[str, object], texts: dict[str, str], config_hash: str,
                      write_lora: Callable[[Path], object] | None = None) -> Path:
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / step_dir_name(step)
    tmp = _tmp_dir(checkpoints_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for name, tensor_dict in tensors.items():
        save_file({k: v.detach().contiguous().cpu() for k, v in tensor_dict.items()}, str(tmp / f"{name}.safetensors"))
    for name, state in states.items():
        # Through a Python file: a full disk then raises its OSError (inside torch's RuntimeError), which a path
        # hides ("unexpected pos"); see toolkit/disk.py
        with (tmp / f"{name}.pt").open("wb") as handle:
            torch.save(state, handle)
    for name, text in texts.items():
        (tmp / name).write_text(text, encoding="utf-8")
    own = {p.name for p in tmp.iterdir()}
    if write_lora is not None:
        write_lora(tmp)
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):  # LoRA files may sit in subfolders (Wan 2.2)
        _fsync_file(path)
        files[path.relative_to(tmp).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    lora_files = sorted(name for name in files if name.split("/")[0] not in own)
    meta = {"step": step, "config_hash": config_hash, "time": time.time(), "files": files, "lora_files": lora_files,
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


def load_checkpoint_files(checkpoint: Checkpoint) -> CheckpointContents:
    """The tensors and states of a verified checkpoint (on the CPU), by name (its LoRA files are not read)."""
    tensors, states = {}, {}
    lora_files = set(checkpoint.meta.get("lora_files", []))
    for name in checkpoint.meta["files"]:
        if name in lora_files:
            continue
        path = checkpoint.path / name
        if name.endswith(".safetensors"):
            tensors[name[:-len(".safetensors")]] = load_file(str(path))
        elif name.endswith(".pt"):
            states[name[:-len(".pt")]] = load_checkpoint_state(path)
    if LEGACY_TRAINABLE in tensors and TRAINABLE not in tensors:
        tensors[TRAINABLE] = tensors.pop(LEGACY_TRAINABLE)
    if TRAINABLE in tensors:
        tensors[TRAINABLE] = trainable_from_file(tensors[TRAINABLE])
    states["trainer_state"] = upgrade_trainer_state(states["trainer_state"])
    return CheckpointContents(tensors, states)


def load_checkpoint_state(path: Path) -> object:
    """One .pt state of a checkpoint folder, unpickled without running code (toolkit/untrusted.py)."""
    return load_state(path, fix=f"resume only from checkpoints you trust: move {path.parent} out of its checkpoints/ "
                                "folder to resume from the one before, or start over with --fresh")


def upgrade_trainer_state(state: dict) -> dict:
    """A trainer state written by an older toolkit, with today's keys: checkpoints from before the NaN guard,
    the grad scaler and several processes resume as the run that wrote them would have gone on."""
    state = dict(state)
    state.setdefault("nan_streak", 0)
    state.setdefault("scaler", None)
    state.setdefault("world_size", 1)
    state.setdefault("rng_ranks", [state["rng"]])
    return state
