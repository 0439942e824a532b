"""Pure-torch optimizer updates: the reference implementation, used on CPU and any device.

Each function updates one parameter in place. The math follows bitsandbytes' blockwise 8-bit kernels:
dequantize the moments, update them in fp32, apply decoupled weight decay and the bias-corrected step
to an fp32 copy of the parameter, write the parameter back in its dtype, requantize the moments.

The step count is an int, or a 0-dim tensor on the parameter's device (the 8-bit optimizers keep it there, so
a step skipped on the device leaves it as it was): the bias corrections are then computed on the device, in
fp64 as the host computes them, without reading it back.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from toolkit.optim.quant import dequantize_blockwise, quantize_blockwise


def adamw_update_(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int | torch.Tensor,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, scales=None) -> None:
    """AdamW on fp32 moments `m`, `v` (updated in place) and parameter `p` of any float dtype.

    scales: adam_step_scales(step, lr, beta1, beta2) when computed beforehand (for many parameters at once)."""
    g = grad.float()
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    step_size, correction2 = adam_step_scales(step, lr, beta1, beta2) if scales is None else scales
    p32 = p.float()
    if weight_decay > 0.0:
        p32.mul_(1.0 - lr * weight_decay)
    denom = (v.sqrt() / correction2).add_(eps)
    # addcdiv_'s arithmetic, p + (value * m) / denom, with a value that may be a device tensor
    p32.add_(m.mul(-step_size).div_(denom))
    p.copy_(p32)


def adam_step_scales(step: int | torch.Tensor, lr: float, beta1: float, beta2: float):
    """(lr / (1 - beta1**step), sqrt(1 - beta2**step)) in fp64: floats for an int step; for a step count tensor,
    tensors on its device, by the same correctly rounded operations (so equal to the floats, on the CPU)."""
    if torch.is_tensor(step):
        s = step.double()
        return torch.full_like(s, lr) / (1.0 - beta1**s), (1.0 - beta2**s).sqrt()
    return lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step)


def lion_update_(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, *, lr: float, beta1: float, beta2: float,
                 weight_decay: float) -> None:
    """Lion (Chen et al. 2023) on an fp32 momentum `m` (updated in place)."""
    g = grad.float()
    p32 = p.float()
    if weight_decay > 0.0:
        p32.mul_(1.0 - lr * weight_decay)
    p32.add_(torch.sign(m * beta1 + g * (1.0 - beta1)), alpha=-lr)
    p.copy_(p32)
    m.mul_(beta2).add_(g, alpha=1.0 - beta2)


def adamw_8bit_update_(p: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float, beta1: float, beta2: float,
                       eps: float, weight_decay: float, scales=None) -> None:
    """AdamW with block-quantized moments in `state` (state1/absmax1 signed, state2/absmax2 unsigned)."""
    m = dequantize_blockwise(state["state1"], state["absmax1"], signed=True)
    v = dequantize_blockwise(state["state2"], state["absmax2"], signed=False)
    adamw_update_(p, grad, m, v, step=state["step"], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, scales=scales)
    quantize_blockwise(m, state["state1"], state["absmax1"], signed=True)
    quantize_blockwise(v, state["state2"], state["absmax2"], signed=False)


def lion_8bit_update_(p: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float, beta1: float, beta2: float,
                      weight_decay: float) -> None:
    """Lion with a block-quantized momentum in `state` (state1/absmax1, signed map)."""
    m = dequantize_blockwise(state["state1"], state["absmax1"], signed=True)
    lion_update_(p, grad, m, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    quantize_blockwise(m, state["state1"], state["absmax1"], signed=True)


@contextlib.contextmanager
def undone_if(skip: torch.Tensor | None, *tensors: torch.Tensor) -> Iterator[None]:
    """The in-place updates of `tensors` inside the block are undone where `skip` (a 0-dim bool tensor, True: a
    non-finite step) holds: torch.where on the device picks the old or the new values, so nothing waits to read
    it. The update runs either way (on non-finite numbers, harmlessly). skip=None: nothing is copied."""
    if skip is None:
        yield
        return
    before = [t.clone() for t in tensors]
    yield
    for t, old in zip(tensors, before):
        torch.where(skip, old, t, out=t)
