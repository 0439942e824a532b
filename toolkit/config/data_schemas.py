"""The `data` section's schemas: one per kind of training data (text, images, video clips).

Which one a run gets follows its family (toolkit/config/families.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from toolkit.config.fields import opt


@dataclass
class TextDataSection:
    path: str = opt(MISSING, "Training data: a .jsonl, .json, .parquet or .txt file.")
    format: str = opt("auto", "Sample format: auto (detect from the fields), text, alpaca or chat.",
                      choices=("auto", "text", "alpaca", "chat"))
    text_field: str = opt("text", "Field holding the text for the text format.")
    max_seq_len: int = opt(512, "Tokens per sequence; longer samples are truncated.", minimum=8)
    packing: bool = opt(False, "Pack several samples into each sequence (no attention across samples).")
    train_on_prompt: bool = opt(False, "Also compute the loss on prompt/user tokens (alpaca, chat).")
    eval_path: Optional[str] = opt(None, "Held-out data file for eval loss; else eval_fraction of path is held out.")
    eval_fraction: float = opt(0.0, "Fraction of the training samples held out for eval when eval_path is unset.",
                               minimum=0.0)


@dataclass
class ImageDataSection:
    path: str = opt(MISSING, "Folder of images with same-name .txt captions (or a metadata.jsonl).")
    resolution: int = opt(512, "Training resolution (the side of a square of the same area).", minimum=64)
    caption_ext: str = opt(".txt", "Caption file extension.")
    default_caption: str = opt("", "Caption for images that have none.")
    trigger_word: Optional[str] = opt(None, "Replaces [trigger] in captions and prompts; prepended when missing.")
    caption_dropout: float = opt(0.0, "Probability of training on an empty caption.", minimum=0.0)
    shuffle_tags: bool = opt(False, "Shuffle comma-separated tags (after keep_tokens).")
    keep_tokens: int = opt(0, "Leading tags kept in place when shuffle_tags is on.", minimum=0)
    cache_latents: bool = opt(True, "Cache VAE latents to disk.")
    cache_text_embeddings: bool = opt(True, "Cache text-encoder outputs to disk (not with shuffle_tags, caption_dropout "
                                      "or train.train_text_encoder: those compute them every step).")
    bucket_step: int = opt(64, "Aspect-ratio buckets: sides are multiples of this many pixels.", minimum=8)
    min_bucket_side: int = opt(0, "Smallest bucket side in pixels; 0 means bucket_step.", minimum=0)
    max_bucket_side: int = opt(0, "Largest bucket side in pixels; 0 means 2 x resolution.", minimum=0)


@dataclass
class VideoDataSection(ImageDataSection):
    num_frames: int = opt(17, "Frames per clip (4k+1: 1, 5, 9, ... 81), taken evenly from each video; shorter "
                          "clips train on the largest 4k+1 they have; images are 1-frame clips.", minimum=1)
