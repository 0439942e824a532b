"""Each training sample's own random draws (its noise, noise offset and noise level), from a generator of its own
seeded by (run.seed, epoch, entry) (data/augment.py Augmentation.noise_seed, beside the view and caption draws;
the batch carries the seeds as `draw_seeds`).

A sample's draws then depend on which sample it is, not on the process that trains it or on its neighbours in the
batch: 2 processes x batch b draw, sample for sample, what 1 process x batch 2b draws (the global batch is split
into contiguous shares, data/order.py), and a resumed run draws what the uninterrupted one did. Batches without
seeds (the batch-size probe's largest batch has them too; tests' hand-made ones may not) draw from torch's global
stream. LoRA dropout (network.dropout) still draws from each process's own stream.
"""

from __future__ import annotations

from typing import Sequence

import torch


class SampleDraws:
    """One generator per sample of a batch, on `device`; each method draws one value (or tensor) per sample, in
    the order the objective asks for them (noise, then its offset, then the level)."""

    def __init__(self, seeds: Sequence[int], device: torch.device):
        self.device = torch.device(device)
        self.generators = [torch.Generator(self.device).manual_seed(int(s)) for s in seeds]

    def normal(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(batch, *shape) standard normal values."""
        return torch.stack([torch.randn(tuple(shape), generator=g, device=self.device, dtype=dtype)
                            for g in self.generators])

    def uniform(self) -> torch.Tensor:
        """(batch,) values uniform in [0, 1), fp32."""
        return torch.stack([torch.rand((), generator=g, device=self.device) for g in self.generators])
