"""The diffusion validation loss (eval.path, eval.every, eval.timesteps, eval.seed) through the entry point on
tiny:sd: logged at the steps asked, the same after a kill -9 and resume as in an uninterrupted run, and computed
without touching the training's random streams (a run with it trains bit for bit what a run without it does)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import torch
from safetensors.torch import load_file

from conftest import REPO, run_toolkit
from test_resume import SINGLE_THREAD, kill_9_after_checkpoint

ARGS = ["train", "configs/examples/quickstart_sd.yaml", "train.steps=4", "save.every=2", "save.keep_last=10",
        "sample.prompts=[]", "log.every=1", "log.tensorboard=false", "train.batch_size=2", "data.random_flip=true"]
LORA = "pytorch_lora_weights.safetensors"


def _evals(out) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


def test_eval_loss_is_logged_reported_and_identical_after_kill_9_and_resume(tmp_path):
    from toolkit.tiny.fixtures import write_shapes_dataset

    write_shapes_dataset(tmp_path / "train", sizes=((64, 64), (96, 64)), count=2)
    write_shapes_dataset(tmp_path / "held_out", sizes=((64, 64), (96, 64)), count=3)
    args = [*ARGS, f"data.path={tmp_path / 'train'}"]
    with_eval = [*args, f"eval.path={tmp_path / 'held_out'}", "eval.every=2", "eval.timesteps=3"]
    env = {**SINGLE_THREAD, "TOOLKIT_CACHE": str(tmp_path / "cache")}
    ref, plain, out = tmp_path / "reference", tmp_path / "plain", tmp_path / "run"

    proc = run_toolkit(*with_eval, f"run.output_dir={ref}", env=env)
    assert proc.returncode == 0, proc.stderr
    reference = _evals(ref)
    assert sorted(reference) == [2, 4] and all(math.isfinite(v) and v > 0 for v in reference.values())
    assert reference[2] != reference[4]  # the LoRA moved between them; the inputs did not
    assert f"step 4: eval loss {reference[4]:.4f}" in proc.stderr
    report = (ref / "report.html").read_text(encoding="utf-8")
    assert f"{reference[4]:.4f} at step 4" in report

    # evaluating draws nothing from the training's streams: the same LoRA as a run without eval.path
    proc = run_toolkit(*args, f"run.output_dir={plain}", env=env)
    assert proc.returncode == 0, proc.stderr
    assert _evals(plain) == {}
    for key, tensor in load_file(str(ref / "final" / LORA)).items():
        assert torch.equal(tensor, load_file(str(plain / "final" / LORA))[key]), key

    killed = subprocess.Popen([sys.executable, "-m", "toolkit", *with_eval, f"run.output_dir={out}"], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    kill_9_after_checkpoint(killed, out, 2)
    assert killed.returncode == -signal.SIGKILL and not (out / "final").exists()
    proc = run_toolkit(*with_eval, f"run.output_dir={out}", env=env)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr
    assert _evals(out) == reference  # bit for bit: the logged floats are equal


def test_eval_path_errors_are_named(run_cli, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code = run_cli("validate", "configs/examples/quickstart_sd.yaml", f"eval.path={tmp_path / 'missing'}")
    err = capsys.readouterr().err
    assert code == 2 and "'eval.path'" in err and "does not exist" in err
    code = run_cli("validate", "configs/examples/quickstart_llm.yaml", "eval.every=5")
    err = capsys.readouterr().err
    assert code == 2 and "eval.every" in err
