"""Building the optimizer a run names: one builder per name of the registry (specs.py, which config validation
reads without torch), and the selection function the trainer calls.

Optional libraries (bitsandbytes, transformers' Adafactor, prodigyopt) are imported inside the builders.
"""

from __future__ import annotations

import importlib.util
from functools import partial
from typing import Any, Callable

import torch

from toolkit.errors import UserError
from toolkit.kernels import triton_available
from toolkit.optim.bnb_compat import bnb_self_check
from toolkit.optim.eight_bit import AdamW8bit, Lion8bit
from toolkit.optim.lion import Lion
from toolkit.optim.specs import OPTIMIZER_NAMES, optimizer_args_problem, optimizer_spec

BACKENDS = ("auto", "toolkit", "bitsandbytes")
DEVICE_TYPES = ("cuda", "hip", "cpu")
_EIGHT_BIT = {"adamw8bit": AdamW8bit, "lion8bit": Lion8bit}

# build(params, lr, betas, eps, weight_decay, device_type, backend, args) -> (optimizer, reason)
Builder = Callable[..., tuple[torch.optim.Optimizer, str]]


def _on_gpu(params: list) -> bool:
    return any(p.device.type == "cuda" for g in params for p in (g["params"] if isinstance(g, dict) else [g]))


def _adamw(params, lr, betas, eps, weight_decay, device_type, backend, args):
    # The fused kernel (CUDA, ROCm and the CPU) also skips a non-finite step on the device (found_inf).
    fused = all(p.device.type in ("cuda", "cpu") for g in params for p in (g["params"] if isinstance(g, dict) else [g]))
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None,
                            **args)
    where = "GPU" if _on_gpu(params) else "CPU"
    return opt, f"adamw: torch.optim.AdamW ({'fused kernel' if fused else 'for-each kernels'}, params on the {where})"


def _lion(params, lr, betas, eps, weight_decay, device_type, backend, args):
    return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay), "lion: toolkit fp32 Lion (eps is not used)"


def _adafactor(params, lr, betas, eps, weight_decay, device_type, backend, args):
    from transformers.optimization import Adafactor

    kwargs = {"scale_parameter": False, **args}  # with a fixed lr, no scaling by the parameters' RMS by default
    opt = Adafactor(params, lr=lr, relative_step=False, warmup_init=False, weight_decay=weight_decay, **kwargs)
    return opt, "adafactor: transformers Adafactor (relative_step=False, fixed lr; betas/eps use its defaults)"


def _prodigy(params, lr, betas, eps, weight_decay, device_type, backend, args):
    if importlib.util.find_spec("prodigyopt") is None:
        raise UserError("optimizer 'prodigy' needs the prodigyopt package: pip install prodigyopt")
    from prodigyopt import Prodigy

    opt = Prodigy(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **args)
    return opt, "prodigy: prodigyopt.Prodigy (lr is a multiplier of the estimated step size; 1.0 is usual)"


def _eight_bit(params, lr, betas, eps, weight_decay, device_type, backend, args, *, name: str):
    kwargs = dict(lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "adamw8bit":
        kwargs["eps"] = eps
    # auto on CUDA: the toolkit's Triton kernels, which stepped 4.9-5.2x faster than bitsandbytes' (docs/optimizers.md,
    # H200) and skip a non-finite step without waiting for the GPU; bitsandbytes only where triton does not import.
    wants_bnb = backend == "bitsandbytes" or (backend == "auto" and device_type == "cuda" and not triton_available())
    why_not_bnb = ""
    if wants_bnb:
        device = next(p for g in params for p in (g["params"] if isinstance(g, dict) else [g])).device
        passed, check = bnb_self_check(name, device)
        if passed:
            import bitsandbytes as bnb

            cls = {"adamw8bit": bnb.optim.AdamW8bit, "lion8bit": bnb.optim.Lion8bit}[name]
            chosen = "optimizer_backend: bitsandbytes" if backend == "bitsandbytes" else "CUDA device"
            return cls(params, **kwargs), f"{name}: bitsandbytes — {chosen}; {check}"
        if backend == "bitsandbytes":
            raise UserError(f"optimizer_backend: bitsandbytes was asked for, but {check}; "
                            "use optimizer_backend: toolkit (same state format, resumes bitsandbytes states)")
        why_not_bnb = f"{check}, so the toolkit's own is used"
    opt = _EIGHT_BIT[name](params, **kwargs)
    gpu = device_type in ("cuda", "hip")
    impl = "Triton kernels" if gpu and triton_available() else "pure torch"
    if gpu and not triton_available():
        impl += ", triton does not import"
    if why_not_bnb:
        reason = why_not_bnb
    elif backend == "toolkit":
        reason = "optimizer_backend: toolkit"
    elif device_type == "hip":
        reason = "HIP device; bitsandbytes is not used on ROCm unless optimizer_backend: bitsandbytes"
    elif device_type == "cuda":
        reason = ("CUDA device: the Triton kernels step about 5x faster than bitsandbytes' (docs/optimizers.md) "
                  "and skip a non-finite step on the device")
    else:
        reason = "CPU device; the reference implementation"
    return opt, f"{name}: toolkit ({impl}) — {reason}"


BUILDERS: dict[str, Builder] = {
    "adamw": _adamw, "adamw8bit": partial(_eight_bit, name="adamw8bit"), "lion8bit": partial(_eight_bit, name="lion8bit"),
    "lion": _lion, "adafactor": _adafactor, "prodigy": _prodigy,
}
assert BUILDERS.keys() == set(OPTIMIZER_NAMES)


def build_optimizer(name: str, params, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, backend: str = "auto", device_type: str = "cpu",
                    args: dict[str, Any] | None = None) -> tuple[torch.optim.Optimizer, str]:
    """Return the optimizer and a one-line human-readable reason for the implementation chosen.

    args: extra keyword arguments for the optimizer (train.optimizer_args), each one its spec accepts."""
    spec = optimizer_spec(name)
    if backend not in BACKENDS:
        raise UserError(f"unknown optimizer_backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if device_type not in DEVICE_TYPES:
        raise UserError(f"unknown device type {device_type!r}; valid: {', '.join(DEVICE_TYPES)}")
    args = dict(args or {})
    problems = [problem for key in args if (problem := optimizer_args_problem(name, key))]
    if problems:
        raise UserError("train.optimizer_args: " + "; ".join(problems))
    opt, reason = BUILDERS[name](list(params), lr, tuple(betas), eps, weight_decay, device_type, backend, args)
    if backend != "auto" and name not in _EIGHT_BIT:
        # Presets set optimizer_backend per device; it only chooses between 8-bit implementations.
        reason += f" (optimizer_backend={backend} applies to adamw8bit and lion8bit only)"
    if args:
        reason += "; optimizer_args: " + ", ".join(f"{key}={value!r}" for key, value in sorted(args.items()))
    return opt, reason
