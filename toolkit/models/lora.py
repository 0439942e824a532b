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


# network.init (auto settled by the static plan from FamilySpec.lora_init) -> LoraConfig's init_lora_weights: True
# is PEFT's kaiming-uniform A (a = sqrt(5)), kohya's own
INIT_LORA_WEIGHTS = {"gaussian": "gaussian", "kaiming": True}


def lora_config(network: DictConfig, targets: list[str] | str, **extra: Any):
    """The PEFT config for the `network` section on `targets` (the values a run uses: network.init settled):
    LoraConfig (rank, alpha, dropout, DoRA, rsLoRA, A's initialisation), or for network.type lokr / loha,
    LoKrConfig / LoHaConfig (rank, alpha; PEFT's own initialisation, one factor zero). `extra` are LoraConfig
    arguments (task_type)."""
    if network.type in ADAPTER_CONFIGS:
        return ADAPTER_CONFIGS[network.type](network, targets)
    from peft import LoraConfig

    init = INIT_LORA_WEIGHTS[network.init]
    return LoraConfig(r=network.rank, lora_alpha=network.alpha, lora_dropout=network.dropout,
                      target_modules=targets, use_dora=network.type == "dora", use_rslora=network.rslora,
                      init_lora_weights=init, **extra)


FULL_RANK = 2**30


def _lokr_config(network: DictConfig, targets: list[str] | str):
    from peft import LoKrConfig

    # PEFT keeps w2 a full matrix when the rank is at least half its larger side: a rank no layer reaches, with
    # alpha equal to it (scale 1), is full rank.
    rank, alpha = (FULL_RANK, float(FULL_RANK)) if network.lokr_full_rank else (network.rank, network.alpha)
    return LoKrConfig(r=rank, alpha=alpha, target_modules=targets, decompose_factor=network.lokr_factor,
                      init_weights=True)


def _loha_config(network: DictConfig, targets: list[str] | str):
    from peft import LoHaConfig

    return LoHaConfig(r=network.rank, alpha=network.alpha, target_modules=targets, init_weights=True)


ADAPTER_CONFIGS = {"lokr": _lokr_config, "loha": _loha_config}  # network.type -> PEFT config; else a LoraConfig
