"""Several training processes (`train --gpus N|all`, `--nnodes ...`) through torch.distributed's own launcher.

The parent process validates the config once (in cli.cmd_train), then `elastic_launch` (the API behind
`torchrun`) starts the workers: `python -u -m toolkit train <the same config arguments>`, each with
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set and the parent's environment (the ROCm
variables that start_toolkit.sh exported included). When one worker fails, the agent stops the others
(SIGTERM, then SIGKILL 30 s later for one that is still running, e.g. blocked in a collective, where a Python
signal handler cannot run). With `--max-restarts N` (torch elastic's own restarts, on one node) it then starts
them all again, up to N times, and they resume from the newest checkpoint that verifies (cli.cmd_train: a
restart never starts over with --fresh); the parent prints one line per restart. Without restarts left, the
parent reports the first failed rank in one line. On Ctrl-C the workers get SIGINT (the trainer finishes its step and saves), then SIGKILL after
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by default); a second Ctrl-C sends SIGTERM at once.
Workers recognise that they were launched from LOCAL_RANK/WORLD_SIZE, so `torchrun -m toolkit train ...`
and `accelerate launch -m toolkit train ...` work the same way.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from toolkit.errors import UserError

DEFAULT_MULTI_NODE_PORT = 29500  # torchrun's default
BACKENDS = {"cuda": "nccl", "hip": "nccl (RCCL)", "cpu": "gloo"}


class WorkersFailed(Exception):
    """A worker stopped with an error or a signal; the others were stopped. `exit_code` is for the CLI."""

    def __init__(self, message: str, rank: int, world_size: int, exitcode: int):
        super().__init__(message)
        self.rank = rank
        self.world_size = world_size
        self.exitcode = exitcode      # the worker's: negative for a signal, as in subprocess
        self.exit_code = 2 if exitcode == 2 else 1   # 2: the worker stopped on a user error


class LaunchInterrupted(Exception):
    """The parent got SIGINT/SIGTERM/...: every worker was stopped. `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int, world_size: int):
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"interrupted ({self.signal_name}): the {world_size} processes were stopped")


@dataclass(frozen=True)
class LaunchPlan:
    """Processes on this node, nodes in all, and where they meet (static rendezvous on the master's port)."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    device_backend: str = "cpu"   # "cuda", "hip" or "cpu" (from the validated run's device)
    max_restarts: int = 0         # torch elastic restarts of every process after one fails (one node)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def several(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        backend = BACKENDS.get(self.device_backend, self.device_backend)
        where = "GPU" if self.device_backend != "cpu" else "CPU"
        procs = f"{self.nproc_per_node} {where} process{'es' if self.nproc_per_node != 1 else ''}"
        if self.nnodes == 1:
            text = f"launch: {procs} on this node ({backend}), rendezvous {self.master_addr}:{self.master_port}"
        else:
            text = (f"launch: {procs} on node {self.node_rank} of {self.nnodes} ({self.world_size} in all, {backend}), "
                    f"rendezvous {self.master_addr}:{self.master_port}; waiting for every node to join")
        if self.max_restarts:
            text += (f"; up to {self.max_restarts} restart{'s' if self.max_restarts != 1 else ''} when a process "
                     "dies (every process resumes from the newest checkpoint that verifies)")
        if self.device_backend == "cpu":
            text += "\n  note: no GPU in use (none visible, or device.backend=cpu): the processes train on the CPU"
        return text


def _gpus_type(value: str) -> int | str:
    if value == "all":
        return "all"
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes or 'all', got {value!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 process, got {count}")
    return count


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {number}")
    return number


def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {number}")
    return number


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {port}")
    return port


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The launch flags of `train`: --gpus, --nnodes, --node-rank, --master-addr, --master-port, --max-restarts."""
    group = parser.add_argument_group("several processes (see docs/multi-gpu.md)")
    group.add_argument("--gpus", type=_gpus_type, default=None, metavar="N|all",
                       help="processes on this node, one per GPU (all: every visible GPU); "
                            "without a GPU, N CPU processes (gloo). Default: one process")
    group.add_argument("--nnodes", type=_positive_int, default=1, metavar="M", help="nodes in all (default 1)")
    group.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank, 0 to M-1 (default 0)")
    group.add_argument("--master-addr", default=None, metavar="HOST",
                       help="address of node 0, reachable from every node (needed with --nnodes > 1)")
    group.add_argument("--master-port", type=_port, default=None, metavar="PORT",
                       help=f"free TCP port on node 0 (default: {DEFAULT_MULTI_NODE_PORT} across nodes, "
                            "any free port on one node)")
    group.add_argument("--max-restarts", type=_non_negative_int, default=0, metavar="N",
                       help="when a process dies (killed, out of memory, a collective timeout), restart every "
                            "process up to N times; they resume from the newest checkpoint that verifies "
                            "(default 0: stop)")


def launch_requested(args: argparse.Namespace) -> bool:
    """Whether any launch flag asks for more than the default single process."""
    return (getattr(args, "gpus", None) is not None or getattr(args, "nnodes", 1) > 1
            or getattr(args, "master_addr", None) is not None or getattr(args, "master_port", None) is not None
            or getattr(args, "node_rank", 0) != 0 or getattr(args, "max_restarts", 0) > 0)


def launched_worker(environ: dict[str, str] | None = None) -> bool:
    """True inside a process started by torchrun, accelerate launch or this module."""
    environ = os.environ if environ is None else environ
    return "LOCAL_RANK" in environ or "WORLD_SIZE" in environ


def accelerate_single_process_note(environ: dict[str, str] | None = None) -> str | None:
    """A note when `accelerate launch` ran its single-process launcher although it was asked for more processes.

    Without --multi_gpu (or a config that says so) accelerate starts one plain process whatever --num_processes
    says; it still exports its ACCELERATE_* settings, and MASTER_ADDR/MASTER_PORT when asked for more than one
    process or machine, but no WORLD_SIZE or RANK (torchrun and accelerate's multi-process launchers always set
    both). torchrun's WORLD_SIZE is what it was asked for, so it needs no such note."""
    environ = os.environ if environ is None else environ
    if "ACCELERATE_MIXED_PRECISION" not in environ or "WORLD_SIZE" in environ or "MASTER_ADDR" not in environ:
        return None
    return ("note: `accelerate launch` started this run as one process: it was asked for more (it set MASTER_ADDR) "
            "but without --multi_gpu it runs a single process. For N processes: `accelerate launch --multi_gpu "
            "--num_processes N -m toolkit train ...`, `torchrun --nproc-per-node N -m toolkit train ...`, or "
            "`./start_toolkit.sh train ... --gpus N` (which also runs N processes on the CPU)")
