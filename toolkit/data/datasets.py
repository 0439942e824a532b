"""Several datasets in one run: each one's settings (data.path and the data section, then data.datasets, each
entry's unset keys taken from the section), and the entries an epoch trains (repeats, or sampling weights).

Entries. An epoch is a list of entry numbers, e = item + k * items (k the k-th time the item comes up in the
epoch), so the data order (order.py) shuffles and batches them like items and an entry's augmentation draws
(its view, its caption edits) differ from one repeat to the next (augment.py seeds them by the entry). With
one dataset, repeats 1 and no weight, the entries are the items: a run with one dataset draws what it drew
before datasets existed.

- repeats (kohya's num_repeats): every item of dataset d comes up repeats_d times an epoch.
- weight: when any dataset sets one, the epoch keeps its size (sum over datasets of items x repeats) and
  dataset d fills round(size x w_d / sum w) of it (a dataset left at 0 weighs 1), passing over its items in a
  new seeded order each pass, so no item comes up twice before every item of its dataset has come up once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from omegaconf import DictConfig, OmegaConf

from toolkit.errors import UserError

MIX_STREAM = 3  # the seed stream of weighted draws (augment.py uses 0 and 1)


@dataclass(frozen=True)
class DatasetSettings:
    """One dataset after inheritance: `section` has every key of the data section (its own path, captions,
    resolution, ...); `label` names its path key in messages."""

    label: str
    section: DictConfig
    resolutions: tuple[int, ...]
    repeats: int
    weight: float
    is_regularization: bool


def dataset_settings(data: Any) -> list[DatasetSettings]:
    """data.path's dataset, then each of data.datasets, with their own keys over the data section's."""
    base = OmegaConf.to_container(data, resolve=True)
    entries = base.pop("datasets", None) or []
    merged = [("data.path", base)]
    merged += [(f"data.datasets[{n}].path", {**base, **{k: v for k, v in entry.items() if v is not None}})
               for n, entry in enumerate(entries)]
    settings = []
    for label, values in merged:
        resolutions = tuple(dict.fromkeys(int(r) for r in values["resolutions"] or [values["resolution"]]))
        if any(r < 64 for r in resolutions):
            raise UserError(f"{label.rsplit('.', 1)[0]}.resolutions: {list(resolutions)} holds a side under 64 px\n"
                            "  fix: give resolutions of at least 64")
        settings.append(DatasetSettings(label, OmegaConf.create(values), resolutions, int(values["repeats"]),
                                        float(values["weight"]), bool(values["is_regularization"])))
    return settings


def named_for(err: UserError, settings: DatasetSettings) -> UserError:
    """A scan's error (which says data.path) naming the dataset's own key, and what a regularisation set is."""
    text = str(err).replace("data.path", settings.label, 1)
    if settings.is_regularization:
        text = text.replace(":", " (regularisation images):", 1)
    return UserError(text)


@dataclass(frozen=True)
class EpochMix:
    """Which entries each epoch trains: `item_dataset` is each item's dataset; repeats and weights per dataset."""

    item_dataset: tuple[int, ...]
    repeats: tuple[int, ...]
    weights: tuple[float, ...]
    seed: int = 0

    @classmethod
    def single(cls, items: int) -> "EpochMix":
        return cls((0,) * items, (1,), (0.0,))

    def members(self) -> list[list[int]]:
        found: list[list[int]] = [[] for _ in self.repeats]
        for item, dataset in enumerate(self.item_dataset):
            found[dataset].append(item)
        return found

    def size(self) -> int:
        """Entries per epoch: every dataset's items x repeats."""
        return sum(len(m) * r for m, r in zip(self.members(), self.repeats))

    def counts(self) -> list[int]:
        """Entries per epoch of each dataset."""
        members = self.members()
        if not any(self.weights):
            return [len(m) * r for m, r in zip(members, self.repeats)]
        weights = [w or 1.0 for w in self.weights]
        return [round(self.size() * w / sum(weights)) for w in weights]

    def entries(self, epoch: int) -> Sequence[int]:
        """The entry numbers of `epoch` (item + k x items), dataset by dataset."""
        n = len(self.item_dataset)
        members = self.members()
        if not any(self.weights):
            if all(r == 1 for r in self.repeats):
                return range(n)
            return [item + k * n for m, r in zip(members, self.repeats) for k in range(r) for item in m]
        out: list[int] = []
        for dataset, (m, count) in enumerate(zip(members, self.counts())):
            rng = np.random.default_rng([self.seed % 2**64, epoch, dataset, MIX_STREAM])
            passes = -(-count // len(m)) if m else 0
            for k in range(passes):
                order = rng.permutation(len(m))
                out += [m[j] + k * n for j in order[:min(len(m), count - k * len(m))]]
        return out


def describe(settings: Sequence[DatasetSettings], mix: EpochMix) -> list[str]:
    """One line per dataset for the data report: its folder, images, resolutions and share of an epoch."""
    lines = []
    counts = mix.counts()
    total = max(1, sum(counts))
    members = mix.members()
    for d, (s, m, count) in enumerate(zip(settings, members, counts)):
        how = f"weight {s.weight or 1.0:g}" if any(mix.weights) else f"repeats {s.repeats}"
        role = ", regularisation (train.prior_loss_weight)" if s.is_regularization else ""
        lines.append(f"dataset {d} ({s.label} = {s.section.path}): {len(m)} items at "
                     f"{'/'.join(map(str, s.resolutions))} px, {how}: {count} of {total} samples an epoch{role}")
    return lines
