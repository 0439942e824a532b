"""The order batches are drawn in: deterministic per (seed, epoch), resumable at any position.

Items are grouped (aspect-ratio buckets for images, one group for text); a batch never mixes
groups. Each epoch shuffles items within groups, cuts them into global batches (batch_size x
world_size items) and shuffles the batches. With several processes each takes its own contiguous share
of every global batch, so 2 processes x batch b see exactly the items of 1 process x batch 2b, and a run
resumed on another number of processes with the same global batch draws the same items.
The state is (epoch, position), so a resumed run draws exactly the batches it would have drawn.

An epoch's entries come from the dataset (`epoch_entries(epoch)`): its items, or with several datasets their
repeats and weighted draws (datasets.py), entry e standing for item e % items; entries of one epoch are a
function of (seed, epoch), so the state stays (epoch, position).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import numpy as np


def epoch_batches(groups: Sequence[int], batch_size: int, seed: int, epoch: int, shuffle: bool = True,
                  entries: Sequence[int] | None = None) -> list[list[int]]:
    """All batches of one epoch, in order (of `entries`, default every item once; entry e is item e % items, in
    that item's group). The last batch of a group may be smaller."""
    rng = np.random.default_rng([seed, epoch])
    members: dict[int, list[int]] = defaultdict(list)
    for index in range(len(groups)) if entries is None else entries:
        members[groups[index % len(groups)]].append(index)
    batches: list[list[int]] = []
    for group in sorted(members):
        items = members[group]
        if shuffle:
            items = [items[i] for i in rng.permutation(len(items))]
        batches += [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def shard(batch: list[int], world_size: int, rank: int) -> list[int]:
    """This rank's contiguous share of a global batch (sizes differ by at most one). A batch with fewer items
    than processes (the tail of a small bucket) gives each rank one item, repeating items."""
    if len(batch) < world_size:
        return [batch[rank % len(batch)]]
    size, extra = divmod(len(batch), world_size)
    start = rank * size + min(rank, extra)
    return batch[start:start + size + (1 if rank < extra else 0)]



class OrderMismatch(ValueError):
    """A checkpoint's data order that this run cannot continue: `key` (seed, batch_size: the global batch,
    num_items: the data's items) was `before`, is `now`."""

    def __init__(self, key: str, before, now):
        name = "global batch size" if key == "batch_size" else key
        super().__init__(f"data order mismatch on resume: {name} was {before}, now {now}")
        self.key, self.before, self.now = key, before, now

class BatchOrder:
    """Yields this process's batches of item indices forever, epoch after epoch; `state_dict` marks the position."""

    def __init__(self, groups: Sequence[int], batch_size: int, seed: int, shuffle: bool = True,
                 world_size: int = 1, rank: int = 0, entries: Callable[[int], Sequence[int]] | None = None):
        if len(groups) == 0:
            raise ValueError("BatchOrder needs at least one item")
        self.groups = list(groups)
        self.batch_size = batch_size * world_size   # the global batch
        self.seed = seed
        self.shuffle = shuffle
        self.world_size = world_size
        self.rank = rank
        self.entries = entries
        self.epoch = 0
        self.position = 0  # index of the next global batch in this epoch's list
        self._batches = self._epoch(0)

    def _epoch(self, epoch: int) -> list[list[int]]:
        entries = self.entries(epoch) if self.entries is not None else None
        return epoch_batches(self.groups, self.batch_size, self.seed, epoch, self.shuffle, entries)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self._batches = self._epoch(epoch)

    def next_batch(self) -> list[int]:
        """This process's share of the next global batch."""
        if self.position >= len(self._batches):
            self._start_epoch(self.epoch + 1)
        batch = self._batches[self.position]
        self.position += 1
        return shard(batch, self.world_size, self.rank)

    def first_batch(self) -> list[int]:
        """This process's share of the epoch's first global batch (without moving the position)."""
        return shard(self._batches[0], self.world_size, self.rank)

    def largest_global_batch(self) -> int:
        """Items in this epoch's largest global batch: fewer than batch_size x world_size when no group (bucket)
        holds that many."""
        return max(len(b) for b in self._batches)

    def batch_shapes(self) -> set[tuple[int, int]]:
        """(group, items) of every batch this process gets: the distinct shapes its model inputs take."""
        return {(self.groups[b[0] % len(self.groups)], len(shard(b, self.world_size, self.rank))) for b in self._batches}

    def position_state(self) -> tuple[int, int]:
        """(epoch, position): where the next batch comes from, taken cheaply at every step."""
        return self.epoch, self.position

    def rewind(self, position: tuple[int, int]) -> None:
        """Back to a position_state() of this run (the batches of a step that failed are drawn again)."""
        epoch, self.position = position[0], position[1]
        if epoch != self.epoch:
            self._start_epoch(epoch)
            self.position = position[1]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "num_items": len(self.groups), "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        # batch_size is the global batch (per-process batch x processes); older checkpoints ran one process.
        for key in ("seed", "batch_size", "num_items"):
            current = {"seed": self.seed, "batch_size": self.batch_size, "num_items": len(self.groups)}[key]
            if state[key] != current:
                raise OrderMismatch(key, state[key], current)
        self._start_epoch(state["epoch"])
        self.position = state["position"]
