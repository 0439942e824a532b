"""Pure-torch optimizer updates: the reference implementation, used on CPU and any device.

Each function updates one parameter in place. The math follows bitsandbytes' blockwise 8-bit kernels:
dequantize the moments, update them in fp32, apply decoupled weight decay and the bias-corrected step
to an fp32 copy of the parameter, write the parameter back in its dtype, requantize the moments.
"""

from __future__ import annotations

import math

import torch

from toolkit.optim.quant import dequantize_blockwise, quantize_blockwise


def adamw_update_(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """AdamW on fp32 moments `m`, `v` (updated in place) and parameter `p` of any float dtype."""
    g = grad.float()
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    _adamw_apply_(p, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)


def _adamw_apply_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int, lr: float, beta1: float,
                  beta2: float, eps: float, weight_decay: float) -> None:
    correction1 = 1.0 - beta1**step
    correction2 = math.sqrt(1.0 - beta2**step)
    p32 = p.float()
    if weight_decay > 0.0:
        p32.mul_(1.0 - lr * weight_decay)
    denom = (v.sqrt() / correction2).add_(eps)
    p32.addcdiv_(m, denom, value=-lr / correction1)
    p.copy_(p32)


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
                       eps: float, weight_decay: float) -> None:
    """AdamW with block-quantized moments in `state` (state1/absmax1 signed, state2/absmax2 unsigned)."""
    m = dequantize_blockwise(state["state1"], state["absmax1"], signed=True)
    v = dequantize_blockwise(state["state2"], state["absmax2"], signed=False)
    adamw_update_(p, grad, m, v, step=state["step"], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay)
    quantize_blockwise(m, state["state1"], state["absmax1"], signed=True)
    quantize_blockwise(v, state["state2"], state["absmax2"], signed=False)


def lion_8bit_update_(p: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float, beta1: float, beta2: float,
                      weight_decay: float) -> None:
    """Lion with a block-quantized momentum in `state` (state1/absmax1, signed map)."""
    m = dequantize_blockwise(state["state1"], state["absmax1"], signed=True)
    lion_update_(p, grad, m, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    quantize_blockwise(m, state["state1"], state["absmax1"], signed=True)
