"""The training loop. Family differences live in the model adapter; this file never asks which family.

One process or several (started by `train --gpus N`, torchrun or accelerate launch): the main process owns
the run folder, logs, samples, reports and checkpoints; every process trains its share of each global batch
through DDP-wrapped trainable modules, and decisions that must agree (skip a non-finite step, stop on a
signal) are taken from numbers summed over all processes.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf

from toolkit.config.load import resolved_container
from toolkit.config.run import ResolvedRun
from toolkit.config.schema import QUANTIZED
from toolkit.data.order import BatchOrder
from toolkit.disk import DiskFull, as_disk_full, disk_full_named, format_bytes, free_bytes, is_disk_full
from toolkit.errors import UserError
from toolkit.models import build_adapter
from toolkit.models.base import DTYPES, Runtime, trainable_parameters
from toolkit.models.quantize import choose_distributed
from toolkit.optim import build_optimizer, optimizer_spec
from toolkit.paths import cache_root
from toolkit.train.attention import choose_for_run, gradient_in_output_layout
from toolkit.train.batch_size import (accumulate_to, checkpoint_batch, checkpointing_for_run, measures_on,
                                      probe_cap, probe_for_run, release_probe)
from toolkit.train.blocks import prepare_blocks
from toolkit.train.compile import compile_blocks, recompute_elementwise
from toolkit.train.checkpoint import (TRAINABLE, find_latest_checkpoint, load_checkpoint_files, rotate_checkpoints,
                                      save_checkpoint, set_aside_checkpoints_after, trainable_file_state)
from toolkit.train.distributed import Processes
from toolkit.train.ema import LoraEMA
from toolkit.train.lora_source import LoraSnapshot, lora_source
from toolkit.train.metrics import MetricsLogger
from toolkit.train.report import RunReport
from toolkit.train.resume import check_resume_config, checkpoint_processes, choose_start
from toolkit.train.rng import restore_rng_state, rng_state, rng_untouched, seed_everything
from toolkit.train.run_dir import RunDir
from toolkit.train.run_lock import RunLock
from toolkit.train.signals import GracefulStop, StopRequested
from toolkit.train.step import Stepper, StepSums

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


class OtherProcessFailed(UserError):
    """The main process stopped with an error of its own (printed there); this process stops quietly."""

    def __init__(self):
        super().__init__("")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with disk_full_named(path.name, path.parent, len(text.encode()), remove=tmp):
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


class Trainer:
    def __init__(self, run: ResolvedRun, fresh: bool = False, log=None):
        self.run_cfg = run
        self.cfg = run.cfg
        self.fresh = fresh
        self.run_dir = RunDir(Path(self.cfg.run.output_dir))
        self.lock: RunLock | None = None  # the main process's lock on the run folder, held until run() returns
        self.exits = ExitStack()  # settings held for the run (the SDPA backend order), undone when it ends
        self.init_from: LoraSnapshot | None = None  # network.init_from's files, for a run that starts (not resumes)
        self.requested_accum = self.cfg.train.grad_accum  # as given: with train.global_batch_size it is derived
        self.batch_resumed = False  # train.batch_size=auto taken from the checkpoint resumed (never probed again)
        self.checkpoint_bytes: int | None = None  # about the room one checkpoint takes, once the LoRA is built
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def log(self, message: str) -> None:
        """The run's log: printed by the main process only."""
        if self.procs.is_main:
            self._log(message)

    # -- processes -------------------------------------------------------------------------
    def _start_processes(self) -> None:
        from accelerate import Accelerator, InitProcessGroupKwargs

        cfg = self.cfg
        timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.device.collective_timeout))
        self.accelerator = Accelerator(cpu=self.run_cfg.device.backend == "cpu", kwargs_handlers=[timeout],
                                       mixed_precision=MIXED_PRECISION[cfg.train.precision])
        self.procs = Processes(self.accelerator)
        self.is_main = self.procs.is_main

    def _choose_distributed(self) -> bool:
        """Whether the frozen base is sharded (fsdp) rather than copied to every process (ddp), and why."""
        cfg, procs = self.cfg, self.procs
        if not procs.several:
            if cfg.device.distributed == "fsdp":
                self.log("device.distributed=fsdp: one process, nothing to shard; training as one process")
            return False
        unshardable = (cfg.model.quantize in QUANTIZED or cfg.model.expert_offload is True
                       or cfg.train.train_text_encoder)  # what fsdp refuses (config/resolve.py)
        if cfg.device.distributed == "auto" and unshardable:
            mode, why = "ddp", "auto: the config quantizes, offloads experts or trains text encoders"
        else:
            mode, why = choose_distributed(cfg.device.distributed, procs.world_size, self.adapter.base_parameters,
                                           self.run_cfg.device, cfg.device.memory_fraction)
        if mode == "ddp":
            self.log(f"device.distributed=ddp ({why}): every process holds the whole model, gradients averaged")
            return False
        self.log(f"device.distributed=fsdp ({why}): the frozen base is sharded over {procs.world_size} processes "
                 "(FSDP2, block by block); LoRA weights stay whole on every process")
        return True

    def _resolve_config(self) -> None:
        """The resolved config as the run folder and checkpoints keep it (again once the batch size is settled)."""
        self.container = resolved_container(self.cfg)
        self.config_yaml = OmegaConf.to_yaml(OmegaConf.create(self.container))
        self.config_hash = hashlib.sha256(self.config_yaml.encode()).hexdigest()[:16]

    def _settle_batch(self, checkpoint) -> tuple[int, int, bool]:
        """What is known of the batch before the model loads: a resumed auto run's batch size is its checkpoint's;
        train.global_batch_size gives grad_accum (a batch probe sets both again later). Returns (batch size,
        grad_accum, whether the batch size came from the checkpoint)."""
        t, processes = self.cfg.train, self.procs.world_size
        resumed = checkpoint is not None and self.run_cfg.batch_size_auto
        if resumed:
            saved = yaml.safe_load((checkpoint.path / "config.yaml").read_text(encoding="utf-8"))["train"]
            t.batch_size, note = checkpoint_batch(saved["batch_size"], checkpoint_processes(checkpoint), processes)
            self._auto_decided("train.batch_size", t.batch_size, note)
            if t.global_batch_size is not None:
                t.grad_accum = saved["grad_accum"]
        elif t.global_batch_size is not None:
            t.batch_size, t.grad_accum, _ = accumulate_to(t.global_batch_size, t.batch_size, processes,
                                                          self.run_cfg.batch_size_auto, self.requested_accum)
        return t.batch_size, t.grad_accum, resumed

    def _open_run_folder(self):
        """On the main process: the checkpoint to resume from (or None), the batch size known so far, the checked
        config, the run folder. Every process gets the same answer; an error there stops the others quietly."""
        outcome = None
        if self.procs.is_main:
            try:
                # Before anything in the folder is read or moved: a live run there (or its resume) refuses here.
                self.lock = RunLock(self.run_dir.root)
                self.lock.acquire(self.log)
                self.run_dir.remove_unfinished(self.log)
                self.run_dir.remove_failed_starts_beside(self.log)
                checkpoint = choose_start(self.cfg.train.resume, self.run_dir, self.fresh, self.log)
                batch = self._settle_batch(checkpoint)
                self._resolve_config()
                if checkpoint is not None:
                    check_resume_config(checkpoint, self.container, self.log, processes=self.procs.world_size)
                self.run_dir.create()
                _write_atomic(self.run_dir.config, self.config_yaml)
                outcome = ("ok", checkpoint, batch)
            except BaseException:
                self.procs.from_main(("failed", None, None))
                raise
        status, checkpoint, batch = self.procs.from_main(outcome)
        if status != "ok":
            raise OtherProcessFailed()
        self.cfg.train.batch_size, self.cfg.train.grad_accum, self.batch_resumed = batch
        self._resolve_config()
        return checkpoint

    # -- setup -----------------------------------------------------------------------------
    def _setup(self):
        cfg, device, procs, init_from = self.cfg, self.run_cfg.device, self.procs, self.init_from
        runtime = Runtime(device=self.accelerator.device, info=device, base_dtype=DTYPES[cfg.model.dtype],
                          compute_dtype=DTYPES[cfg.train.precision], run_dir=self.run_dir.root, log=self.log,
                          is_main=procs.is_main, world_size=procs.world_size, rank=procs.rank,
                          main_process_first=procs.main_first)
        seed_everything(cfg.run.seed)  # the same LoRA initialisation on every process
        with procs.main_first():  # a tiny:<kind> model is written once (transformers saves on rank 0 only)
            self.adapter = build_adapter(cfg, runtime)
        self.sharded = runtime.shard_base = self._choose_distributed()
        self.adapter.load()
        if init_from is not None:  # before the EMA, the optimizer and any wrapping see the LoRA weights
            self.adapter.load_lora(init_from.path, partial=True, label=f"network.init_from ({init_from.source.label})")
            self.log(f"network.init_from: the LoRA starts from {init_from.source.label}; steps, optimizer state and "
                     "schedule start fresh")
        # Encoding on a cold cache may draw from the RNG streams where reading a warm one does not: a run trains
        # the same either way.
        with rng_untouched():
            self.dataset = self.adapter.prepare_data()
        if len(self.dataset) == 0:
            raise UserError(f"data.path: {cfg.data.path} gave no training samples")
        self.adapter.place_for_training()
        if self.accelerator.device.type == "cuda" and torch.version.hip is None:  # cuDNN: NVIDIA only
            # Before anything runs a backward (the batch-size and checkpointing measurements too): until the SDPA
            # probe has chosen, PyTorch's own order may pick cuDNN, whose backward needs it (train/attention.py).
            self.exits.enter_context(gradient_in_output_layout())
        if self.sharded:  # before the optimizer and EMA see the LoRA weights: sharding moves them to the device
            for line in procs.shard(self.adapter.shard_roots()):
                self.log(f"device.distributed=fsdp: sharded {line}")
        # fp8 stays compiled: its row quantization is fused there, and eager each layer ran 2-4x slower
        # (bench/fp8_linear.py); compiled fp8 Flux ran as fast as compiled bf16 (docs/performance.md)
        if cfg.train.compile is True and self.run_cfg.compile_auto and self.adapter.quantized() not in ("none", "fp8"):
            self._compile_off_for_quantized()  # before checkpointing is measured: it measures as the blocks will run
        probing = self._probes_batch_size()
        self.compiled = 0  # the blocks are wrapped below; a measurement before runs them as they load
        if self._measures_checkpointing():
            self._decide_checkpointing(1 if probing else self.cfg.train.batch_size, some_blocks=not probing)
        self.order = BatchOrder(self.dataset.groups, cfg.train.batch_size, cfg.run.seed,
                                world_size=procs.world_size, rank=procs.rank)
        self.compiled = self._prepare_blocks(probing)
        if probing:  # with the blocks as they train (checkpointed, swapped), before the optimizer exists
            self._probe_batch_size()
            self.order = BatchOrder(self.dataset.groups, cfg.train.batch_size, cfg.run.seed,
                                    world_size=procs.world_size, rank=procs.rank)
        self._choose_attention()
        self.params = trainable_parameters(self.adapter.network)
        decay = cfg.train.ema_decay
        if decay >= 1.0:
            raise UserError(f"train.ema_decay: {decay} would never move from the initial weights; "
                            "use a value below 1 (0.999 is usual) or 0 to turn the EMA off")
        self.ema = LoraEMA(self.adapter.network, decay) if decay > 0 else None
        optimizer, reason = build_optimizer(
            cfg.train.optimizer, self.params, lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps,
            weight_decay=cfg.train.weight_decay, backend=cfg.train.optimizer_backend, device_type=device.backend,
            args=OmegaConf.to_container(cfg.train.optimizer_args))
        self.log(f"optimizer: {reason}")
        from transformers import get_scheduler
        self.scheduler = get_scheduler(cfg.train.lr_scheduler, optimizer, num_warmup_steps=cfg.train.warmup_steps,
                                       num_training_steps=cfg.train.steps)
        if self.sharded:
            self.modules = self.adapter.trainable_modules()
        else:
            self.modules = procs.wrap(self.adapter.trainable_modules(), find_unused=self.adapter.unused_parameters())
        self.optimizer = self.accelerator.prepare_optimizer(optimizer)
        self.stepper = Stepper(self, optimizer)
        if procs.several:
            # Each process draws its own noise and dropout from here on (augmentation draws are keyed by item and
            # epoch: data/augment.py).
            seed_everything(hash((cfg.run.seed, procs.rank)) % 2**63)
        n_train = sum(p.numel() for p in self.params)
        self._check_checkpoint_room(n_train)
        t = cfg.train
        self.log(f"model: {cfg.model.family} {cfg.model.name_or_path}; {len(self.adapter.lora_targets())} LoRA "
                 f"modules, {n_train:,} trainable parameters; {len(self.dataset)} training samples")
        total = t.batch_size * procs.world_size * t.grad_accum
        self.log(f"batch: {t.batch_size} per process x {procs.world_size} process{'es' if procs.several else ''} x "
                 f"{t.grad_accum} accumulation = {total} per optimizer step"
                 + ("" if t.global_batch_size is None else f" (train.global_batch_size={t.global_batch_size}"
                    + (")" if total == t.global_batch_size else ": the least at or above it with this batch size)")))

    def _check_checkpoint_room(self, n_train: int) -> None:
        """Now that the LoRA's size is known: room on the disk for a checkpoint (checked by the main process, which
        writes them; every process stops when there is none)."""
        problem = None
        if self.procs.is_main:
            # fp32 LoRA weights, the EMA's copy, and up to two fp32 optimizer states per weight, plus small files.
            needed = self.checkpoint_bytes = n_train * 4 * (1 + (self.cfg.train.ema_decay > 0) + 2) + 2**20
            free = free_bytes(self.run_dir.checkpoints)
            if free < needed:
                problem = (f"not enough room for a checkpoint in {self.run_dir.checkpoints}: one needs about "
                           f"{format_bytes(needed)} ({n_train:,} trainable parameters), {format_bytes(free)} is free"
                           "\n  fix: free space on that disk, or set run.output_dir on another disk")
        problem = self.procs.from_main(problem)
        if problem:
            raise UserError(problem) if self.procs.is_main else OtherProcessFailed()

    def _prepare_blocks(self, probing: bool) -> int:
        """Compile, checkpoint and swap the denoiser's blocks as the config says (train/blocks.py); families
        without block regions (llm) compile their repeated blocks whole and checkpoint their own way.
        Returns the number of compiled blocks."""
        cfg, procs = self.cfg, self.procs
        regions = self.adapter.block_regions(checkpointed=cfg.train.gradient_checkpointing is not False)
        if self.adapter.block_swaps() and self._keeps_nothing_after_all(
                "blocks are swapped (memory is short); the checkpointed blocks recompute their attention"):
            self._rewrite_config()
        self.cuda_graphs = False
        if cfg.train.compile:
            recompute_elementwise(cfg.train.compile_recompute == "pointwise")
            self.exits.callback(recompute_elementwise, False)  # PyTorch's default again once the run ends
        if not regions:
            if cfg.train.cuda_graphs is True:  # asked for where it does not apply: said, not ignored
                self.log("train.cuda_graphs: applies to a denoiser compiled whole; the decoder blocks keep ordinary "
                         "kernel launches (graphs per block measured no faster for an LLM: docs/performance.md)")
            return compile_blocks(self.adapter.shard_roots(), self.log) if cfg.train.compile else 0
        shape_count = len(self.order.batch_shapes())
        if probing and cfg.train.compile:  # compiled for every batch size the probe may choose
            cap = probe_cap(len(self.dataset), procs.world_size, cfg.train.global_batch_size)[0]
            shape_count = max(len(BatchOrder(self.dataset.groups, size, cfg.run.seed, world_size=procs.world_size,
                                             rank=procs.rank).batch_shapes()) for size in range(1, cap + 1))
        # train.global_batch_size with a probed batch size: the accumulation is known only after the probe
        accum = None if probing and cfg.train.global_batch_size else cfg.train.grad_accum
        plan = prepare_blocks(regions, compile_=bool(cfg.train.compile), checkpointing=cfg.train.gradient_checkpointing,
                              swaps=self.adapter.block_swaps(), shape_count=shape_count, log=self.log,
                              cuda_graphs=cfg.train.cuda_graphs, grad_accum=accum,
                              gpu=self.accelerator.device.type == "cuda", processes=procs.world_size,
                              hip=self.run_cfg.device.backend == "hip",
                              keeps=cfg.train.get("checkpoint_keeps", "nothing"))
        self.cuda_graphs = bool(plan.graphs)
        return plan.compiled

    def _compile_off_for_quantized(self) -> None:
        """train.compile=auto was measured faster with 16-bit weights: a quantized denoiser stays eager (and its
        checkpointed blocks, with checkpoint_keeps auto, keep nothing, as eager blocks do)."""
        cfg = self.cfg
        cfg.train.compile = False
        self._auto_decided("train.compile", False, f"train.compile=auto -> false: the denoiser is quantized "
                           f"({self.adapter.quantized()}); compiling was measured faster with 16-bit weights only "
                           "(train.compile=true compiles it anyway)")
        self._keeps_nothing_after_all("keeping attention was measured compiled, and the quantized denoiser runs "
                                      "eagerly")
        self._rewrite_config()

    def _keeps_nothing_after_all(self, why: str) -> bool:
        """train.checkpoint_keeps=auto resolved to attention, and the run turns out not to be the one that was
        measured (`why`): the checkpointed blocks keep nothing. Returns whether the setting changed."""
        if not (self.cfg.train.get("checkpoint_keeps") == "attention" and self.run_cfg.keeps_auto):
            return False
        self.cfg.train.checkpoint_keeps = "nothing"
        self._auto_decided("train.checkpoint_keeps", "nothing", f"train.checkpoint_keeps=auto -> nothing: {why}")
        return True

    def _probes_batch_size(self) -> bool:
        """Whether train.batch_size=auto is measured now: on a GPU, for a run that does not resume (the CPU keeps
        the preset's table, as the config's decisions said)."""
        if not self.run_cfg.batch_size_auto or self.batch_resumed or not measures_on(self.accelerator.device):
            return False
        if self.sharded:
            self.log(f"train.batch_size=auto -> {self.cfg.train.batch_size}: the preset's table (with "
                     "device.distributed=fsdp every process would have to measure at once; the probe does not run)")
            return False
        return True

    def _measures_checkpointing(self) -> bool:
        """Whether train.gradient_checkpointing=auto is measured now: on a GPU, the base not sharded (every process
        would have to measure)."""
        if not self.run_cfg.checkpointing_auto or not measures_on(self.accelerator.device):
            return False
        if self.sharded:
            self.log("train.gradient_checkpointing=auto -> False: not measured with device.distributed=fsdp; set it "
                     "to true if a step runs out of memory")
            return False
        return True

    def _decide_checkpointing(self, size: int, some_blocks: bool) -> None:
        """train.gradient_checkpointing=auto on a GPU: off when a step of `size` (the run's batch size; 1 when the
        batch size is probed next) fits without it; else N of the denoiser's blocks where measured to fit (only
        with `some_blocks`: a probed batch size would otherwise be fitted to the blocks that just hold a batch of
        1), or all, which the probe then fits the batch to (train/batch_size.py). Measured on the main process;
        every process takes the answer."""
        def measure():
            setting, why = checkpointing_for_run(self, size, some_blocks)
            return setting, why, self.cfg.train.get("checkpoint_keeps")  # auto may have dropped attention

        before = self.cfg.train.get("checkpoint_keeps")
        setting, why, keeps = self._measured_on_main(
            measure, lambda failure: (False, f"kept off: the measurement failed ({failure})", before))
        if before is not None:  # every process as the main one decided
            self.cfg.train.checkpoint_keeps = keeps
        if keeps != before:
            self._auto_decided("train.checkpoint_keeps", keeps, "train.checkpoint_keeps=auto -> nothing: a step with "
                               "every block keeping its attention did not fit, or could not be measured (the "
                               "train.gradient_checkpointing line says which)")
        self.cfg.train.gradient_checkpointing = setting  # N blocks: the diffusion families read it in _prepare_blocks
        if setting is True:
            self.adapter.enable_gradient_checkpointing()
        elif setting is False and self.cfg.train.get("checkpoint_offload"):
            self.log("train.checkpoint_offload: nothing to move, gradient checkpointing stays off (measured)")
        self._auto_decided("train.gradient_checkpointing", setting,
                           f"train.gradient_checkpointing=auto -> {setting}: {why}")
        self._rewrite_config()

    def _probe_batch_size(self) -> None:
        """train.batch_size=auto on a GPU: the largest micro-batch whose forward + backward fits, measured on the main
        process (train/batch_size.py) or remembered from an earlier run; every process takes it."""
        t = self.cfg.train
        t.batch_size, why = self._measured_on_main(
            lambda: probe_for_run(self),
            lambda failure: (t.batch_size, f"the preset's table: the batch probe failed ({failure})"))
        if t.global_batch_size is not None:
            t.batch_size, t.grad_accum, note = accumulate_to(t.global_batch_size, t.batch_size, self.procs.world_size,
                                                             True, self.requested_accum)
            why += f"; {note}"
        self._auto_decided("train.batch_size", t.batch_size, f"train.batch_size=auto -> {t.batch_size}: {why}")
        self._rewrite_config()

    def _measured_on_main(self, measure, fallback):
        """measure() on the main process, its answer taken by every process. A measurement that breaks must not
        stop a run that would train: fallback(what failed) answers instead. A user error or a stop on the main
        process stops the others too, instead of leaving them waiting."""
        procs, choice = self.procs, None
        if procs.is_main:
            try:
                choice = measure()
            except (UserError, KeyboardInterrupt, SystemExit):
                procs.from_main(None)
                raise
            except Exception as error:  # noqa: BLE001
                release_probe(trainable_parameters(self.adapter.network), self.accelerator.device)
                first = str(error).splitlines()[0] if str(error) else ""
                choice = fallback(f"{type(error).__name__}: {first}")
            except BaseException:
                procs.from_main(None)
                raise
        choice = procs.from_main(choice)
        if choice is None:
            raise OtherProcessFailed()
        return choice

    def _rewrite_config(self) -> None:
        """The resolved config again, in the run folder too, once an auto setting was measured."""
        self._resolve_config()
        if self.procs.is_main:
            _write_atomic(self.run_dir.config, self.config_yaml)

    def _auto_decided(self, key: str, value, line: str) -> None:
        """Log how an auto setting was settled (`line`: "key=auto -> value: why"); the run report shows it too."""
        self.log(line)
        for decision in self.run_cfg.decisions:
            if decision.key == key:
                decision.value, decision.reason = value, line.split(": ", 1)[1]

    def _choose_attention(self) -> None:
        """device.sdpa_backend: measured on a GPU from the attention calls of one forward on a real batch, which
        runs eagerly, without gradients and without touching the training RNG streams (train/attention.py)."""
        def forward():  # only called when there is something to measure
            with rng_untouched(), torch.no_grad(), self._eager(), self.accelerator.autocast():
                batch = self.dataset.collate(self.order.first_batch())
                self.adapter.loss(batch, self.adapter.trainable_modules())

        context = choose_for_run(self.cfg.device.sdpa_backend, self.accelerator.device, forward, self.is_main,
                                 self.procs.from_main, cache_root() / "attention.json", self.log)
        if context is not None:
            self.exits.enter_context(context)

    def _trainer_state(self, step: int) -> dict:
        """The loop's state; collective: every process contributes its RNG state."""
        scaler = self.accelerator.scaler
        rng_ranks = self.procs.gather(rng_state())
        return {"step": step, "scheduler": self.scheduler.state_dict(), "rng": rng_ranks[0], "rng_ranks": rng_ranks,
                "world_size": self.procs.world_size, "data_order": self.order.state_dict(),
                "nan_streak": self.nan_streak, "scaler": scaler.state_dict() if scaler is not None else None}

    def _restore(self, checkpoint) -> int:
        loaded = load_checkpoint_files(checkpoint)
        state = loaded.states["trainer_state"]
        self.adapter.load_lora_state_dict(loaded.tensors[TRAINABLE])
        self.adapter.load_state_dict(loaded.states.get("adapter_state", {}))
        self.optimizer.load_state_dict(loaded.states["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"] is not None and self.accelerator.scaler is not None:
            self.accelerator.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            if "ema" not in loaded.tensors:
                raise UserError(f"train.ema_decay is {self.cfg.train.ema_decay}, but {checkpoint.path} has no "
                                "ema.safetensors\n  fix: set train.ema_decay=0, or start over with --fresh")
            self.ema.load_state_dict(loaded.tensors["ema"])
        try:
            self.order.load_state_dict(state["data_order"])
        except ValueError as err:
            raise UserError(f"cannot resume from {checkpoint.path}: {err}\n  fix: keep train.batch_size x processes "
                            f"the same as when the run began ({state['data_order']['batch_size']})") from None
        self._restore_rng(state, checkpoint)
        self.nan_streak = state["nan_streak"]
        return int(state["step"])

    def _restore_rng(self, state: dict, checkpoint) -> None:
        saved, world = state["rng_ranks"], self.procs.world_size
        if len(saved) != world:
            self.log(f"resume: {checkpoint.path} was written by {len(saved)} process(es), this run has {world}; "
                     "the data order continues unchanged, the random streams of processes it did not have start anew")
        if self.procs.rank < len(saved):
            restore_rng_state(saved[self.procs.rank])
        else:
            seed_everything(hash((self.cfg.run.seed, self.procs.rank, int(state["step"]))) % 2**63)

    def _save(self, step: int) -> Path | None:
        """A checkpoint (collective: every process calls it; the main one writes, and tells the others whether it
        could, so that a full disk stops every process at once rather than leaving them waiting)."""
        trainer_state = self._trainer_state(step)
        if not self.procs.is_main:
            if self.procs.from_main(None) != "ok":
                raise OtherProcessFailed()
            return None
        try:
            path = self._write_checkpoint(step, trainer_state)
        except BaseException:
            self.procs.from_main("failed")
            raise
        self.procs.from_main("ok")
        return path

    def _write_checkpoint(self, step: int, trainer_state: dict) -> Path:
        tensors = {TRAINABLE: trainable_file_state(self.adapter.lora_state_dict())}
        if self.ema is not None:
            tensors["ema"] = self.ema.state_dict()
        states = {"optimizer": self.optimizer.state_dict(), "trainer_state": trainer_state}
        adapter_state = self.adapter.state_dict()
        if adapter_state:
            states["adapter_state"] = adapter_state
        path = save_checkpoint(self.run_dir.checkpoints, step, tensors, states, self.config_yaml, self.config_hash,
                               write_lora=self._write_lora)
        rotate_checkpoints(self.run_dir.checkpoints, self.cfg.save.keep_last)
        return path

    # -- one step --------------------------------------------------------------------------
    def _record(self, step: int, sums: StepSums) -> bool:
        """Read a launched step's numbers: log them, count non-finite steps; whether any process asked to stop."""
        sums.read()
        if math.isfinite(sums.mean):
            self.nan_streak = 0
        else:
            self.nan_streak += 1
            self.metrics.message(f"warning: step {step}: loss is not finite; update skipped "
                                 f"({self.nan_streak}/{self.cfg.train.max_nan_steps} in a row)")
            if self.nan_streak >= self.cfg.train.max_nan_steps:
                raise UserError(f"loss was NaN or inf for {self.nan_streak} steps in a row (step {step})\n"
                                "  fix: lower train.lr, use train.precision=bf16 or fp32 instead of fp16, "
                                "or check the data")
        self.metrics.step(step, sums.mean, sums.lr, tokens=int(sums.tokens), grad_norm=sums.grad_norm,
                          ended=sums.ended)
        return sums.stops > 0

    @contextmanager
    def _eager(self):
        """Compiled blocks run eagerly while sampling and evaluating: generation with a growing KV cache would
        recompile them at every length, and these forwards are not where the time goes."""
        with torch.compiler.set_stance("force_eager") if self.compiled else nullcontext():
            yield

    @contextmanager
    def _optimizer_eval_mode(self):
        """Optimizers that keep other weights for evaluation than for training (schedule-free) are switched to
        them around eval, sampling, checkpoints and the export, as their spec says."""
        if not optimizer_spec(self.cfg.train.optimizer).needs_eval_mode:
            yield
            return
        self.optimizer.eval()
        try:
            yield
        finally:
            self.optimizer.train()

    def _sample(self, step: int) -> None:
        """Samples from the main process. With a sharded base every process must run the forwards (each holds
        part of the weights): the others generate the same samples into a folder that is then removed."""
        if not list(self.cfg.sample.prompts) or not (self.is_main or self.sharded):
            return
        out_dir = self.run_dir.sample_dir(step) if self.is_main else Path(tempfile.mkdtemp(prefix="toolkit-samples-"))
        # Sampling must not disturb the training RNG streams, or resumed runs would diverge.
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), self._optimizer_eval_mode(), self._eager(), \
                    disk_full_named("samples", out_dir):
                files = self.adapter.sample(out_dir)
        finally:
            if not self.is_main:
                shutil.rmtree(out_dir, ignore_errors=True)
        if files and self.is_main:
            self.metrics.message(f"step {step}: samples in {files[0].parent}")
            self.metrics.samples(files, step)

    def _out_of_memory(self, step: int) -> UserError:
        t = self.cfg.train
        latest = find_latest_checkpoint(self.run_dir.checkpoints, warn=lambda _: None)
        fixes = []
        if t.batch_size > 1 and t.global_batch_size is not None:
            fixes.append(f"train.batch_size={max(1, t.batch_size // 2)} (train.global_batch_size keeps the batch per "
                         "optimizer step)")
        elif t.batch_size > 1:
            fixes.append(f"train.batch_size={max(1, t.batch_size // 2)} train.grad_accum={t.grad_accum * 2} "
                         "(same effective batch)")
        if t.gradient_checkpointing is not True:  # off, or N of the blocks
            fixes.append("train.gradient_checkpointing=true")
        if t.gradient_checkpointing is not False and t.get("checkpoint_keeps") == "attention":
            fixes.append("train.checkpoint_keeps=nothing (checkpointed blocks recompute their attention too)")
        if not optimizer_spec(t.optimizer).memory_light:
            fixes.append("train.optimizer=adamw8bit")
        fixes += self.adapter.memory_fixes()
        kept = f"the last checkpoint is intact: {latest.path}" if latest else "no checkpoint had been written yet"
        return UserError(f"out of memory at step {step} on {self.run_cfg.device.summary()} "
                         f"(preset {self.run_cfg.preset.name}); {kept}\n  fix: " + "\n  or: ".join(fixes or ["a smaller model or data.max_seq_len / data.resolution"]))

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> Path:
        """Train; the run folder's lock is released however this ends."""
        try:
            with self.exits:
                return self._train()
        except Exception as err:  # a full disk under any writer (logs, samples, config.yaml): exit 2, with the room
            full = as_disk_full(err, self.run_dir.root)
            if full is None:
                raise
            raise full.needing(self.checkpoint_bytes, "the next checkpoint") from None
        finally:
            if self.lock is not None:
                self.lock.release()

    def _train(self) -> Path:
        cfg = self.cfg
        self._start_processes()
        # network.init_from is copied before --fresh may move a run folder (the LoRA's own, perhaps) aside; a resumed
        # run does not read it, so a path that is gone is an error only for a run that starts
        init = Path(cfg.network.init_from) if cfg.network.init_from else None
        init_from = LoraSnapshot(lora_source(init, self.log)) if init is not None and init.exists() else None
        try:
            checkpoint = self._open_run_folder()
            if checkpoint is None and init is not None and init_from is None:
                lora_source(init)  # raises: it does not exist
            self.init_from = init_from if checkpoint is None else None
            self._setup()
        finally:
            self.init_from = None
            if init_from is not None:
                init_from.close()
        self.nan_streak = 0
        start = self._restore(checkpoint) if checkpoint is not None else 0
        if checkpoint is not None:
            self.log(f"resumed from {checkpoint.path} (step {start})"
                     + ("; network.init_from is not applied to a resumed run" if cfg.network.init_from else ""))
            if self.is_main:
                for stale in set_aside_checkpoints_after(self.run_dir.checkpoints, start):
                    self.log(f"resume: checkpoint above step {start} set aside (kept, no longer used): {stale}")
        steps = cfg.train.steps
        if start >= steps:
            if self.is_main and not self.run_dir.final.exists():  # the export failed last time (a full disk)
                with self._optimizer_eval_mode():
                    self._export_final()
            self.log(f"run already complete at step {start} (train.steps={steps}); final LoRA: {self.run_dir.final}\n"
                     "  raise train.steps to continue it, or use --fresh to start over")
            self.procs.finish()
            return self.run_dir.final
        self.metrics = MetricsLogger(self.run_dir.logs, steps, start, cfg.log.every, cfg.log.tensorboard, self.is_main,
                                     wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project, run_name=cfg.run.name,
                                     config=self.container, profile=cfg.log.profile)
        report = RunReport(self.run_dir, self.run_cfg, self.config_yaml) if self.is_main else None
        self.adapter.network.train()
        step = start
        started = time.perf_counter()
        try:
            with GracefulStop() as stop:
                lagging = None  # (step, sums) launched, not read yet: read once the next step is launched
                stopping = False
                for step in range(start + 1, steps + 1):
                    self.adapter.begin_step(step)
                    step_started = time.perf_counter()
                    sums = self.stepper.launch(stop.requested is not None)
                    if self.compiled and step == start + 1:
                        self.log(f"train.compile: the first step took {time.perf_counter() - step_started:.1f} s "
                                 "(compilation included)")
                    if lagging is not None:
                        stopping = self._record(*lagging) or stopping
                        lagging = None
                    if not self.procs.several:  # a signal that arrived during the step still counts
                        stopping = stopping or stop.requested is not None
                    due = (step == steps or (cfg.save.every and step % cfg.save.every == 0)
                           or (cfg.train.eval_every and step % cfg.train.eval_every == 0)
                           or (cfg.sample.every and step % cfg.sample.every == 0))
                    if self.stepper.skips_on_device and not (due or stopping):
                        lagging = (step, sums)
                        continue
                    stopping = self._record(step, sums) or stopping
                    if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                        self._eval(step)
                    if stopping or step == steps or (cfg.save.every and step % cfg.save.every == 0):
                        with self._optimizer_eval_mode():
                            saved = self._save(step)
                        if report is not None:
                            report.update(step, steps, time.perf_counter() - started)
                        if saved is not None and (stopping or step != steps):
                            self.metrics.message(f"step {step}: checkpoint {saved}")
                    if cfg.sample.every and step % cfg.sample.every == 0 and step != steps:
                        self._sample(step)
                    if stopping and step != steps:
                        raise StopRequested(stop.exit_code, f"stopped at step {step}; checkpoint saved, "
                                                            "run the same command to resume")
            elapsed = time.perf_counter() - started
            self._check_processes_agree()
            if cfg.train.eval_every == 0 or steps % cfg.train.eval_every:
                self._eval(steps)
            self._sample(steps)
            with self._optimizer_eval_mode():
                final = self._export_final() if self.is_main else self.run_dir.final
            if report is not None:
                self.log(f"report: {report.update(steps, steps, elapsed, finished=True)}")
        except torch.OutOfMemoryError:
            raise self._out_of_memory(step) from None
        finally:
            self.metrics.close()
        self.log(f"done: {steps - start} steps in {elapsed:.1f}s; LoRA written to {final}")
        self.procs.finish()
        return final

    def _check_processes_agree(self) -> None:
        """With several processes, every one must hold the same LoRA weights at the end: compared by checksum,
        so a broken gradient all-reduce can never pass silently."""
        if not self.procs.several:
            return
        digest = hashlib.sha256()
        for name, p in sorted(self.adapter.network.named_parameters()):
            if p.requires_grad:
                digest.update(name.encode())
                digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digests = self.procs.gather(digest.hexdigest())
        if len(set(digests)) != 1:
            raise RuntimeError(f"the processes ended with different LoRA weights (sha256 by rank: {digests}); "
                               "this is a bug in the toolkit, please report it")
        self.log(f"processes: LoRA weights identical on all {self.procs.world_size} (sha256 {digests[0][:16]})")

    def _eval(self, step: int) -> None:
        """The eval loss, on the main process (on every process when the base is sharded: see _sample)."""
        if not (self.is_main or self.sharded):
            return
        with self._optimizer_eval_mode(), self._eager():
            loss = self.adapter.eval_loss()
        if loss is not None and self.is_main:
            self.metrics.write({"step": step, "eval_loss": loss, "time": time.time()})
            self.log(f"step {step}: eval loss {loss:.4f}")

    def _write_lora(self, folder: Path) -> list[Path]:
        """The LoRA files of the weights as they are now (the EMA's with train.ema_decay > 0) into `folder`:
        final/ and every checkpoint hold the same files."""
        with self.ema.applied() if self.ema is not None else nullcontext():
            return self.adapter.save_lora(folder, DTYPES[self.cfg.save.dtype])

    def _export_final(self) -> Path:
        final = self.run_dir.final
        tmp = final.with_name(".final.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            tmp.mkdir(parents=True)
            self._write_lora(tmp)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(err):
                raise DiskFull("the final LoRA", self.run_dir.root, self.checkpoint_bytes, done="its temporary files "
                               "were removed, the checkpoints are as they were", fix="free space on that disk, then "
                               "run the same command: it exports the LoRA from the last checkpoint") from None
            raise
        if final.exists():  # an earlier final (a run extended with more steps): keep it
            final.rename(final.with_name(f"final.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
        tmp.rename(final)
        return final
