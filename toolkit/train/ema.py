"""An exponential moving average of the trainable (LoRA) weights, kept in fp32 beside the model."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class LoraEMA:
    """shadow = decay * shadow + (1 - decay) * weight, after every optimizer step that updated the weights."""

    def __init__(self, module: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        self.shadow = {name: p.detach().to(torch.float32).clone() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, p in self.params.items():
            shadow = self.shadow[name]  # may sit on another device than p (an offloaded Wan 2.2 expert)
            shadow.lerp_(p.detach().to(shadow.device, torch.float32), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = set(self.shadow) - set(state), set(state) - set(self.shadow)
        if missing or unexpected:
            raise ValueError(f"EMA weights do not match the model: {len(missing)} missing, {len(unexpected)} unexpected")
        for name, tensor in state.items():
            self.shadow[name].copy_(tensor.to(self.shadow[name].device, torch.float32))

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Temporarily put the EMA weights into the model (for export), then restore the trained ones."""
        saved = {name: p.detach().clone() for name, p in self.params.items()}
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(self.shadow[name].to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(saved[name])
