"""Image-to-video data: the start image of each clip, which conditions the model as the pipeline's `image` does.

A clip's start image is an image beside it with the same name (clip.mp4 + clip.png, .jpg, .jpeg or .webp; in
either layout, metadata.jsonl included), else the clip's own first frame. A start image is not a training item
itself, and must have its clip's aspect ratio: it is resized to the clip's resized frame and cut with the clip's
view (crop, flip). Items of one frame (stills, clips under 5 frames) train nothing when their first frame is
the condition: they are skipped and named.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from toolkit.data.augment import View, resized_size
from toolkit.data.images import IMAGE_EXTS, UNREADABLE, file_hash, oriented_size
from toolkit.data.video import ClipItem
from toolkit.errors import UserError

ASPECT_TOLERANCE = 0.02  # a start image's width/height may differ from its clip's by this fraction


def start_image_of(clip: Path) -> Path | None:
    """The image beside `clip` with its name, if there is one."""
    for ext in IMAGE_EXTS:
        for candidate in (clip.with_suffix(ext), clip.with_suffix(ext.upper())):
            if candidate != clip and candidate.is_file():
                return candidate
    return None


def _checked_size(image: Path, clip: ClipItem) -> None:
    from PIL import Image

    try:
        with Image.open(image) as opened:
            opened.load()
            size = oriented_size(opened)
    except UNREADABLE as err:
        raise UserError(f"{image}: the start image of {clip.path.name} cannot be read ({err})\n"
                        "  fix: replace it, or remove it to start from the clip's first frame") from None
    ratio, clip_ratio = size[0] / size[1], clip.size[0] / clip.size[1]
    if abs(ratio / clip_ratio - 1) > ASPECT_TOLERANCE:
        raise UserError(f"{image}: {size[0]}x{size[1]} does not have the aspect ratio of its clip {clip.path.name} "
                        f"({clip.size[0]}x{clip.size[1]}); a start image stands for the clip's first frame\n"
                        "  fix: crop it to the clip's aspect ratio, or remove it to start from the clip's first frame")


def pair_start_images(items: list[ClipItem], log: Callable[[str], None]) -> list[ClipItem]:
    """The clips that train image-to-video, each with its start image (None: its first frame); start images
    and one-frame items leave the list, the latter named in a warning."""
    starts = {it.path: start_image_of(it.path) for it in items if it.bucket[2] > 1}
    used = {image for image in starts.values() if image is not None}
    clips, stills = [], []
    for item in items:
        if item.path in used:
            continue
        if item.bucket[2] == 1:
            stills.append(item.path.name)
            continue
        # a clip cut from later in its video (data.frame_extraction) starts from its own first frame
        image = starts[item.path] if not item.frames or item.frames[0] == 0 else None
        if image is not None:
            _checked_size(image, item)
            item = dataclasses.replace(item, start_image=image, start_hash=file_hash(image))
        clips.append(item)
    if stills:
        log(f"warning: skipped {len(stills)} item(s) of one frame, which teach image-to-video nothing (their frame "
            f"is the condition): {', '.join(stills)}")
    if not clips:
        raise UserError("data.path: no clips of 5 frames or more to train image-to-video on\n"
                        "  fix: add video clips (data.num_frames frames, 4k+1), or set model.task=t2v")
    with_image = sum(it.start_image is not None for it in clips)
    log(f"image-to-video: {len(clips)} clips, {with_image} with their own start image, "
        f"{len(clips) - with_image} starting from their first frame")
    return clips


def load_start_image(item: ClipItem, view: View) -> torch.Tensor:
    """The start image beside the clip, resized to the clip's resized frame and cut and mirrored as the view
    says: CHW in [-1, 1], the same cut as the clip's frames."""
    from PIL import Image, ImageOps

    width, height = item.bucket[:2]
    with Image.open(item.start_image) as opened:
        image = ImageOps.exif_transpose(opened).convert("RGB")
    image = image.resize(resized_size(item.size, (width, height)), Image.Resampling.LANCZOS)
    top, left = view.top_left
    image = image.crop((left, top, left + width, top + height))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1).contiguous()
    return pixels.flip(-1) if view.flip else pixels