def restart_number(environ: dict[str, str] | None = None) -> int:
    """How many times torch elastic's launcher has restarted this worker's group (0: the first start)."""
    environ = os.environ if environ is None else environ
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def processes_per_node(gpus: int | str | None, visible_gpus: int) -> int:
    """`--gpus` as a process count for this node; user errors name the count and the fix."""
    if gpus is None:
        return 1
    if gpus == "all":
        if visible_gpus == 0:
            raise UserError("--gpus all: no GPU is visible to PyTorch (or the config sets device.backend=cpu), so "
                            "there is nothing to count\n  fix: give the number of CPU processes (e.g. --gpus 2), or "
                            "check the GPU setup with ./start_toolkit.sh doctor")
        return visible_gpus
    if visible_gpus and gpus > visible_gpus:
        raise UserError(f"--gpus {gpus}: only {visible_gpus} GPU{'s are' if visible_gpus != 1 else ' is'} visible "
                        "(CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES limit what PyTorch sees)\n"
                        f"  fix: --gpus {visible_gpus} or --gpus all")
    return int(gpus)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def make_plan(nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
              master_port: int | None = None, device_backend: str = "cpu", max_restarts: int = 0) -> LaunchPlan:
    """Checks the multi-node flags; one node defaults to 127.0.0.1 and a free port."""
    if max_restarts and nnodes > 1:
        raise UserError(f"--max-restarts {max_restarts} with --nnodes {nnodes}: the launcher of each node would "
                        "restart only its own processes, with static rendezvous\n  fix: restart across nodes with "
                        "torchrun (--rdzv-backend=c10d --max-restarts N, then -m toolkit train CONFIG), or leave "
                        "--max-restarts out and run the same command again to resume")
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank}: expected 0 to {nnodes - 1} with --nnodes {nnodes}")
    if nnodes > 1:
        if not master_addr:
            raise UserError(f"--nnodes {nnodes} needs --master-addr: the address of node 0 that every node can "
                            f"reach (e.g. --master-addr 10.0.0.1), the same on every node")
        port = master_port or DEFAULT_MULTI_NODE_PORT
    else:
        master_addr = master_addr or "127.0.0.1"
        port = master_port or free_port()
    return LaunchPlan(nproc_per_node, nnodes, node_rank, master_addr, port, device_backend, max_restarts)


def plan_from_args(args: argparse.Namespace, visible_gpus: int, device_backend: str) -> LaunchPlan:
    """The plan for the parsed `train` flags; `visible_gpus` is 0 when training on the CPU."""
    nproc = processes_per_node(args.gpus, visible_gpus)
    return make_plan(nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                     device_backend if visible_gpus else "cpu", getattr(args, "max_restarts", 0))


