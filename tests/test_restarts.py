"""Automatic restarts (`train --gpus 2 --max-restarts N`, torch elastic's own) and collective timeouts, on 2 CPU
processes (gloo) through the real entry point, with faults injected by tests/faults/sitecustomize.py: a rank that
stops answering is named by the rank that times out waiting for it, a rank killed with SIGKILL takes the run lock
with it, and each time every process restarts, resumes from the newest checkpoint that verifies, and the run ends
with the same LoRA as an uninterrupted one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_toolkit
from helpers import read_metrics
from toolkit.train.checkpoint import list_checkpoints, verify_checkpoint
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


def test_a_rank_that_hangs_then_one_killed_are_restarted_and_the_run_ends_bit_identical(tmp_path, env):
    reference, out = tmp_path / "reference", tmp_path / "run"
    done = run_toolkit("train", LLM, f"run.output_dir={reference}", *RUN, "--gpus", "2", env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    # attempt 0: rank 1 stops answering as step 6 begins, and rank 0 times out in the step's all-reduce;
    # attempt 1: resumed from step 4, rank 0 (the lock holder) is killed as step 10 begins;
    # attempt 2: resumed from step 8, it goes through
    faults = {"TOOLKIT_TEST_FAULT": "hang:1:6:0,kill:0:10:1"}
    run = run_toolkit("train", LLM, f"run.output_dir={out}", *RUN, "device.collective_timeout=3", "--gpus", "2",
                      "--max-restarts", "2", env={**env, **faults}, timeout=400)
    err = run.stderr
    assert run.returncode == 0, err
    assert ("launch: 2 CPU processes on this node (gloo), rendezvous 127.0.0.1:" in err
            and "; up to 2 restarts when a process dies (every process resumes from the newest checkpoint that "
                "verifies)" in err)
    assert ("error: rank 0 of 2: timed out in the all-reduce (sum) called from Stepper.launch: the other processes "
            "did not join it within device.collective_timeout (") in err
    assert "fix: the process that stopped answering says why in its output" in err
    for restart in (1, 2):
        assert (f"launch: a process stopped (its output, if it wrote any, is above); restarting all 2 processes "
                f"(restart {restart} of 2): they resume from the newest checkpoint that verifies") in err
        assert (f"restart {restart}: the launcher restarted every process after one stopped; resuming from the "
                "newest checkpoint that verifies") in err
    assert f"resumed from {out / 'checkpoints' / 'step-000004'} (step 4)" in err
    assert f"resumed from {out / 'checkpoints' / 'step-000008'} (step 8)" in err
    # the killed main process left its lock; the restart took it over
    assert f"note: {lock_path(out)} was left by a run that is no longer running" in err and "taken over" in err
    assert not lock_path(out).exists() and "Traceback" not in err
    # every checkpoint verifies, none lost or set aside; the LoRA is the uninterrupted run's, bit for bit
    assert [p.name for _, p in sorted(list_checkpoints(out / "checkpoints"))] == \
        ["step-000004", "step-000008", "step-000012"]
    assert all(verify_checkpoint(p)[0] is not None for _, p in list_checkpoints(out / "checkpoints"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004", "step-000008", "step-000012"]
    a, b = adapter(reference), adapter(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in read_metrics(out)][-4:] == [9, 10, 11, 12]
    assert json.loads((out / "checkpoints" / "step-000012" / "meta.json").read_text())["step"] == 12
