"""Graceful stop: the first SIGINT/SIGTERM finishes the step and saves; a second exits at once."""

from __future__ import annotations

import os
import signal
import sys

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StopRequested(Exception):
    """Raised by the trainer after saving, carrying the exit code of the signal that asked."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


class GracefulStop:
    """Context manager installing the handlers; `requested` is the signal number or None."""

    def __init__(self):
        self.requested: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            print(f"\nsecond {signal.Signals(signum).name}: exiting now without saving", file=sys.stderr, flush=True)
            os._exit(EXIT_CODES.get(signum, 1))
        self.requested = signum
        print(f"\n{signal.Signals(signum).name} received: finishing this step and saving a checkpoint "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.requested, 1)

    def __enter__(self) -> "GracefulStop":
        for signum in EXIT_CODES:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread (e.g. inside some test runners): no handler
                pass
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
