"""Two runs never share a run folder: the lock beside it, its takeover when stale, and the cleanup rule."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from conftest import REPO, run_toolkit

QUICK = ["train.steps=1", "save.every=0", "sample.prompts=[]", "log.tensorboard=false"]


def train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_toolkit("train", REPO / "configs/examples/quickstart_llm.yaml", f"run.output_dir={out}", *QUICK, *extra,
                       timeout=120)


def hold_lock(run_root: Path) -> subprocess.Popen:
    """A live helper process holding the run folder's lock (as a running trainer does) until it is killed."""
    code = ("import sys, time; from pathlib import Path; from toolkit.train.run_lock import RunLock; "
            f"RunLock(Path({str(run_root)!r})).acquire(print); print('held', flush=True); time.sleep(120)")
    helper = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert helper.stdout.readline().strip() == "held"
    return helper


def test_a_second_run_into_a_live_run_folder_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")  # without the lock, a start would move this folder aside
    helper = hold_lock(out)
    try:
        for extra in ([], ["--fresh"]):  # a resume of it, and a fresh start over it
            proc = train(out, *extra)
            assert proc.returncode == 2, proc.stderr
            assert "Traceback" not in proc.stderr
            assert f"run folder {out} is in use by another run (pid {helper.pid} on host {socket.gethostname()}" in proc.stderr
            assert f"lock: {tmp_path / '.run.lock'}" in proc.stderr
    finally:
        helper.kill()
        helper.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.lock", "run"]  # nothing moved aside
    assert (out / "notes.txt").read_text() == "mine" and not (out / "config.yaml").exists()


def test_a_lock_from_another_host_is_refused_with_the_fix(tmp_path):
    lock = tmp_path / ".run.lock"
    lock.write_text(json.dumps({"pid": 1234, "host": "some-other-node", "started": 0}))
    proc = train(tmp_path / "run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "pid 1234 on host some-other-node" in proc.stderr and f"if that run has ended, remove {lock}" in proc.stderr


def test_a_stale_lock_is_taken_over_and_leftovers_of_failed_saves_and_starts_are_removed_nothing_else(tmp_path):
    out = tmp_path / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / ".run.lock"  # left by a run killed with -9
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": 0}))
    (out / "checkpoints" / ".tmp-step-000004-999").mkdir(parents=True)
    (out / "checkpoints" / ".tmp-step-000004-999" / "lora.safetensors").write_bytes(b"partial")
    (out / "samples").mkdir()
    (out / "logs").mkdir()
    (out / "config.yaml").write_text("run: {}\n")  # a start that failed before its first step
    failed = tmp_path / "run.old-20250101-000000"  # the same, set aside by an earlier version
    (failed / "logs").mkdir(parents=True)
    (failed / "config.yaml").write_text("run: {}\n")
    kept = tmp_path / "run.old-20250101-000001"  # an earlier run with a file of the user's: never removed
    kept.mkdir()
    (kept / "config.yaml").write_text("run: {}\n")
    (kept / "my-notes.txt").write_text("mine")
    proc = train(out)
    assert proc.returncode == 0, proc.stderr
    assert f"note: {lock} was left by a run that is no longer running (pid {dead.pid} on host " in proc.stderr
    assert f"removed {out / 'checkpoints' / '.tmp-step-000004-999'}: the temporary files of a save" in proc.stderr
    assert f"removed {failed}: an earlier start that failed before its first step" in proc.stderr
    assert f"{out}: an earlier start failed before its first step; its start files were removed" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run.old-20250101-000001"]
    assert (kept / "my-notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    assert (out / "final").is_dir() and not lock.exists()  # the lock is released at the end
