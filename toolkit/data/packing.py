"""Sequence packing, padding-free: a batch is one row of concatenated samples.

transformers (5.x, masking_utils.find_packed_sequence_indices) builds a block-diagonal causal mask
from `position_ids` when no attention_mask and no KV cache are given: every place where the position
does not grow by one starts a new sample. So a packed batch carries `position_ids` that restart at 0
per sample, no attention_mask, and the model is called with use_cache=False. The first label of each
sample is IGNORE_INDEX: the loss shift would otherwise make the previous sample's last token predict
it, a prediction across samples that the unpacked batch never makes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from toolkit.data.samples import IGNORE_INDEX, TokenizedSample, long_tensor


def pack_greedy(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit in data order: sample indices grouped into packs of at most `capacity` tokens."""
    packs: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        for p, free in enumerate(room):
            if length <= free:
                packs[p].append(index)
                room[p] -= length
                break
        else:
            packs.append([index])
            room.append(capacity - length)
    return packs


def flatten_samples(samples: Sequence[TokenizedSample]) -> dict[str, torch.Tensor]:
    """One row: concatenated input_ids and labels, position_ids restarting at 0 per sample."""
    labels = [long_tensor(sample.labels) for sample in samples]
    for row in labels:
        row[:1] = IGNORE_INDEX
    return {"input_ids": torch.cat([long_tensor(sample.input_ids) for sample in samples]).unsqueeze(0),
            "labels": torch.cat(labels).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(len(sample.input_ids)) for sample in samples]).unsqueeze(0)}


class PackedTextDataset:
    """Items are packs of samples (at most max_seq_len tokens each); a batch of packs becomes one flat row."""

    def __init__(self, samples: list[TokenizedSample], max_seq_len: int):
        self.samples = samples
        self.packs = pack_greedy([len(s.input_ids) for s in samples], max_seq_len)
        self.groups = [0] * len(self.packs)

    def __len__(self) -> int:
        return len(self.packs)

    def epoch_entries(self, epoch: int) -> Sequence[int]:
        return range(len(self))

    def collate(self, indices: Sequence[int], epoch: int = 0) -> dict[str, torch.Tensor]:
        """The batch of `indices` (text is not augmented: `epoch` changes nothing)."""
        return flatten_samples([self.samples[i] for pack in indices for i in self.packs[pack]])

    def largest_batch(self, size: int) -> list[int]:
        """The pack with the most tokens, `size` times (a batch is one row of all its packs' tokens)."""
        tokens = [sum(len(self.samples[i].input_ids) for i in pack) for pack in self.packs]
        return [max(range(len(self.packs)), key=tokens.__getitem__)] * size
