"""The training loop. Family differences live in the model adapter; this file never asks which family.

One process or several (started by `train --gpus N`, torchrun or accelerate launch): the main process owns
the run folder, logs, samples, reports and checkpoints; every process trains its share of each global batch
through DDP-wrapped trainable modules, and decisions that must agree (skip a non-finite step, stop on a
signal) are taken from numbers summed over all processes.

A run goes through its plan's stages (toolkit/plan): the static plan comes with the ResolvedRun; opening the run
folder settles a resumed run's batch (train/run_start.py); loading the model settles what its size and loading
decide (train/model_setup.py); measuring settles what fits the device (train/memory_plan.py). The plan is then
written once, as plan.json, and the loop runs with what it says. The config is never written.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch

from toolkit import startup
from toolkit.config.load import resolved_container
from toolkit.disk import as_disk_full, disk_full_named, write_atomic
from toolkit.errors import UserError
from toolkit.models.base import lora_targets, trainable_parameters
from toolkit.plan.compiled_runs import record_compiled, signature
from toolkit.plan.run import ResolvedRun
from toolkit.train.batch_size import batch_lines
from toolkit.train.checkpoint import find_latest_checkpoint, set_aside_checkpoints_after
from toolkit.train.checkpointer import Checkpointer, LoopState, OtherProcessFailed, check_checkpoint_room
from toolkit.train.distributed import Processes
from toolkit.train.ema import LoraEMA
from toolkit.train.events import Events, StepEvents
from toolkit.preflight.init_from import other_family
from toolkit.train.lora_source import LoraSnapshot, lora_source
from toolkit.train.memory_plan import MemoryPlanner
from toolkit.train.metrics import MetricsLogger
from toolkit.train.model_setup import load_model
from toolkit.train.out_of_memory import batch_shapes, memory_fixes, out_of_memory_error
from toolkit.train.report import RunReport
from toolkit.train.resume import check_resume_plan
from toolkit.rng import seed_everything
from toolkit.train.run_dir import RunDir
from toolkit.train.run_optimizer import evaluation_weights, run_optimizer
from toolkit.train.run_start import config_hash, config_yaml, open_run_folder, saved_plan
from toolkit.train.signals import GracefulStop, StopRequested
from toolkit.train.step import StepParts, Stepper, StepSums

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}

__all__ = ["OtherProcessFailed", "Trainer"]


class Trainer:
    def __init__(self, run: ResolvedRun, fresh: bool = False, log=None, events: list[StepEvents] = (),
                 restarted: bool = False):
        self.resolved = run
        self.restarted = restarted  # the launcher restarted the processes (--max-restarts): go on from a checkpoint
        self.cfg = run.cfg  # the static settings; what later stages decide is in self.plan
        self.fresh = fresh
        self.run_dir = RunDir(Path(self.cfg.run.output_dir))
        self.events = Events(events)
        self.checkpoint_bytes: int | None = None  # about the room one checkpoint takes, once the LoRA is built
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def log(self, message: str) -> None:
        """The run's log: printed by the main process only."""
        if self.procs.is_main:
            self._log(message)

    def _start_processes(self) -> None:
        from accelerate import Accelerator, InitProcessGroupKwargs

        cfg = self.cfg
        timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.device.collective_timeout))
        self.accelerator = Accelerator(cpu=self.resolved.device.backend == "cpu", kwargs_handlers=[timeout],
                                       mixed_precision=MIXED_PRECISION[cfg.train.precision])
        self.procs = Processes(self.accelerator)
        self.is_main = self.procs.is_main

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> Path:
        """Train; the run folder's lock is released however this ends."""
        self.lock = None
        try:
            with ExitStack() as exits:  # settings held for the run (the SDPA backend order), undone when it ends
                return self._train(exits)
        except Exception as err:  # a full disk under any writer (logs, samples, config.yaml): exit 2, with the room
            full = as_disk_full(err, self.run_dir.root)
            if full is None:
                raise
            raise full.needing(self.checkpoint_bytes, "the next checkpoint") from None
        finally:
            if self.lock is not None:
                self.lock.release()

    def _train(self, exits: ExitStack) -> Path:
        cfg = self.cfg
        self._start_processes()
        startup.mark("processes")
        # network.init_from is copied before --fresh may move a run folder (the LoRA's own, perhaps) aside; a resumed
        # run does not read it, so a path that is gone is an error only for a run that starts
        init = Path(cfg.network.init_from) if cfg.network.init_from else None
        foreign = other_family(init, cfg.model.family) if init is not None and init.exists() else None
        init_from = LoraSnapshot(lora_source(init, self.log)) if init is not None and init.exists() and not foreign \
            else None
        if init is not None:
            self.procs.barrier()  # every process has its copy before the main process may move it aside
        try:
            start, self.lock = open_run_folder(self.resolved, self.run_dir, self.procs, self.fresh, self.log,
                                               restarted=self.restarted)
            startup.mark("run folder")
            done = start.checkpoint is not None and start.checkpoint.step >= cfg.train.steps
            if self.procs.from_main(done and self.run_dir.final.exists()):  # nothing to train or export, said before
                return self._complete(start.checkpoint.step)             # the model loads (the main process's view)
            if start.checkpoint is None and foreign is not None:  # another family's: only a run that starts reads it
                raise UserError(f"network.init_from: {foreign[0]}\n  fix: {foreign[1]}")
            if start.checkpoint is None and init is not None and init_from is None:
                lora_source(init)  # raises: it does not exist
            moved = self.resolved.cfg.network.init_from  # where --fresh moved it, when it was inside the run folder
            if init_from is not None and moved != cfg.network.init_from:
                init_from.source = replace(init_from.source, label=init_from.source.label.replace(str(init), moved))
            self._setup(start, init_from if start.checkpoint is None else None, exits)
            startup.mark("optimizer and wrappers")
        finally:
            if init_from is not None:
                init_from.close()
        checkpoint, loop = start.checkpoint, LoopState()
        if checkpoint is not None:
            loop = self.checkpointer.restore(checkpoint, cfg.train.ema_decay)
            self.log(f"resumed from {checkpoint.path} (step {loop.step})"
                     + ("; network.init_from is not applied to a resumed run" if cfg.network.init_from else ""))
            if self.is_main:
                for stale in set_aside_checkpoints_after(self.run_dir.checkpoints, loop.step):
                    self.log(f"resume: checkpoint above step {loop.step} set aside (kept, no longer used): {stale}")
        steps = cfg.train.steps
        if loop.step >= steps:
            if self.is_main and not self.run_dir.final.exists():  # the export failed last time (a full disk)
                with self._evaluation_weights():
                    self.checkpointer.export_final()
            return self._complete(loop.step)
        return self._loop(loop)

    def _complete(self, step: int) -> Path:
        self.log(f"run already complete at step {step} (train.steps={self.cfg.train.steps}); final LoRA: "
                 f"{self.run_dir.final}\n  raise train.steps to continue it, or use --fresh to start over")
        self.procs.finish()
        return self.run_dir.final

    # -- setup -----------------------------------------------------------------------------
    def _setup(self, start, init_from: LoraSnapshot | None, exits: ExitStack) -> None:
        """The loaded and measured stages of the plan, then what the steps need: optimizer, schedule, EMA, the
        wrapped modules, the stepper and the checkpointer."""
        cfg, procs = self.cfg, self.procs
        model = load_model(self.resolved, start.plan, procs, self.accelerator.device, self.run_dir.root, init_from, exits,
                           self.log)
        self.adapter, self.dataset, self.sharded = model.adapter, model.dataset, model.sharded
        self.planner = MemoryPlanner(self.resolved, model.plan, self.adapter, self.dataset, procs, self.accelerator,
                                     self.sharded, start.batch_resumed, exits, self.log)
        memory = self.planner.measure()
        startup.mark("measurements")
        self.plan, self.order = memory.plan, memory.order
        if start.checkpoint is not None:
            self._check_resume_plan(start.checkpoint)
        self.params = trainable_parameters(self.adapter.network)
        decay = cfg.train.ema_decay
        if decay >= 1.0:
            raise UserError(f"train.ema_decay: {decay} would never move from the initial weights; "
                            "use a value below 1 (0.999 is usual) or 0 to turn the EMA off")
        self.ema = LoraEMA(self.adapter.network, decay) if decay > 0 else None
        optimizer, reason = run_optimizer(cfg.train, self.params, self.resolved.device.backend,
                                          shard=self.resolved.setting(self.plan, "device.shard_optimizer"))
        self.log(f"optimizer: {reason}")
        from transformers import get_scheduler
        self.scheduler = get_scheduler(cfg.train.lr_scheduler, optimizer, num_warmup_steps=cfg.train.warmup_steps,
                                       num_training_steps=cfg.train.steps)
        # fsdp, or device.gradient_sync=allreduce: the modules run as on one process and the step averages the LoRA
        # gradients itself; else each trainable module in its own DDP wrapper
        averages = procs.several and self.resolved.setting(self.plan, "device.gradient_sync") == "allreduce"
        if averages or not procs.several:
            modules = self.adapter.trainable_modules()
        else:
            modules = procs.wrap(self.adapter.trainable_modules(), find_unused=self.adapter.memory.unused_parameters)
        # a sharded optimizer's state is whole on the main process only, while saving: accelerate's round trip through
        # state_dict (device placement) cannot apply; its local optimizer places a loaded state itself
        self.optimizer = self.accelerator.prepare_optimizer(
            optimizer, device_placement=not self.resolved.setting(self.plan, "device.shard_optimizer"))
        self.stepper = Stepper(StepParts(
            self.dataset, self.order, self.adapter.loss, self.adapter.batch_units, modules, self.params,
            self.optimizer, optimizer, self.scheduler, self.ema, procs, self.accelerator, memory.grad_accum,
            cfg.train.max_grad_norm, averages, memory.cuda_graphs), self.events)
        self.compiled, self.batch_size, self.grad_accum = memory.compiled, memory.batch_size, memory.grad_accum
        if procs.several:
            # Each process draws its own noise and dropout from here on (augmentation draws are keyed by item and
            # epoch: data/augment.py).
            seed_everything(hash((cfg.run.seed, procs.rank)) % 2**63)
        texts = {"config.yaml": config_yaml(self.resolved), "plan.json": self.plan.to_json()}
        if self.is_main:
            write_atomic(self.run_dir.root / "plan.json", texts["plan.json"])
        n_train = sum(p.numel() for p in self.params)
        self.checkpoint_bytes = check_checkpoint_room(self.procs, self.run_dir.checkpoints, n_train,
                                                      self.cfg.train.ema_decay > 0)
        self.checkpointer = Checkpointer(self.run_dir, procs, self.adapter.network, self.adapter.save_lora, self.ema,
                                         self.optimizer, self.scheduler, self.order, self.accelerator.scaler, texts,
                                         config_hash(texts), cfg.save.keep_last, cfg.save.dtype, cfg.run.seed,
                                         self.log, needed=self.checkpoint_bytes)
        self.log(f"model: {cfg.model.family} {cfg.model.name_or_path}; {len(lora_targets(self.adapter.network))} "
                 f"LoRA modules, {n_train:,} trainable parameters; {len(self.dataset)} training samples")
        for line in batch_lines(self.batch_size, procs.world_size, self.grad_accum, cfg.train.global_batch_size,
                                self.order.largest_global_batch(), len(self.dataset)):
            self.log(line)

    def _check_resume_plan(self, checkpoint) -> None:
        """A resumed run's plan against its checkpoint's: a later stage that decided otherwise, where that changes
        what the run learns (the base quantized now, or not), refuses the resume on every process."""
        problem = None
        if self.procs.is_main:
            try:
                check_resume_plan(checkpoint, saved_plan(checkpoint), self.plan, self.log)
            except UserError as error:
                problem = str(error)
        problem = self.procs.from_main(problem)
        if problem:
            raise UserError(problem) if self.procs.is_main else OtherProcessFailed()

    # -- the loop --------------------------------------------------------------------------
    def _loop(self, loop: LoopState) -> Path:
        cfg, events = self.cfg, self.events
        start, steps = loop.step, cfg.train.steps
        eval_every = self.adapter.eval_interval()
        self.metrics = MetricsLogger(self.run_dir.logs, steps, start, cfg.log.every, cfg.log.tensorboard, self.is_main,
                                     wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project, run_name=cfg.run.name,
                                     config=self.plan.effective(resolved_container(self.resolved.asked)),
                                     profile=cfg.log.profile, smoothed=loop.smoothed_loss)
        events.subscribe(self.metrics)
        report = RunReport(self.run_dir, self.resolved, self.plan, config_yaml(self.resolved), steps) if self.is_main else None
        if report is not None:
            events.subscribe(report)
        self.adapter.network.train()
        startup.mark("logs and report")
        step, started = start, time.perf_counter()
        lagging = None  # (step, sums) launched, not read yet: read once the next step is launched
        doing = "the step's forward and backward"  # what runs now, named if it runs out of memory
        try:
            with GracefulStop() as stop:
                stopping = False
                for step in range(start + 1, steps + 1):
                    loop.step = step
                    self.adapter.begin_step(step)
                    events.step_started(step)
                    step_started = time.perf_counter()
                    doing = "the step's forward and backward"
                    sums = self.stepper.launch(stop.requested is not None)
                    doing = "the step's bookkeeping"
                    events.step_launched(step, sums)
                    if step == start + 1:
                        self._first_step(step_started)
                    if lagging is not None:
                        stopping = self._record(loop, *lagging) or stopping
                        lagging = None
                    if not self.procs.several:  # a signal that arrived during the step still counts
                        stopping = stopping or stop.requested is not None
                    saving = stopping or step == steps or (cfg.save.every and step % cfg.save.every == 0)
                    evaluating = eval_every and step % eval_every == 0
                    sampling = cfg.sample.every and step % cfg.sample.every == 0
                    if self.stepper.skips_on_device and not (saving or evaluating or sampling):
                        lagging = (step, sums)
                        continue
                    stopping = self._record(loop, step, sums) or stopping
                    if evaluating:
                        doing = "the eval loss"
                        self._eval(step)
                    if stopping or step == steps or (cfg.save.every and step % cfg.save.every == 0):
                        with self._evaluation_weights():
                            saved = self.checkpointer.save(loop)
                        if saved is not None:
                            events.saved(step, saved)
                            if stopping or step != steps:
                                self.metrics.message(f"step {step}: checkpoint {saved}")
                    if sampling and step != steps:
                        doing = "sampling"
                        self._sample(step)
                    if stopping and step != steps:
                        raise StopRequested(stop.exit_code, f"stopped at step {step}; checkpoint saved, "
                                                            "run the same command to resume")
            elapsed = time.perf_counter() - started
            self.procs.check_same_weights(self.adapter.network, self.log)
            doing = "the eval loss"
            if eval_every == 0 or steps % eval_every:
                self._eval(steps)
            doing = "sampling"
            self._sample(steps)
            doing = "the final export"
            with self._evaluation_weights():
                final = self.checkpointer.export_final() if self.is_main else self.run_dir.final
            events.finished(steps, final)
            if report is not None:
                self.log(f"report: {report.path}")
        except torch.OutOfMemoryError as err:
            traceback.clear_frames(err.__traceback__)  # the failed step's activations go now, before saving
            raise self._out_of_memory(loop, doing, lagging) from None
        finally:
            self.metrics.close()
        done = steps - start
        self.log(f"done: {done} step{'s' if done != 1 else ''} in {elapsed:.1f}s; LoRA written to {final}")
        self.procs.finish()
        return final

    def _first_step(self, step_started: float) -> None:
        """Say where the start-up time went (toolkit/startup.py) and what a first compiled step took; note the run's
        compiled code as cached (plan/compiled_runs.py: train.compile=auto then compiles a later short run of the
        same settings)."""
        if self.accelerator.device.type == "cuda":  # its launch is not its end: the one wait of the start-up line
            torch.cuda.synchronize()
        seconds = time.perf_counter() - step_started
        startup.mark("first step")
        said = startup.CLOCK.summary_once()
        if said is not None:
            self.log(said)
        if not self.compiled:
            return
        self.log(f"train.compile: the first step took {seconds:.1f} s (compilation included), "
                 f"{time.time() - startup.CLOCK.started:.1f} s after the process started")
        if self.is_main:
            run = self.resolved
            try:
                record_compiled(signature(run.asked, run.device.name), run.asked.model.family, seconds)
            except OSError as error:  # the run trains on; a later short run of it is planned eager
                self.log(f"train.compile: could not note the compiled run in the cache folder ({error})")

    def _record(self, loop: LoopState, step: int, sums: StepSums) -> bool:
        """Read a launched step's numbers: count non-finite steps, hand them to the subscribers (the metrics);
        whether any process asked to stop."""
        sums.read()
        if math.isfinite(sums.mean):
            loop.nan_streak = 0
        else:
            loop.nan_streak += 1
            self.metrics.message(f"warning: step {step}: loss is not finite; update skipped "
                                 f"({loop.nan_streak}/{self.cfg.train.max_nan_steps} in a row)")
            if loop.nan_streak >= self.cfg.train.max_nan_steps:
                raise UserError(f"loss was NaN or inf for {loop.nan_streak} steps in a row (step {step})\n"
                                "  fix: lower train.lr, use train.precision=bf16 or fp32 instead of fp16, "
                                "or check the data")
        self.events.step_recorded(step, sums)
        loop.smoothed_loss = self.metrics.smoothed
        return sums.stops > 0

    def _evaluation_weights(self):
        return evaluation_weights(self.optimizer, self.cfg.train.optimizer)

    def _sample(self, step: int) -> None:
        """Samples from the main process. With a sharded base every process must run the forwards (each holds
        part of the weights): the others generate the same samples into a folder that is then removed."""
        if not list(self.cfg.sample.prompts) or not (self.is_main or self.sharded):
            return
        out_dir = self.run_dir.sample_dir(step) if self.is_main else Path(tempfile.mkdtemp(prefix="toolkit-samples-"))
        # Sampling must not disturb the training RNG streams, or resumed runs would diverge.
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), self._evaluation_weights(), self.planner.eager(), \
                    disk_full_named("samples", out_dir):
                files = self.adapter.sample(out_dir)
        finally:
            if not self.is_main:
                shutil.rmtree(out_dir, ignore_errors=True)
        if files and self.is_main:
            self.events.sampled(step, files)

    def _eval(self, step: int) -> None:
        """The eval loss, on the main process (on every process when the base is sharded: see _sample)."""
        if not (self.is_main or self.sharded):
            return
        with self._evaluation_weights(), self.planner.eager():
            loss = self.adapter.eval_loss(self.batch_size)
        if loss is not None and self.is_main:
            self.events.evaluated(step, loss)
            self.log(f"step {step}: eval loss {loss:.4f}")

    def _out_of_memory(self, loop: LoopState, doing: str, lagging) -> UserError:
        """Out of memory at `loop.step`, in `doing`: the state of the last completed step saved first (one
        process; with several, the others wait in a collective that will not finish, so the last checkpoint is
        what remains), then the error naming the step, the batch shapes and the fixes (train/out_of_memory.py)."""
        stepper, step = self.stepper, loop.step
        in_step = doing == "the step's forward and backward"
        shapes = batch_shapes(stepper.shapes) if in_step and stepper.shapes else None
        stepper.shapes = None
        if in_step and stepper.updating:
            doing = "the step's update"
        kept = self._save_after_out_of_memory(loop, lagging, undo=in_step and not stepper.updating)
        fixes = memory_fixes(self.cfg, lambda key: self.resolved.setting(self.plan, key), self.batch_size,
                             self.grad_accum, self.adapter.memory.fixes())
        device = f"{self.resolved.device.summary()} (preset {self.resolved.preset.name})"
        return out_of_memory_error(step, doing, shapes, device, kept, fixes)

    def _save_after_out_of_memory(self, loop: LoopState, lagging, undo: bool) -> str:
        """Save the last completed step (undoing the step that failed part-way when `undo`); what is kept."""
        latest = find_latest_checkpoint(self.run_dir.checkpoints, warn=lambda _: None)
        intact = f"the last checkpoint is intact: {latest.path}" if latest else "no checkpoint had been written yet"
        if self.procs.several:
            return intact
        if self.stepper.updating:
            return f"the update was partly applied, so nothing was saved; {intact}"
        self.optimizer.zero_grad(set_to_none=True)
        if self.accelerator.device.type == "cuda":
            torch.cuda.empty_cache()
        if lagging is not None:
            self._record(loop, *lagging)
        step_rng = None
        if undo:
            position, step_rng = self.stepper.start
            self.order.rewind(position)
            loop.step -= 1
        if loop.step == 0:
            return "no step had completed, so there was nothing to save"
        if latest is not None and latest.step == loop.step:
            return f"the state after step {loop.step} is in {latest.path}"
        with self._evaluation_weights():
            saved = self.checkpointer.save(loop, step_rng)
        self.events.saved(loop.step, saved)
        return f"the state after step {loop.step} is saved: {saved}"
