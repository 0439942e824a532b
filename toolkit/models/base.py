"""The model adapter interface: everything family-specific lives behind it.

The trainer never asks which family it is training; it calls these methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from omegaconf import DictConfig

from toolkit.device.detect import DeviceInfo


@dataclass
class Runtime:
    """Where and how the adapter runs: the resolved device, dtypes and output folder."""

    device: torch.device
    info: DeviceInfo
    base_dtype: torch.dtype        # frozen base weights
    compute_dtype: torch.dtype     # autocast dtype (fp32 means no autocast)
    run_dir: Path


class TrainDataset(Protocol):
    """Items addressed by index; `groups` puts each item in a bucket so a batch never mixes shapes."""

    groups: Sequence[int]

    def __len__(self) -> int: ...

    def collate(self, indices: Sequence[int]) -> dict[str, Any]:
        """A batch (CPU tensors) of the items at `indices`."""


class ModelAdapter(Protocol):
    """One model family: loading, data, loss, sampling and LoRA files."""

    family: str
    network: torch.nn.Module
    """The module that holds the trainable LoRA weights (the trainer may wrap it for DDP)."""

    def load(self) -> None:
        """Load the base model from cfg.model.name_or_path, freeze it and add the LoRA."""

    def lora_targets(self) -> list[str]:
        """The names of the modules that carry LoRA weights."""

    def dataset(self) -> TrainDataset:
        """The training data for this family (cfg.data)."""

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """The scalar training loss of a batch."""

    def eval_loss(self) -> float | None:
        """Loss on held-out data, or None when the family/config has none."""

    def sample(self, out_dir: Path) -> list[Path]:
        """Generate from cfg.sample.prompts into out_dir; return the files written."""

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The exact trainable tensors, for checkpoints."""

    def load_lora_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what lora_state_dict returned."""

    def save_lora(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """Export the LoRA in the ecosystem's format (cfg.save.format) into out_dir."""

    def load_lora(self, path: Path) -> None:
        """Load an exported LoRA (for sampling from a finished run)."""

    # Optional: `begin_step(step)`, called before each optimizer step (1-based) when the adapter has it, for
    # state that follows the step number (the Wan 2.2 expert being trained); `memory_fixes()`, out-of-memory
    # remedies specific to the family; `cudnn_sdpa` (bool), the family's default for device.cudnn_sdpa=auto.


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def trainable_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every trainable tensor, by parameter name."""
    return {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}


def load_trainable_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable tensors back; names must match exactly."""
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    missing, unexpected = set(params) - set(state), set(state) - set(params)
    if missing or unexpected:
        raise ValueError(f"LoRA weights do not match the model: {len(missing)} missing "
                         f"(e.g. {sorted(missing)[:2]}), {len(unexpected)} unexpected (e.g. {sorted(unexpected)[:2]})")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name].to(p.device, p.dtype))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
