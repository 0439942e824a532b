"""Augmentation of image and video training data: horizontal flip and crops within the aspect bucket (views of
an item, each encoded and cached once), and the caption edits of captions.py, all drawn deterministically.

Views. An item is resized to cover its bucket (images.py) and cut to the bucket's size; `data.crop_variants`
N > 1 places that cut at N offsets evenly spaced from one edge of the overhang (the part of the resized image
beyond the bucket, along its longer side) to the other, and `data.random_flip` adds each cut mirrored. Every
view is encoded by the VAE once and cached under its own key (offsets and flip in the key), so a step only
picks a cached latent: the latent cache holds N x (2 with flip) latents per item, and the first run's encoding
time grows by the same factor. An item whose aspect ratio is its bucket's has no overhang and one crop.

Why fixed crops, not crops taken on the latent grid of one larger latent: the latent of a crop is not a crop
of the latent (the encoder sees past the crop's borders, so the edges differ), and offsets on the grid are
multiples of 8 or 16 pixels. A few exact encodings cost disk and one-time encoding, and nothing per step.
The mirrored view is encoded from mirrored pixels too: a VAE's latent of a mirrored image is not the mirrored
latent.

Draws. Item i's choices in epoch e (which view; the caption's dropout, shuffle and tag dropout) come from
generators seeded (run.seed, e, i), never from a shared stream: a resumed run (the data order restores the
epoch), a run on another number of processes with the same global batch, and the uncached path all draw the
same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VIEW_STREAM, CAPTION_STREAM = 0, 1
NOISE_STREAM = 4  # the seed of an entry's noise generator (models/sample_draws.py); datasets.py's mix is 3


@dataclass(frozen=True)
class View:
    """One way to present an item: where the bucket-sized cut sits in the resized image, and whether it is
    mirrored. `plain` marks the view without augmentation (the centre crop, unflipped)."""

    top_left: tuple[int, int]
    flip: bool = False
    plain: bool = True

    def key_parts(self) -> tuple:
        """What a cache key adds for this view: nothing for the plain view, so its entries are those of a run
        without augmentation."""
        return () if self.plain else ("view", *self.top_left, self.flip)


def resized_size(size: tuple[int, int], bucket: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of an image of `size` resized to cover `bucket` (width, height), aspect ratio kept."""
    (w, h), (bw, bh) = size, bucket
    scale = max(bw / w, bh / h)
    return max(bw, round(w * scale)), max(bh, round(h * scale))


def centre_offset(size: tuple[int, int], bucket: tuple[int, int]) -> tuple[int, int]:
    """(top, left) of the centred bucket-sized cut of the resized image."""
    new_w, new_h = resized_size(size, bucket)
    return (new_h - bucket[1]) // 2, (new_w - bucket[0]) // 2


def crop_offsets(size: tuple[int, int], bucket: tuple[int, int], count: int) -> list[tuple[int, int]]:
    """(top, left) of `count` cuts evenly spaced across the overhang, both edges included; fewer when the
    overhang has fewer distinct pixel offsets. One cut (count 1) is the centred one."""
    if count == 1:
        return [centre_offset(size, bucket)]
    new_w, new_h = resized_size(size, bucket)
    over_h, over_w = new_h - bucket[1], new_w - bucket[0]
    offsets = [(round(k * over_h / (count - 1)), round(k * over_w / (count - 1))) for k in range(count)]
    return list(dict.fromkeys(offsets))


def mirrored_left(left: int, size: tuple[int, int], bucket: tuple[int, int]) -> int:
    """The left edge of a cut in the mirrored resized image: what SDXL's crop conditioning sees when flipped."""
    return resized_size(size, bucket)[0] - left - bucket[0]


@dataclass(frozen=True)
class Augmentation:
    """The data section's view settings and the run's seed: the views of each item, and each draw."""

    random_flip: bool = False
    crop_variants: int = 1
    seed: int = 0

    @classmethod
    def from_data(cls, data, seed: int) -> "Augmentation":
        return cls(bool(data.random_flip), int(data.crop_variants), int(seed))

    @property
    def flips(self) -> tuple[bool, ...]:
        return (False, True) if self.random_flip else (False,)

    def views(self, size: tuple[int, int], bucket: tuple[int, int]) -> list[View]:
        """Every view training can draw of an item of `size` in `bucket`: crops in order, each unflipped, then
        flipped."""
        centre = centre_offset(size, bucket)
        return [View(offset, flip, plain=offset == centre and not flip)
                for offset in crop_offsets(size, bucket, self.crop_variants) for flip in self.flips]

    def _rng(self, index: int, epoch: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed % 2**64, epoch, index, stream])

    def draw_view(self, index: int, epoch: int, count: int) -> int:
        """Which of item `index`'s `count` views (as `views` lists them) it trains on in `epoch`."""
        flips = len(self.flips)
        crop_u, flip_u = self._rng(index, epoch, VIEW_STREAM).random(2)
        return int(crop_u * (count // flips)) * flips + int(flips == 2 and flip_u < 0.5)

    def caption_rng(self, index: int, epoch: int) -> np.random.Generator:
        """The generator of item `index`'s caption edits in `epoch` (CaptionRules.vary / dropped)."""
        return self._rng(index, epoch, CAPTION_STREAM)

    def noise_seed(self, index: int, epoch: int) -> int:
        """The seed of entry `index`'s noise, noise offset and noise level in `epoch` (models/sample_draws.py)."""
        return int(self._rng(index, epoch, NOISE_STREAM).integers(2**63))
