"""Automatic restarts (`train --gpus 2 --max-restarts N`, torch elastic's own) and collective timeouts, on 2 CPU
processes (gloo). Through the real entry point, with faults injected by tests/faults/sitecustomize.py: a rank that
stops answering is named by the rank that times out waiting for it, then the main process is killed with SIGKILL
(the run lock goes with it); each time every process restarts, resumes from the newest checkpoint that verifies,
and the run ends with the same LoRA as an uninterrupted one. And the collective timeout on its own, in a small
worker script: the message names the rank, the collective and its caller."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_toolkit
from helpers import read_metrics
from toolkit.train.checkpoint import list_checkpoints, verify_checkpoint
from toolkit import launch
from toolkit.train.run_lock import lock_path

LLM = str(REPO / "configs/examples/quickstart_llm.yaml")
RUN = ["train.steps=12", "save.every=4", "save.keep_last=10", "train.batch_size=4", "data.max_seq_len=32",
       "train.optimizer=adamw", "train.lr=3e-3", "log.every=1", "log.tensorboard=false", "sample.prompts=[]",
       "save.dtype=fp32"]
FAULTS = str(Path(__file__).parent / "faults")


@pytest.fixture
def env(tmp_path_factory) -> dict[str, str]:
    """One thread per process; latent/text caches of their own; the fault hook on the path."""
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOOLKIT_CACHE": os.environ["TOOLKIT_CACHE"],
            "PYTHONPATH": os.pathsep.join([str(REPO), FAULTS, os.environ.get("PYTHONPATH", "")])}


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "adapter_model.safetensors"))


def test_a_killed_main_process_is_restarted_and_the_run_ends_bit_identical(tmp_path, env):
    reference, out = tmp_path / "reference", tmp_path / "run"
    done = run_toolkit("train", LLM, f"run.output_dir={reference}", *RUN, "--gpus", "2", env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    # attempt 0: rank 0 (the main process, which holds the run lock) is killed as step 6 begins; rank 1 loses it in
    # the step's all-reduce. Attempt 1: resumed from step 4, it goes through.
    run = run_toolkit("train", LLM, f"run.output_dir={out}", *RUN, "--gpus", "2", "--max-restarts", "2",
                      env={**env, "TOOLKIT_TEST_FAULT": "kill:0:6"}, timeout=400)
    err = run.stderr
    assert run.returncode == 0, err
    assert ("launch: 2 CPU processes on this node (gloo), rendezvous 127.0.0.1:" in err
            and "; up to 2 restarts when a process dies (every process resumes from the newest checkpoint that "
                "verifies)" in err)
    assert ("error: rank 1 of 2: lost the other processes in the all-reduce (sum) called from Stepper.launch: one of "
            "them stopped (") in err
    assert ("launch: a process stopped (its output, if it wrote any, is above); restarting all 2 processes "
            "(restart 1 of 2): they resume from the newest checkpoint that verifies") in err
    assert ("restart 1: the launcher restarted every process after one stopped; resuming from the newest checkpoint "
            "that verifies") in err and "restart 2 of 2" not in err
    assert f"resumed from {out / 'checkpoints' / 'step-000004'} (step 4)" in err
    # the killed main process left its lock; the restart took it over
    assert f"note: {lock_path(out)} was left by a run that is no longer running" in err and "taken over" in err
    assert not lock_path(out).exists() and "Traceback" not in err
    # every checkpoint verifies, none lost or set aside; the LoRA is the uninterrupted run's, bit for bit
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004", "step-000008", "step-000012"]
    assert all(verify_checkpoint(p)[0] is not None for _, p in list_checkpoints(out / "checkpoints"))
    a, b = adapter(reference), adapter(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in read_metrics(out)][-8:] == list(range(5, 13))
    assert json.loads((out / "checkpoints" / "step-000012" / "meta.json").read_text())["step"] == 12


HANGS = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    from types import SimpleNamespace
    import torch, torch.distributed as dist
    from toolkit.errors import UserError
    from toolkit.process_exit import leave
    from toolkit.train.distributed import Processes

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    procs = Processes(SimpleNamespace(num_processes=2, process_index=rank, is_main_process=rank == 0,
                                      device=torch.device("cpu")))

    def count_the_step():
        return procs.sum(torch.ones(1))

    if rank == 1:
        time.sleep(60)  # stops answering; SIGTERM from the launcher ends it
    try:
        count_the_step()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        leave(2)  # as python -m toolkit leaves: the group it could not close must not turn 2 into an abort
""")


def test_a_collective_that_hangs_times_out_naming_the_rank_and_what_it_was_doing(tmp_path, capfd):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    with pytest.raises(launch.WorkersFailed) as info:
        launch.run_workers(launch.make_plan(2), sys.executable, [str(script)])
    assert (info.value.rank, info.value.exitcode, info.value.exit_code) == (0, 2, 2)
    err = capfd.readouterr().err
    assert ("error: rank 0 of 2: timed out in the all-reduce (sum) called from count_the_step: the other processes did "
            "not join it within device.collective_timeout ([") in err and "Timed out waiting 2000ms" in err
    assert "\n  fix: the process that stopped answering says why in its output" in err and "Traceback" not in err
