"""Several training processes, on torch.distributed as accelerate sets it up (NCCL on CUDA, RCCL through the
`nccl` name on ROCm, gloo on the CPU). This file only says which collectives the trainer uses and how it
wraps the trainable modules; every byte goes through torch.distributed.

Why DistributedDataParallel directly rather than accelerator.prepare_model: prepare_model also patches the
module's forward for mixed precision and may move the whole module to the device. The trainer already
autocasts, and a Wan 2.2 expert may keep its frozen weights in CPU memory on purpose. The frozen base
weights and buffers are left out of DDP (nothing to average, and no start-up broadcast of billions of
parameters): every rank loaded the same files, and only LoRA weights train.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist


class Processes:
    """The processes of one run, from the accelerator: who is main, and the collectives the trainer uses."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.world_size = accelerator.num_processes
        self.rank = accelerator.process_index
        self.is_main = accelerator.is_main_process
        self.device = accelerator.device

    @property
    def several(self) -> bool:
        return self.world_size > 1

    def wrap(self, modules: Mapping[str, torch.nn.Module], find_unused: bool) -> dict[str, torch.nn.Module]:
        """Each trainable module in its own DDP wrapper (one process: the modules themselves)."""
        if not self.several:
            return dict(modules)
        from torch.nn.parallel import DistributedDataParallel

        wrapped = {}
        for name, module in modules.items():
            frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
            frozen += [n for n, _ in module.named_buffers()]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen)
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped[name] = DistributedDataParallel(module, device_ids=device_ids, find_unused_parameters=find_unused)
        return wrapped

    @contextmanager
    def no_sync(self, modules: Mapping[str, torch.nn.Module], skip: bool) -> Iterator[None]:
        """Gradient all-reduce held back for every wrapped module (an accumulation micro-batch) when `skip`."""
        with ExitStack() as stack:
            if skip and self.several:
                for module in modules.values():
                    stack.enter_context(module.no_sync())
            yield

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over processes (in place)."""
        if self.several:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def from_main(self, value: Any) -> Any:
        """The main process's `value`, on every process."""
        if not self.several:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value`, by rank, on every process."""
        if not self.several:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def main_first(self):
        """Context: the main process runs the block first (filling shared caches), then the others."""
        return self.accelerator.main_process_first()

    def barrier(self) -> None:
        if self.several:
            self.accelerator.wait_for_everyone()
