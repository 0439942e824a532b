"""Shared test setup: a private cache for tiny models, the repo root, and a helper to run the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and not os.environ.get("OMP_NUM_THREADS"):
    # pytest-xdist's workers share the cores this process may use instead of each taking all (a thread count the
    # user set stays)
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session", autouse=True)
def library_log_handlers():
    """diffusers and transformers create their log handler on first use, bound to sys.stderr as it is then. Made
    inside a test that captures with capsys, it would write to that test's stream, closed afterwards, and a later
    warning would print "--- Logging error ---" with a traceback into another test's output. Made here, it
    writes to the session's stream."""
    import diffusers.utils.logging
    import transformers.utils.logging

    diffusers.utils.logging.get_logger("diffusers")
    transformers.utils.logging.get_logger("transformers")


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory) -> Path:
    """Tiny models are written once per test session into a private cache (TOOLKIT_CACHE)."""
    cache = Path(os.environ.get("TOOLKIT_TEST_CACHE") or tmp_path_factory.mktemp("toolkit-cache"))
    os.environ["TOOLKIT_CACHE"] = str(cache)
    return cache


@pytest.fixture
def own_data_caches(tmp_path_factory, monkeypatch, tiny_cache) -> Path:
    """Latent and text caches of a test kept apart from the session's (other tests count cache hits, and the same
    toy images recur across tests); the tiny models are the session's."""
    cache = tmp_path_factory.mktemp("data-cache")
    (tiny_cache / "tiny").mkdir(parents=True, exist_ok=True)
    (cache / "tiny").symlink_to(tiny_cache / "tiny")
    monkeypatch.setenv("TOOLKIT_CACHE", str(cache))
    return cache


@pytest.fixture
def run_cli(monkeypatch):
    """Run `python -m toolkit ARGS` in-process from the repo root; returns main()'s exit code (the output goes
    to pytest's capture: read it with capsys)."""
    from toolkit.cli import main

    def _run(*args: str) -> int:
        monkeypatch.chdir(REPO)
        return main([str(a) for a in args])

    return _run


def run_toolkit(*args: str, cwd: Path = REPO, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real entry point `python -m toolkit ARGS` in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "toolkit", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=full_env)


@pytest.fixture(scope="session")
def tiny_runs(tiny_cache, tmp_path_factory):
    """Tiny finished runs, trained on first use once per session (helpers.TinyRuns: runs[family] is the folder)."""
    from helpers import TinyRuns

    return TinyRuns(tmp_path_factory.mktemp("tiny-runs"))
