"""The UI's jobs: runs (and `sample` calls) started as the CLI starts them, through the launcher, as separate
processes, one at a time per set of GPUs, with a queue kept in <outputs>/.ui/jobs.json so that a restart of the UI
keeps it. Stop is SIGINT to the job's process group (the trainer saves a checkpoint and exits); resume is the same
command again (the trainer resumes from its last checkpoint)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from toolkit.errors import UserError
from toolkit.train.run_lock import live_holder_refusal, lock_holder

REPO = Path(__file__).resolve().parents[2]
KEEP_DONE = 200  # finished jobs kept in jobs.json (their logs stay in .ui/jobs/)


@dataclass
class Job:
    id: str
    kind: str  # train or sample
    run: str  # the run folder's name under the outputs root
    args: list[str]  # after `./start_toolkit.sh` (or `python -m toolkit`)
    log: str
    gpus: str = ""  # --gpus: N or all ("" = one process, as the CLI)
    devices: str = ""  # CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES for the job ("" = the UI's own)
    config_file: str | None = None  # train jobs: the YAML the UI saved, and its overrides (for provenance)
    overrides: list[str] = field(default_factory=list)
    state: str = "queued"  # queued, running, done, cancelled
    queued_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    pid: int | None = None  # the job runner's pid, which leads the job's process group
    exit_code: int | None = None
    stop_requested: bool = False

    def device_keys(self) -> set[str]:
        """The GPUs this job occupies, for "one run at a time per set of GPUs" ("*": every GPU)."""
        if self.gpus == "all" and not self.devices:
            return {"*"}
        ids = self.devices.split(",") if self.devices else [str(i) for i in range(int(self.gpus or 1))]
        count = len(ids) if self.gpus == "all" else int(self.gpus or 1)
        return set(ids[:count])


class JobRefused(UserError):
    """A job that cannot be queued or stopped in the run folder's state: in use (the CLI's own message), already
    queued, not running (HTTP 409)."""


def parse_gpus(gpus: str, devices: str) -> tuple[str, str]:
    """The New run form's GPU fields, checked: --gpus (N or all) and the device ids it may use."""
    gpus, devices = gpus.strip(), devices.replace(" ", "")
    if gpus and gpus != "all" and not (gpus.isdigit() and int(gpus) >= 1):
        raise UserError(f"GPUs: '{gpus}' is not a number of GPUs\n  fix: leave it empty (one process), or give N or all")
    if devices and not all(part.isdigit() for part in devices.split(",")):
        raise UserError(f"devices: '{devices}' is not a list of GPU ids\n  fix: leave it empty, or give ids like 0,1")
    if devices and gpus.isdigit() and int(gpus) > len(devices.split(",")):
        raise UserError(f"GPUs: {gpus} processes need {gpus} devices, and only {devices} are given\n"
                         "  fix: list more device ids, or lower GPUs")
    return gpus, devices


