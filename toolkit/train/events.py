"""The training loop's events: whoever needs to see a run as it goes (the metrics writer, the report, a benchmark's
phase timing, a web UI) subscribes here instead of reaching into the loop.

A subscriber subclasses StepEvents and overrides what it needs; `Events` calls every subscriber, in the order
subscribed. Within a launched step the Stepper marks its phases (PHASES) so a timer can take host clocks
and GPU events at exactly those points; nothing there waits for the GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PHASES = ("start", "queued", "forward", "backward", "read", "read done", "update", "updated", "end")
"""A step's marks, in the order they come: start (before the first batch is asked for), queued (each micro-batch
collated), forward / backward (the adapter's loss called / returned, then backward), read / read done (the loss read on
the host: only where the optimizer cannot skip a step on the device), update / updated (clip, optimizer step,
zero_grad), end (the step's end time taken)."""


class StepEvents:
    """The events, each a no-op here: subclass and override what you need."""

    def step_started(self, step: int) -> None:
        """Optimizer step `step` (1-based) is about to be launched."""

    def phase(self, name: str) -> None:
        """A mark inside the step being launched (PHASES)."""

    def step_launched(self, step: int, sums: Any) -> None:
        """Step `step` is launched; `sums` (train/step.py StepSums) may still be on the device."""

    def step_recorded(self, step: int, sums: Any) -> None:
        """Step `step`'s numbers were read (`sums.mean`, `sums.lr`, ...): one step late where the optimizer allows."""

    def evaluated(self, step: int, loss: float) -> None:
        """The eval loss at `step`."""

    def saved(self, step: int, path: Path) -> None:
        """A checkpoint of `step` was written to `path`."""

    def sampled(self, step: int, files: list[Path]) -> None:
        """Samples of `step` were written."""

    def finished(self, step: int, final: Path) -> None:
        """The run ended at `step` with its LoRA in `final`."""


class Events:
    """The subscribers of one run (StepEvents), called in the order subscribed."""

    def __init__(self, subscribers: "list[StepEvents]" = ()):
        self.subscribers: list[StepEvents] = []
        self._phase: list = []  # only the subscribers that time phases: called several times a step
        for subscriber in subscribers:
            self.subscribe(subscriber)

    def subscribe(self, subscriber: StepEvents) -> None:
        self.subscribers.append(subscriber)
        if type(subscriber).phase is not StepEvents.phase:
            self._phase.append(subscriber.phase)

    def phase(self, name: str) -> None:
        for call in self._phase:
            call(name)

    def step_started(self, step: int) -> None:
        for s in self.subscribers:
            s.step_started(step)

    def step_launched(self, step: int, sums) -> None:
        for s in self.subscribers:
            s.step_launched(step, sums)

    def step_recorded(self, step: int, sums) -> None:
        for s in self.subscribers:
            s.step_recorded(step, sums)

    def evaluated(self, step: int, loss: float) -> None:
        for s in self.subscribers:
            s.evaluated(step, loss)

    def saved(self, step: int, path: Path) -> None:
        for s in self.subscribers:
            s.saved(step, path)

    def sampled(self, step: int, files: list[Path]) -> None:
        for s in self.subscribers:
            s.sampled(step, files)

    def finished(self, step: int, final: Path) -> None:
        for s in self.subscribers:
            s.finished(step, final)
