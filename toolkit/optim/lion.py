"""Lion in fp32 (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms")."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from toolkit.optim.reference import lion_update_


class Lion(torch.optim.Optimizer):
    """Lion with an fp32 momentum ("exp_avg"); decoupled weight decay as in the paper."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        if not lr >= 0.0 or not weight_decay >= 0.0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid Lion hyperparameters: lr={lr}, betas={betas}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                lion_update_(p, p.grad, state["exp_avg"], lr=group["lr"], beta1=beta1, beta2=beta2,
                             weight_decay=group["weight_decay"])
        return loss
