"""Where a toolkit step's time goes between the host and the GPU, without the profiler (whose own overhead on a
launch-bound host hides the answer).

`PhaseTimer(into)`, subscribed to the trainer's step events (toolkit/train/events.py), takes host clocks and, on a
GPU, CUDA events at each phase mark of a step (the step started, each batch collated, the adapter's loss called and
returned, the update begun and done, the step's end time taken). Per phase:
- the GPU's time between two events: what the GPU spent there, waits for the host included; the host's time: how
  long the host took to launch it;
- the GPU's queue ahead of the host where the phase ends ("ahead"): how much launched work the GPU had still to do
  when the host got there. The host and GPU clocks are tied once when the window opens (a synchronize, then one
  event; that first step starts with an empty queue and is left out). Near zero at a mark, the GPU was waiting for
  the host there; a queue tens of milliseconds deep all through the step means the host is not what the step waits
  for (launches then block once the queue is full, which is why a host phase can take longer than its GPU work
  without the GPU ever waiting). The queue is only seen at the marks, not between them.
- the GPU's SM clock and power draw, read once a step after its end mark (NVML through torch.cuda, amdsmi on ROCm;
  none where that is missing; the library's own averages over up to a second): a GPU at its power limit runs its
  kernels at a lower clock, so equal kernels take longer than on a cool GPU.

The earlier form of this measurement gave the GPU a head start (a sleep queued before each step) and read the
shorter GPU step as what the host's launching cost. The sleep also let the GPU's clock rise to its maximum
(1,965 MHz against 1,500-1,830 at 681-695 W of 700 under load, one H100, 2026-11-27), so the difference was the
clock, not the host: without the sleep, the queue's median was 39-65 ms at every layer mark of forward and
backward (in one of 17 steps it ran dry at the start of the forward and refilled within the first layers).

With an optimizer that cannot skip a non-finite step on the device the step reads its loss before the update,
waiting for the GPU inside every step; the summary says so ("waits_for_gpu").

Used by bench/llm.py --phases for the toolkit rows (trainer_rate.py runs its windows after the timed steps).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

from toolkit.train.events import StepEvents


def gpu_clocks() -> tuple[float, float] | None:
    """(SM clock in MHz, power draw in W) of the current GPU, as NVML (ROCm: amdsmi) last sampled them (averages over
    up to a second, so several steps), or None where the library is missing or reports nothing."""
    try:
        mhz, power = float(torch.cuda.clock_rate()), float(torch.cuda.power_draw())
    except Exception:  # noqa: BLE001 - pynvml / amdsmi not installed, or a device it does not know
        return None
    watts = power if torch.version.hip else power / 1000  # amdsmi reports W, NVML mW
    return (mhz, watts) if mhz > 0 and watts > 0 else None  # amdsmi: 0 for "N/A"


def _tie_clocks() -> tuple[float, "torch.cuda.Event"]:
    """(host seconds, event) taken at the same moment on an idle GPU: maps the GPU's event times to host time."""
    torch.cuda.synchronize()
    event = torch.cuda.Event(enable_timing=True)
    before = time.perf_counter()
    event.record()
    after = time.perf_counter()
    event.synchronize()
    return (before + after) / 2, event


class PhaseTimer(StepEvents):
    """Times the steps of its window, per phase (the Stepper's marks, toolkit/train/events.py PHASES); medians go
    into `into` ("phases": [[phase, GPU ms, host ms, queue ahead ms (median), queue ahead ms (least)]],
    "gpu_step_ms", "host_step_ms", "clocks"; the GPU figures None without one). A step starts at its "start"
    mark and ends at its "end" mark (where the step takes its end time). On a GPU the first step starts behind a
    synchronize and is left out. Subscribe it to the trainer's events; `window()` is the context its steps run in
    (trainer_rate's windows open and close it at the right steps)."""

    def __init__(self, into: dict):
        self.into = into
        self.active = False
        self.gpu = torch.cuda.is_available()
        self.steps: list[list[tuple]] = []  # per step: (mark, host seconds, event or None)
        self.clocks: list[tuple[float, float]] = []
        self.tie = None

    def phase(self, name: str) -> None:
        if not self.active:
            return
        if name == "start":
            self.steps.append([])
        elif not self.steps:
            return  # the window opened inside a step: marked from the next one on
        event = None
        if self.gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.steps[-1].append((name, time.perf_counter(), event))
        if name == "end" and self.gpu:
            sample = gpu_clocks()
            if sample is not None:
                self.clocks.append(sample)

    @contextmanager
    def window(self):
        self.tie = _tie_clocks() if self.gpu else None
        self.active = True
        try:
            yield
        finally:
            self.active = False
        steps, clocks = [s for s in self.steps if s and s[-1][0] == "end"], self.clocks
        if self.gpu:
            torch.cuda.synchronize()
            steps, clocks = steps[1:], clocks[1:]  # the first started with an empty queue (_tie_clocks)
        self.into.update(summarize(steps, self.tie, clocks))


