"""Which device we train on, what it can do, and why each automatic decision was made."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from toolkit.device.archs import bare_arch_name, lookup_amd_arch


@dataclass
class DeviceInfo:
    """The training device as the toolkit sees it."""

    backend: str                 # "cuda", "hip" or "cpu"
    arch: str                    # "sm_90", "gfx1151", "cpu"
    name: str
    memory_gb: float             # device memory (for unified-memory APUs: what the GPU reports)
    bf16: bool                   # decided by architecture, not torch.cuda.is_bf16_supported()
    device_count: int = 1
    integrated: bool = False
    reasons: list[str] = field(default_factory=list)

    @property
    def torch_device(self) -> str:
        return "cpu" if self.backend == "cpu" else "cuda"

    def summary(self) -> str:
        mem = f", {self.memory_gb:.0f} GB" if self.backend != "cpu" else ""
        return f"{self.backend} {self.arch} ({self.name}{mem})"


def _system_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def cpu_device_info(reason: str) -> DeviceInfo:
    return DeviceInfo(backend="cpu", arch="cpu", name="CPU", memory_gb=_system_memory_gb(), bf16=False,
                      reasons=[reason])


def _hip_device_info(props, count: int) -> DeviceInfo:
    arch = bare_arch_name(props.gcnArchName)
    info = lookup_amd_arch(arch)
    memory_gb = props.total_memory / 2**30
    reasons = [f"detected HIP device {props.name} ({arch}, {memory_gb:.0f} GB) through torch.version.hip={torch.version.hip}"]
    if info is None:
        reasons.append(f"{arch} is not in the toolkit's AMD table: assuming no bf16 (fp16 with loss scaling); "
                       "set train.precision to override")
        return DeviceInfo("hip", arch, props.name, memory_gb, bf16=False, device_count=count, reasons=reasons)
    if info.bf16:
        reasons.append(f"{arch} ({info.family}) supports bf16" + (f" ({info.notes})" if info.notes else ""))
    else:
        reasons.append(f"{arch} ({info.family}) has no bf16: fp16 with loss scaling "
                       "(torch.cuda.is_bf16_supported() says True on every ROCm GPU, so the arch decides)")
    integrated = bool(getattr(props, "is_integrated", 0)) or info.integrated
    if integrated:
        reasons.append(f"{arch} is a unified-memory APU: batch sizes follow the {memory_gb:.0f} GB the GPU reports")
    return DeviceInfo("hip", arch, props.name, memory_gb, bf16=info.bf16, device_count=count,
                      integrated=integrated, reasons=reasons)


def _cuda_device_info(props, count: int) -> DeviceInfo:
    arch = f"sm_{props.major}{props.minor}"
    memory_gb = props.total_memory / 2**30
    bf16 = props.major >= 8
    reasons = [f"detected CUDA device {props.name} ({arch}, {memory_gb:.0f} GB)",
               f"{arch}: " + ("bf16 supported (Ampere or newer)" if bf16 else "pre-Ampere, no bf16: fp16 with loss scaling")]
    return DeviceInfo("cuda", arch, props.name, memory_gb, bf16=bf16, device_count=count, reasons=reasons)


def detect_device(force_cpu: bool = False) -> DeviceInfo:
    """Detect the training device. HIP is told apart from CUDA by torch.version.hip."""
    if force_cpu:
        return cpu_device_info("device.backend=cpu: using the CPU as asked")
    if not torch.cuda.is_available():
        return cpu_device_info("no CUDA or ROCm GPU visible to PyTorch: using the CPU")
    count = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    if getattr(torch.version, "hip", None):
        return _hip_device_info(props, count)
    return _cuda_device_info(props, count)
