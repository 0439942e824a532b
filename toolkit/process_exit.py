"""How a toolkit process ends (python -m toolkit). Kept free of torch: `--help` and config errors stay fast."""

from __future__ import annotations

import atexit
import logging
import os
import sys


def leave(code: int) -> None:
    """End this process with `code`. A process of a several-process launch leaves directly: through the
    interpreter's shutdown, a process group still open (a rank that timed out or lost its peers cannot close it), or
    even a closed one under load, can abort in a C++ destructor ("terminate called without an active exception",
    exit -6, seen in CI), which would replace the code the launcher reports (2 for a timeout the user can fix) with a
    crash. os._exit skips the interpreter's exit, so what registered for it (a profiler's or a benchmark's report
    of this process, wandb's flush) runs first, as it would have. A single process leaves the usual way."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
