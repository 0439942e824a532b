"""Where a run's start-up time goes, from the process's start to the end of its first step, said in one log line.

The entry point and the trainer mark the end of each phase (`mark("config")`); the trainer says the phases once its
first step has run (`summary()`), so a slow start names its cause: the imports, the model's load, the data's
encoding, the measurements (batch size, attention backend, checkpointing), or the first step's compilation. One
clock per process, said once: start-up is the process's, and a second Trainer in the same process (the tests, the
UI's in-process runs) has none to say.

TOOLKIT_PROFILE_STARTUP=FILE profiles the start-up (cProfile, from the entry point to the end of the first step) into
FILE, for pstats or snakeviz: bench/compile_times.py's `profile` run sets it. With several processes the main one
writes FILE and each other FILE.rank<N>.
"""

from __future__ import annotations

import os
import time

import toolkit


def process_started() -> float:
    """The wall-clock time this process started (the kernel's record: Python's own start-up included), or when
    the toolkit was first imported where the kernel does not say."""
    try:
        import psutil  # accelerate's dependency

        return psutil.Process(os.getpid()).create_time()
    except (ImportError, OSError):
        return toolkit.STARTED


class StartupClock:
    """Named phases, each ending at its mark; the first phase ("python") ends when the toolkit was imported."""

    def __init__(self, started: float | None = None):
        self.started = process_started() if started is None else started
        self.marks: list[tuple[str, float]] = [("python", max(self.started, toolkit.STARTED))]
        self.said = False
        self.profiler = None

    def profile_from_env(self) -> None:
        """Profile until the summary when TOOLKIT_PROFILE_STARTUP names a file (see the module docstring)."""
        if os.environ.get("TOOLKIT_PROFILE_STARTUP") and self.profiler is None:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()

    def mark(self, phase: str) -> None:
        """The phase `phase` ends now (it began at the previous mark). A phase marked twice adds up."""
        self.marks.append((phase, time.time()))

    def phases(self) -> dict[str, float]:
        """Seconds per phase, in the order they first ended."""
        out: dict[str, float] = {}
        previous = self.started
        for phase, at in self.marks:
            out[phase] = out.get(phase, 0.0) + max(0.0, at - previous)
            previous = at
        return out

    def summary_once(self) -> str | None:
        """The summary the first time it is asked for in this process, None after."""
        if self.said:
            return None
        self.said = True
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(profile_file(os.environ["TOOLKIT_PROFILE_STARTUP"]))
        return self.summary()

    def summary(self) -> str:
        """'start-up: 33.2 s to the end of the first step: python 0.1 s, imports and config 5.2 s, ...'."""
        phases = self.phases()
        total = self.marks[-1][1] - self.started
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())
        return f"start-up: {total:.1f} s to the end of the first step: {parts}"


CLOCK = StartupClock()


def profile_file(asked: str) -> str:
    """Where this process writes its start-up profile: `asked`, or `asked`.rank<N> for a process other than the
    first of a several-process launch (each writing the one file would leave whichever finished last)."""
    rank = os.environ.get("RANK", "0") or "0"
    return asked if rank == "0" else f"{asked}.rank{rank}"


def share_package_map() -> None:
    """importlib.metadata.packages_distributions, answered once per process. transformers and diffusers each call it
    while they are imported, and each call reads every installed distribution's file list and checks that each
    file exists: 1 to 1.5 s a call on a GPU machine's environment (2026-11-29, H200; measured with the start-up
    profile). The installed packages do not change under a run, so the second call takes the first's answer."""
    import functools
    import importlib.metadata

    if not hasattr(importlib.metadata.packages_distributions, "cache_info"):
        importlib.metadata.packages_distributions = functools.cache(importlib.metadata.packages_distributions)


def mark(phase: str) -> None:
    CLOCK.mark(phase)
