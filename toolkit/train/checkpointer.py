"""A run's checkpoints as the trainer writes and restores them: the trainable tensors, the EMA, the optimizer, the
loop's state (step, schedule, grad scaler, every process's RNG streams, data position, NaN streak, smoothed loss),
the run's config.yaml and plan.json, and the LoRA files (final/ holds the same). Collective where several
processes contribute (their RNG states) or must stop together (a full disk on the main process)."""

from __future__ import annotations

import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from toolkit.disk import DiskFull, format_bytes, free_bytes, is_disk_full
from toolkit.errors import UserError
from toolkit.data.order import OrderMismatch
from toolkit.models.base import DTYPES, load_trainable_state_dict, trainable_state_dict
from toolkit.train.checkpoint import (TRAINABLE, load_checkpoint_files, rotate_checkpoints, save_checkpoint,
                                      trainable_file_state)
from toolkit.rng import restore_rng_state, rng_state, seed_everything, with_step_rng
from toolkit.train.run_dir import RunDir, name_aside


class OtherProcessFailed(UserError):
    """The main process stopped with an error of its own (printed there); this process stops quietly."""

    def __init__(self):
        super().__init__("")


@dataclass
class LoopState:
    """What the loop carries from step to step beyond the model and optimizer."""

    step: int = 0
    nan_streak: int = 0
    smoothed_loss: float | None = None  # the metrics' smoothed loss, so a resumed log reads as an unbroken one


