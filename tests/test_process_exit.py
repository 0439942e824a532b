"""How a toolkit process ends: one of several processes leaves directly with its code, after what registered for
the interpreter's exit has run; a single process leaves the usual way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = """
import atexit, sys
from toolkit.process_exit import leave
atexit.register(lambda: print("atexit ran", flush=True))
print("buffered", end="")   # unflushed: leaving must not lose it
sys.stdout.write("")
leave(int(sys.argv[1]))
"""


@pytest.mark.parametrize("world_size", ["1", "2"])
@pytest.mark.parametrize("code", [0, 2, 130])
def test_leave_ends_with_the_code_after_the_exit_hooks_and_the_buffered_output(world_size, code):
    env = {**os.environ, "WORLD_SIZE": world_size, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(code)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == code, done.stderr
    assert done.stdout == "bufferedatexit ran\n"
