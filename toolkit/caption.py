"""`caption FOLDER`: a caption file for each image of a training folder that has none, written by a
vision-language model (transformers' AutoModelForImageTextToText: Qwen2.5-VL, Qwen3-VL), as ai-toolkit,
SimpleTuner and OneTrainer caption their datasets before training.

The folder is read as `train` reads data.path: its images (or, when it has none, those of kohya's `N_name`
subfolders), each caption beside its image under the same name (`cat.png` -> `cat.txt`); an edit pair's reference
(`cat_ref1.png` beside `cat.png`) is an input and gets none. An image that has a caption keeps it; `--replace`
writes new ones and keeps each old caption beside it as `cat.txt.old-<time>` (nothing a user wrote is lost). A
folder described by a metadata.jsonl is refused: its captions live in that file, which this command does not edit.
Each caption is the model's greedy answer to `--prompt` about that one image, with `--prefix` (a trigger word)
before it, written atomically: an interrupted run leaves whole captions, and running it again goes on from there.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from PIL import Image

from toolkit.data.images import IMAGE_EXTS, UNREADABLE, caption_suffix, is_mask_file, kohya_subfolders
from toolkit.data.references import is_reference_file
from toolkit.disk import write_atomic
from toolkit.errors import UserError
from toolkit.train.run_dir import name_aside

DEFAULT_PROMPT = ("Write a caption for this image as one paragraph of plain sentences, for training an image "
                  "model: the main subject and what it looks like, what it is doing, the setting, the composition, "
                  "the lighting and colours, and the style or medium. Describe only what is visible. Do not begin "
                  "with 'This image' or 'The image'.")


@dataclass
class CaptionJob:
    folder: Path
    model: str                        # a Hub id or folder (the command's default: cli.CAPTION_MODEL)
    prompt: str | None = None         # DEFAULT_PROMPT
    prefix: str = ""
    caption_ext: str = ".txt"
    replace: bool = False
    max_new_tokens: int = 160
    max_pixels: int | None = None     # the image processor's own limit when None
    device: str = "auto"
    revision: str | None = None


@dataclass
class CaptionReport:
    written: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)         # images that had a caption (without --replace)
    replaced: list[Path] = field(default_factory=list)     # old captions kept aside (with --replace)
    unreadable: list[str] = field(default_factory=list)    # images PIL cannot read (skipped, as `train` skips them)
    shared: list[str] = field(default_factory=list)        # a second image of one name (cat.jpg beside cat.png)


def images_to_caption(folder: Path) -> list[Path]:
    """The images `train` would read from `folder` (when it has none, its kohya subfolders'), masks left out."""
    if not folder.is_dir():
        raise UserError(f"caption: {folder} is not a folder\n  fix: give the folder of training images (data.path)")
    if (folder / "metadata.jsonl").is_file():
        raise UserError(f"caption: {folder / 'metadata.jsonl'} holds this folder's captions, and this command writes "
                        f"caption files\n  fix: caption a folder of images without a metadata.jsonl, or write the "
                        f"captions into the file's \"text\" fields")
    def images_in(where: Path) -> list[Path]:
        found = [p for p in sorted(where.iterdir())
                 if p.is_file() and p.suffix.lower() in IMAGE_EXTS and not is_mask_file(p)]
        stems = {p.stem for p in found}
        # an edit pair's reference (cat_ref1.png beside cat.png) is an input, never captioned
        return [p for p in found if not (is_reference_file(p) and p.stem.rsplit("_ref", 1)[0] in stems)]

    images = images_in(folder) or [p for name in kohya_subfolders(folder) for p in images_in(folder / name)]
    if not images:
        raise UserError(f"caption: no images ({', '.join(IMAGE_EXTS)}) in {folder}\n  fix: give the folder that "
                        "holds the training images")
    return images


class Captioner:
    """A vision-language model that answers one prompt about one image at a time (greedy, so a caption is the
    same every time it is written)."""

    def __init__(self, job: CaptionJob, log: Callable[[str], None]):
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        from toolkit.data.vision_chat import VisionChatEncoder
        from toolkit.tiny import resolve_model_path

        self.job = job
        self.device = _device(job.device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        path, common = resolve_model_path(job.model), {"revision": job.revision}
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, **common)
            image_processor = AutoImageProcessor.from_pretrained(path, **common)
            self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, **common)
        except (OSError, ValueError) as err:
            raise UserError(f"caption --model: cannot load '{job.model}' as an image-text-to-text model: "
                            f"{str(err).splitlines()[0]}\n  fix: give a Qwen2.5-VL or Qwen3-VL folder or a Hub id you "
                            "can reach") from None
        if self.tokenizer.chat_template is None:
            raise UserError(f"caption --model: '{job.model}' has no chat template\n  fix: use an instruct model")
        if getattr(self.model.config, "image_token_id", None) is None or not hasattr(image_processor, "merge_size"):
            raise UserError(f"caption --model: '{job.model}' is a {type(self.model).__name__}; this command reads "
                            "the Qwen-VL models' image layout (merged patches)\n  fix: use a Qwen2.5-VL or Qwen3-VL "
                            "instruct model (the default, Qwen/Qwen2.5-VL-7B-Instruct)")
        self.model.requires_grad_(False).eval().to(self.device)
        settings = SimpleNamespace(max_seq_len=10**9, train_on_prompt=False, min_pixels=None,
                                   max_pixels=job.max_pixels)
        self.encoder = VisionChatEncoder(self.tokenizer, image_processor, self.model.config.image_token_id, settings)
        self.token_types = "mm_token_type_ids" in inspect.signature(type(self.model).forward).parameters
        log(f"caption: {type(self.model).__name__} from {job.model} on {self.device}")

    @torch.no_grad()
    def __call__(self, image: Path) -> str:
        from toolkit.models.generation import generating

        prompt = self.encoder.prompt(self.job.prompt or DEFAULT_PROMPT, image)
        inputs = {k: v.to(self.device) for k, v in prompt.items()}
        if self.token_types:  # transformers 5: the multimodal positions come from each token's modality
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.encoder.image_token_id).int()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        with generating():
            output = self.model.generate(**inputs, max_new_tokens=self.job.max_new_tokens, do_sample=False,
                                         temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        text = self.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        return " ".join(text.split())


def _device(asked: str) -> torch.device:
    """--device: auto (a GPU when there is one), or a device this machine has."""
    if asked == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(asked)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cuda" and not (
            torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count())):
        raise UserError(f"caption --device {asked}: not a device of this machine\n  fix: auto, cpu, or cuda[:N] with "
                        f"a GPU PyTorch sees ({torch.cuda.device_count()} here)")
    return device


