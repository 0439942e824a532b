"""Out of memory mid-run (one process): the state of the last completed step is saved first, then the run stops
with exit 2 naming the step, the batch shapes and the fixes; the same command resumes and ends bit-identical to a
run that never failed. The fault (torch.OutOfMemoryError in a step's first backward, after its forward drew its
noise) is injected by tests/faults/sitecustomize.py in a real `python -m toolkit train` process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_toolkit
from helpers import read_metrics

FAULTS = str(Path(__file__).parent / "faults")
COMMON = ["save.keep_last=10", "save.dtype=fp32", "log.every=1", "log.tensorboard=false", "sample.prompts=[]"]
RUNS = {  # family: (config, overrides, train.steps, the step that runs out of memory)
    # adamw8bit skips a non-finite update on the device, so step 5's numbers are read only after step 6 launched
    "llm": ("quickstart_llm.yaml", ["train.steps=8", "save.every=4", "train.batch_size=4", "data.max_seq_len=32",
                                    "train.optimizer=adamw8bit", "train.lr=3e-3"], 8, 6),
    # each SD step draws noise and timesteps from torch's RNG: the failed step's draws are undone
    "sd": ("quickstart_sd.yaml", ["train.steps=5", "save.every=2", "train.batch_size=2"], 5, 4),
}


@pytest.fixture
def env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOOLKIT_CACHE": os.environ["TOOLKIT_CACHE"],
            "PYTHONPATH": os.pathsep.join([str(REPO), FAULTS, os.environ.get("PYTHONPATH", "")])}


def _train(family: str, out: Path, env: dict, fault: str | None = None):
    config, overrides, _, _ = RUNS[family]
    return run_toolkit("train", REPO / "configs/examples" / config, *COMMON, *overrides, f"run.output_dir={out}",
                       env={**env, "TOOLKIT_TEST_FAULT": fault or ""}, timeout=400)


@pytest.mark.parametrize("family", list(RUNS))
def test_out_of_memory_mid_step_saves_the_last_step_and_the_same_command_resumes_bit_identical(family, tmp_path, env):
    _, _, steps, failing = RUNS[family]
    reference, out = tmp_path / "reference", tmp_path / "run"
    done = _train(family, reference, env)
    assert done.returncode == 0, done.stderr

    failed = _train(family, out, env, fault=f"oom:0:{failing}")
    err = failed.stderr
    assert failed.returncode == 2, err
    assert "Traceback" not in err and "injected by tests/faults" not in err
    assert f"error: out of memory at step {failing} on cpu" in err
    assert "in the step's forward and backward (batch: " in err
    saved = out / "checkpoints" / f"step-{failing - 1:06d}"
    assert f"  the state after step {failing - 1} is saved: {saved}\n" in err
    assert ("  fix (then run the same command with it: the run resumes): train.gradient_checkpointing=true (blocks "
            "recompute their activations in backward)\n") in err
    assert "  or: device.memory_fraction=0.80 (the auto memory settings plan with less of the device)" in err
    batch = int(next(o for o in RUNS[family][1] if o.startswith("train.batch_size=")).split("=")[1])
    fresh = err.split("  or, starting over (--fresh): ")[1]  # a resume keeps the batch: changing it starts over
    assert f"train.batch_size={batch // 2} train.grad_accum=2 (the same batch per optimizer step)" in fresh
    assert [r["step"] for r in read_metrics(out)] == list(range(1, failing))

    resumed = _train(family, out, env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {saved} (step {failing - 1})" in resumed.stderr
    a = load_file(str(reference / "final" / next(p.name for p in (reference / "final").glob("*.safetensors"))))
    b = load_file(str(out / "final" / next(p.name for p in (out / "final").glob("*.safetensors"))))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the log reads as one run: every step once, with the uninterrupted run's losses and smoothed losses
    ref, got = read_metrics(reference), read_metrics(out)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [(r["loss"], r["loss_smoothed"]) for r in got] == [(r["loss"], r["loss_smoothed"]) for r in ref]


def test_the_message_splits_the_fixes_a_resume_takes_from_those_that_start_over():
    from toolkit.train.out_of_memory import batch_shapes, out_of_memory_error

    shapes = batch_shapes({"latents": torch.zeros(4, 4, 128, 96), "timesteps": torch.zeros(4), "ids": [1, 2]})
    assert shapes == "latents 4x4x128x96, timesteps 4"
    error = out_of_memory_error(9, "the update", None, "cuda NVIDIA H100 (preset sm_90)",
                                "the last checkpoint is intact: /r/checkpoints/step-000008",
                                ["model.block_swap=10 (10 of the 40 frozen blocks wait in CPU memory)",
                                 "model.quantize=8bit (a quantized frozen base)",
                                 "train.batch_size=2 train.grad_accum=2 (the same batch per optimizer step)",
                                 "data.resolution lower (fewer latent tokens per image)"])
    assert str(error) == (
        "out of memory at step 9 on cuda NVIDIA H100 (preset sm_90), in the update\n"
        "  the last checkpoint is intact: /r/checkpoints/step-000008\n"
        "  fix (then run the same command with it: the run resumes): model.block_swap=10 (10 of the 40 frozen blocks "
        "wait in CPU memory)\n"
        "  or, starting over (--fresh): model.quantize=8bit (a quantized frozen base)\n"
        "  or: train.batch_size=2 train.grad_accum=2 (the same batch per optimizer step)\n"
        "  or: data.resolution lower (fewer latent tokens per image)")
