"""toolkit/launch.py: several processes through torch's elastic launcher, on small worker scripts (never the
trainer), and the `train --gpus/--nnodes` flags down to the LaunchConfig."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import run_toolkit
from toolkit import launch
from toolkit.cli import build_parser
from toolkit.errors import UserError

WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    rank = int(os.environ["RANK"])
    out, mode = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))  # as the trainer: a stop on SIGINT, no traceback
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "MIOPEN_FIND_MODE")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
    if rank == 1 and mode == "exit3":
        time.sleep(0.3)
        print("worker 1: failing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    if rank == 1 and mode == "sigkill":
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if mode in ("fail-once", "fail-always"):
        with open(os.path.join(out, f"rank{rank}.attempt{attempt}"), "w") as f:
            f.write(os.environ.get("TORCHELASTIC_MAX_RESTARTS", ""))
        if rank == 1 and (mode == "fail-always" or attempt == "0"):
            sys.exit(3)
        sys.exit(0)
    if mode != "ok":
        time.sleep(60)  # rank 0 would wait this long unless it is stopped
        open(os.path.join(out, f"rank{rank}.finished"), "w").close()
""")


@pytest.fixture
def worker(tmp_path) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return script


def _run(worker: Path, mode: str, nproc: int = 2, max_restarts: int = 0) -> None:
    launch.run_workers(launch.make_plan(nproc, max_restarts=max_restarts), sys.executable,
                       [str(worker), str(worker.parent), mode])


