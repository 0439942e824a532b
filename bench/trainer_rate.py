"""Shared by the benchmarks: run the toolkit's Trainer on a config and read its measured step rate."""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

PROFILED_STEPS = 3


@contextmanager
def profile_after(launches: int, into: dict | None, peak: dict):
    """Profile the Trainer's steps after the first `launches` ones into `into` (None: no profile); the peak
    memory of the steps before the profile goes into peak["gib"]."""
    if into is None:
        yield
        return
    from kernel_profile import profiled

    from toolkit.train.step import Stepper

    launch, count, window = Stepper.launch, {"n": 0}, {}

    def watched(self, stop_requested):
        count["n"] += 1
        if count["n"] == launches + 1:
            peak["gib"] = torch.cuda.max_memory_allocated() / 2**30
            window["cm"] = profiled(PROFILED_STEPS, into)
            window["cm"].__enter__()
        sums = launch(self, stop_requested)
        if count["n"] == launches + PROFILED_STEPS:
            window.pop("cm").__exit__(None, None, None)
        return sums

    Stepper.launch = watched
    try:
        yield
    finally:
        Stepper.launch = launch
        if "cm" in window:
            window.pop("cm").__exit__(None, None, None)


def trainer_rate(config_yaml: str, overrides: list[str], out: Path, optimizer: str, steps: int,
                 warmup: int, logs: list[str] | None = None, profile: dict | None = None) -> tuple[float, float]:
    """(steps per second after `warmup` steps, peak GiB) of a Trainer run of `config_yaml` + `overrides`.

    The rate is the Trainer's own (logs/metrics.jsonl, logged every `warmup` steps); 8-bit optimizers are
    the toolkit's kernels, not bitsandbytes. The run's log lines are appended to `logs` when given. With
    `profile` (a dict), PROFILED_STEPS more steps run after the timed ones under the profiler, and their
    summary (bench/kernel_profile.py) goes into it; the rate and the peak leave them out."""
    from toolkit.config.run import load_run
    from toolkit.train.trainer import Trainer

    extra = PROFILED_STEPS if profile is not None else 0
    overrides = [*overrides, f"train.steps={steps + warmup + extra}", f"train.optimizer={optimizer}", f"run.output_dir={out}",
                 f"log.every={warmup}"]
    if optimizer.endswith("8bit"):
        overrides.append("train.optimizer_backend=toolkit")
    cfg = Path(tempfile.mkdtemp()) / "bench.yaml"
    cfg.write_text(config_yaml)
    run = load_run([cfg], overrides)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    peak = {}
    with profile_after(steps + warmup, profile, peak):
        Trainer(run, fresh=True, log=logs.append if logs is not None else (lambda m: None)).run()
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "steps_per_s" in r and warmup < r["step"] <= steps + warmup]
    peak = peak.get("gib", torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0)
    return sum(r["steps_per_s"] for r in timed) / len(timed), peak
