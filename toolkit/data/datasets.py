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
- balance (data.balance_regularization, repeats only): the regularisation items come up as often in an epoch as
  the training items do (the sum of their items x repeats), by kohya's rule (sd-scripts train_util.py,
  DreamBoothDataset): in order, each regularisation item with its own repeats until the count is reached (the
  rest unused: more regularisation than training images), then one more repeat each, in order, until it is.
"""

from __future__ import annotations

import re
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
    own: frozenset[str] = frozenset()  # the keys a data.datasets entry sets itself (data.path's: none)


def dataset_settings(data: Any) -> list[DatasetSettings]:
    """data.path's dataset, then each of data.datasets, with their own keys over the data section's, except two
    an entry does not inherit: a regularisation entry's trigger word (its images are the class, not the subject:
    kohya's class images and ai-toolkit's reg datasets take no trigger), and data.resolutions where the entry sets
    a `resolution` of its own."""
    base = OmegaConf.to_container(data, resolve=True)
    entries = base.pop("datasets", None) or []
    merged = [("data.path", base, frozenset())]
    for n, entry in enumerate(entries):
        own = {k: v for k, v in entry.items() if v is not None}
        values = {**base, **own}
        if "resolution" in own and "resolutions" not in own:
            values["resolutions"] = []
        if values["is_regularization"] and "trigger_word" not in own:
            values["trigger_word"] = None
        merged.append((f"data.datasets[{n}].path", values, frozenset(k for k in own if k != "path")))
    settings = []
    for label, values, own in merged:
        resolutions = tuple(dict.fromkeys(int(r) for r in values["resolutions"] or [values["resolution"]]))
        if any(r < 64 for r in resolutions):
            raise UserError(f"{label.rsplit('.', 1)[0]}.resolutions: {list(resolutions)} holds a side under 64 px\n"
                            "  fix: give resolutions of at least 64")
        settings.append(DatasetSettings(label, OmegaConf.create(values), resolutions, int(values["repeats"]),
                                        float(values["weight"]), bool(values["is_regularization"]), own))
    return settings


def named_for(err: UserError, settings: DatasetSettings) -> UserError:
    """A scan's error (which says data.path, or data.<key>) naming the dataset's own key (an entry's own setting:
    data.datasets[1].target_frames), and what a regularisation set is."""
    text = str(err).replace("data.path", settings.label, 1)
    entry = settings.label.rsplit(".", 1)[0]
    for key in settings.own:
        text = re.sub(rf"\bdata\.{key}\b", f"{entry}.{key}", text)
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
    regularization: tuple[bool, ...] = ()   # per dataset: is_regularization
    balance: bool = False                   # data.balance_regularization

    @classmethod
    def single(cls, items: int) -> "EpochMix":
        return cls((0,) * items, (1,), (0.0,))

    def members(self) -> list[list[int]]:
        found: list[list[int]] = [[] for _ in self.repeats]
        for item, dataset in enumerate(self.item_dataset):
            found[dataset].append(item)
        return found

    def balances(self) -> bool:
        """Whether the regularisation items are balanced against the training items: asked, by repeats (weights set
        each dataset's share themselves), with items of both kinds."""
        kinds = {self.regularization[d] for d in self.item_dataset} if self.regularization else set()
        return self.balance and not any(self.weights) and kinds == {True, False}

    def item_repeats(self) -> list[int]:
        """Each item's times an epoch: its dataset's repeats, or for a balanced regularisation item kohya's count
        (0: unused)."""
        repeats = [self.repeats[d] for d in self.item_dataset]
        if not self.balances():
            return repeats
        regular = [i for i, d in enumerate(self.item_dataset) if self.regularization[d]]
        target = sum(r for i, r in enumerate(repeats) if not self.regularization[self.item_dataset[i]])
        balanced = {i: 0 for i in regular}
        count, first = 0, True
        while count < target:
            for i in regular:
                added = repeats[i] if first else 1
                balanced[i] += added
                count += added
                if count >= target:
                    break
            first = False
        return [balanced.get(i, r) for i, r in enumerate(repeats)]

    def size(self) -> int:
        """Entries per epoch."""
        return sum(self.counts())

    def counts(self) -> list[int]:
        """Entries per epoch of each dataset."""
        members = self.members()
        if not any(self.weights):
            repeats = self.item_repeats()
            return [sum(repeats[i] for i in m) for m in members]
        size = sum(len(m) * r for m, r in zip(members, self.repeats))
        weights = [w or 1.0 for w in self.weights]
        return [round(size * w / sum(weights)) for w in weights]

    def entries(self, epoch: int) -> Sequence[int]:
        """The entry numbers of `epoch` (item + k x items), dataset by dataset."""
        n = len(self.item_dataset)
        members = self.members()
        if not any(self.weights):
            repeats = self.item_repeats()
            if all(r == 1 for r in repeats):
                return range(n)
            return [item + k * n for m in members for k in range(max((repeats[i] for i in m), default=0))
                    for item in m if k < repeats[item]]
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
    repeats = mix.item_repeats()
    for d, (s, m, count) in enumerate(zip(settings, members, counts)):
        how = f"weight {s.weight or 1.0:g}" if any(mix.weights) else f"repeats {s.repeats}"
        role = ", regularisation (train.prior_loss_weight)" if s.is_regularization else ""
        if s.is_regularization and mix.balances():
            unused = sum(1 for i in m if repeats[i] == 0)
            how += ", balanced with the training images (data.balance_regularization)"
            role += f"; {unused} of its {len(m)} items unused (more than the training images)" if unused else ""
        lines.append(f"dataset {d} ({s.label} = {s.section.path}): {len(m)} items at "
                     f"{'/'.join(map(str, s.resolutions))} px, {how}: {count} of {total} samples an epoch{role}")
    if mix.balance and any(mix.weights) and any(mix.regularization):
        lines.append("data.balance_regularization: not applied: the datasets' weights set each one's share of an epoch")
    return lines
