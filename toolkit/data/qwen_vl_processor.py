"""The Qwen2-VL processor of a Qwen-Image-Edit folder for environments without torchvision.

transformers' Qwen2VLProcessor always builds its video processor, and that needs torchvision, which the toolkit does
not install: loading a Qwen-Image-Edit pipeline would fail before any image is seen. The edit pipelines only call the
processor on text and images, so without torchvision the folder's processor/ is read into `ImageQwen2VLProcessor`:
Qwen2VLProcessor's own code with its image processor and tokenizer, and no video processor. With torchvision, the
pipeline loads its own.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin


class ImageQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without the video processor (text and images only)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def processor_override(model_path: str, revision: str | None = None) -> dict:
    """{"processor": ...} for from_pretrained when torchvision is missing (the pipeline loads its own otherwise)."""
    if importlib.util.find_spec("torchvision") is not None:
        return {}
    from transformers import AutoImageProcessor, AutoTokenizer

    common = dict(subfolder="processor", revision=revision)
    if Path(model_path).is_dir():
        common.pop("subfolder")
        model_path = str(Path(model_path) / "processor")
    return {"processor": ImageQwen2VLProcessor(AutoImageProcessor.from_pretrained(model_path, **common),
                                               AutoTokenizer.from_pretrained(model_path, **common))}
