"""Reference images (edit and control training): the images a target is conditioned on, found beside it.

Three layouts, the first that applies to a dataset wins:
  data.reference_paths: [folder, ...]   reference i of `name.png` is folder i's image with the stem `name`
                                         (ai-toolkit's control_path, control_path_1 .. _3)
  references/ inside the dataset folder  references/name_ref0.png, name_ref1.png, ... (or references/name.png alone)
  beside the target                      name_ref0.png, name_ref1.png, ... next to name.png

Any number of references per target, numbered from 0 without gaps. `data.references` says how many each target
has (auto: each has what it has, at least one). A reference file whose target is missing, a gap in the numbers,
a target with fewer references than declared, or one the family cannot take are UserErrors naming the file.

Each reference is cut to its own bucket: its aspect ratio kept, about the family's reference area (data.resolution
squared for the families here), sides multiples of the family's step, as the family's pipeline resizes its images.
A target's view (flip) flips its references too, so an edit stays consistent; crops apply to the target only.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from toolkit.data.images import IMAGE_EXTS, UNREADABLE, cover_and_crop, file_hash, oriented_size
from toolkit.errors import UserError

REFERENCE_FOLDER = "references"
_REF_NAME = re.compile(r"^(?P<stem>.+)_ref(?P<index>\d+)$")


def is_reference_file(path: Path) -> bool:
    """A `name_refN.png` file: a reference of `name.png`, never a training image itself."""
    return _REF_NAME.match(Path(path).stem) is not None


@dataclass(frozen=True)
class ReferenceSizing:
    """How a family's pipeline sizes its reference images: about `area` pixels at the reference's own aspect ratio
    (never larger than the image unless `upscale`), sides rounded to multiples of `multiple`; `floor`: the scaled
    sides truncated and then cut down to a multiple (Flux2Pipeline's int() and `// multiple_of * multiple_of`,
    which keep a reference within the area), instead of rounded to the nearest (Qwen-Image-Edit's
    calculate_dimensions)."""

    multiple: int
    upscale: bool = True
    floor: bool = False
    max_references: int | None = None

    def bucket(self, size: tuple[int, int], area: int) -> tuple[int, int]:
        width, height = size
        if self.upscale or width * height > area:
            scale = math.sqrt(area / (width * height))
            width, height = width * scale, height * scale
        step = self.multiple
        if self.floor:
            return max(step, int(width) // step * step), max(step, int(height) // step * step)
        return max(step, round(width / step) * step), max(step, round(height / step) * step)


def _images_with_stem(folder: Path, stem: str) -> list[Path]:
    return [p for p in (folder / f"{stem}{ext}" for ext in IMAGE_EXTS) if p.is_file()]


def _numbered(folder: Path, stem: str) -> dict[int, Path]:
    """name_refN.* in `folder`, by N; two files with one N (name_ref0.png and name_ref0.jpg) are an error."""
    found: dict[int, Path] = {}
    for path in sorted(folder.glob(f"{glob_escape(stem)}_ref*")):
        match = _REF_NAME.match(path.stem)
        if match is None or match["stem"] != stem or path.suffix.lower() not in IMAGE_EXTS:
            continue
        index = int(match["index"])
        if index in found:
            raise UserError(f"{path}: reference {index} of {stem} is given twice ({found[index].name} and {path.name})"
                            "\n  fix: keep one of them")
        found[index] = path
    return found


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def references_of(target: Path, root: Path, folders: list[Path]) -> list[Path]:
    """The references of `target` (a file under `root`), in order, by the layouts above."""
    stem = target.stem
    if folders:
        refs = []
        for i, folder in enumerate(folders):
            found = _images_with_stem(folder, stem)
            if len(found) > 1:
                raise UserError(f"{folder}: two references for {target.name}: {', '.join(p.name for p in found)}\n"
                                "  fix: keep one image per stem in each reference folder")
            if not found:
                raise UserError(f"{folder}: no reference {i} for {target.name} (expected {stem}.png, .jpg or .webp "
                                f"there: data.reference_paths[{i}])\n  fix: add it, or remove {target.name} from the "
                                "dataset")
            refs.append(found[0])
        return refs
    folder = root / REFERENCE_FOLDER
    numbered = _numbered(folder, stem) if folder.is_dir() else {}
    if not numbered:
        alone = _images_with_stem(folder, stem) if folder.is_dir() else []
        if alone:
            return alone[:1]
        numbered = _numbered(target.parent, stem)
    missing = [i for i in range(max(numbered, default=-1) + 1) if i not in numbered]
    if missing:
        have = ", ".join(p.name for _, p in sorted(numbered.items()))
        raise UserError(f"{target}: its references are numbered with a gap: {stem}_ref{missing[0]} is missing "
                        f"(found {have})\n  fix: number them from 0 without gaps ({stem}_ref0, {stem}_ref1, ...)")
    return [numbered[i] for i in sorted(numbered)]


def orphans(root: Path, targets: set[str]) -> list[str]:
    """name_refN files beside the targets (or in references/) whose target `name` is not a training image."""
    names = []
    for folder in (root, root / REFERENCE_FOLDER):
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                match = _REF_NAME.match(path.stem)
                if match and path.suffix.lower() in IMAGE_EXTS and match["stem"] not in targets:
                    names.append(str(path.relative_to(root)))
    return names


def _reference_size(path: Path, target: Path) -> tuple[int, int]:
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
            return oriented_size(image)
    except UNREADABLE as err:
        raise UserError(f"{path}: a reference of {target.name} cannot be read ({err})\n  fix: replace it") from None


def attach_references(items: list, data, sizing: ReferenceSizing, log: Callable[[str], None],
                      required: bool) -> list:
    """The items, each with its references (paths, content hashes, buckets); a UserError names the first
    missing or odd one. `required`: every target needs at least one (the edit families); else a dataset
    without any reference file trains plain (FLUX.2) and a dataset with some needs them everywhere."""
    if not items:
        return items
    root = Path(data.path)
    folders = [Path(f) for f in data.reference_paths]
    for i, folder in enumerate(folders):
        if not folder.is_dir():
            raise UserError(f"data.reference_paths[{i}]: {folder} is not a folder\n  fix: point it at the folder "
                            "of reference images named as the targets")
    stray = [] if folders else orphans(root, {item.path.stem for item in items})
    if stray:
        shown = ", ".join(stray[:5]) + (f" and {len(stray) - 5} more" if len(stray) > 5 else "")
        raise UserError(f"data.path: reference file(s) without their target image in {root}: {shown}\n  fix: add "
                        "the target (name.png for name_ref0.png), or remove the reference")
    found = {item.path: references_of(item.path, root, folders) for item in items}
    if not required and not any(found.values()):
        return items
    declared = data.references
    counts = Counter(len(refs) for refs in found.values())
    for item in items:
        refs = found[item.path]
        want = declared if declared != "auto" else max(1, len(refs))
        if len(refs) < want:
            expected = (f"data.reference_paths[{len(refs)}]" if folders else
                        f"{item.path.stem}_ref{len(refs)}.png beside it or in {REFERENCE_FOLDER}/")
            why = (f"data.references={declared}" if declared != "auto" else "every target needs at least one"
                   if required else "other targets of this dataset have references, so each needs one")
            raise UserError(f"{item.path}: reference {len(refs)} is missing ({why}; expected {expected})\n  fix: add "
                            "it, or remove the target from the dataset")
        if declared != "auto" and len(refs) > int(declared):
            raise UserError(f"{item.path}: {len(refs)} references, and data.references={declared}\n  fix: set "
                            f"data.references to {len(refs)} (or auto), or remove the extra ones")
        if sizing.max_references is not None and len(refs) > sizing.max_references:
            raise UserError(f"{item.path}: {len(refs)} references; this family's pipeline takes at most "
                            f"{sizing.max_references}\n  fix: keep at most {sizing.max_references} per target")
    area = data.resolution ** 2
    out = []
    for item in items:
        refs = found[item.path]
        buckets = tuple(sizing.bucket(_reference_size(ref, item.path), area) for ref in refs)
        out.append(dataclasses.replace(item, references=tuple(refs), reference_hashes=tuple(map(file_hash, refs)),
                                       reference_buckets=buckets))
    total = sum(len(refs) for refs in found.values())
    per = ", ".join(f"{n} with {k}" for k, n in sorted(counts.items()))
    where = ("data.reference_paths" if folders else f"{REFERENCE_FOLDER}/" if (root / REFERENCE_FOLDER).is_dir()
             else "beside the targets (name_refN)")
    log(f"references: {total} for {len(items)} targets ({per}), from {where}")
    return out


def load_references(item, flip: bool) -> list[torch.Tensor]:
    """Each reference of `item` cut to its bucket (centred), mirrored when the target's view is: CHW in [-1, 1]."""
    from PIL import Image, ImageOps

    pixels = []
    for path, bucket in zip(item.references, item.reference_buckets):
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
        image = cover_and_crop(image, bucket)[0]
        tensor = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1).contiguous()
        pixels.append(tensor.flip(-1) if flip else tensor)
    return pixels


def sample_references(paths: list[list[str]], prompts: list[str], required: bool) -> list[list[Path]]:
    """sample.references checked against the prompts: one list of image paths per prompt (an edit family needs
    one for every prompt); each path must be an image file. Without prompts nothing is sampled, and the
    references are not read."""
    if not prompts:
        return []
    if paths and len(paths) != len(prompts):
        raise UserError(f"sample.references: {len(paths)} lists for {len(prompts)} prompts\n  fix: give one list of "
                        "reference images per prompt, in the order of sample.prompts")
    if required and prompts and (not paths or not all(paths)):
        raise UserError("sample.references: this family edits its references, and a sample prompt has none\n  fix: "
                        "set sample.references: [[ref.png], ...] (one list per prompt), or sample.prompts: []")
    out = []
    for i, refs in enumerate(paths):
        for path in refs:
            if not Path(path).is_file():
                raise UserError(f"sample.references[{i}]: {path} is not a file\n  fix: give the path of an image")
        out.append([Path(p) for p in refs])
    return out


def open_image(path: Path):
    """An image file as the RGB PIL image the pipelines take (EXIF orientation applied)."""
    from PIL import Image, ImageOps

    with Image.open(path) as opened:
        return ImageOps.exif_transpose(opened).convert("RGB")
