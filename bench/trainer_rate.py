"""Shared by the benchmarks: run the toolkit's Trainer on a config and read its measured step rate."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch


def trainer_rate(config_yaml: str, overrides: list[str], out: Path, optimizer: str, steps: int,
                 warmup: int, logs: list[str] | None = None) -> tuple[float, float]:
    """(steps per second after `warmup` steps, peak GiB) of a Trainer run of `config_yaml` + `overrides`.

    The rate is the Trainer's own (logs/metrics.jsonl, logged every `warmup` steps); 8-bit optimizers are
    the toolkit's kernels, not bitsandbytes. The run's log lines are appended to `logs` when given."""
    from toolkit.config.run import load_run
    from toolkit.train.trainer import Trainer

    overrides = [*overrides, f"train.steps={steps + warmup}", f"train.optimizer={optimizer}", f"run.output_dir={out}",
                 f"log.every={warmup}"]
    if optimizer.endswith("8bit"):
        overrides.append("train.optimizer_backend=toolkit")
    cfg = Path(tempfile.mkdtemp()) / "bench.yaml"
    cfg.write_text(config_yaml)
    run = load_run([cfg], overrides)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    Trainer(run, fresh=True, log=logs.append if logs is not None else (lambda m: None)).run()
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "steps_per_s" in r and r["step"] > warmup]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return sum(r["steps_per_s"] for r in timed) / len(timed), peak