# phase names by (mark, next mark); with train.grad_accum > 1 a step collates every micro-batch first, then runs
# forward and backward per micro-batch: the spans of one name are added up within the step
NAMES = {("start", "queued"): "collate the batch", ("queued", "queued"): "collate the batch",
         ("queued", "forward"): "batch to the loss", ("forward", "backward"): "forward (loss included)",
         ("backward", "forward"): "backward", ("backward", "update"): "backward", ("backward", "read"): "backward",
         ("read", "read done"): "read the loss (waits for the GPU)", ("read done", "update"): "before the update",
         ("update", "updated"): "clip, optimizer step, zero_grad", ("updated", "end"): "scheduler, step's numbers"}


def summarize(steps: list[list[tuple]], tie: tuple | None = None, clocks: list | None = None) -> dict:
    """Medians over the steps of each phase (its spans between consecutive marks added up within a step) and of
    the whole step. With `tie` (host seconds, event at that moment), each phase also gets the GPU's queue ahead of
    the host at its end, in ms (the least over its spans in a step; then the median and the least over steps).
    "waits_for_gpu": the step read its loss before the update (an optimizer that cannot skip a step on the device),
    so the GPU runs dry inside every step. `clocks`: (MHz, W) a step."""
    def ahead(host: float, event) -> float | None:
        if tie is None or event is None:
            return None
        return (tie[0] + tie[1].elapsed_time(event) / 1e3 - host) * 1e3

    spans: dict[str, list[tuple]] = {}
    whole, waits = [], False
    for marks in steps:
        step: dict[str, list] = {}
        for (a, host_a, event_a), (b, host_b, event_b) in zip(marks, marks[1:]):
            gpu_ms = event_a.elapsed_time(event_b) if event_a is not None else None
            total = step.setdefault(NAMES.get((a, b), f"{a} -> {b}"), [0.0, 0.0, None])
            total[0] = None if gpu_ms is None else total[0] + gpu_ms
            total[1] += (host_b - host_a) * 1e3
            queued = ahead(host_b, event_b)
            total[2] = queued if total[2] is None else min(total[2], queued)
            waits = waits or a == "read"
        for name, values in step.items():
            spans.setdefault(name, []).append(values)
        (_, host_a, event_a), (_, host_b, event_b) = marks[0], marks[-1]
        whole.append((event_a.elapsed_time(event_b) if event_a is not None else None, (host_b - host_a) * 1e3))
    # no steps (a window whose only step failed, or left out behind the clocks' tie): None figures
    median = lambda values: None if None in values or not values else round(statistics.median(values), 2)  # noqa: E731
    least = lambda values: None if None in values or not values else round(min(values), 2)  # noqa: E731
    phases = [[name, median([v[0] for v in vs]), median([v[1] for v in vs]), median([v[2] for v in vs]),
               least([v[2] for v in vs])] for name, vs in spans.items()]
    summary = {"steps": len(steps), "waits_for_gpu": waits, "phases": phases,
               "gpu_step_ms": median([g for g, _ in whole]), "host_step_ms": median([h for _, h in whole])}
    if clocks:
        mhz, watts = [c[0] for c in clocks], [c[1] for c in clocks]
        summary["clocks"] = {"sm_mhz": median(mhz), "sm_mhz_least": min(mhz), "sm_mhz_most": max(mhz),
                             "power_w": median(watts)}
    return summary


def print_phases(row: str, result: dict) -> None:
    summary = result.get("phases")
    if not summary:
        return
    if "failed" in summary:
        print(f"  {row}: the phased steps failed ({summary['failed']})")
        return
    waits = " (the step reads its loss before the update: it waits for the GPU)" if summary["waits_for_gpu"] else ""
    clocks = summary.get("clocks")
    clock = (f"; SM clock {clocks['sm_mhz']:.0f} MHz ({clocks['sm_mhz_least']:.0f}-{clocks['sm_mhz_most']:.0f}), "
             f"{clocks['power_w']:.0f} W") if clocks else ""
    print(f"  {row}: medians of {summary['steps']} steps, GPU {summary['gpu_step_ms']} ms a step, "
          f"host {summary['host_step_ms']} ms{clock}{waits}")
    print(f"    {'phase':<34} {'GPU ms':>8}  {'host ms':>8}  GPU queue ahead at its end, ms (median, least)")
    for name, gpu_ms, host_ms, ahead_ms, least_ms in summary["phases"]:
        print(f"    {name:<34} {gpu_ms!s:>8}  {host_ms:>8.2f}  {ahead_ms!s:>8} {least_ms!s:>8}")
