"""start_toolkit.sh, run with TOOLKIT_PYTHON set to this interpreter so that no .venv is created."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "start_toolkit.sh"
KFD = REPO / "tests" / "fixtures" / "kfd"
ROCM_VARS = ("HSA_OVERRIDE_GFX_VERSION", "MIOPEN_FIND_MODE", "PYTORCH_ROCM_ARCH", "ROCM_PATH",
             "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", "AMD_SERIALIZE_KERNEL", "HIP_LAUNCH_BLOCKING",
             "TORCH_USE_HIP_DSA", "TOOLKIT_TORCH_ARCHS", "TOOLKIT_SYSFS_ROOT", "LD_LIBRARY_PATH")


def launch(*args: str, sysfs: str = "no_gpu", env: dict[str, str] | None = None,
           cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ROCM_VARS}
    full_env = {**base, "TOOLKIT_PYTHON": sys.executable, "TOOLKIT_SYSFS_ROOT": str(KFD / sysfs), **(env or {})}
    return subprocess.run([str(LAUNCHER), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_launcher_is_executable():
    assert os.access(LAUNCHER, os.X_OK)
    assert os.access(REPO / ".ci" / "run", os.X_OK)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_exits_0(flag):
    done = launch(flag)
    assert done.returncode == 0
    assert done.stdout.startswith("usage: ./start_toolkit.sh [--debug-hip] COMMAND [ARGS...]")
    assert "test [PYTEST ARGS]" in done.stdout


def test_help_names_the_multi_process_flags():
    done = launch("--help")
    assert done.returncode == 0
    for flag in ("--gpus N|all", "--nnodes", "--node-rank", "--master-addr", "--master-port", "docs/multi-gpu.md"):
        assert flag in done.stdout


def test_no_arguments_prints_usage_and_exits_2():
    done = launch()
    assert done.returncode == 2
    assert done.stdout.startswith("usage: ./start_toolkit.sh")


def test_unknown_launcher_option_is_an_error():
    done = launch("--frobnicate", "train")
    assert done.returncode == 2
    assert "unknown option --frobnicate" in done.stderr


def test_rocm_exports_reach_the_command_and_user_values_win():
    done = launch("__env", "HSA_OVERRIDE_GFX_VERSION", "MIOPEN_FIND_MODE", "PYTORCH_ROCM_ARCH",
                  "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", "HIP_LAUNCH_BLOCKING",
                  sysfs="gfx1151", env={"TOOLKIT_TORCH_ARCHS": "gfx1100", "MIOPEN_FIND_MODE": "NORMAL"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "HSA_OVERRIDE_GFX_VERSION=11.0.0\n"
        "MIOPEN_FIND_MODE=NORMAL\n"
        "PYTORCH_ROCM_ARCH=gfx1151\n"
        "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1\n"
        "HIP_LAUNCH_BLOCKING unset\n"
    )
    assert "MIOPEN_FIND_MODE=NORMAL: kept, already set by you" in done.stderr
    assert "GPU gfx1151" in done.stderr


def test_debug_hip_before_the_subcommand_is_consumed_and_forwarded():
    done = launch("--debug-hip", "__env", "AMD_SERIALIZE_KERNEL", "TORCH_USE_HIP_DSA", "HIP_LAUNCH_BLOCKING",
                  sysfs="gfx942", env={"TOOLKIT_TORCH_ARCHS": "gfx942"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "AMD_SERIALIZE_KERNEL=3\nTORCH_USE_HIP_DSA=1\nHIP_LAUNCH_BLOCKING=1\n"


def test_no_gpu_sets_nothing_and_prints_no_summary():
    done = launch("__env", "PYTORCH_ROCM_ARCH", "MIOPEN_FIND_MODE", sysfs="no_gpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "PYTORCH_ROCM_ARCH unset\nMIOPEN_FIND_MODE unset\n"
    assert done.stderr == ""


def test_test_subcommand_runs_pytest_from_the_repo_root_and_returns_its_exit_code(tmp_path):
    # From another directory, selecting nothing: pytest's "no tests collected" (5) must come back unmasked,
    # with pytest-xdist's workers (one per core, at most 4) and without them (TOOLKIT_TEST_WORKERS=0).
    args = ("test", "-k", "no_test_has_this_name_xyz", "tests/test_launcher.py")
    workers = launch(*args, cwd=tmp_path, env={"TOOLKIT_TEST_WORKERS": "2"})
    assert workers.returncode == 5, workers.stdout + workers.stderr
    assert "bringing up nodes" in workers.stdout  # xdist's workers started
    one = launch(*args, cwd=tmp_path, env={"TOOLKIT_TEST_WORKERS": "0"})
    assert one.returncode == 5, one.stdout + one.stderr
    assert "deselected" in one.stdout and "bringing up nodes" not in one.stdout
    # the path given is what runs (not the whole suite as well), and -s (no capture) runs in one process
    deselected = int(re.search(r"(\d+) deselected", one.stdout).group(1))
    assert deselected < 2 * len(re.findall(r"^def test_", Path(__file__).read_text(), flags=re.M))  # suite: 600+
    uncaptured = launch(*args, "-s", cwd=tmp_path, env={"TOOLKIT_TEST_WORKERS": "2"})
    assert uncaptured.returncode == 5 and "bringing up nodes" not in uncaptured.stdout


def test_other_subcommands_pass_through_to_the_python_cli():
    pytest.importorskip("toolkit.cli", reason="toolkit/cli.py (the Python CLI) is not written yet")
    done = launch("presets")
    assert done.returncode == 0, done.stderr
    bogus = launch("no-such-subcommand")
    assert bogus.returncode != 0
