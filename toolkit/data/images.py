"""Image folders for diffusion training: discovery, captions, buckets, and the batch a family trains on.

Two layouts under data.path:
  folder of images, each with a same-name caption file (data.caption_ext, default .txt)
  metadata.jsonl with one {"file_name": ..., "text": ...} per line (the diffusers / HF imagefolder form)
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL.Image import DecompressionBombError

from toolkit.data.augment import Augmentation, View, mirrored_left, resized_size
from toolkit.data.buckets import SHRUNK, bucket_step, bucket_table, choose_bucket, format_bucket_table, shrunk_by_step
from toolkit.data.captions import CaptionRules
from toolkit.data.datasets import EpochMix
from toolkit.data.folder_report import report_captions
from toolkit.errors import UserError
from toolkit.text_files import read_text

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MASK_SUFFIX = ".mask"  # name.mask.png beside name.png: its loss mask (data/masks.py)


def is_mask_file(path: Path) -> bool:
    """A `name.mask.png` file: a mask, never a training image."""
    return Path(path.stem).suffix == MASK_SUFFIX


@dataclass
class ImageItem:
    path: Path
    caption: str                 # after default caption and trigger word (tag shuffle/dropout come per step)
    size: tuple[int, int]        # original (width, height)
    bucket: tuple[int, int]      # training (width, height)
    content_hash: str = ""
    dataset: int = 0             # which dataset (data/datasets.py) it came from
    mask: Path | None = None     # its loss mask (data.masked_loss)
    references: tuple[Path, ...] = ()                  # its reference images (data/references.py), in order
    reference_hashes: tuple[str, ...] = ()
    reference_buckets: tuple[tuple[int, int], ...] = ()  # each reference's (width, height)

    @property
    def group(self) -> tuple:
        """What items of one batch share: the bucket, and their references' buckets (stacked side by side)."""
        return (self.bucket, self.reference_buckets)


def caption_rules(data) -> CaptionRules:
    return CaptionRules(trigger_word=data.trigger_word, default_caption=data.default_caption,
                        caption_dropout=data.caption_dropout, shuffle_tags=data.shuffle_tags,
                        keep_tokens=data.keep_tokens, tag_dropout=data.tag_dropout)


def caption_suffix(caption_ext: str) -> str:
    """data.caption_ext as a suffix: written without its dot (ai-toolkit's `txt`), it gets one."""
    return caption_ext if caption_ext.startswith(".") else f".{caption_ext}"


