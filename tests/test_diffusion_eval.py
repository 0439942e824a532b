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

import pytest
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


WAN22 = ["train", "configs/examples/quickstart_wan22.yaml", "train.steps=4", "save.every=2", "save.keep_last=10",
         "sample.prompts=[]", "log.every=1", "train.expert_switch_every=1", "eval.every=2", "eval.timesteps=4"]
OFFLOADED = ["model.expert_offload=true", "model.block_swap=1"]


def test_wan22_eval_loss_is_the_same_offloaded_and_after_kill_9_and_resume(tmp_path):
    """Wan 2.2 A14B, both experts alternating every step: the eval loss of a run with the idle expert offloaded and a
    block of each swapped, killed after its step-2 checkpoint and resumed, equals that of a plain uninterrupted
    run bit for bit."""
    from helpers import data_cache_apart
    from toolkit.tiny.fixtures import write_shapes_dataset

    write_shapes_dataset(tmp_path / "held_out", sizes=((64, 64), (96, 64)), count=2)
    with_eval = [*WAN22, f"eval.path={tmp_path / 'held_out'}"]
    env = {**SINGLE_THREAD, "TOOLKIT_CACHE": str(data_cache_apart(tmp_path / "cache"))}
    ref, out = tmp_path / "reference", tmp_path / "run"

    proc = run_toolkit(*with_eval, "model.expert_offload=false", "model.block_swap=0", f"run.output_dir={ref}", env=env)
    assert proc.returncode == 0, proc.stderr
    reference = _evals(ref)
    assert sorted(reference) == [2, 4] and all(math.isfinite(v) and v > 0 for v in reference.values())
    assert reference[2] != reference[4]

    command = [sys.executable, "-m", "toolkit", *with_eval, *OFFLOADED, f"run.output_dir={out}"]
    killed = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, **env})
    kill_9_after_checkpoint(killed, out, 2)
    assert killed.returncode == -signal.SIGKILL and not (out / "final").exists()
    assert _evals(out) == {2: reference[2]}
    proc = run_toolkit(*with_eval, *OFFLOADED, f"run.output_dir={out}", env=env)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr
    assert _evals(out) == reference  # bit for bit: the logged floats are equal


def test_wan22_eval_scores_each_level_with_the_expert_that_owns_its_sigma(run_cli, tmp_path, own_data_caches):
    """tiny:wan22 (boundary 0.875, shift 3): of 4 levels, sigmas 0.30, 0.64, 0.83 go to the low-noise expert and
    0.95 to the high-noise one, whichever expert trains (here only the low-noise one, the other offloaded); each
    expert is brought to the device once per evaluation, and the trained one is resident again after."""
    from toolkit.models.diffusion_wan import Wan22Adapter
    from toolkit.tiny.fixtures import write_shapes_dataset

    write_shapes_dataset(tmp_path / "held_out", sizes=((64, 64),), count=3)
    scored, residents, placed, evaluating = [], [], [], []
    loss_at, predict = Wan22Adapter.loss_at, Wan22Adapter.predict
    place, eval_loss = Wan22Adapter.place_experts, Wan22Adapter.eval_loss

    def spy_loss_at(self, name, batch, latents, cond, noise, level):
        scored.append((name, level))
        return loss_at(self, name, batch, latents, cond, noise, level)

    def spy_predict(self, denoiser, noised, cond, batch):
        out = predict(self, denoiser, noised, cond, batch)  # the expert's pre-forward hook has placed it
        if evaluating:
            residents.append(self.resident)
        return out

    def spy_place(self, resident):
        placed.append((bool(evaluating), resident))
        place(self, resident)

    def spy_eval_loss(self, batch_size):
        evaluating.append(True)
        try:
            return eval_loss(self, batch_size)
        finally:
            evaluating.clear()
            assert self.resident == "transformer_2"

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Wan22Adapter, "loss_at", spy_loss_at)
        patch.setattr(Wan22Adapter, "predict", spy_predict)
        patch.setattr(Wan22Adapter, "place_experts", spy_place)
        patch.setattr(Wan22Adapter, "eval_loss", spy_eval_loss)
        code = run_cli(*WAN22, "train.steps=2", "save.every=0", "train.experts=low_noise", *OFFLOADED,
                       f"eval.path={tmp_path / 'held_out'}", f"run.output_dir={tmp_path / 'run'}")
    assert code == 0
    # 3 images in batches of 2: 2 chunks x 4 levels, every call by the expert resident at that moment
    assert len(scored) == 8 and [name for name, _ in scored] == residents
    owner = {round(level * 8): name for name, level in scored}  # level (k + 0.5) / 4 -> 2k + 1
    assert owner == {1: "transformer_2", 3: "transformer_2", 5: "transformer_2", 7: "transformer"}
    # one evaluation (at step 2, the last): the high-noise expert in, then the low-noise one back
    assert [resident for during, resident in placed if during] == ["transformer", "transformer_2"]
