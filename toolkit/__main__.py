import atexit
import logging
import os
import sys

from toolkit.cli import main

code = main()
if code == 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("RANK", "0") != "0":
    # A process other than the main one, after a run that went well: it writes no run files, its process group is
    # closed (Processes.finish), and its output is flushed here. Leaving through the interpreter's shutdown can
    # still abort in a C++ destructor ("terminate called without an active exception": seen once in CI under
    # load, after "done"), which would fail a finished launch; leaving directly cannot.
    # os._exit skips the interpreter's exit: run what registered for it first (a profiler's or a benchmark's report
    # of this process, wandb's flush), as the main process's exit does.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
sys.exit(code)
