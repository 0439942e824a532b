"""train.checkpoint_offload: the inputs of gradient-checkpointed layers wait in pinned CPU memory between their
forward and their backward, as unsloth's offloaded checkpointing does.

With every layer checkpointed, what a step keeps on the GPU between forward and backward is mostly each layer's
input (on the Llama-3.2-1B shape at 4 x 2048: 16 x 32 MiB). A non-reentrant torch.utils.checkpoint saves exactly
those inputs, and saves them through the saved-tensor hooks active around its call (it enters its own hooks only
after), so hooks around each checkpointed call see the layer's input and, on a GPU, one small CPU tensor of the
checkpoint's own, which stays where it is (tests/test_checkpoint_offload.py, CPU and GPU). Here they copy the
input to pinned memory on a side stream in forward, and in backward bring it back on that stream, the next layer's input (the one before it in forward) fetched while the current one
recomputes, so that the copies overlap the compute.

On the CPU (and for tensors not on a CUDA/HIP device) the hooks keep tensors as they are. Measured on an H200
(Llama-3.2-1B shape, 4 x 2048, every layer checkpointed; bench/llm.py, one run): peak 3.9 GiB instead of 4.3, at
56.9k tokens/s instead of 57.2k. Smaller, not faster, so it stays off unless asked for.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

MIN_BYTES = 1 << 20  # smaller saved tensors stay where they are: the copy would cost more than it frees


class _Offloaded:
    """One saved tensor on its way to pinned memory and back (`previous`: the one saved before it)."""

    def __init__(self, tensor: torch.Tensor, stream, previous: "_Offloaded | None"):
        self.device, self.stream, self.previous = tensor.device, stream, previous
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the values are written
        with torch.cuda.stream(stream):
            self.host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its GPU memory is not reused before the copy has read it
        self.back: torch.Tensor | None = None
        self.ready = None

    def prefetch(self) -> None:
        """Start the copy back to the device on the side stream (after the copy out, on the same stream)."""
        if self.back is not None or self.host is None:
            return
        with torch.cuda.stream(self.stream):
            self.back = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def fetch(self) -> torch.Tensor:
        """The tensor on its device, the compute stream ordered after its copy."""
        self.prefetch()
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self.ready)
        tensor, self.back, self.host = self.back, None, None
        tensor.record_stream(compute)  # allocated on the side stream, used on the compute stream
        return tensor


class InputOffload:
    """Saved-tensor hooks that move checkpointed layers' inputs to pinned CPU memory and back (module docstring);
    `saved` counts what they were given, `moved` what they moved."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last: _Offloaded | None = None
        self.saved = self.moved = 0

    def pack(self, tensor: torch.Tensor):
        self.saved += 1
        if self.stream is None or tensor.device.type != "cuda" or tensor.numel() * tensor.element_size() < MIN_BYTES:
            return tensor
        self.moved += 1
        self.last = _Offloaded(tensor, self.stream, self.last)
        return self.last

    def unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        tensor = packed.fetch()
        if packed.previous is not None:  # the layer before this one runs its backward next
            packed.previous.prefetch()
            packed.previous = None
        return tensor

    @contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


def offloading(checkpoint_fn: Callable, offload: InputOffload) -> Callable:
    """`checkpoint_fn` (a non-reentrant checkpoint) with its saved inputs going through `offload`."""
    def run(*args, **kwargs):
        with offload.hooks():
            return checkpoint_fn(*args, **kwargs)

    return run
