"""Quantizing a frozen base for LoRA training: which library on which backend, how much memory, and the swap.

`model.quantize: auto` quantizes only when the 16-bit weights would not fit the device's memory budget
(device.memory_fraction of its memory, of which the weights may take WEIGHT_SHARE; the rest is for
activations, latents and the LoRA's optimizer). The libraries: bitsandbytes (CUDA, CPU; 8-bit and NF4
4-bit layers), and torchao's int8 weight-only tensors, plain PyTorch ops that run wherever PyTorch does,
which is why `quantize_backend: auto` picks torchao for 8-bit on ROCm, where bitsandbytes installs often
break. `fp8` is the toolkit's own (kernels/fp8_linear.py): e4m3 weights with fp8 matmuls where the GPU has them,
the same source on CUDA, ROCm and the CPU. PEFT trains LoRA over every kind of layer.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from toolkit.device.detect import DeviceInfo
from toolkit.errors import UserError
from toolkit.kernels.fp8_linear import float8_linear
from toolkit.plan.weights import WEIGHT_SHARE, weight_budget_gb, weights_gb

def choose_quantize(requested: str, count_params: Callable[[], int], device: DeviceInfo, memory_fraction: float,
                    what: str = "the base") -> tuple[str, str]:
    """model.quantize resolved for the resident weights (`count_params()`, called only when needed), and why."""
    if requested != "auto":
        return requested, f"model.quantize={requested} (set in the config)"
    if device.backend == "cpu":
        return "none", "model.quantize=auto -> none: the CPU is never quantized automatically"
    num_params = count_params()
    budget = weight_budget_gb(device, memory_fraction)
    for mode in ("none", "8bit", "4bit"):
        need = weights_gb(num_params, mode)
        if need <= budget or mode == "4bit":
            bits = {"none": "16-bit", "8bit": "8-bit", "4bit": "4-bit"}[mode]
            relation = "fit" if need <= budget else "still exceed"
            return mode, (f"model.quantize=auto -> {mode}: {what} ({num_params / 1e9:.2f}B parameters) takes "
                          f"{need:.1f} GB in {bits} weights, which {relation} the {budget:.1f} GB weight budget "
                          f"({WEIGHT_SHARE:.0%} of device.memory_fraction={memory_fraction} x {device.memory_gb:.0f} GB)")
    raise AssertionError("unreachable")


def plan_weights(quantize: str, offload: bool | str, counts: dict[str, int], device: DeviceInfo,
                 memory_fraction: float) -> tuple[str, bool, str]:
    """(model.quantize, expert offload, reason) for denoisers with `counts` parameters each.

    With several experts (Wan 2.2 A14B), offloading keeps only the largest resident. auto prefers 16-bit
    weights with offload over 8-bit without: offload costs a copy every expert switch, quantization costs
    quality on every step. An offload asked for with a single denoiser is an error."""
    several = len(counts) > 1
    if offload is True and not several:
        raise UserError("model.expert_offload=true: this model has one transformer (only Wan 2.2 A14B has two "
                        "experts)\n  fix: leave model.expert_offload=auto")
    if offload not in (True, False, "auto"):
        raise UserError(f"model.expert_offload: expected true, false or auto, got {offload!r}")
    total, largest = sum(counts.values()), max(counts.values())
    what = " + ".join(counts) if several else next(iter(counts))
    if offload != "auto" or not several or device.backend == "cpu":
        chosen = bool(offload is True)
        mode, why = choose_quantize(quantize, lambda: largest if chosen else total, device, memory_fraction,
                                    f"the {what}" if not chosen else f"one expert of the {what}")
        note = "" if not several else f"; model.expert_offload={str(chosen).lower()}"
        return mode, chosen, why + note
    budget = weight_budget_gb(device, memory_fraction)
    modes = ("none", "8bit", "4bit") if quantize == "auto" else (quantize,)
    for mode in modes:
        for chosen, resident in ((False, total), (True, largest)):
            need = weights_gb(resident, mode)
            if need <= budget:
                where = "one expert resident, the other in CPU memory" if chosen else "both experts resident"
                return mode, chosen, (f"model.quantize={mode}, model.expert_offload={str(chosen).lower()}: {what} "
                                      f"({total / 1e9:.2f}B parameters), {where}: {need:.1f} GB of weights within the "
                                      f"{budget:.1f} GB budget ({WEIGHT_SHARE:.0%} of device.memory_fraction="
                                      f"{memory_fraction} x {device.memory_gb:.0f} GB)")
    mode = modes[-1]
    return mode, True, (f"model.quantize={mode}, model.expert_offload=true: even one expert ({weights_gb(largest, mode):.1f}"
                        f" GB) exceeds the {budget:.1f} GB weight budget; expect out-of-memory errors")


def choose_backend(requested: str, mode: str, backend: str) -> tuple[str, str]:
    """The quantization library for `mode` on this device backend, and why."""
    if mode == "fp8":  # the static plan (plan/static_rules.py) refuses any other model.quantize_backend with it
        return "toolkit", "fp8 is the toolkit's own layer (kernels/fp8_linear.py)"
    if requested == "torchao" and mode == "4bit":
        raise UserError("model.quantize_backend=torchao supports 8bit only (PEFT trains LoRA over torchao int8 "
                        "weights, not int4)\n  fix: model.quantize=8bit, or model.quantize_backend=bitsandbytes")
    if requested == "auto":
        if backend == "hip" and mode == "8bit":
            chosen, why = "torchao", "auto on ROCm: torchao int8 weight-only (plain PyTorch ops; bitsandbytes ROCm builds often break)"
        else:
            chosen, why = "bitsandbytes", f"auto on {backend}: bitsandbytes"
    else:
        chosen, why = requested, "set in the config"
    if importlib.util.find_spec(chosen) is None:  # the library's name is its package's
        raise UserError(f"model.quantize={mode} needs {chosen}, which is not installed\n"
                        f"  fix: pip install {chosen}, or set model.quantize=none")
    return chosen, why


def quantize_linear_layers(model: torch.nn.Module, mode: str, compute_dtype: torch.dtype, device: torch.device,
                           skip: tuple[str, ...] = ("lm_head",), backend: str = "bitsandbytes",
                           include: Callable[[str], bool] | None = None, info: DeviceInfo | None = None) -> int:
    """Replace every nn.Linear (but children named in `skip`, and where `include(qualified name)` is false)
    by its quantized twin on `device`; returns how many. Run before adding the LoRA. fp8 needs `info`, the
    device whose fp8 format and kernels it uses."""
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is not torch.nn.Linear or child_name in skip or (include and not include(name)):
                continue
            if mode == "fp8":
                new = float8_linear(child, device, info, compute_dtype)
            elif backend == "torchao":
                new = _torchao_int8(child, device)
            else:
                new = _bnb_linear(child, mode, compute_dtype, device)
            setattr(parent, child_name, new)
            count += 1
    if backend == "bitsandbytes":
        setattr(model, f"is_loaded_in_{mode}", True)  # PEFT and prepare_model_for_kbit_training read this
    return count


def _bnb_linear(child: torch.nn.Linear, mode: str, compute_dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    import bitsandbytes as bnb

    has_bias = child.bias is not None
    if mode == "4bit":
        new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=has_bias, compute_dtype=compute_dtype,
                                quant_type="nf4", device="meta")
        new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
    else:
        new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=has_bias, has_fp16_weights=False,
                                  threshold=6.0, device="meta")
        new.weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
    if has_bias:
        new.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
    return new.to(device)  # bitsandbytes quantizes on the move to the device


def _torchao_int8(child: torch.nn.Linear, device: torch.device) -> torch.nn.Module:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    child.to(device)  # move first, then quantize: the 16-bit copy never has to fit next to the others
    quantize_(child, Int8WeightOnlyConfig())
    return child
