"""train.reference_logps=precompute: every training row's reference log-prob (the LoRA disabled) computed once
before the first step and kept in the run folder, so that a resumed run reads them instead of recomputing."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from toolkit.data.preference import ExampleDataset

FILE = "reference_logps.safetensors"


def fingerprint(dataset: ExampleDataset, model: str) -> str:
    """What the cached values depend on: the model and every example's tokens."""
    digest = hashlib.sha256(model.encode())
    for example in dataset.examples:
        digest.update(repr((example.prompt, example.completions)).encode())
    return digest.hexdigest()


def precompute_reference(dataset: ExampleDataset, reference_sums: Callable[[dict], torch.Tensor], batch_size: int,
                         run_dir: Path, model: str, log: Callable[[str], None], write: bool = True) -> None:
    """Sets dataset.reference (examples x completions): read from the run folder when its fingerprint matches,
    else computed in batches of `batch_size` and (`write`: the main process) written there."""
    path, key = run_dir / FILE, fingerprint(dataset, model)
    if path.is_file():
        stored = load_file(str(path))
        if stored.get("fingerprint") is not None and bytes(stored["fingerprint"].tolist()).decode() == key:
            dataset.reference = stored["reference"]
            log(f"train.reference_logps=precompute: {len(dataset)} examples' reference log-probs read from {path}")
            return
    columns = len(dataset.examples[0].completions)
    values = torch.empty(len(dataset), columns, dtype=torch.float32)
    for first in range(0, len(dataset), batch_size):
        indices = list(range(first, min(first + batch_size, len(dataset))))
        sums = reference_sums(dataset.collate(indices)).float().cpu()
        values[first:first + len(indices)] = sums.view(columns, len(indices)).t()
    dataset.reference = values
    if not write:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    save_file({"reference": values, "fingerprint": torch.tensor(list(key.encode()), dtype=torch.uint8)}, str(path))
    log(f"train.reference_logps=precompute: {len(dataset)} examples' reference log-probs computed with the LoRA "
        f"disabled, kept in {path}")
