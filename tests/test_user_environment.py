"""The environment the launcher makes for users (.venv) loads what the toolkit wrote without library noise: no
torchao "Failed to load ..." lines, no deprecation warnings. The test extra (pytest, bitsandbytes, torchao) lives
in .venv-test, layered over it, so the suite can check QLoRA while users' scripts stay quiet."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from conftest import REPO

RUNTIME = os.environ.get("TOOLKIT_RUNTIME_PYTHON")
pytestmark = pytest.mark.skipif(not RUNTIME, reason="needs the users' .venv: runs under ./start_toolkit.sh test "
                                                    "without TOOLKIT_PYTHON (it sets TOOLKIT_RUNTIME_PYTHON)")
NOISE = re.compile(r"Failed to load|deprecat|FutureWarning|UserWarning|^W\d{4} ", re.IGNORECASE)


def test_the_users_environment_lacks_the_test_extra():
    code = "import importlib.util as u; print([m for m in ('torchao', 'bitsandbytes', 'pytest') if u.find_spec(m)])"
    proc = subprocess.run([RUNTIME, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_merged_model_loads_with_transformers_without_library_noise(tiny_runs, tmp_path):
    merged = tmp_path / "merged"
    env = {**os.environ, "TOOLKIT_CACHE": str(tiny_runs.cache)}
    proc = subprocess.run([RUNTIME, "-m", "toolkit", "merge", str(tiny_runs["llm"]), str(merged)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    load = ("import sys; from transformers import AutoModelForCausalLM, AutoTokenizer; "
            "model = AutoModelForCausalLM.from_pretrained(sys.argv[1]); AutoTokenizer.from_pretrained(sys.argv[1]); "
            "print(type(model).__name__)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}  # as a user's shell
    proc = subprocess.run([RUNTIME, "-c", load, str(merged)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "LlamaForCausalLM"
    assert [line for line in proc.stderr.splitlines() if NOISE.search(line)] == []
