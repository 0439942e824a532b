"""What every peer row of bench/diffusion.py shares: the peer's own installation (pinned source and pinned packages,
apart from the toolkit's), a process of its own timed from its progress bar, and its peak GPU memory.

Layout, built on a machine with PyPI by bench/peers/packages.sh and carried to the GPU machine (git-ignored):

    .whl-peers/NAME/source.tar.gz   the peer's repository at the commit pinned in bench/peers/NAME.py
    .whl-peers/NAME/wheels/*.whl    the packages it pins that the GPU machine's image lacks or has in another version

`install(name)` unpacks both under /tmp/peer-NAME (once per machine): src/ and site/. A peer process sees site/ and
src/ first on its PYTHONPATH, then the machine's own packages (torch among them: every row runs on the same torch),
never the toolkit's carried ones.

Step time: the peer's progress bar (tqdm) lines are read as they come and stamped with the host clock; the rate is
(steps after warm-up) / (seconds between the warm-up step's line and the last one). kohya sd-scripts, musubi-tuner
and ai-toolkit each read the loss back to the host every step (for the bar's average), so the host clock follows
the GPU. Peak memory: bench/memory_hook.py's sitecustomize hook (max_memory_allocated at exit, every process), as for the
toolkit's own rows in that bench."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRIED = REPO / ".whl-peers"
TQDM = re.compile(r"(\d+)/(\d+) \[")  # "steps:  40%|####      | 4/10 [00:03<00:05, 1.2it/s, avr_loss=0.1]"


STANDINS = Path(__file__).with_name("standins")  # import-only stand-ins, last on a peer's PYTHONPATH (standins/av)


class PeerFailed(RuntimeError):
    """The peer could not run the workload: the row is printed with this message instead of figures."""


def install(name: str, root: Path = Path("/tmp")) -> tuple[Path, Path]:
    """(source folder, site folder) of peer `name`, unpacked from .whl-peers/NAME once per machine."""
    carried = CARRIED / name
    if not (carried / "source.tar.gz").exists():
        raise PeerFailed(f"{carried}/source.tar.gz is missing: build it with `bash bench/peers/packages.sh {name}` "
                         "on a machine with PyPI and carry .whl-peers")
    top = root / f"peer-{name}"
    src, site, done = top / "src", top / "site", top / ".installed"
    if not done.exists():
        src.mkdir(parents=True, exist_ok=True)
        with tarfile.open(carried / "source.tar.gz") as archive:
            archive.extractall(src, filter="data")
        wheels = sorted((carried / "wheels").glob("*.whl"))
        if wheels:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
        site.mkdir(exist_ok=True)
        done.write_text("ok\n")
    return src, site


def peer_env(site: Path, src: Path, work: Path, **extra: str) -> dict:
    """The environment of a peer process: its own packages first, the memory hook, nothing downloaded."""
    from memory_hook import MEMORY_HOOK

    hook = work / "memory-hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(MEMORY_HOOK)
    memory = work / "memory"
    memory.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not the toolkit's carried packages
    env.update(PYTHONPATH=os.pathsep.join(map(str, (hook, site, src))), PYTHONUNBUFFERED="1",
               SCALING_BENCH_MEMORY=str(memory), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(work / "hf-home"), TOKENIZERS_PARALLELISM="false", **extra)
    return env


def peak_gib(work: Path) -> float:
    """The largest GPU peak any process of the row wrote (0.0 on the CPU)."""
    peaks = [json.loads(p.read_text()) for p in (work / "memory").glob("memory-*.json")]
    return max((p["gib"] for p in peaks if p.get("kind") == "gpu_max_allocated"), default=0.0)


def run_logged(cmd: list[str], cwd: Path, env: dict, log: Path, timeout: float) -> float:
    """Run a step that is not timed per step (a caching script); its wall seconds, or PeerFailed with the log's tail."""
    start = time.perf_counter()
    with log.open("a") as handle:
        handle.write("$ " + " ".join(cmd) + "\n")
        handle.flush()
        try:
            done = subprocess.run(cmd, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PeerFailed(f"timed out after {timeout:.0f} s: {tail(log)}") from None
    if done.returncode != 0:
        raise PeerFailed(f"exit {done.returncode}: {tail(log)}")
    return time.perf_counter() - start


def timed_run(cmd: list[str], cwd: Path, env: dict, log: Path, warmup: int, timeout: float,
              progress: re.Pattern = TQDM) -> dict:
    """Run the peer's training command, stamping each progress line. Returns s_per_step over the steps after
    `warmup`, seconds_to_first_step (start-up, model loading, caching done inside the command), wall_s, and the
    steps seen. PeerFailed if it exits non-zero or shows fewer than warmup + 2 steps."""
    start = time.perf_counter()
    stamps: dict[int, float] = {}
    with log.open("a") as handle:
        handle.write("$ " + " ".join(cmd) + "\n")
        handle.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        pending = b""
        try:
            while True:
                if time.perf_counter() - start > timeout:
                    proc.kill()
                    raise PeerFailed(f"timed out after {timeout:.0f} s: {tail(log)}")
                chunk = proc.stdout.read1(65536)
                if not chunk:
                    break
                now = time.perf_counter() - start
                handle.write(chunk.decode(errors="replace"))
                pending += chunk
                *lines, pending = re.split(rb"[\r\n]", pending)
                for line in lines:
                    match = progress.search(line.decode(errors="replace"))
                    if match and int(match.group(1)) not in stamps:
                        stamps[int(match.group(1))] = now
        finally:
            proc.wait()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise PeerFailed(f"exit {proc.returncode}: {tail(log)}")
    return rate(stamps, warmup, wall, log)


def rate(stamps: dict[int, float], warmup: int, wall: float, log: Path) -> dict:
    """The figures from the progress stamps {step: seconds since start}."""
    last = max(stamps, default=0)
    if warmup not in stamps or last < warmup + 2:
        raise PeerFailed(f"{last} steps shown, fewer than warm-up {warmup} + 2: {tail(log)}")
    return {"s_per_step": (stamps[last] - stamps[warmup]) / (last - warmup), "timed_steps": last - warmup,
            "seconds_to_first_step": stamps.get(1, stamps[min(stamps)]), "wall_s": wall}


def tail(log: Path, lines: int = 6) -> str:
    text = [line for line in re.split(r"[\r\n]", log.read_text(errors="replace")) if line.strip()] if log.exists() else []
    return " | ".join(text[-lines:]) + f" (whole output: {log})"


def tensorboard_losses(logs: Path, tag: str) -> list[float]:
    """The per-step scalar `tag` a peer logged under `logs` (every event file, by step), or PeerFailed if none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = {}
    for events in sorted(logs.rglob("events.out.tfevents.*")) if logs.exists() else []:
        accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        accumulator.Reload()
        if tag in accumulator.Tags().get("scalars", []):
            losses.update({e.step: e.value for e in accumulator.Scalars(tag)})
    if not losses:
        raise PeerFailed(f"no '{tag}' in tensorboard events under {logs}")
    return [losses[step] for step in sorted(losses)]
