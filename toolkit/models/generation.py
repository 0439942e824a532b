"""How the llm and vlm families generate (GRPO's completions, samples), whatever the training steps run with.

Generation calls the decoder once per new token, each time with a longer KV cache: a new attention shape per token.
Two things the training steps are right to use cost there what they save in a step:
- compiled decoder layers (train.compile) would recompile for each new length and for no_grad: generation runs them
  eagerly (torch.compiler's force_eager stance), as TRL's GRPOTrainer does (generate's disable_compile);
- cuDNN attention, which device.sdpa_backend=auto may put first for the training shapes, builds an execution graph
  for each shape it has not seen (hundreds of milliseconds each: pytorch/pytorch#155958, sgl-project/sglang#4650),
  so a decode would build one per new token: generation leaves it out (flash, memory-efficient or math take the
  calls, PyTorch's own choice among them).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from toolkit.models.base import eval_mode

DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextmanager
def generating() -> Iterator[None]:
    """The block's forwards eager (compiled layers run their Python) and without cuDNN attention; the training's
    compiled code and SDPA priority come back on leaving."""
    with torch.compiler.set_stance("force_eager"), sdpa_kernel(DECODE_ATTENTION):
        yield


class EagerGeneration:
    """train.generation=eager: the trained network itself generates (the LoRA unmerged, a dynamic KV cache), under
    generating()."""

    def __init__(self, network: torch.nn.Module):
        self.network = network

    def width(self, longest: int) -> int:
        return longest

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, **sampling: Any) -> torch.Tensor:
        with eval_mode(self.network), generating():
            return self.network.generate(input_ids=ids, attention_mask=mask, use_cache=True, disable_compile=True,
                                         **sampling)

    def describe(self) -> str:
        return "train.generation=eager: the trained network generates (LoRA unmerged, dynamic KV cache), eagerly"
