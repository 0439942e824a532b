"""Stopping well: a second signal exits at once, NaN losses skip steps then stop, out of memory keeps the checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_toolkit
from helpers import read_metrics
from toolkit.cli import main
from toolkit.models.llm import LLMAdapter
from toolkit.train.checkpoint import find_latest_checkpoint

QUICK = [str(REPO / "configs/examples/quickstart_llm.yaml"), "data.max_seq_len=32", "train.batch_size=8",
         "train.lr=3e-3", "save.dtype=fp32", "save.keep_last=10", "log.every=1", "log.tensorboard=false",
         "sample.prompts=[]"]


def train(monkeypatch, out, *extra: str) -> int:
    monkeypatch.chdir(REPO)
    return main(["train", *QUICK, f"run.output_dir={out}", *extra])


def loss_failing_at(monkeypatch, calls: set[int], make) -> None:
    """Replace the adapter's loss so that its N-th call (1-based) in `calls` returns/raises make(loss)."""
    original = LLMAdapter.loss
    count = {"n": 0}

    def loss(self, batch, modules):
        count["n"] += 1
        value = original(self, batch, modules)
        return make(value) if count["n"] in calls else value

    monkeypatch.setattr(LLMAdapter, "loss", loss)


def test_second_signal_exits_at_once_without_waiting(tmp_path):
    script = ("import os, signal, time\n"
              "from toolkit.train.signals import GracefulStop\n"
              "with GracefulStop() as stop:\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(0.2)\n"
              "    print(stop.requested == signal.SIGINT, stop.exit_code, flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(10)\n"
              "    print('still running', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130
    assert proc.stdout.splitlines() == ["True 130"]
    assert "SIGINT received: finishing this step and saving a checkpoint" in proc.stderr
    assert "second SIGINT: exiting now without saving" in proc.stderr


def test_absurd_lr_gives_nan_losses_that_skip_steps_then_stop_with_a_message(tmp_path):
    out = tmp_path / "run"
    proc = run_toolkit("train", *QUICK, f"run.output_dir={out}", "train.optimizer=adamw", "train.lr=1e30",
                       "train.lr_scheduler=constant", "train.warmup_steps=0", "train.max_grad_norm=0",
                       "train.steps=20", "train.max_nan_steps=3", "save.every=1")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "update skipped (1/3 in a row)" in proc.stderr and "update skipped (3/3 in a row)" in proc.stderr
    assert "error: loss was NaN or inf for 3 steps in a row" in proc.stderr
    assert "fix: lower train.lr" in proc.stderr
    assert not (out / "final").exists()


# skipped on the device (the toolkit's 8-bit, torch's fused AdamW) / the loss read before the update (fp32 Lion)
@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw", "lion"])
def test_one_nan_loss_skips_that_update_and_training_goes_on(monkeypatch, tmp_path, capsys, optimizer):
    out = tmp_path / "run"
    loss_failing_at(monkeypatch, {3}, lambda loss: loss * float("nan"))
    assert train(monkeypatch, out, "train.steps=4", "save.every=1", f"train.optimizer={optimizer}") == 0
    err = capsys.readouterr().err
    assert "warning: step 3: loss is not finite; update skipped (1/5 in a row)" in err
    weights = {s: load_file(str(out / "checkpoints" / f"step-{s:06d}" / "trainable_state.safetensors"))
               for s in (2, 3, 4)}
    assert all(torch.equal(weights[2][k], weights[3][k]) for k in weights[2])  # step 3 changed nothing
    assert not all(torch.equal(weights[3][k], weights[4][k]) for k in weights[3])  # step 4 trained again
    assert (out / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_loss_read_a_step_late_trains_exactly_like_reading_it_at_once(monkeypatch, tmp_path, capsys, optimizer):
    """Fused AdamW and the toolkit's adamw8bit skip a non-finite step on the device, and the trainer reads each
    loss one step late (no wait for the GPU between steps). With a NaN at step 3 of 6 and nothing due in
    between, that run logs the same losses, warns the same way and ends with the same LoRA, bit for bit, as the
    trainer reading every loss before its update (and not calling step() for step 3)."""
    from toolkit.train.trainer import Trainer

    setup, skipped_on_device = Trainer._setup, []

    def watched(self, *args):
        setup(self, *args)
        skipped_on_device.append(self.stepper.skips_on_device)

    monkeypatch.setattr(Trainer, "_setup", watched)
    loss_failing_at(monkeypatch, {3}, lambda loss: loss * float("nan"))
    common = ("train.steps=6", "save.every=0", "log.every=1", f"train.optimizer={optimizer}")
    assert train(monkeypatch, tmp_path / "late", *common) == 0
    assert skipped_on_device == [True]

    def reading_at_once(self, *args):
        setup(self, *args)
        self.stepper.skips_on_device = False

    monkeypatch.setattr(Trainer, "_setup", reading_at_once)
    loss_failing_at(monkeypatch, {3}, lambda loss: loss * float("nan"))
    assert train(monkeypatch, tmp_path / "at-once", *common) == 0
    err = capsys.readouterr().err
    assert err.count("warning: step 3: loss is not finite; update skipped (1/5 in a row)") == 2
    late, at_once = (read_metrics(tmp_path / name) for name in ("late", "at-once"))
    assert [r["step"] for r in late] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in late] == [r["loss"] for r in at_once]
    a, b = (load_file(str(tmp_path / name / "final" / "adapter_model.safetensors")) for name in ("late", "at-once"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_out_of_memory_saves_the_step_before_and_ends_with_the_fixes(monkeypatch, tmp_path, capsys):
    out = tmp_path / "run"

    def out_of_memory(loss):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    loss_failing_at(monkeypatch, {6}, out_of_memory)
    assert train(monkeypatch, out, "train.steps=12", "save.every=4", "train.optimizer=adamw") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "error: out of memory at step 6 on" in err and "(preset cpu)" in err
    assert f"the state after step 5 is saved: {out / 'checkpoints' / 'step-000005'}" in err  # step 6 undone
    assert ("fix (then run the same command with it: the run resumes): train.gradient_checkpointing=true" in err
            and "or: device.memory_fraction=0.80" in err)
    assert "or, starting over (--fresh): model.quantize=8bit (a quantized frozen base)" in err  # the llm's own
    assert "or: train.batch_size=4 train.grad_accum=2 (the same batch per optimizer step)" in err
    assert "or: train.optimizer=adamw8bit" in err
    latest = find_latest_checkpoint(out / "checkpoints", warn=lambda m: (_ for _ in ()).throw(AssertionError(m)))
    assert latest.step == 5
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004", "step-000005"]
