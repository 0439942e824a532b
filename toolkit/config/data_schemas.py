"""The `data` section's schemas: one per kind of training data (text, images, video clips).

Which one a run gets follows its family (toolkit/config/families.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from omegaconf import MISSING

from toolkit.config.fields import opt


@dataclass
class TextDataSection:
    path: str = opt(MISSING, "Training data: a .jsonl, .json, .parquet or .txt file.")
    format: str = opt("auto", "Sample format: auto (detect from the fields), text, alpaca or chat for "
                      "train.objective=sft; preference (prompt/chosen/rejected: dpo, orpo), unpaired "
                      "(prompt/completion/label: kto) or prompt (prompt: grpo), each plain text or conversational "
                      "(lists of {role, content} messages) as TRL takes them; auto: the objective's.",
                      choices=("auto", "text", "alpaca", "chat", "preference", "unpaired", "prompt"))
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
    caption_dropout: float = opt(0.0, "Probability of training a sample on an empty caption (drawn per sample and "
                                 "epoch; the empty caption's embedding is cached).", minimum=0.0, maximum=1.0)
    shuffle_tags: bool = opt(False, "Shuffle the comma-separated tags of each caption every epoch, after the first "
                             "keep_tokens (kohya's shuffle_caption); text embeddings are then computed every step.")
    keep_tokens: int = opt(0, "Leading tags that shuffle_tags and tag_dropout leave in place (the prepended trigger "
                           "word is always kept).", minimum=0)
    tag_dropout: float = opt(0.0, "Probability of leaving out each tag after keep_tokens (kohya's "
                             "caption_tag_dropout_rate); text embeddings are then computed every step.",
                             minimum=0.0, maximum=1.0)
    random_flip: bool = opt(False, "Train on the horizontally mirrored image (or clip) half of the time; the mirrored "
                            "copy is encoded and cached once, beside the original. Leave off for text, logos and "
                            "subjects whose left and right differ.")
    crop_variants: int = opt(1, "Crops per image within its aspect bucket: 1 takes the centre; N > 1 takes N crops "
                             "evenly spaced along the side that overhangs the bucket (kohya's random_crop), each "
                             "encoded and cached once, and trains on one of them per epoch. The latent cache then "
                             "holds N (2N with random_flip) latents per image.", minimum=1)
    cache_latents: bool = opt(True, "Cache VAE latents to disk.")
    cache_text_embeddings: bool = opt(True, "Cache text-encoder outputs to disk (not with shuffle_tags, tag_dropout "
                                      "or train.train_text_encoder: those compute them every step).")
    bucket_step: Union[int, str] = opt("auto", "Aspect-ratio buckets: sides are multiples of this many pixels "
                                       "(kohya's bucket_reso_steps), or auto: 64 from resolution 512 up, below "
                                       "it resolution / 8 rounded down to a power of two, at least 16 (96 -> 16, 256 "
                                       "-> 32), so that small images are not cut to a coarse grid. Images are never "
                                       "upscaled: one smaller than its bucket goes to a smaller one, and the log names "
                                       "the images the step made much smaller.", minimum=8)
    min_bucket_side: int = opt(0, "Smallest bucket side in pixels; 0 means the bucket step.", minimum=0)
    max_bucket_side: int = opt(0, "Largest bucket side in pixels; 0 means 2 x resolution.", minimum=0)


@dataclass
class VideoDataSection(ImageDataSection):
    num_frames: int = opt(17, "Frames per clip (4k+1: 1, 5, 9, ... 81), taken evenly from each video; shorter "
                          "clips train on the largest 4k+1 they have; images are 1-frame clips.", minimum=1)
