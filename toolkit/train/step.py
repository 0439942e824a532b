"""One optimizer step of the trainer: micro-batches through the (wrapped) trainable modules, backward, the
update; the step's numbers stay on the device until the trainer reads them (StepSums)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from toolkit.rng import step_rng_state
from toolkit.train.events import Events


@dataclass
class StepSums:
    """One launched optimizer step's numbers, on the device until read(): the loss summed over units, and the
    counts [units, tokens, stop requests] (host numbers with one process, summed over processes otherwise)."""

    loss: torch.Tensor
    counts: "list[float] | torch.Tensor"
    grad_norm: torch.Tensor | None = None
    lr: float = 0.0
    mean: float = math.nan
    tokens: float = 0.0
    stops: float = 0.0
    done: bool = False
    ended: "StepEnd | None" = None
    host: "torch.Tensor | None" = None      # set by fetch(): the numbers on their way to host memory
    copied: "torch.cuda.Event | None" = None

    def fetch(self) -> None:
        """Start copying the step's numbers (loss, counts, gradient norm) to host memory right behind the step's
        work on the GPU's stream, so that read() waits for this step only. A read that copies later queues behind
        whatever was launched since: reading step N-1 after step N was launched would wait for step N to finish,
        and the GPU would idle while the host launches step N+1 (evidence step-fetch, bench/results/evidence.json)."""
        values = [self.loss.reshape(1)] + ([self.counts.reshape(-1)] if torch.is_tensor(self.counts) else [])
        if torch.is_tensor(self.grad_norm):
            values.append(self.grad_norm.reshape(1))
        stacked = torch.cat([v.double() for v in values])
        cuda = stacked.device.type == "cuda"
        self.host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=cuda)
        self.host.copy_(stacked, non_blocking=cuda)
        if cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def read(self) -> None:
        if self.done:
            return
        if self.host is not None:
            if self.copied is not None:
                self.copied.synchronize()
            values = self.host.tolist()
            loss, rest = values[0], values[1:]
            if torch.is_tensor(self.counts):
                (units, self.tokens, self.stops), rest = rest[:3], rest[3:]
            else:
                units, self.tokens, self.stops = self.counts
            if torch.is_tensor(self.grad_norm):
                self.grad_norm = rest[0]
        elif torch.is_tensor(self.counts):
            loss, units, self.tokens, self.stops = torch.cat([self.loss.reshape(1), self.counts]).tolist()
        else:
            loss, (units, self.tokens, self.stops) = self.loss.item(), self.counts
        self.mean, self.done = loss / max(units, 1.0), True


@dataclass
class StepEnd:
    """When a step's work ended: an event on the GPU's stream (read once the step is done, so a number read a
    step late still times its own step), the host clock on the CPU (where launching is doing)."""

    host: float
    event: "torch.cuda.Event | None" = None

    @classmethod
    def now(cls, device: torch.device) -> "StepEnd":
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return cls(time.perf_counter(), event)

    def seconds_since(self, earlier: "StepEnd") -> float:
        if self.event is not None and earlier.event is not None:
            return earlier.event.elapsed_time(self.event) / 1000
        return self.host - earlier.host


@dataclass
class StepParts:
    """What launching a step uses, handed over by the trainer once everything is built."""

    dataset: Any                     # collate(indices, epoch)
    order: Any                       # data/order.py BatchOrder: this process's share of each global batch
    loss: Callable                   # the adapter's loss(batch, modules): a sum over units
    units: Callable                  # the adapter's batch_units(batch): (loss units, tokens)
    modules: Mapping[str, torch.nn.Module]   # the trainable modules as wrapped (DDP) or sharded
    params: list                     # the LoRA weights
    optimizer: Any                   # accelerate's wrapper (fp16 loss scaling)
    inner: torch.optim.Optimizer     # the optimizer itself (found_inf)
    scheduler: Any
    ema: Any                         # train/ema.py LoraEMA or None
    procs: Any                       # train/distributed.py Processes
    accelerator: Any                 # autocast, backward, clip, the loss scaler
    grad_accum: int
    max_grad_norm: float
    averages: bool = False           # LoRA gradients averaged here, once a step, in one flat all-reduce (fsdp, or
                                     # device.gradient_sync=allreduce): the modules are not DDP-wrapped
    cuda_graphs: bool = False        # compiled regions replayed as CUDA graphs (train/blocks.py)


class Stepper:
    """Launches optimizer steps from its StepParts, marking each step's phases for the run's events."""

    def __init__(self, parts: StepParts, events: Events):
        self.parts, self.events = parts, events
        p = parts
        # Optimizers that take GradScaler's `found_inf` (torch's fused AdamW, the toolkit's adamw8bit and
        # lion8bit) skip a non-finite step on the device, so the trainer never waits for the GPU between steps.
        self.skips_on_device = bool(getattr(p.inner, "_step_supports_amp_scaling", False)
                                    and p.accelerator.scaler is None and p.ema is None)
        # Where the step in flight is, for a step that runs out of memory (train/out_of_memory.py): the data
        # position and torch's RNG streams as it began (one process: the trainer then saves the previous step),
        # the shapes of the micro-batch in flight, and whether the update had begun (it cannot be undone).
        self.keeps_start = not p.procs.several
        self.start: tuple | None = None
        self.shapes: dict | None = None
        self.updating = False

    def _next_batch(self) -> dict:
        """This process's next micro-batch; its epoch keys the data's augmentation draws (data/augment.py)."""
        p = self.parts
        batch = p.dataset.collate(p.order.next_batch(), epoch=p.order.epoch)
        self.events.phase("queued")
        return batch

    def launch(self, stop_requested: bool) -> StepSums:
        """Launch one optimizer step over grad_accum micro-batches on every process; its numbers stay on the
        device (StepSums) until read. The loss is the mean over every unit (token, sample) of the global batch;
        a non-finite loss anywhere discards the step's update on every process.

        With an optimizer that can skip an update on the device (torch's fused AdamW and the toolkit's 8-bit
        optimizers, as GradScaler uses them) nothing here waits for the GPU: the update is launched with
        `found_inf` set from the loss, and the loss is read a step later, while the GPU works on the next one.
        Other optimizers (bitsandbytes' too), fp16 loss scaling and the EMA read the loss here, once, after
        backward is queued."""
        p, events = self.parts, self.events
        events.phase("start")
        if self.keeps_start:
            self.start = (p.order.position_state(), step_rng_state())
        batches = [self._next_batch() for _ in range(p.grad_accum)]
        device = p.accelerator.device
        weights = [p.units(batch) for batch in batches]
        counts = [float(sum(units for units, _ in weights)), float(sum(tokens for _, tokens in weights)),
                  float(stop_requested)]
        if p.procs.several:  # units, tokens and stop requests summed over processes, read later
            # from pinned memory: a copy from pageable memory would wait for the GPU to finish the last step
            host = torch.tensor(counts, pin_memory=device.type == "cuda")
            counts = p.procs.sum(host.to(device, non_blocking=True))
            units = counts[0].clamp(min=1.0)
        else:
            units = max(counts[0], 1.0)
        # The loss is a sum over units; dividing by the step's units over every process before backward gives
        # the gradient of the mean over the global batch (DDP then averages over processes, hence world_size),
        # and keeps gradients at the scale fp16 loss scaling expects.
        scale = p.procs.world_size / units
        losses = []
        for micro, batch in enumerate(batches):
            if device.type == "cuda":
                # Pinned host memory makes the adapter's non_blocking copies asynchronous: a copy from
                # pageable memory waits for the GPU to drain, leaving it idle while the next step launches.
                batch = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}
            self.shapes = batch
            if p.cuda_graphs:  # a new step: the graphs' previous outputs may be overwritten from here on
                torch.compiler.cudagraph_mark_step_begin()
            with p.procs.no_sync(p.modules, skip=micro < p.grad_accum - 1 and not p.averages):
                with p.accelerator.autocast():
                    events.phase("forward")
                    loss = p.loss(batch, p.modules)
                    events.phase("backward")
                p.accelerator.backward(loss * scale)
            losses.append(loss.detach().float())
        self.shapes = None
        if p.averages:  # not DDP-wrapped (the LoRA weights are not sharded either): one all-reduce a step
            p.procs.average_gradients(p.params)
        loss_sum = p.procs.sum(torch.stack(losses).sum())
        sums = StepSums(loss_sum, counts)
        if self.skips_on_device:
            p.inner.found_inf = (~torch.isfinite(loss_sum)).float()
            self._update(sums)
        else:
            events.phase("read")
            sums.read()  # the one wait for the GPU in this step
            events.phase("read done")
            if math.isfinite(sums.mean):
                scale = self._loss_scale() if p.ema is not None else 1.0
                self._update(sums)
                # fp16: GradScaler skipped the update exactly when it lowered its scale (accelerate's
                # step_was_skipped cannot tell: an optimizer that takes found_inf skips inside step())
                if p.ema is not None and self._loss_scale() >= scale:
                    p.ema.update()
            else:
                p.optimizer.zero_grad(set_to_none=True)
        p.scheduler.step()
        sums.lr = p.scheduler.get_last_lr()[0]
        sums.ended = StepEnd.now(device)
        events.phase("end")
        if self.skips_on_device:  # read a step later, without waiting for the steps launched after this one
            sums.fetch()          # (after `ended`: that event has completed once the copy has)
        return sums

    def _update(self, sums: StepSums) -> None:
        p = self.parts
        self.events.phase("update")
        self.updating = True
        if p.max_grad_norm > 0:  # a device tensor: MetricsLogger converts it on the steps it logs
            sums.grad_norm = p.accelerator.clip_grad_norm_(p.params, p.max_grad_norm)
        p.optimizer.step()
        p.optimizer.zero_grad(set_to_none=True)
        self.updating = False
        self.events.phase("updated")

    def _loss_scale(self) -> float:
        """fp16 loss scaling's current scale (a wait for the GPU), 1.0 without it."""
        scaler = self.parts.accelerator.scaler
        return 1.0 if scaler is None else scaler.get_scale()
