"""Block swap: some of the frozen denoiser's repeated blocks keep their weights in pinned CPU memory and are
streamed to the GPU just ahead of use, on a side stream, so a base larger than the GPU's memory trains in
16 bits without quantization (`model.block_swap`).

How it stays correct:
- Only the frozen base weights move. The LoRA weights of a swapped block stay on the device, where the
  optimizer steps them.
- A swapped block is always gradient-checkpointed (train/blocks.py does it): its forward saves nothing
  that points at the weights, and backward recomputes the block, fetching the weights again. Without that,
  autograd would hold views of a slot that the next block's weights overwrite.
- The GPU holds a few slots per kind of block (blocks with the same weight shapes share slots). A block's
  weights are copied into a free slot, and its parameters point at that slot (`param.data = slot`). When it
  is no longer needed they point back at the pinned host copy; nothing is ever copied back, since the
  weights never change.
- Order: a swapped block calls `enter()` before it runs (its forward, or its recompute in backward). That
  waits for its copy (issued earlier, or now), releases the block that ran before it once the compute stream
  has passed it, and starts copying the block expected next: the following swapped block in the forward
  pass, the preceding one in the backward pass (recomputes run in reverse order). A block is expected to run
  next in the same direction as the last two entries; wrong guesses cost a copy, never correctness.

On the CPU (the tests) the "device" is the CPU too and copies are synchronous; the order of transfers and the
numbers are the same as on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

SLOTS_PER_KIND = 3  # the block running, the one before it (released at the next entry), the one prefetched


@dataclass
class SwapPlan:
    """Which blocks swap (indices into the root's repeated blocks, in forward order) and why."""

    swapped: list[int]
    reason: str


def spread(count: int, total: int) -> list[int]:
    """`count` block indices out of `total`, spread evenly (so each copy overlaps the compute of the resident
    blocks between two swapped ones), starting from the end of the forward pass."""
    if count <= 0:
        return []
    if count >= total:
        return list(range(total))
    step = total / count
    return sorted({total - 1 - int(i * step) for i in range(count)})


def frozen_bytes(block: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in block.parameters() if not p.requires_grad)


def plan_block_swap(setting, blocks: list[torch.nn.Module], resident_gb: float, budget_gb: float,
                    device_backend: str, unified: bool) -> SwapPlan:
    """model.block_swap resolved: an integer is taken as given; auto swaps the fewest blocks that bring the
    resident 16-bit weights (`resident_gb`, all denoiser weights the step needs) within `budget_gb`."""
    sizes = [frozen_bytes(b) / 1e9 for b in blocks]
    if isinstance(setting, bool) or not (setting == "auto" or isinstance(setting, int)):
        raise ValueError(f"model.block_swap: expected a number of blocks or auto, got {setting!r}")
    if isinstance(setting, int):
        count = min(setting, len(blocks))
        chosen = spread(count, len(blocks))
        return SwapPlan(chosen, f"model.block_swap={setting}: {count} of {len(blocks)} blocks swapped (set in the "
                                f"config)")
    if device_backend == "cpu":
        return SwapPlan([], "model.block_swap=auto -> 0: the CPU holds every weight already")
    if unified:
        return SwapPlan([], "model.block_swap=auto -> 0: unified memory (the GPU and the CPU share the same RAM)")
    if resident_gb <= budget_gb or not blocks:
        return SwapPlan([], f"model.block_swap=auto -> 0: {resident_gb:.1f} GB of 16-bit weights fit the "
                            f"{budget_gb:.1f} GB weight budget")
    excess = resident_gb - budget_gb
    for count in range(1, len(blocks) + 1):
        chosen = spread(count, len(blocks))
        moved = sum(sizes[i] for i in chosen)
        if moved >= excess:
            return SwapPlan(chosen, f"model.block_swap=auto -> {count}: {resident_gb:.1f} GB of 16-bit weights exceed "
                                    f"the {budget_gb:.1f} GB weight budget; {count} of {len(blocks)} blocks "
                                    f"({moved:.1f} GB) stay in CPU memory and stream in ahead of use")
    chosen = list(range(len(blocks)))
    return SwapPlan(chosen, f"model.block_swap=auto -> {len(blocks)}: even with every block swapped the rest exceeds "
                            f"the {budget_gb:.1f} GB weight budget; expect out-of-memory errors")


@dataclass
class _Swapped:
    index: int
    block: torch.nn.Module
    kind: tuple
    params: list[tuple[torch.nn.Parameter, torch.Tensor]]   # (parameter, its pinned host copy)
    slot: int | None = None
    ready: object = None        # a device event: the copy into the slot is done


@dataclass
class _Pool:
    buffers: list[list[torch.Tensor]]
    owner: list[int | None]                                   # swapped index holding each slot
    freed: list[object] = field(default_factory=list)         # per slot: event after which it may be overwritten


class BlockSwap:
    """The runtime of a swap plan over the repeated `blocks` of one denoiser."""

    def __init__(self, blocks: list[torch.nn.Module], swapped: list[int], device: torch.device,
                 trace: Callable[[str, int], None] | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.trace = trace or (lambda what, index: None)   # ("copy" | "release", block index): for the tests
        self.entries: dict[int, _Swapped] = {}
        self.order = sorted(swapped)                          # forward order of the swapped blocks
        self.pools: dict[tuple, _Pool] = {}
        self.history: list[int] = []
        for index in self.order:
            block = blocks[index]
            frozen = [p for p in block.parameters() if not p.requires_grad]
            kind = tuple((tuple(p.shape), p.dtype) for p in frozen)
            params = [(p, self._host_copy(p.data)) for p in frozen]
            for p, host in params:
                p.data = host
            self.entries[index] = _Swapped(index, block, kind, params)

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        cpu = tensor.detach().to("cpu")
        return cpu.pin_memory() if self.cuda else cpu.clone()

    @property
    def swapped(self) -> list[int]:
        return list(self.order)

    def _pool(self, kind: tuple) -> _Pool:
        if kind not in self.pools:
            buffers = [[torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in kind]
                       for _ in range(SLOTS_PER_KIND)]
            self.pools[kind] = _Pool(buffers, [None] * SLOTS_PER_KIND, [None] * SLOTS_PER_KIND)
        return self.pools[kind]

    def _event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _fetch(self, entry: _Swapped, protect: set[int]) -> None:
        """Copy `entry`'s weights into a free slot of its kind (the least recently released one not holding a
        block in `protect`)."""
        pool = self._pool(entry.kind)
        free = [s for s, owner in enumerate(pool.owner) if owner is None]
        if not free:  # take a slot from a block not protected (released ones are None already)
            free = [s for s, owner in enumerate(pool.owner) if owner not in protect]
            if not free:
                raise RuntimeError("block swap: no free slot (SLOTS_PER_KIND too small for the protected blocks)")
            self._evict(self.entries[pool.owner[free[0]]])
        slot = free[0]
        pool.owner[slot] = entry.index
        entry.slot = slot
        self.trace("copy", entry.index)
        buffers = pool.buffers[slot]
        if self.cuda:
            with torch.cuda.stream(self.stream):
                if pool.freed[slot] is not None:
                    self.stream.wait_event(pool.freed[slot])
                for (param, host), buffer in zip(entry.params, buffers):
                    buffer.copy_(host, non_blocking=True)
                entry.ready = torch.cuda.Event()
                entry.ready.record(self.stream)
        else:
            for (param, host), buffer in zip(entry.params, buffers):
                buffer.copy_(host)
        for (param, host), buffer in zip(entry.params, buffers):
            param.data = buffer

    def _evict(self, entry: _Swapped) -> None:
        """Point the block's parameters back at the host copies; its slot may be overwritten once the compute
        stream has passed this point."""
        if entry.slot is None:
            return
        pool = self.pools[entry.kind]
        pool.owner[entry.slot] = None
        pool.freed[entry.slot] = self._event()
        entry.slot, entry.ready = None, None
        self.trace("release", entry.index)
        for param, host in entry.params:
            param.data = host

    def _expected_next(self, index: int) -> int | None:
        """The swapped block expected to enter after `index`. In training the forward pass runs first to last and
        the recomputes in backward last to first; sampling runs first to last at every denoising step."""
        position, last = self.order.index(index), len(self.order) - 1
        if position == last:
            backward = torch.is_grad_enabled()
            if not backward:
                return self.order[0] if last > 0 else None
        elif position == 0:
            backward = False
        else:
            backward = len(self.history) >= 2 and self.history[-2] >= self.history[-1]
        nxt = position + (-1 if backward else 1)
        return self.order[nxt] if 0 <= nxt <= last else None

    def enter(self, index: int) -> None:
        """Block `index` (a swapped one) is about to run: its weights on the device, the block before it released
        (unless it is the one expected next), the next one on its way."""
        entry = self.entries[index]
        previous = self.history[-1] if self.history else None
        self.history = (self.history + [index])[-2:]
        upcoming = self._expected_next(index)
        if previous is not None and previous not in (index, upcoming):
            self._evict(self.entries[previous])
        if entry.slot is None:
            self._fetch(entry, protect={index, upcoming})
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(entry.ready)
        if upcoming is not None and self.entries[upcoming].slot is None:
            self._fetch(self.entries[upcoming], protect={index, upcoming})


    def release_all(self) -> None:
        """Every swapped block back to its host copy and the slots given back to the allocator: the denoiser goes
        idle (Wan 2.2's other expert trains now). Slots are made again at the next enter()."""
        for entry in self.entries.values():
            self._evict(entry)
        self.pools, self.history = {}, []


def move_except_swapped(root: torch.nn.Module, device: torch.device, swap: BlockSwap | None,
                        trainable: torch.device | None = None) -> None:
    """Every parameter and buffer of `root` onto `device`, but the swapped blocks' frozen weights (which stay
    in pinned CPU memory until their block runs) and, when `trainable` is given, the trainable (LoRA) weights,
    which go there instead (they never leave the GPU, where the optimizer state is)."""
    keep = {id(p) for entry in swap.entries.values() for p, _ in entry.params} if swap is not None else set()
    for module in root.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in keep:
                param.data = param.data.to(trainable if trainable is not None and param.requires_grad else device)
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to(device)
