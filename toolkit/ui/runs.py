"""The runs under the outputs root and the status of each, from its folder and its lock file alone (plus the exit
codes of the runs this UI started, which nothing in a run folder records)."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.train.run_lock import lock_holder
from toolkit.ui import run_files

if TYPE_CHECKING:
    from toolkit.ui.jobs import Job

STOP_EXIT_CODES = (130, 143)  # train/signals.py: a run stopped by SIGINT or SIGTERM after saving a checkpoint
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # a folder name that is safe in a URL and on a disk


def is_run_folder(path: Path) -> bool:
    """A folder a run wrote: its config.yaml, checkpoints or metrics."""
    return path.is_dir() and any((path / name).exists() for name in ("config.yaml", "checkpoints", "logs"))


def run_names(root: Path) -> list[str]:
    """The run folders directly under the outputs root (hidden ones, like the UI's own .ui/, left out)."""
    try:
        children = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(p.name for p in children if RUN_NAME.fullmatch(p.name) and is_run_folder(p))


@dataclass
class Status:
    state: str  # running, queued, starting, finished, interrupted, failed
    note: str


def run_status(run: Path, step: int | None, total: int | None, job: "Job | None") -> Status:
    """running: its lock is held by a live process; queued / starting: a job of this UI that holds no lock yet;
    finished: final/ exists and the last step is train.steps; failed: the UI's job for it exited with an error, or
    the run died without releasing its lock (killed), or it ended before its first checkpoint (unless the UI
    stopped it); interrupted: a checkpoint to resume from (or the UI's stop) and none of the above."""
    holder, alive = lock_holder(run)
    if holder is not None and alive:
        where = f"pid {holder.get('pid', '?')}" + (f" on {holder['host']}" if holder.get("host") != socket.gethostname()
                                                   else "")
        return Status("running", where)
    if job is not None and job.state in ("queued", "running"):
        return Status("queued" if job.state == "queued" else "starting", f"job {job.id}")
    if (run / "final").is_dir() and step is not None and total is not None and step >= total:
        return Status("finished", "")
    if job is not None and job.exit_code not in (None, 0, *STOP_EXIT_CODES):
        return Status("failed", f"job {job.id} exited with code {job.exit_code}")
    if holder is not None:
        return Status("failed", f"the run (pid {holder.get('pid', '?')}) ended without releasing its lock: killed")
    if run_files.checkpoints(run):
        return Status("interrupted", "stopped before train.steps; resume continues from the last checkpoint")
    if job is not None and job.exit_code in STOP_EXIT_CODES:
        return Status("interrupted", "stopped before its first checkpoint; resume starts it again")
    return Status("failed", "ended before its first checkpoint")


def last_step(run: Path, metrics: dict | None) -> int | None:
    """The last step the run logged or saved."""
    saved = [c["step"] for c in run_files.checkpoints(run)]
    steps = ([metrics["step"]] if metrics and isinstance(metrics.get("step"), int) else []) + saved
    return max(steps) if steps else None


def summary(root: Path, name: str, job: "Job | None" = None) -> dict | None:
    """One row of the runs page; None when the folder is gone (deleted while the UI is open)."""
    run = root / name
    if not run.is_dir():
        if job is not None and job.state in ("queued", "running"):
            return {"name": name, "status": "queued" if job.state == "queued" else "starting", "note": f"job {job.id}",
                    "step": None, "total_steps": None, "loss": None, "eta_s": None, "device": "", "updated": None}
        return None
    config = run_files.read_config(run)
    total = (config.get("train") or {}).get("steps")
    metrics = run_files.last_record(run / "logs" / "metrics.jsonl", "loss")
    step = last_step(run, metrics)
    status = run_status(run, step, total, job)
    loss = None
    if metrics:
        loss = metrics.get("loss_smoothed") if metrics.get("loss_smoothed") is not None else metrics.get("loss")
    eta = None
    if status.state == "running" and metrics and metrics.get("steps_per_s") and isinstance(total, int):
        eta = max(0.0, (total - metrics["step"]) / metrics["steps_per_s"])
    try:
        updated = max(p.stat().st_mtime for p in (run, run / "logs" / "metrics.jsonl") if p.exists())
    except (OSError, ValueError):
        updated = None
    log = Path(job.log) if job is not None else None
    return {"name": name, "status": status.state, "note": status.note, "step": step, "total_steps": total,
            "loss": loss, "eta_s": eta, "device": run_files.device_summary(run, log), "updated": updated,
            "family": (config.get("model") or {}).get("family"), "model": (config.get("model") or {}).get("name_or_path")}
