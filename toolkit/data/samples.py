"""A tokenized LLM training sample and the label value the loss ignores (shared by text.py and packing.py)."""

from __future__ import annotations

from dataclasses import dataclass

IGNORE_INDEX = -100  # the label that torch's cross_entropy (and transformers' causal-LM loss) skips


@dataclass
class TokenizedSample:
    input_ids: list[int]
    labels: list[int]
