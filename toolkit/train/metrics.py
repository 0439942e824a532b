"""Metrics: logs/metrics.jsonl, TensorBoard events, optional Weights & Biases, one progress bar
(or a plain line every `log.every` steps without a TTY), and an optional profiler trace."""

from __future__ import annotations

import json
import math
import resource
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from toolkit.disk import disk_full_named, is_disk_full
from toolkit.errors import UserError
from toolkit.train.events import StepEvents
from toolkit.train.plots import IMAGE_SUFFIXES

PROFILE_STEPS = (2, 4)
"""Steps (of this session, first to last, inclusive) that log.profile records; step 1 warms up."""


def peak_memory_mb() -> tuple[float, str]:
    """Peak memory in MiB and what it measures: GPU allocations when a GPU is in use, else the process RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20, "gpu_max_allocated"
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "process_max_rss"


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


class StepProfiler:
    """torch.profiler over PROFILE_STEPS; writes logs/profile/trace-steps-A-B.json (Chrome trace format)."""

    def __init__(self, out_dir: Path):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        first, last = PROFILE_STEPS
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.trace_path = out_dir / f"trace-steps-{first}-{last}.json"
        self._profile = profile(activities=activities, record_shapes=True,
                                schedule=schedule(wait=first - 2, warmup=1, active=last - first + 1, repeat=1),
                                on_trace_ready=lambda prof: prof.export_chrome_trace(str(self.trace_path)))
        self._profile.start()
        self._done = False

    def step(self) -> None:
        if not self._done:
            self._profile.step()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._profile.stop()


class MetricsLogger(StepEvents):
    """The run's numbers as the loop's events bring them (`smoothed`: the smoothed loss a resumed run had reached,
    so that its log reads as an uninterrupted run's)."""

    def __init__(self, logs_dir: Path, total_steps: int, start_step: int, every: int, tensorboard: bool,
                 enabled: bool = True, wandb: bool = False, wandb_project: str | None = None,
                 run_name: str = "lora", config: dict | None = None, profile: bool = False,
                 smoothed: float | None = None):
        self.enabled = enabled
        self.every = every
        self.total_steps = total_steps
        self.smoothed: float | None = smoothed
        # First, so that a missing wandb stops the run before any file is opened.
        self._wandb = self._start_wandb(wandb_project or run_name, run_name, config) if enabled and wandb else None
        self._jsonl = (logs_dir / "metrics.jsonl").open("a", encoding="utf-8") if enabled else None
        self.logs_dir = logs_dir
        self._tb = None
        self._thread_hook = threading.excepthook
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=str(logs_dir / "tensorboard"))
            threading.excepthook = self._tensorboard_thread_failed
        self.profiler = StepProfiler(logs_dir / "profile") if enabled and profile else None
        self._tty = sys.stderr.isatty()
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, unit="step",
                         disable=not (enabled and self._tty), file=sys.stderr)
        self._last_time = time.perf_counter()
        self._last_end = None  # the StepEnd of the last logged step
        self._last_step = start_step
        self._tokens = 0  # since the last logged step
        self._tokens_per_s: float | None = None

    @staticmethod
    def _start_wandb(project: str, name: str, config: dict | None):
        try:
            import wandb
        except ImportError:
            raise UserError("log.wandb is true but wandb is not installed\n"
                            "  fix: .venv/bin/pip install wandb (then `wandb login`), or set log.wandb=false") from None
        return wandb.init(project=project, name=name, config=config or {})

    def step(self, step: int, loss: float, lr: float, extra: dict | None = None, tokens: int | None = None,
             grad_norm: "float | torch.Tensor | None" = None, ended=None) -> None:
        """Record one optimizer step's numbers; `tokens` (the batch's token count) adds tokens/s."""
        if not self.enabled:
            return
        if self.profiler is not None:
            self.profiler.step()
        if _finite(loss):
            self.smoothed = loss if self.smoothed is None else 0.9 * self.smoothed + 0.1 * loss
        if tokens:
            self._tokens += tokens
        postfix = {"loss": f"{self.smoothed:.4f}" if self.smoothed is not None else "nan", "lr": f"{lr:.2e}"}
        if self._tokens_per_s is not None:
            postfix["tok/s"] = f"{self._tokens_per_s:,.0f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)
        if step % self.every and step != self.total_steps:
            return
        now = time.perf_counter()
        # From the end of the last logged step to the end of this one (train/step.py StepEnd): numbers read a
        # step late are logged after the next step ran, which the host clock would count in.
        both = ended is not None and self._last_end is not None
        elapsed = max(ended.seconds_since(self._last_end) if both else now - self._last_time, 1e-9)
        self._last_end = ended
        rate = (step - self._last_step) / elapsed
        self._tokens_per_s = self._tokens / elapsed if self._tokens else None
        memory, memory_kind = peak_memory_mb()
        self._last_time, self._last_step, self._tokens = now, step, 0
        record = {"step": step, "loss": loss, "loss_smoothed": self.smoothed, "lr": lr, "steps_per_s": rate}
        if self._tokens_per_s is not None:
            record["tokens_per_s"] = self._tokens_per_s
        grad_norm = float(grad_norm) if grad_norm is not None else None  # a device tensor until logged
        if _finite(grad_norm):
            record["grad_norm"] = grad_norm
        record.update({"memory_mb": memory, "memory_kind": memory_kind, "time": time.time(), **(extra or {})})
        self.write(record)
        if not self._tty:
            eta = (self.total_steps - step) / rate if rate > 0 else float("inf")
            throughput = f"{self._tokens_per_s:,.0f} tok/s" if self._tokens_per_s is not None else f"{rate:.2f} it/s"
            smoothed = self.smoothed if self.smoothed is not None else float("nan")
            print(f"step {step}/{self.total_steps}  loss {loss:.4f} (smoothed {smoothed:.4f})  lr {lr:.2e}  "
                  f"{throughput}  mem {memory:,.0f} MB  eta {_format_eta(eta)}", file=sys.stderr, flush=True)

    # -- the loop's events ----------------------------------------------------------------------
    def step_recorded(self, step: int, sums) -> None:
        self.step(step, sums.mean, sums.lr, tokens=int(sums.tokens), grad_norm=sums.grad_norm, ended=sums.ended)

    def evaluated(self, step: int, loss: float) -> None:
        self.write({"step": step, "eval_loss": loss, "time": time.time()})

    def sampled(self, step: int, files: list[Path]) -> None:
        self.message(f"step {step}: samples in {files[0].parent}")
        self.samples(files, step)
    def _tensorboard_thread_failed(self, args) -> None:
        """TensorBoard writes its events in a thread of its own, and raises that thread's error again at its next
        call here, where a full disk is named: the thread's own traceback is left out."""
        if not (is_disk_full(args.exc_value) and type(args.thread).__name__ == "_AsyncWriterThread"):
            self._thread_hook(args)

    def _full_disk_named(self):
        return disk_full_named("the run's logs (metrics.jsonl, TensorBoard events)", self.logs_dir)

    def write(self, record: dict) -> None:
        """Append a record to metrics.jsonl and its numbers to TensorBoard (and W&B)."""
        if not self.enabled:
            return
        numbers = {k: v for k, v in record.items()
                   if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        with self._full_disk_named():
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
            if self._tb is not None:
                for key, value in numbers.items():
                    self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(numbers, step=record["step"])

    def image(self, tag: str, path: Path, step: int) -> None:
        """Log a sample image (a family that produces images calls this for each sample or grid)."""
        if not self.enabled or (self._tb is None and self._wandb is None):
            return
        import numpy as np
        from PIL import Image

        with Image.open(path) as img:
            pixels = np.asarray(img.convert("RGB"))
        if self._tb is not None:
            with self._full_disk_named():
                self._tb.add_image(tag, pixels, step, dataformats="HWC")
        if self._wandb is not None:
            import wandb
            self._wandb.log({tag: wandb.Image(pixels)}, step=step)

    def samples(self, paths: list[Path], step: int) -> None:
        """Log the images among one sampling round's files (text samples live in samples/ and the report); a
        video sample is logged by the still that comes first in `paths` (its middle frame, 00.png before 00.webp)."""
        logged = set()
        for path in paths:
            if path.suffix.lower() in IMAGE_SUFFIXES and path.stem not in logged:
                self.image(f"samples/{path.stem}", path, step)
                logged.add(path.stem)

    def message(self, text: str) -> None:
        """Print above the progress bar without breaking it."""
        if self.enabled:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        """Close the files; a full disk while the run is already stopping on an error leaves that error in charge."""
        if not self.enabled:
            return
        stopping = sys.exc_info()[1] is not None  # called from the trainer's finally
        if self.profiler is not None:
            self.profiler.close()
        self._bar.close()
        try:
            with self._full_disk_named():
                try:
                    self._jsonl.close()  # closed even when its last flush fails
                finally:
                    if self._tb is not None:
                        try:
                            self._tb.flush()  # raises what TensorBoard's writer thread met
                        finally:
                            self._tb.close()
        except UserError:
            if not stopping:
                raise
        finally:
            if self._tb is not None:
                threading.excepthook = self._thread_hook
            if self._wandb is not None:
                self._wandb.finish()


def _format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"