class Checkpointer:
    """Writes and restores the checkpoints of one run (see the module docstring)."""

    def __init__(self, run_dir: RunDir, procs, network: torch.nn.Module, save_lora: Callable, ema, optimizer,
                 scheduler, order, scaler, texts: dict[str, str], config_hash: str, keep_last: int, save_dtype: str,
                 seed: int, log: Callable[[str], None], needed: int | None = None):
        self.run_dir, self.procs, self.network, self.save_lora = run_dir, procs, network, save_lora
        self.ema, self.optimizer, self.scheduler, self.order, self.scaler = ema, optimizer, scheduler, order, scaler
        self.texts, self.config_hash, self.keep_last = texts, config_hash, keep_last
        self.save_dtype, self.seed, self.log = DTYPES[save_dtype], seed, log
        self.needed = needed  # about the room a checkpoint takes (the main process knows it), for a full disk

    # -- writing ---------------------------------------------------------------------------------
    def write_lora(self, folder: Path) -> list[Path]:
        """The LoRA files of the weights as they are now (the EMA's with train.ema_decay > 0) into `folder`:
        final/ and every checkpoint hold the same files."""
        with self.ema.applied() if self.ema is not None else nullcontext():
            return self.save_lora(folder, self.save_dtype)

    def save(self, loop: LoopState, step_rng: dict | None = None) -> Path | None:
        """A checkpoint of `loop.step` (collective: every process calls it; the main one writes, and tells the
        others whether it could, so that a full disk stops every process at once rather than leaving them
        waiting). `step_rng`: the step streams as the next step began (one that failed part-way, undone)."""
        trainer_state = self._trainer_state(loop, step_rng)
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's AcceleratedOptimizer wraps it
        if hasattr(inner, "gather_state"):  # device.shard_optimizer (train/optimizer_shards.py, imported only then)
            inner.gather_state()  # collective: every process's part to the main process
        if not self.procs.is_main:
            if self.procs.from_main(None) != "ok":
                raise OtherProcessFailed()
            return None
        try:
            path = self._write(loop.step, trainer_state)
        except BaseException:
            self.procs.from_main("failed")
            raise
        self.procs.from_main("ok")
        return path

    def _trainer_state(self, loop: LoopState, step_rng: dict | None = None) -> dict:
        """The loop's state; collective: every process contributes its RNG state."""
        rng_ranks = self.procs.gather(rng_state() if step_rng is None else with_step_rng(rng_state(), step_rng))
        return {"step": loop.step, "scheduler": self.scheduler.state_dict(), "rng": rng_ranks[0],
                "rng_ranks": rng_ranks, "world_size": self.procs.world_size, "data_order": self.order.state_dict(),
                "nan_streak": loop.nan_streak, "smoothed_loss": loop.smoothed_loss,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def _write(self, step: int, trainer_state: dict) -> Path:
        tensors = {TRAINABLE: trainable_file_state(trainable_state_dict(self.network))}
        if self.ema is not None:
            tensors["ema"] = self.ema.state_dict()
        states = {"optimizer": self.optimizer.state_dict(), "trainer_state": trainer_state}
        path = save_checkpoint(self.run_dir.checkpoints, step, tensors, states, self.texts, self.config_hash,
                               write_lora=self.write_lora)
        rotate_checkpoints(self.run_dir.checkpoints, self.keep_last)
        return path

    def export_final(self) -> Path:
        """final/: the LoRA files, written to a temporary folder and renamed; an earlier final/ is kept aside."""
        final = self.run_dir.final
        tmp = final.with_name(".final.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            tmp.mkdir(parents=True)
            self.write_lora(tmp)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(err):
                raise DiskFull("the final LoRA", self.run_dir.root, self.needed, done="its temporary files were "
                               "removed, the checkpoints are as they were", fix="free space on that disk, then run "
                               "the same command: it exports the LoRA from the last checkpoint") from None
            raise
        if final.exists():  # an earlier final (a run extended with more steps): keep it
            final.rename(name_aside(final, "replaced"))
        tmp.rename(final)
        return final

    # -- reading ---------------------------------------------------------------------------------
    def restore(self, checkpoint, ema_decay: float) -> LoopState:
        """Every state of `checkpoint` back in place; returns the loop's."""
        loaded = load_checkpoint_files(checkpoint)
        state = loaded.states["trainer_state"]
        load_trainable_state_dict(self.network, loaded.tensors[TRAINABLE])
        self.optimizer.load_state_dict(loaded.states["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"] is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            if "ema" not in loaded.tensors:
                raise UserError(f"train.ema_decay is {ema_decay}, but {checkpoint.path} has no ema.safetensors\n"
                                "  fix: set train.ema_decay=0, or start over with --fresh")
            self.ema.load_state_dict(loaded.tensors["ema"])
        try:
            self.order.load_state_dict(state["data_order"])
        except OrderMismatch as err:
            raise UserError(f"cannot resume from {checkpoint.path}: {err}\n  fix: {_order_fix(err, checkpoint)}") from None
        self._restore_rng(state, checkpoint)
        return LoopState(int(state["step"]), state["nan_streak"], state.get("smoothed_loss"))

    def _restore_rng(self, state: dict, checkpoint) -> None:
        saved, world = state["rng_ranks"], self.procs.world_size
        if len(saved) != world:
            self.log(f"resume: {checkpoint.path} was written by {len(saved)} process(es), this run has {world}; "
                     "the data order continues unchanged, the random streams of processes it did not have start anew")
        if self.procs.rank < len(saved):
            restore_rng_state(saved[self.procs.rank])
        else:
            seed_everything(hash((self.seed, self.procs.rank, int(state["step"]))) % 2**63)


def _order_fix(err: OrderMismatch, checkpoint) -> str:
    """The fix line for a data order the checkpoint's run cannot continue."""
    if err.key == "batch_size":
        return f"keep train.batch_size x processes the same as when the run began ({err.before})"
    if err.key == "seed":
        return f"set run.seed={err.before}, as when the run began"
    return (f"the data changed since the run began ({err.before} items then, {err.now} now: files added or removed, "
            "or data.repeats, data.resolutions or the datasets changed); put it back to resume, or keep what the "
            f"run learned in a new run on this data: network.init_from={checkpoint.path} --fresh")


def check_checkpoint_room(procs, checkpoints: Path, n_train: int, ema: bool) -> int | None:
    """Once the LoRA's size is known: room on the disk for a checkpoint, checked by the main process (which writes
    them); every process stops when there is none. Returns the room one checkpoint takes (main process)."""
    problem = needed = None
    if procs.is_main:
        # fp32 LoRA weights, the EMA's copy, and up to two fp32 optimizer states per weight, plus small files.
        needed = n_train * 4 * (1 + ema + 2) + 2**20
        free = free_bytes(checkpoints)
        if free < needed:
            problem = (f"not enough room for a checkpoint in {checkpoints}: one needs about {format_bytes(needed)} "
                       f"({n_train:,} trainable parameters), {format_bytes(free)} is free"
                       "\n  fix: free space on that disk, or set run.output_dir on another disk")
    problem = procs.from_main(problem)
    if problem:
        raise UserError(problem) if procs.is_main else OtherProcessFailed()
    return needed