class JobQueue:
    """The jobs of one outputs root. `tick()` (every half second, on a thread) reaps ended jobs and starts queued
    ones whose GPUs are free."""

    def __init__(self, root: Path):
        self.root = root
        self.dir = root / ".ui"
        self.file = self.dir / "jobs.json"
        (self.dir / "jobs").mkdir(parents=True, exist_ok=True)
        (self.dir / "configs").mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.children: dict[str, subprocess.Popen] = {}  # jobs this process started: reaped with poll()
        self.jobs: list[Job] = self._load()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- persistence -------------------------------------------------------------------------
    def _load(self) -> list[Job]:
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            raise UserError(f"{self.file} is not readable as JSON ({err})\n  fix: move it away; the UI starts "
                            "with an empty queue (run folders are not affected)") from None
        known = {f.name for f in fields(Job)}
        return [Job(**{k: v for k, v in item.items() if k in known}) for item in data.get("jobs", [])]

    def save(self) -> None:
        with self.lock:
            done = [j for j in self.jobs if j.state in ("done", "cancelled")]
            keep = {id(j) for j in done[-KEEP_DONE:]}
            self.jobs = [j for j in self.jobs if j.state in ("queued", "running") or id(j) in keep]
            tmp = self.file.with_name(f".{self.file.name}.tmp")
            tmp.write_text(json.dumps({"version": 1, "jobs": [asdict(j) for j in self.jobs]}, indent=1),
                           encoding="utf-8")
            os.replace(tmp, self.file)

    # -- queries ---------------------------------------------------------------------------------
    def latest(self, run: str, kind: str = "train") -> Job | None:
        with self.lock:
            for job in reversed(self.jobs):
                if job.run == run and job.kind == kind:
                    return job
        return None

    def active(self) -> list[Job]:
        with self.lock:
            return [j for j in self.jobs if j.state in ("queued", "running")]

    def get(self, job_id: str) -> Job | None:
        with self.lock:
            return next((j for j in self.jobs if j.id == job_id), None)

    # -- submitting --------------------------------------------------------------------------
    def submit(self, kind: str, run: str, args: list[str], gpus: str = "", devices: str = "",
               config_file: str | None = None, overrides: list[str] | None = None) -> Job:
        """Queue a job; refused while the run folder has a job of this UI, or (train) while a live run holds it (the
        CLI's own message; `sample` never takes the lock)."""
        refusal = live_holder_refusal(self.root / run) if kind == "train" else None
        if refusal is not None:
            raise JobRefused(str(refusal))
        with self.lock:
            for job in self.active():
                if job.run == run:
                    raise JobRefused(f"run folder {self.root / run} already has a {job.state} job in this UI "
                                     f"({job.kind}, job {job.id})\n  fix: wait for it, or stop it first")
            job_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            job = Job(id=job_id, kind=kind, run=run, args=args, log=str(self.dir / "jobs" / f"{job_id}.log"),
                      gpus=gpus, devices=devices, config_file=config_file, overrides=list(overrides or []),
                      queued_at=time.time())
            self.jobs.append(job)
            self.save()
        self.tick()
        return job

    def resume_args(self, run: str) -> tuple[list[str], str, str, str | None, list[str]]:
        """The command that resumes a run: its last UI train job's, without --fresh; else the run's own config.yaml,
        into the same folder."""
        job = self.latest(run)
        if job is not None:
            return ([a for a in job.args if a != "--fresh"], job.gpus, job.devices, job.config_file,
                    job.overrides)
        folder = self.root / run
        overrides = [f"run.output_dir={folder.resolve()}"]
        return ["train", str(folder / "config.yaml"), *overrides], "", "", str(folder / "config.yaml"), overrides

    # -- stopping ------------------------------------------------------------------------------
    def stop(self, run: str) -> str:
        """Cancel the run's queued job, or send SIGINT to its running job's process group (or, for a run started
        elsewhere on this host, to the process that holds its lock). Returns what was done."""
        with self.lock:
            for job in self.active():
                if job.run != run:
                    continue
                if job.state == "queued":
                    job.state, job.ended_at = "cancelled", time.time()
                    self.save()
                    return f"job {job.id} taken off the queue"
                try:
                    os.killpg(job.pid, signal.SIGINT)
                except ProcessLookupError:
                    return f"job {job.id} has already ended"
                job.stop_requested = True
                self.save()
                return f"SIGINT sent to job {job.id}: the run saves a checkpoint and stops"
        holder, alive = lock_holder(self.root / run)
        if holder and alive and holder.get("pid"):
            import socket

            if holder.get("host") != socket.gethostname():
                raise JobRefused(f"run {run} runs on host {holder.get('host')}\n  fix: stop it there (Ctrl-C)")
            os.kill(int(holder["pid"]), signal.SIGINT)
            return f"SIGINT sent to pid {holder['pid']}: the run saves a checkpoint and stops"
        raise JobRefused(f"run {run} is not running\n  fix: nothing to stop")

    # -- the scheduler -------------------------------------------------------------------------
    def tick(self) -> None:
        with self.lock:
            changed = self._reap()
            busy: set[str] = set()
            for job in self.jobs:
                if job.state == "running":
                    busy |= job.device_keys()
            for job in self.jobs:
                if job.state != "queued":
                    continue
                keys = job.device_keys()
                if "*" in busy or ("*" in keys and busy) or keys & busy:
                    continue
                self._start(job)
                busy |= keys
                changed = True
            if changed:
                self.save()

    def _reap(self) -> bool:
        changed = False
        for job in self.jobs:
            if job.state != "running":
                continue
            exit_file = Path(job.log).with_suffix(".exit.json")
            child = self.children.get(job.id)
            ended = child.poll() is not None if child is not None else not _job_alive(job)
            if not ended:
                continue
            self.children.pop(job.id, None)
            try:
                record = json.loads(exit_file.read_text(encoding="utf-8"))
                job.exit_code, job.ended_at = record["exit_code"], record["ended"]
            except (OSError, ValueError, KeyError):  # the runner itself was killed: the code is unknown
                job.exit_code, job.ended_at = (child.returncode if child is not None else None), time.time()
            job.state = "done"
            changed = True
        return changed

    def _start(self, job: Job) -> None:
        command, env = launcher_command(job.args)
        if job.devices:
            env["CUDA_VISIBLE_DEVICES"] = env["HIP_VISIBLE_DEVICES"] = job.devices
        exit_file = Path(job.log).with_suffix(".exit.json")
        wrapped = [sys.executable, "-m", "toolkit.ui.job_runner", str(exit_file), "--", *command]
        with open(job.log, "ab") as log:
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            # A session of its own: the job outlives the UI, and SIGINT reaches its whole process group.
            child = subprocess.Popen(wrapped, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        self.children[job.id] = child
        job.pid, job.state, job.started_at = child.pid, "running", time.time()

    def start_thread(self) -> None:
        def loop():
            while not self._stop.wait(0.5):
                try:
                    self.tick()
                except Exception as err:  # noqa: BLE001 - a scheduler that dies would strand the queue silently
                    print(f"ui: job scheduler: {type(err).__name__}: {err}", file=sys.stderr, flush=True)

        self._thread = threading.Thread(target=loop, name="ui-jobs", daemon=True)
        self._thread.start()

    def stop_thread(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def launcher_command(args: list[str]) -> tuple[list[str], dict]:
    """The command line the CLI user would type: ./start_toolkit.sh ARGS with this interpreter (TOOLKIT_PYTHON),
    or `python -m toolkit ARGS` where the toolkit is installed without its launcher."""
    env = dict(os.environ)
    script = REPO / "start_toolkit.sh"
    if script.is_file():
        env["TOOLKIT_PYTHON"] = sys.executable
        return [str(script), *args], env
    return [sys.executable, "-m", "toolkit", *args], env


def _job_alive(job: Job) -> bool:
    """Whether a job this process did not start (one from before a restart of the UI) is still running: its runner's
    pid is alive and is still that runner (pids are reused)."""
    if not job.pid:
        return False
    try:
        cmdline = Path(f"/proc/{job.pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: the pid alone
        try:
            os.kill(job.pid, 0)
        except ProcessLookupError:
            return False
        return True
    return Path(job.log).with_suffix(".exit.json").name.encode() in cmdline
