"""The README's first command: train the quickstart through the real entry point, on the CPU."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from conftest import REPO, run_toolkit
from helpers import read_metrics


def test_quickstart_llm_trains_and_writes_the_adapter(tmp_path):
    out = tmp_path / "run"
    proc = run_toolkit("train", REPO / "configs/examples/quickstart_llm.yaml", f"run.output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert "preset cpu: chosen by device.preset" in proc.stderr
    assert "optimizer: adamw8bit: toolkit" in proc.stderr

    assert sorted(p.name for p in (out / "final").iterdir()) == ["README.md", "adapter_config.json",
                                                                 "adapter_model.safetensors"]
    weights = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert len(weights) == 2 * 14  # lora_A and lora_B of every linear layer in 2 blocks
    assert all(k.startswith("base_model.model.model.layers.") for k in weights)
    assert all(v.dtype == torch.float32 for v in weights.values())  # save.dtype: fp32
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in weights.items())

    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step-000050", "step-000100"]
    assert (out / "config.yaml").is_file()
    assert (out / "samples" / "step-000100" / "samples.txt").read_text().startswith("### the red circle")

    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 10
    assert losses[0] > 5.4 and losses[-1] < losses[0] - 0.5, losses  # the loss visibly falls
