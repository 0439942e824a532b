"""Where a toolkit step's time goes on the GPU: the Trainer on a config, with torch.profiler around a few launched
steps after the warm-up, and dynamo's counters (graphs compiled, graph breaks).

    python bench/profile_steps.py CONFIG.yaml [key=value ...] [--after 6 --steps 3 --rows 20]

Prints the GPU's busy time per step beside the step's wall time (a gap is the GPU waiting for the host), the
kernels that take the most GPU time, and the host functions that take the most CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--after", type=int, default=6, help="launched steps before the profile")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()

    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    from toolkit.plan.run import load_run
    from toolkit.train.events import StepEvents
    from toolkit.train.trainer import Trainer

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    window = {}
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))

    class Profiled(StepEvents):
        """The profiler over launched steps after+1 .. after+steps (the trainer's step events)."""

        def step_started(self, step: int) -> None:
            if step == args.after + 1:
                sync()
                prof.start()
                window["start"] = time.perf_counter()

        def step_launched(self, step: int, sums) -> None:
            if step == args.after + args.steps:
                sync()
                window["seconds"] = time.perf_counter() - window["start"]
                prof.stop()

    steps = args.after + args.steps + 1
    run = load_run([args.config], [*args.overrides, f"train.steps={steps}", "save.every=0", "sample.every=0",
                                   "log.every=1000"])
    Trainer(run, fresh=True, log=print, events=[Profiled()]).run()
    events = prof.key_averages()
    # kernels only: an operator's row also carries its kernels' time (the table's own total counts it this way)
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    wall = window["seconds"] / args.steps
    print(f"\nper step: wall {wall * 1e3:.1f} ms, GPU busy {device_us / args.steps / 1e3:.1f} ms "
          f"({device_us / args.steps / 1e6 / wall:.0%})")
    print(f"dynamo: {dict(counters['stats'])}; graph breaks: {sum(counters['graph_break'].values())} "
          f"{dict(counters['graph_break'])}")
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
