"""The LoRA files through loaders the project did not write (ComfyUI, kohya sd-scripts, musubi-tuner), by running
bench/check_exports.py. Skipped unless TOOLKIT_COMFYUI, TOOLKIT_SD_SCRIPTS or TOOLKIT_MUSUBI name checkouts of
them (TOOLKIT_LOADER_DEPS: a folder with the extra packages they import; see the script's docstring)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

TOOLS = ("TOOLKIT_COMFYUI", "TOOLKIT_SD_SCRIPTS", "TOOLKIT_MUSUBI")


@pytest.mark.skipif(not any(os.environ.get(v) for v in TOOLS), reason="no ComfyUI / sd-scripts / musubi-tuner checkout")
def test_every_family_loads_exactly_in_the_outside_loaders(tmp_path):
    deps = os.environ.get("TOOLKIT_LOADER_DEPS")
    cache = tmp_path / "cache"  # its own latent and text caches (other tests count cache hits); the session's tiny models
    cache.mkdir()
    session_tiny = Path(os.environ["TOOLKIT_CACHE"]) / "tiny"
    session_tiny.mkdir(parents=True, exist_ok=True)
    (cache / "tiny").symlink_to(session_tiny)
    proc = subprocess.run([sys.executable, "bench/check_exports.py", *(["--deps", deps] if deps else [])], cwd=REPO,
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TOOLKIT_CACHE": str(cache)})
    table = proc.stdout[proc.stdout.index("tool "):] if "tool " in proc.stdout else proc.stdout + proc.stderr[-3000:]
    rows = [line for line in table.splitlines()[1:] if line.strip()]
    assert proc.returncode == 0 and rows and not any("FAIL" in r for r in rows), table
