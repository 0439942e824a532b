"""bench/device_queue.sh, on the CPU: the first call copies the checkout, starts the named jobs in their own
session and collects what they wrote; a later call finds the queue running, waits for it and collects the rest."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import REPO

JOBS = """\
job_first() { echo "first ran in $PWD" > $R/first.txt; return 3; }
job_slow() { while [ ! -f $R/go ]; do sleep 0.2; done; echo slow done > $R/slow.txt; }
job_never() { echo never > $R/never.txt; }
"""


def queue(checkout: Path, root: Path, out: Path, wait: int, **env) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["bash", str(REPO / "bench" / "device_queue.sh")], cwd=checkout, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "QUEUE_ROOT": str(root), "OUT": str(out),
                                                      "WAIT": str(wait), "JOBS_FILE": "jobs.sh", "BYTECODE": "0", **env})


def test_the_queue_runs_the_named_jobs_across_calls(tmp_path: Path):
    checkout, root = tmp_path / "checkout", tmp_path / "root"
    checkout.mkdir()
    (checkout / "jobs.sh").write_text(JOBS)
    first = queue(checkout, root, tmp_path / "out1", wait=2, JOBS="first slow")
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "out1/res/first.txt").read_text() == f"first ran in {root / 'w'}\n"  # in the copy
    assert not (tmp_path / "out1/res/slow.txt").exists() and not (tmp_path / "out1/res/all.done").exists()
    assert "start slow" in first.stdout and "end first rc=3" in first.stdout  # its own exit status

    (root / "res" / "go").touch()
    second = queue(checkout, root, tmp_path / "out2", wait=30, JOBS="never")  # the running queue's JOBS stand
    assert "the queue started by an earlier call is running" in second.stdout
    assert (tmp_path / "out2/res/slow.txt").read_text() == "slow done\n"
    assert (tmp_path / "out2/res/all.done").exists() and not (tmp_path / "out2/res/never.txt").exists()
    assert "end slow rc=0" in second.stdout


def test_every_job_of_the_device_jobs_file_names_a_bench_script_that_exists():
    listed = subprocess.run(["bash", "-c", 'source bench/device_jobs.sh && echo "D=$D" && declare -F && declare -f'], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    jobs = [line.split()[-1] for line in listed.splitlines() if line.startswith("declare -f job_")]
    assert {"job_parity_sd15", "job_sd15", "job_grpo", "job_fsdp"} <= set(jobs)
    scripts = {word for word in listed.replace(";", " ").replace("=", " ").split()
               if word.startswith("bench/") and word.endswith(".py")}
    assert "bench/diffusion.py" in scripts and "bench/loss_parity.py" in scripts
    assert scripts and all((REPO / s).is_file() for s in scripts), scripts


def test_a_first_call_without_jobs_says_so_and_starts_nothing(tmp_path: Path):
    checkout, root = tmp_path / "checkout", tmp_path / "root"
    checkout.mkdir()
    (checkout / "jobs.sh").write_text(JOBS)
    env = {k: v for k, v in os.environ.items() if k != "JOBS"}
    done = subprocess.run(["bash", str(REPO / "bench" / "device_queue.sh")], cwd=checkout, capture_output=True,
                          text=True, timeout=60, env={**env, "QUEUE_ROOT": str(root), "OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and "name the jobs: JOBS=" in done.stderr
    assert not root.exists()
