"""Image + text chats for the vlm family: TRL's vision format, rendered with the model's chat template, the images
resized and cut into patches by the model's own image processor.

A record is {"messages": [...], "images": [...]}: each message's content is a string or a list of parts,
{"type": "text", "text": ...} or {"type": "image"} (the record's next image; {"type": "image", "image": PATH} names
its own). The loss covers the assistant turns (header masked, end-of-turn learned), as for the llm family's chats;
image tokens never carry a loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from toolkit.data.records import read_records, where
from toolkit.data.samples import IGNORE_INDEX, long_tensor
from toolkit.data.text import TextDataset, split_eval
from toolkit.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass
class VisionSample:
    input_ids: list[int]
    labels: list[int]
    pixel_values: torch.Tensor | None     # (patches, channels * patch area), the processor's flattened patches
    image_grid_thw: torch.Tensor | None   # (images, 3): each image's grid of patches (time, height, width)


class VisionChatEncoder:
    """One record -> VisionSample, through the tokenizer's chat template and the image processor.

    The processor's image token (<|image_pad|> for Qwen) stands for one image in the rendered text; it is repeated
    once per merged patch of that image (the grid's patches / merge_size^2), as transformers' Qwen2.5-VL and
    Qwen3-VL processors do, so the model finds one token per image feature."""

    def __init__(self, tokenizer, image_processor, image_token_id: int, data_cfg):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(image_token_id)
        self.max_seq_len = data_cfg.max_seq_len
        self.train_on_prompt = data_cfg.train_on_prompt
        size = dict(image_processor.size)
        size = {"shortest_edge": data_cfg.min_pixels or size.get("shortest_edge"),
                "longest_edge": data_cfg.max_pixels or size.get("longest_edge")}
        self.size = size
        self.merge = int(getattr(image_processor, "merge_size", 1))

    def encode(self, record: dict, path: str) -> VisionSample:
        messages, images = vision_conversation(record, path)
        if self.tokenizer.chat_template is None:
            raise UserError(f"{path}: the model's tokenizer has no chat template\n  fix: use an instruct model")
        full = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start, end = self.render(messages[:i], add_generation_prompt=True), self.render(messages[: i + 1])
            if not (full.startswith(start) and full.startswith(end)):
                raise UserError(f"{where(path, record)}: the chat template renders earlier turns differently once "
                                "later ones follow, so the assistant turns cannot be found\n  fix: use a model whose "
                                "template renders each turn once")
            spans.append((len(start), len(end)))
        pixel_values = grid = None
        tokens_per_image: list[int] = []
        if images:
            processed = self.image_processor(images=[self.open_image(p, record, path) for p in images],
                                             size=self.size, return_tensors="pt")
            pixel_values, grid = processed["pixel_values"], processed["image_grid_thw"]
            tokens_per_image = [int(g.prod()) // self.merge ** 2 for g in grid]
        if full.count(self.image_token) != len(images):
            raise UserError(f"{where(path, record)}: the template wrote {full.count(self.image_token)} image tokens "
                            f"for {len(images)} images\n  fix: give each image part of the messages one image")
        input_ids, labels = self.tokenize(full, spans, tokens_per_image)
        if len(input_ids) > self.max_seq_len:
            last_image = max((i for i, t in enumerate(input_ids) if t == self.image_token_id), default=-1)
            if last_image >= self.max_seq_len:
                raise UserError(f"{where(path, record)}: {last_image + 1} tokens up to its last image, more than "
                                f"data.max_seq_len={self.max_seq_len}\n  fix: raise data.max_seq_len, or lower "
                                "data.max_pixels (fewer tokens an image)")
            input_ids, labels = input_ids[: self.max_seq_len], labels[: self.max_seq_len]
        if all(label == IGNORE_INDEX for label in labels[1:]):
            raise UserError(f"{where(path, record)}: no assistant token within data.max_seq_len="
                            f"{self.max_seq_len}\n  fix: raise data.max_seq_len")
        return VisionSample(input_ids, labels, pixel_values, grid)

    def prompt(self, text: str, image: Path | None) -> dict[str, torch.Tensor]:
        """generate()'s inputs for one user turn (the image first, when given), ready for the assistant's answer."""
        content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": text}]
        rendered = self.render([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs: dict[str, torch.Tensor] = {}
        tokens_per_image = []
        if image:
            processed = self.image_processor(images=[self.open_image(image, {}, "sample.images")], size=self.size,
                                             return_tensors="pt")
            inputs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
            tokens_per_image = [int(g.prod()) // self.merge ** 2 for g in processed["image_grid_thw"]]
        ids, _ = self.tokenize(rendered, [], tokens_per_image)
        input_ids = torch.tensor([ids])
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **inputs}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def tokenize(self, text: str, spans: list[tuple[int, int]], tokens_per_image: list[int]) -> tuple[list, list]:
        """Token ids of `text` cut at the assistant spans' edges (each piece tokenized on its own, images expanded),
        and their labels: the ids inside a span (everywhere with train_on_prompt), never an image token."""
        cuts = sorted({0, len(text), *(edge for span in spans for edge in span)})
        images = iter(tokens_per_image)
        input_ids: list[int] = []
        labels: list[int] = []
        for begin, end in zip(cuts, cuts[1:]):
            piece = text[begin:end]
            first, *rest = piece.split(self.image_token)
            expanded = first + "".join(self.image_token * next(images) + after for after in rest)
            ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
            learned = self.train_on_prompt or any(s <= begin and end <= e for s, e in spans)
            input_ids += ids
            labels += [i if learned and i != self.image_token_id else IGNORE_INDEX for i in ids]
        return input_ids, labels

    @staticmethod
    def open_image(file: Path, record: dict, path: str):
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(file) as image:
                return image.convert("RGB")
        except (FileNotFoundError, UnidentifiedImageError, OSError) as err:
            raise unreadable_image(file, err.__class__.__name__, record, path) from None


def vision_messages(record: dict, path: str) -> tuple[list[dict], list[Path]]:
    """The messages as the chat template takes them (image parts as {"type": "image"}) and the image files in
    the order their parts come."""
    messages, listed = record.get("messages"), record.get("images") or []
    if not isinstance(messages, list) or not messages or not isinstance(listed, list):
        keys = sorted(k for k in record if k != "__line__")
        raise UserError(f"{where(path, record)}: a vision chat record needs 'messages' (a non-empty list) and "
                        f"optionally 'images' (a list of paths); found keys {keys}\n  fix: write it as "
                        "{\"messages\": [...], \"images\": [\"a.png\"]} (TRL's vision format)")
    folder = Path(path).parent
    listed = iter(listed)
    out, images = [], []
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise UserError(f"{where(path, record)}: each message needs a 'role' and a 'content'\n  fix: give "
                            "each message a string 'role' (user, assistant, system) and its 'content'")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        parts = []
        for part in content if isinstance(content, list) else [None]:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                name = part.get("image") or next(listed, None)
                if not isinstance(name, str):
                    raise UserError(f"{where(path, record)}: more image parts than images\n  fix: list one path "
                                    "in 'images' for each {\"type\": \"image\"} part")
                images.append(folder / name)
                parts.append({"type": "image"})
            else:
                raise UserError(f"{where(path, record)}: a content part must be {{\"type\": \"text\", \"text\": "
                                f"...}} or {{\"type\": \"image\"}}, got {part!r}\n  fix: write the content as "
                                "a string, or as a list of such parts")
        out.append({"role": message["role"], "content": parts})
    if next(listed, None) is not None:
        raise UserError(f"{where(path, record)}: more images than image parts in the messages\n  fix: add a "
                        "{\"type\": \"image\"} part where each image belongs")
    return out, images


def vision_conversation(record: dict, path: str) -> tuple[list[dict], list[Path]]:
    """vision_messages, with an assistant turn to learn from."""
    messages, images = vision_messages(record, path)
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where(path, record)}: the conversation has no assistant turn to learn from\n  fix: "
                        "add the assistant's answer, or leave the record out")
    return messages, images


def check_vision_record(record: dict, path: str) -> None:
    """Raise the UserError VisionChatEncoder.encode would raise for the record itself, without the tokenizer or the
    image processor (the preflight reads every record of the data with it before the run folder is made): its
    messages and image parts, an assistant turn, image files that are there (decoding them waits for the encoder)."""
    for file in vision_conversation(record, path)[1]:
        if not file.is_file():
            raise unreadable_image(file, "IsADirectoryError" if file.is_dir() else "FileNotFoundError", record, path)


def unreadable_image(file: Path, why: str, record: dict, path: str) -> UserError:
    return UserError(f"{where(path, record)}: cannot read image {file}: {why}\n  fix: give an image file "
                     f"({', '.join(IMAGE_SUFFIXES)}) relative to the data file's folder")


class VisionChatDataset(TextDataset):
    """Encoded chats (a TextDataset's samples, with their images); collate pads the tokens on the right and
    concatenates the batch's image patches."""

    def collate(self, indices: Sequence[int], epoch: int = 0) -> dict[str, Any]:
        """The batch of `indices` (no augmentation: `epoch` changes nothing)."""
        batch = [self.samples[i] for i in indices]
        width = max(len(s.input_ids) for s in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, sample in enumerate(batch):
            n = len(sample.input_ids)
            input_ids[row, :n], labels[row, :n] = long_tensor(sample.input_ids), long_tensor(sample.labels)
            attention_mask[row, :n] = 1
        out = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
        with_images = [s for s in batch if s.pixel_values is not None]
        if with_images:
            out["pixel_values"] = torch.cat([s.pixel_values for s in with_images])
            out["image_grid_thw"] = torch.cat([s.image_grid_thw for s in with_images])
        return out

    def largest_batch(self, size: int) -> list[int]:
        """The sample with the most tokens (and patches), `size` times."""
        def weight(i: int) -> tuple[int, int]:
            s = self.samples[i]
            return len(s.input_ids), 0 if s.pixel_values is None else s.pixel_values.shape[0]
        return [max(range(len(self.samples)), key=weight)] * size


@dataclass
class VisionChatData:
    train: VisionChatDataset
    eval: VisionChatDataset | None


def build_vision_chat_data(data_cfg, encoder: VisionChatEncoder, pad_token_id: int, seed: int) -> VisionChatData:
    """Read and encode data.path (and data.eval_path, or hold out data.eval_fraction of it)."""
    def load(path: str, key: str) -> list[VisionSample]:
        return [encoder.encode(record, path) for record in read_records(path, key=key)]

    samples = load(data_cfg.path, "data.path")
    eval_samples = None
    if data_cfg.eval_path:
        eval_samples = load(data_cfg.eval_path, "data.eval_path")
    elif data_cfg.eval_fraction > 0:
        samples, eval_samples = split_eval(samples, data_cfg.eval_fraction, seed)
    return VisionChatData(VisionChatDataset(samples, pad_token_id),
                          VisionChatDataset(eval_samples, pad_token_id) if eval_samples else None)
