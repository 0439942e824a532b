"""Metrics: logs/metrics.jsonl, TensorBoard events, and one progress bar (or plain lines without a TTY)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm


class MetricsLogger:
    def __init__(self, logs_dir: Path, total_steps: int, start_step: int, every: int, tensorboard: bool,
                 enabled: bool = True):
        self.enabled = enabled
        self.every = every
        self.total_steps = total_steps
        self.smoothed: float | None = None
        self._jsonl = (logs_dir / "metrics.jsonl").open("a", encoding="utf-8") if enabled else None
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=str(logs_dir / "tensorboard"))
        self._tty = sys.stderr.isatty()
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                         disable=not (enabled and self._tty), file=sys.stderr)
        self._last_time = time.perf_counter()
        self._last_step = start_step

    def step(self, step: int, loss: float, lr: float, extra: dict | None = None) -> None:
        """Record one optimizer step's numbers."""
        if not self.enabled:
            return
        if loss == loss and abs(loss) != float("inf"):
            self.smoothed = loss if self.smoothed is None else 0.9 * self.smoothed + 0.1 * loss
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{self.smoothed:.4f}" if self.smoothed is not None else "nan", lr=f"{lr:.2e}",
                              refresh=False)
        if step % self.every and step != self.total_steps:
            return
        now = time.perf_counter()
        rate = (step - self._last_step) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_step = now, step
        record = {"step": step, "loss": loss, "loss_smoothed": self.smoothed, "lr": lr, "steps_per_s": rate,
                  "time": time.time(), **(extra or {})}
        self.write(record)
        if not self._tty:
            eta = (self.total_steps - step) / rate if rate > 0 else float("inf")
            print(f"step {step}/{self.total_steps}  loss {loss:.4f} (smoothed {self.smoothed or float('nan'):.4f})  "
                  f"lr {lr:.2e}  {rate:.2f} it/s  eta {eta:.0f}s", file=sys.stderr, flush=True)

    def write(self, record: dict) -> None:
        """Append a record to metrics.jsonl and its numbers to TensorBoard."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def message(self, text: str) -> None:
        """Print above the progress bar without breaking it."""
        if self.enabled:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if not self.enabled:
            return
        self._bar.close()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
