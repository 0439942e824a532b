"""Shared by the benchmarks: run the toolkit's Trainer on a config and read its measured step rate."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from toolkit.train.events import StepEvents

PROFILED_STEPS = 3
PHASED_STEPS = 10


class Windows(StepEvents):
    """After the Trainer's first `launches` steps, each window (steps, make_context) in turn: its steps run inside
    make_context() (entered as the window's first step starts, left once its last is launched), through the
    trainer's step events. The peak memory of the steps before the first window goes into peak["gib"];
    peak["steps"] counts the steps launched so far, peak["window"] the window open (a failure while one is open is
    that window's; None once it closed)."""

    def __init__(self, launches: int, windows: list[tuple[int, Callable]], peak: dict):
        self.launches, self.peak, self.spans, self.open = launches, peak, [], []
        peak["steps"] = launches if not windows else 0
        first = launches + 1
        for steps, make in windows:
            self.spans.append((first, first + steps - 1, make))
            first += steps
        self.count = 0

    def step_started(self, step: int) -> None:
        self.count += 1
        self.peak["steps"] = self.count
        if self.count == self.launches + 1 and torch.cuda.is_available():
            self.peak["gib"] = torch.cuda.max_memory_allocated() / 2**30
        for index, (start, _, make) in enumerate(self.spans):
            if self.count == start:
                self.peak["window"] = index  # the window a failure from here on belongs to
                self.open.append(make())
                self.open[-1].__enter__()

    def step_launched(self, step: int, sums) -> None:
        if self.count == 1:
            self.peak["first_step_at"] = time.time()  # the first step launched (compiled: its compile done)
        if any(self.count == end for _, end, _ in self.spans):
            self.open.pop().__exit__(None, None, None)
            self.peak["window"] = None  # closed: a later failure (the final export, say) is the run's own

    def close(self) -> None:
        while self.open:
            self.open.pop().__exit__(None, None, None)


def config_file(config_yaml: str) -> Path:
    """`config_yaml` in a file of its own, for load_run."""
    path = Path(tempfile.mkdtemp()) / "bench.yaml"
    path.write_text(config_yaml)
    return path


def planned(config_yaml: str, overrides: list[str], keys: tuple[str, ...], steps: int) -> list[str]:
    """`key=value` for each of `keys` the toolkit settles (auto) when the run is planned as `steps` steps long: to
    time a few steps of a run that a user would make longer (train.compile=auto compiles from a length)."""
    from toolkit.plan.run import load_run

    run = load_run([config_file(config_yaml)], [*overrides, f"train.steps={steps}"])
    return [f"{key}={str(run.setting(run.plan, key)).lower()}" for key in keys if run.is_auto(key)]


def trainer_rate(config_yaml: str, overrides: list[str], out: Path, optimizer: str, steps: int,
                 warmup: int, logs: list[str] | None = None, profile: dict | None = None,
                 memory: dict | None = None, losses: list | None = None,
                 phases: dict | None = None, first_step: dict | None = None) -> tuple[float, float]:
    """(steps per second after `warmup` steps, peak GiB) of a Trainer run of `config_yaml` + `overrides`.

    The rate is the Trainer's own (logs/metrics.jsonl, logged every `warmup` steps); 8-bit optimizers are
    the toolkit's kernels, not bitsandbytes. The run's log lines are appended to `logs` when given. With
    `profile` (a dict), PROFILED_STEPS more steps run after the timed ones under the profiler, and their
    summary (bench/kernel_profile.py) goes into it; with `memory` (a dict), one more step runs with the
    allocator's history recorded, and what held its peak (bench/memory_peak.py) goes into it. The rate and the
    peak leave those steps out; when one of them fails, its dict says so under "failed" and the rate stands.
    `losses` (a list) receives the logged losses, to compare rows that train in another precision. With `phases`
    (a dict), PHASED_STEPS more steps are timed per phase on the host and the GPU, with the GPU's queue ahead of
    the host and its clock (bench/step_phases.py), under "phases". `first_step` (a dict) gets "at": the
    time.time() at which the first step was launched."""
    from toolkit.plan.run import load_run
    from toolkit.train.trainer import Trainer

    windows, summaries = [], []  # (steps, context), and the dict each window's failure is written to
    window_subscribers = []  # windows that time the trainer's phases subscribe to its step events
    if profile is not None:
        from kernel_profile import profiled

        windows.append((PROFILED_STEPS, lambda: profiled(PROFILED_STEPS, profile)))
        summaries.append(profile)
    if memory is not None:
        from memory_peak import recorded

        windows.append((1, lambda: recorded(memory)))
        summaries.append(memory)
    if phases is not None:
        from step_phases import PhaseTimer

        phases.update(phases={})
        timer = PhaseTimer(phases["phases"])
        window_subscribers.append(timer)
        windows.append((PHASED_STEPS, timer.window))
        summaries.append(phases["phases"])
    extra = sum(n for n, _ in windows)
    overrides = [*overrides, f"train.steps={steps + warmup + extra}", f"train.optimizer={optimizer}",
                 f"run.output_dir={out}", f"log.every={warmup}"]
    if optimizer.endswith("8bit"):
        overrides.append("train.optimizer_backend=toolkit")
    run = load_run([config_file(config_yaml)], overrides)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    peak = {}
    watch = Windows(steps + warmup, windows, peak)
    subscribers = [watch] + [w for w in window_subscribers]
    try:
        Trainer(run, fresh=True, log=logs.append if logs is not None else (lambda m: None), events=subscribers).run()
    except Exception as error:  # noqa: BLE001
        if peak["steps"] <= steps + warmup or peak.get("window", 0) is None:
            raise
        # a window's own step failed (the profiler or the allocator's history): the timed steps stand
        summaries[peak.get("window", 0)]["failed"] = f"{type(error).__name__}: {error}"
    finally:
        watch.close()
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "steps_per_s" in r and warmup < r["step"] <= steps + warmup]
    if losses is not None:
        losses += [r["loss"] for r in records if "loss" in r]
    if not timed:  # the step rate is logged every `warmup` steps, and a step's line one launch late
        raise RuntimeError(f"no step rate logged between steps {warmup} and {steps + warmup}: give more --steps "
                           f"than --warmup")
    if first_step is not None and "first_step_at" in peak:
        first_step["at"] = peak["first_step_at"]
    peak = peak.get("gib", torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0)
    return sum(r["steps_per_s"] for r in timed) / len(timed), peak