def launch_config(plan: LaunchPlan, log_dir: str, run_id: str | None = None):
    """torch's LaunchConfig for the plan: static rendezvous, plan.max_restarts restarts. `log_dir` is the agent's folder
    (it stays empty: the workers' output is not redirected); without one torch makes a new /tmp folder."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=plan.nnodes,
        max_nodes=plan.nnodes,
        nproc_per_node=plan.nproc_per_node,
        run_id=run_id or f"toolkit-{uuid.uuid4().hex[:12]}",
        role="trainer",
        # Restarts need a fresh store per attempt: torch's c10d rendezvous gives one (as torchrun --standalone),
        # where the static one keeps the first attempt's keys and the restarted processes cannot meet again.
        rdzv_backend="c10d" if plan.max_restarts else "static",
        rdzv_endpoint=f"{plan.master_addr}:{plan.master_port}",
        rdzv_configs={} if plan.max_restarts else {"rank": plan.node_rank},
        max_restarts=plan.max_restarts,
        monitor_interval=0.1,
        # Workers write to this console directly (no redirection, no prefixes): their output is live.
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


@contextmanager
def _worker_environment(nproc_per_node: int) -> Iterator[None]:
    """OMP_NUM_THREADS=1 for the workers when the user has not set it (torchrun's rule); restored afterwards."""
    added = "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1
    if added:
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if added:
            os.environ.pop("OMP_NUM_THREADS", None)


@contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent's own warnings (closing signals, its failure table) are left out: the parent prints one line.
    LOGLEVEL=INFO (torchrun's variable) shows them all."""
    if os.environ.get("LOGLEVEL"):
        yield
        return
    names = [n for n in logging.root.manager.loggerDict
             if n.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))]
    loggers = [logging.getLogger(n) for n in names]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, before):
            lg.setLevel(level)


AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


class _RestartNotice(logging.Filter):
    """The agent's "will restart worker group" record as the toolkit's one line; `keep`: pass the agent's records
    on (LOGLEVEL set), else drop them."""

    def __init__(self, world_size: int, keep: bool):
        super().__init__()
        self.world_size, self.keep = world_size, keep

    def filter(self, record: logging.LogRecord) -> bool:
        if "will restart worker group" in str(record.msg) and "attempts left" in str(record.msg):
            remaining, most = int(record.args[2]), int(record.args[3])
            what = (f"all {self.world_size} processes (restart {most - remaining + 1} of {most}): they resume"
                    if self.world_size > 1 else f"it (restart {most - remaining + 1} of {most}): it resumes")
            print(f"launch: a process stopped (its output, if it wrote any, is above); restarting {what} from the "
                  "newest checkpoint that verifies", file=sys.stderr, flush=True)
        return self.keep


@contextmanager
def _announce_restarts(plan: LaunchPlan) -> Iterator[None]:
    """A line on stderr each time the agent restarts the processes (with --max-restarts)."""
    if not plan.max_restarts:
        yield
        return
    agent = logging.getLogger(AGENT_LOGGER)
    notice = _RestartNotice(plan.world_size, keep=bool(os.environ.get("LOGLEVEL")))
    level = agent.level
    agent.setLevel(min(level or logging.INFO, logging.INFO))
    agent.addFilter(notice)
    try:
        yield
    finally:
        agent.removeFilter(notice)
        agent.setLevel(level)


def describe_failure(rank: int, world_size: int, exitcode: int) -> str:
    """One line naming the failed rank and how it stopped."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        how = f"killed by {name}" + (" (often: out of memory; see dmesg)" if name == "SIGKILL" else "")
    else:
        how = f"exit code {exitcode}"
    return f"rank {rank} of {world_size} stopped ({how}); the other processes were stopped (its output is above)"


def run_workers(plan: LaunchPlan, entrypoint: str, args: Sequence[str], run_id: str | None = None) -> None:
    """Run `entrypoint args` in plan.nproc_per_node processes on this node and wait for all of them.

    Raises WorkersFailed when one fails (the others are stopped first), LaunchInterrupted when this process
    got a termination signal (the workers get it too, then SIGTERM and SIGKILL)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    log_dir = tempfile.mkdtemp(prefix="toolkit-launch-")
    try:
        config = launch_config(plan, log_dir, run_id=run_id)
        with _worker_environment(plan.nproc_per_node), _quiet_agent(), _announce_restarts(plan):
            try:
                elastic_launch(config, entrypoint)(*args)
            except ChildFailedError as err:
                rank, failure = err.get_first_failure()
                spent = f" (after {plan.max_restarts} restart{'s' if plan.max_restarts != 1 else ''})" \
                    if plan.max_restarts else ""
                raise WorkersFailed(describe_failure(rank, plan.world_size, failure.exitcode) + spent, rank,
                                    plan.world_size, failure.exitcode) from None
            except SignalException as err:
                raise LaunchInterrupted(int(err.sigval), plan.world_size) from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def train_worker_args(config_args: Sequence[str], fresh: bool = False) -> list[str]:
    """The workers' command line after the interpreter: the same config arguments, no launch flags."""
    return ["-u", "-m", "toolkit", "train", *config_args, *(["--fresh"] if fresh else [])]


def launch_train(plan: LaunchPlan, config_args: Sequence[str], fresh: bool = False) -> int:
    """`train` in every process of the plan; prints the outcome's one line and returns the exit code."""
    print(plan.describe(), file=sys.stderr, flush=True)
    try:
        run_workers(plan, sys.executable, train_worker_args(config_args, fresh))
    except WorkersFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except LaunchInterrupted as err:
        print(str(err), file=sys.stderr)
        return err.exit_code
    return 0
