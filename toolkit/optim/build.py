"""Optimizer registry and the selection function the trainer calls."""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from toolkit.errors import UserError
from toolkit.optim.bnb_compat import bnb_self_check
from toolkit.optim.eight_bit import AdamW8bit, Lion8bit, triton_available
from toolkit.optim.lion import Lion

BACKENDS = ("auto", "toolkit", "bitsandbytes")
DEVICE_TYPES = ("cuda", "hip", "cpu")
_EIGHT_BIT = {"adamw8bit": AdamW8bit, "lion8bit": Lion8bit}


def _on_gpu(params: list) -> bool:
    return any(p.device.type == "cuda" for g in params for p in (g["params"] if isinstance(g, dict) else [g]))


def _adamw(params, lr, betas, eps, weight_decay, device_type):
    fused = _on_gpu(params)
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None)
    return opt, f"adamw: torch.optim.AdamW ({'fused kernel, params on the GPU' if fused else 'params on the CPU'})"


def _lion(params, lr, betas, eps, weight_decay, device_type):
    return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay), "lion: toolkit fp32 Lion (eps is not used)"


def _adafactor(params, lr, betas, eps, weight_decay, device_type):
    from transformers.optimization import Adafactor

    opt = Adafactor(params, lr=lr, relative_step=False, scale_parameter=False, warmup_init=False,
                    weight_decay=weight_decay)
    return opt, "adafactor: transformers Adafactor (relative_step=False, fixed lr; betas/eps use its defaults)"


def _prodigy(params, lr, betas, eps, weight_decay, device_type):
    if importlib.util.find_spec("prodigyopt") is None:
        raise UserError("optimizer 'prodigy' needs the prodigyopt package: pip install prodigyopt")
    from prodigyopt import Prodigy

    opt = Prodigy(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return opt, "prodigy: prodigyopt.Prodigy (lr is a multiplier of the estimated step size; 1.0 is usual)"


def _eight_bit(name: str) -> Callable:
    def build(params, lr, betas, eps, weight_decay, device_type, backend):
        return _build_eight_bit(name, params, lr, betas, eps, weight_decay, device_type, backend)

    return build


_REGISTRY: dict[str, Callable] = {
    "adamw": _adamw,
    "adamw8bit": _eight_bit("adamw8bit"),
    "lion8bit": _eight_bit("lion8bit"),
    "lion": _lion,
    "adafactor": _adafactor,
    "prodigy": _prodigy,
}
OPTIMIZER_NAMES = tuple(_REGISTRY)


def build_optimizer(name: str, params, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, backend: str = "auto",
                    device_type: str = "cpu") -> tuple[torch.optim.Optimizer, str]:
    """Return the optimizer and a one-line human-readable reason for the implementation chosen."""
    if name not in _REGISTRY:
        raise UserError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZER_NAMES)}")
    if backend not in BACKENDS:
        raise UserError(f"unknown optimizer_backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if device_type not in DEVICE_TYPES:
        raise UserError(f"unknown device type {device_type!r}; valid: {', '.join(DEVICE_TYPES)}")
    params = list(params)
    if name not in _EIGHT_BIT:
        # Presets set optimizer_backend per device; it only chooses between 8-bit implementations.
        opt, reason = _REGISTRY[name](params, lr, tuple(betas), eps, weight_decay, device_type)
        if backend != "auto":
            reason += f" (optimizer_backend={backend} applies to adamw8bit and lion8bit only)"
        return opt, reason
    return _REGISTRY[name](params, lr, tuple(betas), eps, weight_decay, device_type, backend)


def _build_eight_bit(name, params, lr, betas, eps, weight_decay, device_type, backend):
    kwargs = dict(lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "adamw8bit":
        kwargs["eps"] = eps
    wants_bnb = backend == "bitsandbytes" or (backend == "auto" and device_type == "cuda")
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
    else:
        reason = "CPU device; the reference implementation"
    return opt, f"{name}: toolkit ({impl}) — {reason}"
