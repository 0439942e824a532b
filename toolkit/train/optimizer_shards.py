"""device.shard_optimizer: ZeRO stage 1 over the run's processes, through torch's ZeroRedundancyOptimizer.

Each process owns whole LoRA tensors (ZeroRedundancyOptimizer's partition: largest first, each to the process
holding the fewest elements so far), keeps the optimizer state of those only and steps them; the updated tensors
then go from their owner to every other process (one all-gather of flat buffers), so every process ends each step
with the same bits. Whole tensors rather than flat slices: each tensor is stepped by the very
optimizer code one process runs (an 8-bit optimizer's blocks, Adafactor's factored moments, per-tensor norms stay
as they are), so the run matches one process as closely as ddp does.

Checkpoints hold the whole state in the ordinary optimizer's format (every process sends its part to the main
process while saving), so a checkpoint loads into a plain optimizer, and into a sharded one at any process count:
each process keeps its own tensors' part of it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer


def _local_attribute(name: str) -> property:
    """An attribute of the wrapper read, set and deleted on the local optimizer (ShardedOptimizer.optim)."""
    return property(lambda self: getattr(self.optim, name, None),
                    lambda self, value: setattr(self.optim, name, value),
                    lambda self: self.optim.__dict__.pop(name, None))


class ShardedOptimizer(ZeroRedundancyOptimizer):
    """The optimizer `build` makes, over this process's share of `params` only.

    ZeroRedundancyOptimizer's own state_dict and load_state_dict are replaced: its load keeps a second copy of the
    owned state in the wrapper and forces Adam's step counters onto the CPU (which the fused kernel refuses), and
    its consolidated state would stay on the main process after saving. Here the local optimizer loads its part
    through its own load_state_dict, and the gathered state is dropped once returned."""

    def __init__(self, params: list[torch.nn.Parameter], build: Callable[[list[dict]], torch.optim.Optimizer]):
        super().__init__(params, optimizer_class=_Local(build), parameters_as_bucket_view=False)
        self._shares = [[p for group in groups for p in group["params"]] for groups in self._partition_parameters()]
        # the exposed groups carry the local optimizer's settings (fused, foreach...): a saved state loads into a
        # plain optimizer exactly as one saved by it
        for exposed, local in zip(self.param_groups, self.optim.param_groups):
            exposed.update({k: v for k, v in local.items() if k != "params"})
        self.defaults = dict(self.optim.defaults)
        # fused AdamW and the toolkit's 8-bit optimizers skip a non-finite step on the device (found_inf): so does
        # this one, the trainer then never waits for the GPU between steps (train/step.py)
        self._step_supports_amp_scaling = getattr(self.optim, "_step_supports_amp_scaling", False)

    # set by the trainer or GradScaler around step(): they belong to the local optimizer
    found_inf = _local_attribute("found_inf")
    grad_scale = _local_attribute("grad_scale")

    def owned_elements(self) -> int:
        """How many optimizer-state elements this process holds (the tests count the 1/N)."""
        return sum(t.numel() for state in self.optim.state.values() for t in state.values()
                   if torch.is_tensor(t) and t.dim() > 0)

    def _sync_params(self) -> None:
        """After the local step: every process's tensors to every other, in one all-gather of flat buffers (each
        process's tensors packed into its own, padded to the largest share) and one multi-tensor copy out.
        ZeroRedundancyOptimizer's own sends one broadcast per tensor, or moves the weights into flat buckets
        (parameters_as_bucket_view), which a CUDA graph captured before, by the batch-size probe, would not see."""
        first = self._shares[self.rank][0] if self._shares[self.rank] else next(p for s in self._shares for p in s)
        if any(p.dtype != first.dtype or p.device != first.device for share in self._shares for p in share):
            return super()._sync_params()  # one dtype and device in practice (fp32 LoRA weights)
        sizes = [sum(p.numel() for p in share) for share in self._shares]
        width = max(sizes)
        send = torch.zeros(width, dtype=first.dtype, device=first.device)
        if sizes[self.rank]:
            torch.cat([p.detach().reshape(-1) for p in self._shares[self.rank]], out=send[:sizes[self.rank]])
        received = torch.empty(width * self.world_size, dtype=first.dtype, device=first.device)
        dist.all_gather_into_tensor(received, send, group=self.process_group)
        targets, parts = [], []
        for rank, share in enumerate(self._shares):
            if rank == self.rank or not share:
                continue
            flat = received[rank * width: rank * width + sizes[rank]]
            parts += [part.view_as(p) for part, p in zip(flat.split([p.numel() for p in share]), share)]
            targets += [p.detach() for p in share]
        if targets:
            torch._foreach_copy_(targets, parts)

    def gather_state(self) -> None:
        """Collective: every process sends its part of the state to the main process (before state_dict there)."""
        self.consolidate_state_dict(to=0)

    def state_dict(self) -> dict[str, Any]:
        """The whole state in the ordinary format (main process, after gather_state on every process)."""
        try:
            return super().state_dict()
        finally:
            self._all_state_dicts = []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A whole state (saved by a plain or a sharded optimizer, at any process count): this process's tensors'
        part goes to its optimizer, through that optimizer's own load_state_dict."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved optimizer state has other parameter groups (torch.optim.Optimizer refuses "
                             "the same)")
        local_groups, local_state, index = [], {}, 0
        for saved, local in zip(groups, self.optim.param_groups):
            ids = []
            for param in local["params"]:
                global_index = self._param_to_index[param]
                if global_index in state_dict["state"]:
                    local_state[index] = state_dict["state"][global_index]
                ids.append(index)
                index += 1
            local_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        for saved, exposed in zip(groups, self.param_groups):
            exposed.update({k: v for k, v in saved.items() if k != "params"})


class _Local:
    """ZeroRedundancyOptimizer builds its local optimizer as optimizer_class(groups, **defaults): here, `build`."""

    def __init__(self, build: Callable[[list[dict]], torch.optim.Optimizer]):
        self.build = build

    def __call__(self, groups: list[dict], **_defaults) -> torch.optim.Optimizer:
        return self.build(groups)