def test_two_processes_succeed_and_get_the_rendezvous_environment(worker, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MIOPEN_FIND_MODE", "FAST")  # as start_toolkit.sh exports the ROCm variables
    _run(worker, "ok")
    seen = [json.loads((worker.parent / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["RANK"] for s in seen] == ["0", "1"]
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1"]
    assert {s["WORLD_SIZE"] for s in seen} == {"2"}
    assert {s["MASTER_ADDR"] for s in seen} == {"127.0.0.1"}
    assert len({s["MASTER_PORT"] for s in seen}) == 1
    assert {s["OMP_NUM_THREADS"] for s in seen} == {"1"}  # torchrun's default, for the workers only
    assert "OMP_NUM_THREADS" not in os.environ
    assert {s["MIOPEN_FIND_MODE"] for s in seen} == {"FAST"}  # each worker inherits the parent's environment


def test_a_user_set_omp_num_threads_is_kept(worker, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    _run(worker, "ok")
    assert json.loads((worker.parent / "rank0.json").read_text())["OMP_NUM_THREADS"] == "3"


def test_a_failing_rank_stops_the_others_quickly_and_is_named(worker, capfd):
    start = time.monotonic()
    with pytest.raises(launch.WorkersFailed) as info:
        _run(worker, "exit3")
    elapsed = time.monotonic() - start
    assert elapsed < 15, f"took {elapsed:.1f} s: the other rank was not stopped"
    err = info.value
    assert (err.rank, err.world_size, err.exitcode, err.exit_code) == (1, 2, 3, 1)
    assert str(err) == ("rank 1 of 2 stopped (exit code 3); the other processes were stopped "
                        "(its output is above)")
    assert not (worker.parent / "rank0.finished").exists()
    captured = capfd.readouterr()
    assert "worker 1: failing on purpose" in captured.err  # the worker's own output, live
    assert "Traceback" not in captured.err and "closing signal" not in captured.err  # no agent noise


def test_a_rank_killed_by_a_signal_is_named_with_the_signal(worker):
    start = time.monotonic()
    with pytest.raises(launch.WorkersFailed) as info:
        _run(worker, "sigkill")
    assert time.monotonic() - start < 15
    assert info.value.rank == 1 and info.value.exitcode == -9 and info.value.exit_code == 1
    assert "rank 1 of 2 stopped (killed by SIGKILL" in str(info.value)
    assert not (worker.parent / "rank0.finished").exists()


def test_max_restarts_restarts_every_worker_and_says_so(worker, capfd):
    _run(worker, "fail-once", max_restarts=2)
    attempts = sorted(p.name for p in worker.parent.glob("rank*.attempt*"))
    assert attempts == ["rank0.attempt0", "rank0.attempt1", "rank1.attempt0", "rank1.attempt1"]
    assert (worker.parent / "rank0.attempt1").read_text() == "2"
    err = capfd.readouterr().err
    assert err.count("launch: a process stopped (its output, if it wrote any, is above); restarting all 2 processes "
                     "(restart 1 of 2): they resume from the newest checkpoint that verifies") == 1
    assert "restart 2 of 2" not in err and "Traceback" not in err


def test_a_worker_that_keeps_failing_stops_after_the_last_restart(worker, capfd):
    with pytest.raises(launch.WorkersFailed) as info:
        _run(worker, "fail-always", max_restarts=1)
    assert str(info.value) == ("rank 1 of 2 stopped (exit code 3); the other processes were stopped (its output is "
                               "above) (after 1 restart)")
    assert sorted(p.name for p in worker.parent.glob("rank1.attempt*")) == ["rank1.attempt0", "rank1.attempt1"]
    assert "restarting all 2 processes (restart 1 of 1)" in capfd.readouterr().err


def test_max_restarts_reaches_the_launch_config_on_one_node_only(tmp_path):
    plan = _plan("--gpus", "2", "--max-restarts", "3")
    assert plan.max_restarts == 3 and launch.launch_requested(build_parser().parse_args(
        ["train", "cfg.yaml", "--max-restarts", "1"]))  # one process with restarts is launched too
    config = launch.launch_config(plan, str(tmp_path))
    assert config.max_restarts == 3 and config.rdzv_backend == "c10d" and "rank" not in config.rdzv_configs
    assert "up to 3 restarts when a process dies (every process resumes from the newest checkpoint" in plan.describe()
    with pytest.raises(UserError, match=r"--max-restarts 1 with --nnodes 2: the launcher of each node would restart "
                                        r"only its own processes"):
        _plan("--nnodes", "2", "--master-addr", "node0", "--max-restarts", "1")
    assert launch.restart_number({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2 and launch.restart_number({}) == 0


def test_a_worker_user_error_keeps_exit_code_2():
    assert launch.WorkersFailed("x", rank=0, world_size=2, exitcode=2).exit_code == 2
    assert launch.describe_failure(3, 8, -15).startswith("rank 3 of 8 stopped (killed by SIGTERM)")


def test_cli_config_error_is_printed_once_and_nothing_starts():
    done = run_toolkit("train", "configs/examples/quickstart_llm.yaml", "train.lrr=1", "--gpus", "2", timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("unknown key 'train.lrr'") == 1
    assert "launch:" not in done.stderr and "Traceback" not in done.stderr


def test_cli_gpus_all_without_a_gpu_is_a_user_error():
    done = run_toolkit("train", "configs/examples/quickstart_llm.yaml", "device.backend=cpu", "--gpus", "all",
                       timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: --gpus all: no GPU is visible" in done.stderr
    assert "--gpus 2" in done.stderr and "Traceback" not in done.stderr


def _plan(*flags: str, visible: int = 0, backend: str = "cpu") -> launch.LaunchPlan:
    args = build_parser().parse_args(["train", "cfg.yaml", *flags])
    return launch.plan_from_args(args, visible, backend)


def test_multi_node_flags_reach_the_launch_config(tmp_path):
    plan = _plan("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500",
                 "--gpus", "4", visible=8, backend="cuda")
    assert (plan.nproc_per_node, plan.nnodes, plan.node_rank, plan.world_size) == (4, 2, 1, 8)
    config = launch.launch_config(plan, str(tmp_path), run_id="r1")
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 4)
    assert config.rdzv_backend == "static" and config.rdzv_endpoint == "10.0.0.1:29500"
    assert config.rdzv_configs["rank"] == 1
    assert config.max_restarts == 0 and config.run_id == "r1"
    assert "node 1 of 2 (8 in all, nccl)" in plan.describe()


def test_multi_node_defaults_to_port_29500_and_needs_the_master_address():
    assert _plan("--nnodes", "2", "--master-addr", "node0").master_port == 29500
    with pytest.raises(UserError, match="--master-addr"):
        _plan("--nnodes", "2", "--gpus", "2")
    with pytest.raises(UserError, match="--node-rank 2: expected 0 to 1"):
        _plan("--nnodes", "2", "--node-rank", "2", "--master-addr", "node0")


def test_one_node_uses_localhost_and_a_free_port():
    plan = _plan("--gpus", "3")
    assert (plan.nproc_per_node, plan.master_addr, plan.device_backend) == (3, "127.0.0.1", "cpu")
    assert 0 < plan.master_port < 65536
    assert "3 CPU processes on this node (gloo)" in plan.describe()
    assert "no GPU" in plan.describe()


def test_gpu_counts():
    assert launch.processes_per_node(None, 4) == 1
    assert launch.processes_per_node("all", 4) == 4
    assert launch.processes_per_node(2, 4) == 2
    assert launch.processes_per_node(3, 0) == 3  # no GPU: CPU processes
    with pytest.raises(UserError, match="--gpus 5: only 4 GPUs are visible"):
        launch.processes_per_node(5, 4)
    with pytest.raises(UserError, match="--gpus all: no GPU"):
        launch.processes_per_node("all", 0)
    assert "nccl (RCCL)" in _plan("--gpus", "all", visible=2, backend="hip").describe()
    assert not _plan("--gpus", "all", visible=1, backend="cuda").several  # one GPU: no launch at all


@pytest.mark.parametrize("flag, value", [("--gpus", "0"), ("--gpus", "-1"), ("--gpus", "two"),
                                         ("--max-restarts", "-1"), ("--max-restarts", "one")])
def test_bad_launch_values_are_refused_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["train", "cfg.yaml", flag, value])
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_workers_get_the_same_config_arguments_without_launch_flags():
    args = build_parser().parse_args(["train", "a.yaml", "b.yaml", "train.lr=1", "--gpus", "2", "--fresh"])
    assert launch.train_worker_args(args.config, args.fresh) == [
        "-u", "-m", "toolkit", "train", "a.yaml", "b.yaml", "train.lr=1", "--fresh"]


def test_inside_a_launched_worker_no_second_launch():
    assert launch.launched_worker({"LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert launch.launched_worker({"WORLD_SIZE": "1"})
    assert not launch.launched_worker({})


DRIVER = textwrap.dedent("""
    import sys
    from toolkit import launch
    plan = launch.make_plan(2)
    try:
        launch.run_workers(plan, sys.executable, sys.argv[1:])
    except launch.LaunchInterrupted as err:
        print(err, file=sys.stderr)
        sys.exit(err.exit_code)
""")


def test_ctrl_c_in_the_parent_stops_every_worker(worker, tmp_path):
    import signal
    import subprocess

    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    parent = subprocess.Popen([sys.executable, str(driver), str(worker), str(tmp_path), "sleep"],
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"rank{r}.json").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and parent.poll() is None, "the workers did not start"
            time.sleep(0.1)
        start = time.monotonic()
        parent.send_signal(signal.SIGINT)
        _, err = parent.communicate(timeout=20)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert time.monotonic() - start < 15
    assert parent.returncode == 130, err
    assert "interrupted (SIGINT): the 2 processes were stopped" in err
    assert "Traceback" not in err
    assert not any((tmp_path / f"rank{r}.finished").exists() for r in (0, 1))


def test_accelerate_asked_for_two_processes_without_multi_gpu_says_it_runs_one(tmp_path):
    """`accelerate launch --num_processes 2 --cpu` runs accelerate's single-process launcher: the run says so and
    names the flags that start several processes."""
    import subprocess

    from conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "toolkit",
                           "train", "configs/examples/quickstart_llm.yaml", f"run.output_dir={tmp_path / 'run'}",
                           "train.steps=1", "data.max_seq_len=16", "save.every=0", "sample.prompts=[]",
                           "log.tensorboard=false"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("note: `accelerate launch` started this run as one process: it was asked for more (it set MASTER_ADDR) "
            "but without --multi_gpu it runs a single process. For N processes: `accelerate launch --multi_gpu "
            "--num_processes N -m toolkit train ...`, `torchrun --nproc-per-node N -m toolkit train ...`, or "
            "`./start_toolkit.sh train ... --gpus N` (which also runs N processes on the CPU)") in proc.stderr
    assert "batch: 8 per process x 1 process x 1 accumulation" in proc.stderr


@pytest.mark.parametrize("environ", [
    {},                                                                  # no launcher
    {"ACCELERATE_MIXED_PRECISION": "no"},                                # accelerate asked for one process
    {"ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "RANK": "0"},  # --multi_gpu
    {"MASTER_ADDR": "localhost", "WORLD_SIZE": "1", "RANK": "0", "TORCHELASTIC_RUN_ID": "x"},  # torchrun, 1 process
])
def test_no_launcher_note_where_the_process_count_is_what_was_asked(environ):
    assert launch.accelerate_single_process_note(environ) is None
