"""Masked loss (data.masked_loss): a mask per image weighs the loss per latent pixel, white trained, black at
data.mask_min.

Where a mask is: `name.mask.<ext>` beside the image first, else `<mask folder>/name.<ext>` (data.mask_folder,
default masks/ in the dataset's folder), any image extension. A mask is cut exactly as its image (the same
resize to cover the bucket, the same crop offset, mirrored with it: load_mask), kept as 8-bit grey at the
bucket's size in the mask cache, and brought to the latents' grid when the loss is taken (`loss_weights`: the
area average of each latent pixel's patch), so a mask edge inside a patch weighs it partly.

The loss is weighted, not renormalised: a sample's loss is the mean over all its latent values of
weight x squared error (kohya's masked_loss and ai-toolkit multiply the same way), so a mask that keeps half
the image gives half the gradient's support and about half the loss.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from toolkit.data.images import IMAGE_EXTS, MASK_SUFFIX, oriented_size
from toolkit.errors import UserError



def find_mask(image: Path, folder: Path, exts: tuple[str, ...]) -> Path | None:
    """The mask of `image`: name.mask.<ext> beside it, else <folder>/name.<ext>; None when neither exists."""
    for ext in exts:
        beside = image.with_name(f"{image.stem}{MASK_SUFFIX}{ext}")
        if beside.is_file():
            return beside
    for ext in exts:
        inside = folder / f"{image.stem}{ext}"
        if inside.is_file():
            return inside
    return None


def missing_masks_error(key: str, missing: list[str], folder: Path) -> UserError:
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    return UserError(f"{key}: data.masked_loss is on and {len(missing)} image(s) have no mask: {shown}\n  fix: add "
                     f"name.mask.png beside each image or name.png in {folder} (white is trained), or set "
                     "data.masked_loss=false")


def check_mask_size(mask: Path, image: Path, mask_size: tuple[int, int], image_size: tuple[int, int]) -> None:
    """A mask must have its image's size (as displayed): it is cut exactly as the image is."""
    if mask_size != image_size:
        raise UserError(f"data.masked_loss: the mask {mask} is {mask_size[0]}x{mask_size[1]} and its image {image.name} "
                        f"is {image_size[0]}x{image_size[1]}\n  fix: save the mask at the image's size")


def mask_pixels(mask_image, bucket: tuple[int, int], top_left: tuple[int, int], flip: bool) -> torch.Tensor:
    """A PIL mask (any mode) as (1, H, W) uint8 at the bucket's size, resized, cut and mirrored as its image."""
    from PIL import Image

    from toolkit.data.augment import resized_size

    grey = mask_image.convert("L")
    new_w, new_h = resized_size(grey.size, bucket)
    if (new_w, new_h) != grey.size:
        grey = grey.resize((new_w, new_h), Image.Resampling.BILINEAR)
    top, left = top_left
    grey = grey.crop((left, top, left + bucket[0], top + bucket[1]))
    mask = torch.from_numpy(np.asarray(grey, dtype=np.uint8).copy())[None]
    return mask.flip(-1) if flip else mask


def loss_weights(masks: torch.Tensor, latent_shape: torch.Size, mask_min: float) -> torch.Tensor:
    """(B, 1, [1,] h, w) loss weights for latents of `latent_shape` from (B, 1, H, W) uint8 masks: mask_min where
    black, 1 where white, each latent pixel the average over its patch."""
    weight = F.interpolate(masks.float() / 255.0, size=tuple(latent_shape[-2:]), mode="area")
    weight = mask_min + (1.0 - mask_min) * weight
    return weight.unsqueeze(2) if len(latent_shape) == 5 else weight


def attach_masks(items: list, dataset, mask_folder: str | None) -> list:
    """`items` of one dataset (datasets.py's DatasetSettings) each with its mask, checked for size; every missing
    mask is named in one error."""
    import dataclasses

    from PIL import Image


    folder = Path(mask_folder) if mask_folder else Path(dataset.section.path) / "masks"
    found, missing = [], []
    for item in items:
        mask = find_mask(item.path, folder, IMAGE_EXTS)
        if mask is None:
            missing.append(item.path.name)
            continue
        with Image.open(mask) as opened:
            check_mask_size(mask, item.path, oriented_size(opened), item.size)
        found.append(dataclasses.replace(item, mask=mask))
    if missing:
        raise missing_masks_error(dataset.label, sorted(set(missing)), folder)
    return found


def load_mask(item, view) -> torch.Tensor:
    """The mask of `item` for `view` (augment.py): (1, H, W) uint8 at the bucket's size."""
    from PIL import Image, ImageOps

    with Image.open(item.mask) as opened:
        mask = ImageOps.exif_transpose(opened)
        return mask_pixels(mask, item.bucket[:2], view.top_left, view.flip)
