"""How much device memory a frozen base's weights take, the share of the budget they may take, and what follows
for several processes (device.distributed=auto). Arithmetic only: the memory plan of a loaded model
(models/quantize.py) and the loaded stage's rules (plan/loaded_rules.py) both read it."""

from __future__ import annotations

from typing import Callable

from toolkit.device.detect import DeviceInfo

WEIGHT_SHARE = 0.6  # of the memory budget, for the frozen weights resident on the device
BYTES_PER_PARAM = {"none": 2.0, "8bit": 1.0, "4bit": 0.5, "fp8": 1.0}


def weights_gb(num_params: int, mode: str) -> float:
    return num_params * BYTES_PER_PARAM[mode] / 1e9


def weight_budget_gb(device: DeviceInfo, memory_fraction: float) -> float:
    """GB of device memory the frozen weights may take."""
    return device.memory_gb * memory_fraction * WEIGHT_SHARE


def choose_distributed(setting: str, processes: int, count_params: Callable[[], int | None], device: DeviceInfo,
                       memory_fraction: float) -> tuple[str, str]:
    """device.distributed resolved for `processes` processes: (ddp or fsdp, why). auto shards the frozen base
    (fsdp) only on a GPU where its 16-bit weights do not fit one device's weight budget."""
    if setting != "auto":
        return setting, "set in the config"
    if processes < 2:
        return "ddp", "auto: one process"
    if device.backend == "cpu":
        return "ddp", "auto: the CPU is never sharded automatically"
    num_params = count_params()
    if num_params is None:
        return "ddp", "auto: the base's size is not known before loading"
    need, budget = weights_gb(num_params, "none"), weight_budget_gb(device, memory_fraction)
    if need <= budget:
        return "ddp", (f"auto: the base ({num_params / 1e9:.2f}B parameters, {need:.1f} GB in 16-bit) fits the "
                       f"{budget:.1f} GB weight budget of one device")
    return "fsdp", (f"auto: the base ({num_params / 1e9:.2f}B parameters, {need:.1f} GB in 16-bit) does not fit the "
                    f"{budget:.1f} GB weight budget of one device; sharded over {processes}, "
                    f"{need / processes:.1f} GB each")
