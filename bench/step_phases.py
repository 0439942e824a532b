"""Where a toolkit step's time goes between the host and the GPU, without the profiler (whose own overhead on a
launch-bound host hides the answer).

`phased(into)` marks the points of each Trainer step (its first batch asked for, the batch collated, the adapter's
loss called and returned, the update begun and done, the step's end time taken) with host clocks and, on a GPU,
CUDA events.
Per phase, the GPU's time between two events is what the GPU spent there, waits for the host included; the host's
time is how long the host took to launch it. A phase whose host time is above its GPU time drains what the
host had queued ahead.

`head_start_ms`: before each step a GPU sleep of that length is queued first, so the step is launched while the
GPU is still busy and then runs as fast as its kernels allow. The GPU step time with a head start against without
is what the host's launching costs a step. That holds for optimizers that skip a non-finite step on the device
(torch's fused AdamW, the toolkit's 8-bit ones, what the bench rows use); with others the step reads its loss
before the update, waiting for the GPU inside every step, and the summary says so ("waits_for_gpu").

Used by bench/llm.py --phases for the toolkit rows (trainer_rate.py runs its windows after the timed steps).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

HEAD_START_MS = 300.0


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep, measured once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


@contextmanager
def phased(into: dict, head_start_ms: float = 0.0):
    """Time the steps run inside, per phase; medians go into `into` ("phases": [[phase, GPU ms, host ms]],
    "gpu_step_ms", "host_step_ms"; the GPU figures None without one). A step starts at its first batch and ends
    where the step takes its end time (StepEnd.now), so the wrapping leaves Stepper.launch to whoever else wraps it
    (trainer_rate's windows)."""
    from toolkit.train.step import StepEnd, Stepper, StepSums

    gpu = torch.cuda.is_available()
    cycles = _sleep_cycles_per_ms() * head_start_ms if gpu and head_start_ms > 0 else 0
    steps: list[list[tuple]] = []  # per step: (mark, host seconds, event or None)
    state = {"in_step": False, "adapter": None}

    def mark(name: str) -> None:
        event = None
        if gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        steps[-1].append((name, time.perf_counter(), event))

    next_batch, update, now, read = Stepper._next_batch, Stepper._update, StepEnd.__dict__["now"], StepSums.read

    def timed_next_batch(self):
        if not state["in_step"]:
            if cycles:
                torch.cuda._sleep(int(cycles))
            steps.append([])
            mark("start")
            state["in_step"] = True
            if state["adapter"] is None:
                state["adapter"] = adapter = self.adapter
                adapter_loss = adapter.loss

                def loss(batch, modules):
                    if not state["in_step"]:  # an evaluation between steps
                        return adapter_loss(batch, modules)
                    mark("forward")
                    out = adapter_loss(batch, modules)
                    mark("backward")
                    return out

                adapter.loss = loss  # an instance attribute over the method, while the window is open
        batch = next_batch(self)
        mark("queued")
        return batch

    def timed_update(self, sums):
        mark("update")
        update(self, sums)
        mark("updated")

    def timed_read(self):  # inside a step only where the optimizer cannot skip on the device: a wait for the GPU
        if not state["in_step"]:
            return read(self)
        mark("read")
        read(self)
        mark("read done")

    def timed_now(cls, device):
        ended = now.__func__(cls, device)
        if state["in_step"]:
            mark("end")
            state["in_step"] = False
        return ended

    Stepper._next_batch, Stepper._update, StepEnd.now = timed_next_batch, timed_update, classmethod(timed_now)
    StepSums.read = timed_read
    try:
        yield
    finally:
        Stepper._next_batch, Stepper._update, StepEnd.now = next_batch, update, now
        StepSums.read = read
        if state["adapter"] is not None:
            del state["adapter"].loss
    if gpu:
        torch.cuda.synchronize()
    into.update(summarize(steps))


# phase names by (mark, next mark); with train.grad_accum > 1 a step collates every micro-batch first, then runs
# forward and backward per micro-batch: the spans of one name are added up within the step
NAMES = {("start", "queued"): "collate the batch", ("queued", "queued"): "collate the batch",
         ("queued", "forward"): "batch to the loss", ("forward", "backward"): "forward (loss included)",
         ("backward", "forward"): "backward", ("backward", "update"): "backward", ("backward", "read"): "backward",
         ("read", "read done"): "read the loss (waits for the GPU)", ("read done", "update"): "before the update",
         ("update", "updated"): "clip, optimizer step, zero_grad", ("updated", "end"): "scheduler, step's numbers"}


def summarize(steps: list[list[tuple]]) -> dict:
    """Medians over the steps of each phase (its spans between consecutive marks added up within a step) and of
    the whole step. "waits_for_gpu": the step read its loss before the update (an optimizer that cannot skip a
    step on the device): the GPU then runs dry inside every step, and a head start changes nothing."""
    spans: dict[str, list[tuple]] = {}
    whole, waits = [], False
    for marks in steps:
        step: dict[str, list] = {}
        for (a, host_a, event_a), (b, host_b, event_b) in zip(marks, marks[1:]):
            gpu_ms = event_a.elapsed_time(event_b) if event_a is not None else None
            total = step.setdefault(NAMES.get((a, b), f"{a} -> {b}"), [0.0, 0.0])
            total[0] = None if gpu_ms is None else total[0] + gpu_ms
            total[1] += (host_b - host_a) * 1e3
            waits = waits or a == "read"
        for name, (gpu_ms, host_ms) in step.items():
            spans.setdefault(name, []).append((gpu_ms, host_ms))
        (_, host_a, event_a), (_, host_b, event_b) = marks[0], marks[-1]
        whole.append((event_a.elapsed_time(event_b) if event_a is not None else None, (host_b - host_a) * 1e3))
    median = lambda values: None if None in values else round(statistics.median(values), 2)  # noqa: E731
    return {"steps": len(steps), "waits_for_gpu": waits,
            "phases": [[name, median([g for g, _ in v]), median([h for _, h in v])] for name, v in spans.items()],
            "gpu_step_ms": median([g for g, _ in whole]), "host_step_ms": median([h for _, h in whole])}


def print_phases(row: str, result: dict) -> None:
    for label, key in (("", "phases"), (f" with a {HEAD_START_MS:.0f} ms head start", "head_start")):
        summary = result.get(key)
        if not summary:
            continue
        if "failed" in summary:
            print(f"  {row}{label}: the timed steps failed ({summary['failed']})")
            continue
        waits = " (the step reads its loss before the update: it waits for the GPU)" if summary["waits_for_gpu"] else ""
        print(f"  {row}{label}: medians of {summary['steps']} steps, GPU {summary['gpu_step_ms']} ms a step, "
              f"host {summary['host_step_ms']} ms{waits}")
        for name, gpu_ms, host_ms in summary["phases"]:
            print(f"    {name:<34} GPU {gpu_ms!s:>8} ms   host {host_ms:>8.2f} ms")