def caption_folder(job: CaptionJob, log: Callable[[str], None],
                   captioner: Callable[[Path], str] | None = None) -> CaptionReport:
    """Caption `job.folder`'s images as the module's note says; `captioner` (image -> text) is built from
    job.model when not given."""
    suffix = caption_suffix(job.caption_ext)
    images = images_to_caption(job.folder)
    report = CaptionReport()
    todo, owner = [], {}
    for image in images:
        caption = image.with_suffix(suffix)
        if caption in owner:  # cat.png and cat.jpg: one cat.txt, which `train` reads for both
            report.shared.append(f"{image.name} (its caption is {owner[caption].name}'s)")
            continue
        owner[caption] = image
        if caption.is_file() and not job.replace:
            report.kept.append(image)
        else:
            todo.append(image)
    if todo:
        captioner = captioner or Captioner(job, log)
    for n, image in enumerate(todo, 1):
        try:
            with Image.open(image) as opened:
                opened.load()
        except UNREADABLE as err:  # skipped, as `train` skips it; the others are still captioned
            report.unreadable.append(f"{image.name} ({str(err).splitlines()[0] if str(err) else type(err).__name__})")
            continue
        text = captioner(image)
        if not text:
            log(f"caption: {image.name}: the model wrote nothing; no caption file written")
            continue
        caption = image.with_suffix(suffix)
        if caption.is_file():
            aside = name_aside(caption, "old")
            caption.rename(aside)
            report.replaced.append(aside)
        write_atomic(caption, f"{job.prefix}{text}\n")
        report.written.append(caption)
        log(f"caption [{n}/{len(todo)}] {caption.name}: {job.prefix}{text}")
    return report


def summary(job: CaptionJob, report: CaptionReport) -> str:
    lines = [f"caption: {len(report.written)} caption files written in {job.folder}"]
    if report.kept:
        lines.append(f"  {len(report.kept)} images kept the caption they had (--replace writes new ones, keeping the "
                     "old ones beside them)")
    if report.replaced:
        lines.append(f"  {len(report.replaced)} earlier captions kept as <name>{job.caption_ext}.old-<time>")
    if report.unreadable:
        lines.append(f"  warning: {len(report.unreadable)} unreadable images skipped: {', '.join(report.unreadable[:5])}")
    if report.shared:
        lines.append(f"  warning: {len(report.shared)} images share a caption file with an image of the same name: "
                     f"{', '.join(report.shared[:5])}; rename one of each pair to caption it apart")
    return "\n".join(lines)
