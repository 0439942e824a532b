"""Reference images on the model side (edit families), composed into an adapter beside its family code: the scan
that finds them (data/references.py), each view's reference pixels, their VAE latents cached with the target's,
and the batch's reference latents for the family's predict, which places them as its pipeline does.

A batch holds reference i of every item as `reference_latents.<i>` ([B, C, h_i, w_i]; items are batched with
others whose references have the same buckets), or, with data.cache_latents off, as `reference.<i>` pixels
encoded at each step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from toolkit.data.references import ReferenceSizing, attach_references, is_reference_file, load_references
from toolkit.data.augment import View
from toolkit.data.images import is_mask_file, load_image_view, scan_images
from toolkit.errors import UserError

LATENTS, PIXELS = "reference_latents.", "reference."


def not_a_target(path) -> bool:
    """Masks and reference images: files beside the targets that do not train themselves."""
    return is_mask_file(path) or is_reference_file(path)


class References:
    """The reference images of a family that conditions on them. `required`: every target needs one (the edit
    families); `encode`: images [B, 3, H, W] in [-1, 1] -> the family's normalised latents."""

    def __init__(self, sizing: ReferenceSizing, encode: Callable[[torch.Tensor], torch.Tensor],
                 to_device: Callable[[torch.Tensor], torch.Tensor], required: bool, data):
        self.sizing, self.encode, self.to_device, self.required = sizing, encode, to_device, required
        if data.reference_paths and data.datasets:
            raise UserError("data.reference_paths: its folders hold data.path's references, and data.datasets adds "
                            "more datasets, whose references they are not\n  fix: put each dataset's references in "
                            "a references/ folder inside it (or beside its images as name_ref0.png, ...) and unset "
                            "data.reference_paths")

    def scan(self, data, log: Callable[[str], None]) -> list:
        """The dataset's targets (reference files are not targets), each with its references."""
        items = scan_images(data, log, skip=not_a_target)
        return attach_references(items, data, self.sizing, log, self.required)

    def load(self, item, view, loaded: dict[str, Any]) -> dict[str, Any]:
        """A loaded target view with its references' pixels (`reference.<i>`), flipped with the target."""
        refs = load_references(item, view.flip) if item.references else []
        return {**loaded, **{f"{PIXELS}{i}": pixels for i, pixels in enumerate(refs)}}

    def encoded(self, loaded: dict[str, Any]) -> dict[str, torch.Tensor]:
        """What the latent cache keeps of a view's references: each one's latents (unbatched)."""
        return {f"{LATENTS}{i}": self.encode(loaded[f"{PIXELS}{i}"][None])[0] for i in range(count(loaded, PIXELS))}

    @staticmethod
    def key_parts(item) -> tuple:
        """What a cached view depends on beyond its target: each reference's content and bucket."""
        return ("references", item.reference_hashes, item.reference_buckets) if item.references else ()

    def latents(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """The batch's reference latents on the device, in order: cached, or encoded now from their pixels."""
        if f"{LATENTS}0" in batch:
            return [self.to_device(batch[f"{LATENTS}{i}"]) for i in range(count(batch, LATENTS))]
        with torch.no_grad():
            return [self.encode(batch[f"{PIXELS}{i}"]) for i in range(count(batch, PIXELS))]


def count(tensors: dict[str, Any], prefix: str) -> int:
    """How many numbered entries `prefix<i>` there are (0, 1, ... without gaps)."""
    n = 0
    while f"{prefix}{n}" in tensors:
        n += 1
    return n


class ReferencedTargets:
    """The data hooks of an adapter whose targets come with their reference images as they are (`self.references`,
    a References): mixed in first, beside the family's own code (Flux Kontext, FLUX.2)."""

    def scan(self, data, log) -> list:
        return self.references.scan(data, log)

    def load_item(self, item, view: View) -> dict[str, Any]:
        return self.references.load(item, view, load_image_view(item, view))

    def encode_view(self, loaded: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {**super().encode_view(loaded), **self.references.encoded(loaded)}

    def latent_key_parts(self, item) -> tuple:
        return self.references.key_parts(item)
