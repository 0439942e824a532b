"""`python -m toolkit.ui.job_runner EXIT.json -- COMMAND...`: runs one job of the UI and records its exit code.

It leads the job's process group (the UI starts it in a session of its own, so a restart of the UI kills
nothing). The UI stops a run with SIGINT to the whole group, as Ctrl-C in a terminal would: the trainer saves a
checkpoint and exits 130; this process ignores that signal and waits. Nothing in a run folder records that a run
failed, so the exit code goes to EXIT.json (beside the UI's job list, never inside the run folder), where the
UI reads it even after a restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m toolkit.ui.job_runner EXIT.json -- COMMAND...", file=sys.stderr)
        return 2
    exit_file, command = argv[0], argv[2:]
    # A handler, not SIG_IGN: handlers are reset in the child at exec, an ignored signal would stay ignored there.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    started = time.time()
    try:
        code = subprocess.call(command)
    except OSError as err:
        print(f"error: could not start {command[0]}: {err}", file=sys.stderr, flush=True)
        code = 127
    tmp = f"{exit_file}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"exit_code": code, "started": started, "ended": time.time()}, f)
    os.replace(tmp, exit_file)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