def captioned_files(root: Path, caption_ext: str, exts: tuple[str, ...] = IMAGE_EXTS,
                    skip: Callable[[Path], bool] = is_mask_file) -> list[tuple[Path, str | None]]:
    """(file, caption text or None) from metadata.jsonl, else every file with a suffix in `exts` that is not
    `skip`ped (masks; the reference images of the families that take them)."""
    caption_ext = caption_suffix(caption_ext)
    metadata = root / "metadata.jsonl"
    if metadata.is_file():
        pairs = []
        for n, line in enumerate(read_text(metadata, "data.path").split("\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                file, text = root / record["file_name"], record.get("text", record.get("caption"))
                if not isinstance(record["file_name"], str) or not isinstance(text, (str, type(None))):
                    raise TypeError("file_name and text must be strings")
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"{metadata}:{n}: expected a JSON object with file_name and text (or caption), "
                                "strings\n"
                                '  fix: write lines like {"file_name": "0001.png", "text": "a red circle"}') from None
            pairs.append((file, text))
        return pairs
    pairs = []
    for path in sorted(p for p in root.iterdir() if p.suffix.lower() in exts and not skip(p)):
        caption_file = path.with_suffix(caption_ext)
        pairs.append((path, read_text(caption_file, "data.path") if caption_file.is_file() else None))
    return pairs


def kohya_subfolders(root: Path) -> list[str]:
    """The subfolders of `root` named as kohya's DreamBooth layout names them (`10_sks shape`: repeats, then the
    class and trigger words)."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and re.fullmatch(r"\d+_.+", p.name))


def _unlisted(root: Path, pairs: list[tuple[Path, str | None]], exts: tuple[str, ...],
              skip: Callable[[Path], bool]) -> list[str]:
    """With a metadata.jsonl: the files of the folder it leaves out (without one, every file is read)."""
    if not (root / "metadata.jsonl").is_file():
        return []
    listed = {path.name for path, _ in pairs}
    return sorted(p.name for p in root.iterdir() if p.suffix.lower() in exts and not skip(p) and p.name not in listed)


def _image_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        image.load()  # decode fully: a truncated file fails here, not in the middle of training
        return oriented_size(image)


def oriented_size(image) -> tuple[int, int]:
    """(width, height) of a PIL image as displayed, after its EXIF orientation (90-degree turns swap them)."""
    orientation = image.getexif().get(0x0112, 1)
    w, h = image.size
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


def warn_skipped(log: Callable[[str], None], root: Path, noun: str, unreadable: list[str], small: list[str],
                 step: int) -> None:
    """One warning line each for the unreadable files and the ones under one bucket step, naming them."""
    if unreadable:
        log(f"warning: skipped {len(unreadable)} unreadable {noun}(s) in {root}: {', '.join(unreadable)}")
    if small:
        log(f"warning: skipped {len(small)} {noun}(s) smaller than {step} px: {', '.join(small)}")


# What Pillow and PyAV raise for a corrupt or truncated file (Pillow's GIF reader: IndexError; its header parsers:
# struct.error; a header that claims billions of pixels: DecompressionBombError): skipped and named, not fatal.
UNREADABLE = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, DecompressionBombError)


def file_hash(path: Path) -> str:
    """The first 32 hex digits of the file's sha256 (read in 1 MiB chunks): the key of its cached latents."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:32]


def scan_folder(data, log: Callable[[str], None], noun: str, exts: tuple[str, ...],
                probe: Callable[[Path], tuple[tuple[int, int], Any]], kinds: str = "images",
                add: str = "add .png/.jpg/.webp images", report: bool = True,
                skip: Callable[[Path], bool] = is_mask_file) -> list[tuple]:
    """(file, caption, size, extra, bucket) for each file under data.path with a suffix in `exts` that fits a bucket.

    `probe(file)` gives the displayed (width, height) and anything else the caller keeps (`extra`); the caption
    has the default caption and trigger word applied; the bucket is (width, height). Unreadable files and files
    under one bucket step are skipped and named in one warning each (`noun`: what a file is called there). None
    usable is a UserError: the files were all too small, or there were no `kinds` to use (`add`: the fix).
    """
    root = Path(data.path)
    rules = caption_rules(data)
    step, why = bucket_step(data.bucket_step, data.resolution)
    table = bucket_table(data.resolution, step, data.min_bucket_side, data.max_bucket_side)
    found, skipped, small, sides = [], [], [], []
    pairs = captioned_files(root, data.caption_ext, exts, skip)
    if report:
        report_captions(root, pairs, caption_suffix(data.caption_ext), rules, noun, log)
        unlisted = _unlisted(root, pairs, exts, skip)
        if unlisted:
            log(f"note: {len(unlisted)} {noun}(s) in {root} not listed in metadata.jsonl, not used: "
                f"{', '.join(unlisted[:5])}{' ...' if len(unlisted) > 5 else ''}")
    for path, raw in pairs:
        try:
            size, extra = probe(path)
        except UNREADABLE as err:
            skipped.append(f"{path.name} ({str(err).splitlines()[0] if str(err) else type(err).__name__})")
            continue
        bucket = choose_bucket(*size, table, step)
        if bucket is None:
            small.append(f"{path.name} ({size[0]}x{size[1]})")
            sides.append(min(size))
            continue
        found.append((path, rules.base(raw), size, extra, bucket))
    if small and not found:
        raise all_too_small(data, step, root, noun, small, max(sides), len(skipped))
    warn_skipped(log, root, noun, skipped, small, step)
    if not found:
        kohya = kohya_subfolders(root)
        fix = (f"this toolkit reads the images of one folder per dataset, with repeats set in the config, not "
               f"kohya's N_name subfolders ({', '.join(kohya[:3])}): set data.path to the subfolder and data.repeats to "
               f"its N (data.datasets, or a `data:` list, for several)" if kohya else
               f"{add} (with same-name {data.caption_ext} captions, or a metadata.jsonl)")
        raise UserError(f"data.path: no usable {kinds} in {root}" + (f" ({len(skipped)} unreadable: "
                        f"{', '.join(skipped[:5])}{', ...' if len(skipped) > 5 else ''})" if skipped else "")
                        + f"\n  fix: {fix}")
    shrunk = shrunk_by_step({path.name: (size, bucket[:2]) for path, _, size, _, bucket in found}, data.resolution)
    if shrunk:
        names = ", ".join(shrunk[:5]) + (f" and {len(shrunk) - 5} more" if len(shrunk) > 5 else "")
        log(f"note: {len(shrunk)} {noun}(s) train at under {SHRUNK:.0%} of the area they could have (their own, at "
            f"most data.resolution={data.resolution} squared): {names}. Buckets are never larger than the {noun} and "
            f"their sides are multiples of {step} px ({why}); a smaller data.bucket_step keeps more of each {noun}")
    return found


def all_too_small(data, step: int, root: Path, noun: str, small: list[str], largest_side: int,
                  unreadable: int) -> UserError:
    """Every readable file is under the smallest bucket side (the bucket step in use, data.bucket_step): the message
    names them, the sides that would train (data.resolution, the step), and a bucket step they would fit."""
    resolution = data.resolution
    shown = ", ".join(small[:5]) + (f", ... ({len(small)} in all)" if len(small) > 5 else "")
    also = f"; {unreadable} more could not be read" if unreadable else ""
    smaller_step = next((s for s in (32, 16, 8) if s < step and s <= largest_side), None)
    lower = f", or let them train in smaller buckets: data.bucket_step={smaller_step}" if smaller_step else ""
    return UserError(f"data.path: every {noun} in {root} is smaller than data.resolution ({resolution} px) and than "
                     f"the smallest bucket side (data.bucket_step: {step} px), so none can train: {shown}{also}"
                     f"\n  fix: use larger {noun}s (at least {step} px a side, about {resolution} px to train at "
                     f"data.resolution){lower}")


def scan_images(data, log: Callable[[str], None], report: bool = True,
                skip: Callable[[Path], bool] = is_mask_file) -> list[ImageItem]:
    """Every readable image under data.path with its caption and bucket; corrupt files are skipped and named
    (`report`: log the caption report, once per folder; `skip`: files that are not training images)."""
    root = Path(data.path)
    if not root.is_dir():
        raise UserError(f"data.path: {root} is not a folder\n  fix: point data.path at a folder of images "
                        f"with same-name {data.caption_ext} captions (or a metadata.jsonl)")
    found = scan_folder(data, log, "image", IMAGE_EXTS, lambda path: (_image_size(path), None), report=report,
                        skip=skip)
    items = [ImageItem(path, caption, size, bucket, file_hash(path)) for path, caption, size, _, bucket in found]
    log(format_bucket_table(Counter(item.bucket for item in items), bucket_step(data.bucket_step, data.resolution)[1]))
    return items


def load_pixels(item: ImageItem, view: View | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
    """The image resized to cover its bucket and cut to it (centred, or at the view's offset, mirrored when the
    view says so): CHW in [-1, 1], and the cut's (top, left) in the resized image as the model sees it (mirrored
    with the pixels, as SDXL's crop conditioning expects)."""
    from PIL import Image, ImageOps

    with Image.open(item.path) as opened:
        image = ImageOps.exif_transpose(opened).convert("RGB")
    image, (top, left) = cover_and_crop(image, item.bucket, view.top_left if view else None)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1).contiguous()
    if view is not None and view.flip:
        return pixels.flip(-1), (top, mirrored_left(left, item.size, item.bucket))
    return pixels, (top, left)


def cover_and_crop(image, bucket: tuple[int, int], top_left: tuple[int, int] | None = None):
    """An RGB PIL image resized (Lanczos) to cover bucket (width, height) and cut to it at `top_left` (default:
    centred), and the cut's (top, left)."""
    from PIL import Image

    bw, bh = bucket
    new_w, new_h = resized_size(image.size, bucket)
    if (new_w, new_h) != image.size:
        image = image.resize((new_w, new_h), Image.Resampling.LANCZOS)
    top, left = top_left if top_left is not None else ((new_h - bh) // 2, (new_w - bw) // 2)
    return image.crop((left, top, left + bw, top + bh)), (top, left)


def load_image_view(item: ImageItem, view: View | None = None) -> dict[str, torch.Tensor]:
    """One view of an image as a DiffusionDataset row: its pixels and the cut's (top, left)."""
    pixels, crop = load_pixels(item, view)
    return {"pixels": pixels, "crop": torch.tensor(crop)}


@dataclass
class DiffusionDataset:
    """Items in buckets; a batch holds each item's view (augment.py) as cached latents (with whatever else the
    family cached beside them) or as pixels, and text embeddings (cached) or captions.

    `load(item, view)` reads one view: {"pixels": ..., "crop": (top, left)} and any family extras (the
    start image of image-to-video). `encoded[i][v]` is view v of item i from the latent cache. With cached text
    embeddings and caption dropout, `empty_text` (the embedding of "") stands in for a dropped caption.
    """

    items: list
    rules: CaptionRules
    augment: Augmentation = field(default_factory=Augmentation)
    encoded: list[list[dict[str, torch.Tensor]]] | None = None
    text: list[dict[str, torch.Tensor]] | None = None
    empty_text: dict[str, torch.Tensor] | None = None
    load: Callable[[Any, View], dict[str, torch.Tensor]] = load_image_view
    mix: EpochMix | None = None                       # several datasets: each epoch's entries (datasets.py)
    prior_weights: list[float] | None = None          # each item's loss weight (regularisation datasets)
    masks: list[list[torch.Tensor]] | None = None     # view v of item i's mask, (1, H, W) uint8 (masks.py)
    dop_text: list[dict[str, torch.Tensor]] | None = None  # each item's class-caption embedding (train.dop_class)
    dop_captions: list[str | None] | None = None      # each item's class caption; None: no preservation for it
    groups: list[int] = field(init=False)
    views: list[list[View]] = field(init=False)

    def __post_init__(self) -> None:
        key = [getattr(item, "group", item.bucket) for item in self.items]  # clips have no references
        order = {g: i for i, g in enumerate(sorted(set(key)))}
        self.groups = [order[g] for g in key]
        self.views = [self.augment.views(item.size, item.bucket[:2]) for item in self.items]
        if self.mix is None:
            self.mix = EpochMix.single(len(self.items))

    def __len__(self) -> int:
        return len(self.items)

    def epoch_entries(self, epoch: int) -> Sequence[int]:
        """The epoch's entries (entry e: item e % len(self)): every item once, or several datasets' mix."""
        return self.mix.entries(epoch)

    def largest_batch(self, size: int) -> list[int]:
        """An item of the largest bucket (width x height, x frames for clips), `size` times."""
        return [max(range(len(self.items)), key=lambda i: math.prod(self.items[i].bucket))] * size

    def collate(self, entries: Sequence[int], epoch: int = 0) -> dict[str, Any]:
        """The batch of `entries` (entry e: item e % len(self)), with each entry's view and caption edits drawn
        for `epoch` (augment.py; seeded by the entry, so repeats of an item draw apart)."""
        batch: dict[str, Any] = {}
        indices = [e % len(self.items) for e in entries]
        picks = [self.augment.draw_view(e, epoch, len(self.views[i])) for e, i in zip(entries, indices)]
        if self.encoded is not None:
            rows = [self.encoded[i][v] for i, v in zip(indices, picks)]
        else:
            rows = [self.load(self.items[i], self.views[i][v]) for i, v in zip(indices, picks)]
        for key in rows[0]:
            if key != "crop":
                batch[key] = torch.stack([row[key] for row in rows])
        rngs = [self.augment.caption_rng(e, epoch) for e in entries]
        dropped = [self.rules.dropped(rng) for rng in rngs] if self.text is not None else None
        if self.text is not None:
            texts = [self.empty_text if drop else self.text[i] for i, drop in zip(indices, dropped)]
            for key in texts[0]:
                batch[key] = torch.stack([t[key] for t in texts])
        else:
            batch["captions"] = [self.rules.vary(self.items[i].caption, rng) for i, rng in zip(indices, rngs)]
        # Where each item's pixels came from, (B, 2) each, for families that condition on it (SDXL):
        # the file's (height, width), the crop's (top, left) in the resized image, the bucket's (height, width).
        batch["original_size"] = torch.tensor([(self.items[i].size[1], self.items[i].size[0]) for i in indices])
        batch["crop_top_left"] = torch.stack([torch.as_tensor(row["crop"]).long() for row in rows])
        batch["target_size"] = torch.tensor([(self.items[i].bucket[1], self.items[i].bucket[0]) for i in indices])
        if self.masks is not None:
            batch["mask"] = torch.stack([self.masks[i][v] for i, v in zip(indices, picks)])
        if self.prior_weights is not None:
            batch["loss_weight"] = torch.tensor([self.prior_weights[i] for i in indices], dtype=torch.float32)
        if self.dop_captions is not None:
            self._add_preservation(batch, indices)
        # each sample's noise and noise level from a generator of its own (models/sample_draws.py)
        batch["draw_seeds"] = [self.augment.noise_seed(e, epoch) for e in entries]
        return batch

    def _add_preservation(self, batch: dict[str, Any], indices: list[int]) -> None:
        """The class captions (train.dop_class) of the batch: `preserve` (B,) marks the items that have one
        (regularisation images do not); their embeddings under dop.<key>, or their text as dop.captions."""
        batch["preserve"] = torch.tensor([self.dop_captions[i] is not None for i in indices])
        if self.dop_text is not None:
            for key in self.dop_text[indices[0]]:
                batch[f"dop.{key}"] = torch.stack([self.dop_text[i][key] for i in indices])
        else:
            batch["dop.captions"] = [self.dop_captions[i] or "" for i in indices]
