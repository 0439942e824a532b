"""LoRA plumbing shared by every family: which modules get a LoRA, and the PEFT config that adds it."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from toolkit.errors import UserError


def target_modules(value: Any, auto: list[str] | str, all_linear: list[str] | str) -> list[str] | str:
    """network.target_modules: auto and all-linear map to the family's lists; a list names modules."""
    if value == "auto":
        return auto
    if value == "all-linear":
        return all_linear
    if OmegaConf.is_list(value) or isinstance(value, list):
        names = list(value)
        if names and all(isinstance(n, str) for n in names):
            return names
    raise UserError(f"network.target_modules: expected auto, all-linear or a list of module names, got {value!r}")


def lora_config(network: DictConfig, targets: list[str] | str, **extra: Any):
    """The PEFT LoraConfig for the `network` section (rank, alpha, dropout, DoRA, rsLoRA) on `targets`."""
    from peft import LoraConfig

    return LoraConfig(r=network.rank, lora_alpha=network.alpha, lora_dropout=network.dropout,
                      target_modules=targets, use_dora=network.type == "dora", use_rslora=network.rslora, **extra)
