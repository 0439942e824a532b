"""Helpers shared by the tests: a CPU runtime, an adapter ready to train, its mean loss, a run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import REPO


def cpu_runtime(run, tmp_path: Path, **kwargs):
    from toolkit.models.base import Runtime

    return Runtime(torch.device("cpu"), run.device, torch.float32, torch.float32, tmp_path, **kwargs)


def adapter_for(config: str, tmp_path: Path, *overrides: str):
    """(adapter, dataset) for an example config, loaded, with its data prepared and placed for training,
    in the order the trainer does it."""
    from toolkit.config.run import load_run
    from toolkit.models import build_adapter

    run = load_run([REPO / "configs/examples" / config], [f"run.output_dir={tmp_path}", *overrides])
    adapter = build_adapter(run.cfg, cpu_runtime(run, tmp_path))
    adapter.load()
    dataset = adapter.prepare_data()
    adapter.place_for_training()
    return adapter, dataset


def mean_loss(adapter, batch) -> torch.Tensor:
    """The batch's mean loss, through the adapter's own (unwrapped) trainable modules."""
    return adapter.loss(batch, adapter.trainable_modules()) / adapter.loss_weight(batch)


def read_metrics(run_dir: Path, key: str | None = "loss") -> list:
    """The records of logs/metrics.jsonl (only those with `key`, or all when key is None)."""
    records = [json.loads(line) for line in (Path(run_dir) / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if key is None or key in r]
