"""The training loop. Family differences live in the model adapter; this file never asks which family."""

from __future__ import annotations

import hashlib
import shutil
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from omegaconf import OmegaConf

from toolkit.config.load import resolved_container
from toolkit.config.run import ResolvedRun
from toolkit.data.order import BatchOrder
from toolkit.errors import UserError
from toolkit.models import build_adapter
from toolkit.models.base import DTYPES, Runtime, trainable_parameters
from toolkit.optim import build_optimizer
from toolkit.train.checkpoint import (find_latest_checkpoint, load_checkpoint_files, rotate_checkpoints,
                                      save_checkpoint, set_aside_checkpoints_after)
from toolkit.train.ema import LoraEMA
from toolkit.train.metrics import MetricsLogger
from toolkit.train.report import RunReport
from toolkit.train.resume import check_resume_config, choose_start
from toolkit.train.rng import restore_rng_state, rng_state, seed_everything
from toolkit.train.run_dir import RunDir
from toolkit.train.signals import GracefulStop, StopRequested

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class Trainer:
    def __init__(self, run: ResolvedRun, fresh: bool = False, log=None):
        self.run_cfg = run
        self.cfg = run.cfg
        self.fresh = fresh
        self.run_dir = RunDir(Path(self.cfg.run.output_dir))
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    # -- setup -----------------------------------------------------------------------------
    def _setup(self):
        from accelerate import Accelerator

        cfg, device = self.cfg, self.run_cfg.device
        self.accelerator = Accelerator(cpu=device.backend == "cpu",
                                       mixed_precision=MIXED_PRECISION[cfg.train.precision])
        self.is_main = self.accelerator.is_main_process
        runtime = Runtime(device=self.accelerator.device, info=device, base_dtype=DTYPES[cfg.model.dtype],
                          compute_dtype=DTYPES[cfg.train.precision], run_dir=self.run_dir.root)
        seed_everything(cfg.run.seed)
        self.adapter = build_adapter(cfg, runtime)
        if device.backend == "cuda":
            self._choose_cudnn_sdpa(cfg.device.cudnn_sdpa)
        self.adapter.load()
        self.dataset = self.adapter.dataset()
        if len(self.dataset) == 0:
            raise UserError(f"data.path: {cfg.data.path} gave no training samples")
        self.order = BatchOrder(self.dataset.groups, cfg.train.batch_size, cfg.run.seed,
                                world_size=self.accelerator.num_processes, rank=self.accelerator.process_index)
        params = trainable_parameters(self.adapter.network)
        decay = cfg.train.ema_decay
        if decay >= 1.0:
            raise UserError(f"train.ema_decay: {decay} would never move from the initial weights; "
                            "use a value below 1 (0.999 is usual) or 0 to turn the EMA off")
        self.ema = LoraEMA(self.adapter.network, decay) if decay > 0 else None
        optimizer, reason = build_optimizer(
            cfg.train.optimizer, params, lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps,
            weight_decay=cfg.train.weight_decay, backend=cfg.train.optimizer_backend, device_type=device.backend)
        self.log(f"optimizer: {reason}")
        from transformers import get_scheduler
        self.scheduler = get_scheduler(cfg.train.lr_scheduler, optimizer, num_warmup_steps=cfg.train.warmup_steps,
                                       num_training_steps=cfg.train.steps)
        if self.accelerator.num_processes > 1:
            self.adapter.forward_module = self.accelerator.prepare_model(self.adapter.network)
        self.optimizer = self.accelerator.prepare_optimizer(optimizer)
        n_train = sum(p.numel() for p in params)
        self.log(f"model: {cfg.model.family} {cfg.model.name_or_path}; {len(self.adapter.lora_targets())} LoRA "
                 f"modules, {n_train:,} trainable parameters; {len(self.dataset)} training samples")

    def _choose_cudnn_sdpa(self, setting) -> None:
        """PyTorch SDPA's cuDNN backend: the adapter's default under auto (Flux shapes crashed it, FINDINGS.md)."""
        if setting == "auto":
            enabled, why = getattr(self.adapter, "cudnn_sdpa", True), f"auto for {self.cfg.model.family}"
        elif isinstance(setting, bool):
            enabled, why = setting, "set in the config"
        else:
            raise UserError(f"device.cudnn_sdpa: expected true, false or auto, got {setting!r}")
        torch.backends.cuda.enable_cudnn_sdp(enabled)
        self.log(f"attention: SDPA cuDNN backend {'on' if enabled else 'off'} (device.cudnn_sdpa {why})")

    # -- state -----------------------------------------------------------------------------
    def _trainer_state(self, step: int) -> dict:
        scaler = self.accelerator.scaler
        return {"step": step, "scheduler": self.scheduler.state_dict(), "rng": rng_state(),
                "data_order": self.order.state_dict(), "nan_streak": self.nan_streak,
                "scaler": scaler.state_dict() if scaler is not None else None}

    def _restore(self, checkpoint) -> int:
        loaded = load_checkpoint_files(checkpoint)
        state = loaded.trainer
        self.adapter.load_lora_state_dict(loaded.lora)
        self.optimizer.load_state_dict(loaded.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") is not None and self.accelerator.scaler is not None:
            self.accelerator.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            if loaded.ema is None:
                raise UserError(f"train.ema_decay is {self.cfg.train.ema_decay}, but {checkpoint.path} has no "
                                "ema.safetensors\n  fix: set train.ema_decay=0, or start over with --fresh")
            self.ema.load_state_dict(loaded.ema)
        self.order.load_state_dict(state["data_order"])
        restore_rng_state(state["rng"])
        self.nan_streak = state.get("nan_streak", 0)
        return int(state["step"])

    def _save(self, step: int) -> Path:
        path = save_checkpoint(self.run_dir.checkpoints, step, self.adapter.lora_state_dict(),
                               self.optimizer.state_dict(), self._trainer_state(step), self.config_yaml,
                               self.config_hash, ema=self.ema.state_dict() if self.ema is not None else None)
        rotate_checkpoints(self.run_dir.checkpoints, self.cfg.save.keep_last)
        return path

    # -- one step --------------------------------------------------------------------------
    def _train_step(self) -> float:
        """One optimizer step over grad_accum micro-batches; returns the mean loss (NaN skips the update)."""
        accum = self.cfg.train.grad_accum
        module = getattr(self.adapter, "forward_module", None) or self.adapter.network
        losses = []
        self.step_tokens, self.grad_norm = 0, None
        for micro in range(accum):
            batch = self.dataset.collate(self.order.next_batch())
            if self.accelerator.device.type == "cuda":
                # Pinned host memory makes the adapter's non_blocking copies asynchronous: a copy from
                # pageable memory waits for the GPU to drain, leaving it idle while the next step launches.
                batch = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}
            if isinstance(batch, dict) and torch.is_tensor(batch.get("input_ids")):
                self.step_tokens += batch["input_ids"].numel()
            sync = micro == accum - 1 or self.accelerator.num_processes == 1
            context = self.accelerator.no_sync(module) if not sync else nullcontext()
            with context, self.accelerator.autocast():
                loss = self.adapter.loss(batch) / accum
            with context:
                self.accelerator.backward(loss)
            losses.append(loss.detach())
        # One host sync per step, after backward is queued, so the GPU stays busy while we wait for it.
        # A non-finite loss discards the step's gradients and skips the update.
        total = torch.stack(losses).float().sum().item()
        if not math.isfinite(total):
            self.optimizer.zero_grad(set_to_none=True)
            return float("nan")
        if self.cfg.train.max_grad_norm > 0:
            # Kept as a device tensor: MetricsLogger converts it only on the steps it logs.
            self.grad_norm = self.accelerator.clip_grad_norm_(trainable_parameters(self.adapter.network),
                                                              self.cfg.train.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None and not self.optimizer.step_was_skipped:  # fp16: the scaler may skip a step
            self.ema.update()
        return total

    def _sample(self, step: int) -> None:
        if not list(self.cfg.sample.prompts) or not self.is_main:
            return
        # Sampling must not disturb the training RNG streams, or resumed runs would diverge.
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            files = self.adapter.sample(self.run_dir.sample_dir(step))
        if files:
            self.metrics.message(f"step {step}: samples in {files[0].parent}")
            self.metrics.samples(files, step)

    def _out_of_memory(self, step: int) -> UserError:
        t = self.cfg.train
        latest = find_latest_checkpoint(self.run_dir.checkpoints, warn=lambda _: None)
        fixes = []
        if t.batch_size > 1:
            fixes.append(f"train.batch_size={max(1, t.batch_size // 2)} train.grad_accum={t.grad_accum * 2} "
                         "(same effective batch)")
        if not t.gradient_checkpointing:
            fixes.append("train.gradient_checkpointing=true")
        if t.optimizer not in ("adamw8bit", "lion8bit", "adafactor"):
            fixes.append("train.optimizer=adamw8bit")
        # Family-specific remedies come from the adapter; the trainer does not ask which family it is.
        fixes += getattr(self.adapter, "memory_fixes", lambda: [])()
        kept = f"the last checkpoint is intact: {latest.path}" if latest else "no checkpoint had been written yet"
        return UserError(f"out of memory at step {step} on {self.run_cfg.device.summary()} "
                         f"(preset {self.run_cfg.preset.name}); {kept}\n  fix: " + "\n  or: ".join(fixes or ["a smaller model or data.max_seq_len / data.resolution"]))

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> Path:
        cfg = self.cfg
        container = resolved_container(cfg)
        self.config_yaml = OmegaConf.to_yaml(OmegaConf.create(container))
        self.config_hash = hashlib.sha256(self.config_yaml.encode()).hexdigest()[:16]
        checkpoint = choose_start(cfg.train.resume, self.run_dir, self.fresh, self.log)
        if checkpoint is not None:
            check_resume_config(checkpoint, container, self.log)
        self.run_dir.create()
        _write_atomic(self.run_dir.config, self.config_yaml)
        self._setup()
        self.nan_streak = 0
        start = self._restore(checkpoint) if checkpoint is not None else 0
        if checkpoint is not None:
            self.log(f"resumed from {checkpoint.path} (step {start})")
            for stale in set_aside_checkpoints_after(self.run_dir.checkpoints, start):
                self.log(f"resume: checkpoint above step {start} set aside (kept, no longer used): {stale}")
        steps = cfg.train.steps
        if start >= steps:
            self.log(f"run already complete at step {start} (train.steps={steps}); final LoRA: {self.run_dir.final}\n"
                     "  raise train.steps to continue it, or use --fresh to start over")
            return self.run_dir.final
        self.metrics = MetricsLogger(self.run_dir.logs, steps, start, cfg.log.every, cfg.log.tensorboard, self.is_main,
                                     wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project, run_name=cfg.run.name,
                                     config=container, profile=cfg.log.profile)
        report = RunReport(self.run_dir, self.run_cfg, self.config_yaml) if self.is_main else None
        self.adapter.network.train()
        step = start
        started = time.perf_counter()
        try:
            with GracefulStop() as stop:
                begin_step = getattr(self.adapter, "begin_step", None)  # per-step adapter state (Wan 2.2 experts)
                for step in range(start + 1, steps + 1):
                    if begin_step is not None:
                        begin_step(step)
                    loss = self._train_step()
                    if math.isfinite(loss):
                        self.nan_streak = 0
                    else:
                        self.nan_streak += 1
                        self.metrics.message(f"warning: step {step}: loss is not finite; update skipped "
                                             f"({self.nan_streak}/{cfg.train.max_nan_steps} in a row)")
                        if self.nan_streak >= cfg.train.max_nan_steps:
                            raise UserError(f"loss was NaN or inf for {self.nan_streak} steps in a row (step {step})\n"
                                            "  fix: lower train.lr, use train.precision=bf16 or fp32 instead of fp16, "
                                            "or check the data")
                    self.scheduler.step()
                    self.metrics.step(step, loss, self.scheduler.get_last_lr()[0], tokens=self.step_tokens,
                                      grad_norm=self.grad_norm)
                    if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                        self._eval(step)
                    stopping = stop.requested is not None
                    if self.is_main and (stopping or step == steps or (cfg.save.every and step % cfg.save.every == 0)):
                        saved = self._save(step)
                        report.update(step, steps, time.perf_counter() - started)
                        if stopping or step != steps:
                            self.metrics.message(f"step {step}: checkpoint {saved}")
                    if cfg.sample.every and step % cfg.sample.every == 0 and step != steps:
                        self._sample(step)
                    if stopping and step != steps:
                        raise StopRequested(stop.exit_code, f"stopped at step {step}; checkpoint saved, "
                                                            "run the same command to resume")
            elapsed = time.perf_counter() - started
            if cfg.train.eval_every == 0 or steps % cfg.train.eval_every:
                self._eval(steps)
            self._sample(steps)
            final = self._export_final() if self.is_main else self.run_dir.final
            if report is not None:
                self.log(f"report: {report.update(steps, steps, elapsed, finished=True)}")
        except torch.OutOfMemoryError:
            raise self._out_of_memory(step) from None
        finally:
            self.metrics.close()
        self.log(f"done: {steps - start} steps in {elapsed:.1f}s; LoRA written to {final}")
        return final

    def _eval(self, step: int) -> None:
        loss = self.adapter.eval_loss()
        if loss is not None:
            self.metrics.write({"step": step, "eval_loss": loss, "time": time.time()})
            self.log(f"step {step}: eval loss {loss:.4f}")

    def _export_final(self) -> Path:
        final = self.run_dir.final
        tmp = final.with_name(".final.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        with self.ema.applied() if self.ema is not None else nullcontext():
            self.adapter.save_lora(tmp, DTYPES[self.cfg.save.dtype])
        if final.exists():  # an earlier final (a run extended with more steps): keep it
            final.rename(final.with_name(f"final.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
        tmp.rename(final)
        return final
