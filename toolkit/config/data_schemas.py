"""The `data` section's schemas: one per kind of training data (text, image + text chats, images, video clips).

Which one a run gets follows its family (toolkit/config/families.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional, Union

from omegaconf import MISSING

from toolkit.config.fields import opt


@dataclass
class TextDataSection:
    path: str = opt(MISSING, "Training data: a .jsonl, .json, .parquet or .txt file.", path="local")
    format: str = opt("auto", "Sample format: auto (detect from the fields), text, alpaca or chat ({role, content} "
                      "messages, or ShareGPT's conversations of {from, value}) for train.objective=sft; preference "
                      "(prompt/chosen/rejected: dpo, orpo), unpaired (prompt/completion/label: kto) or prompt "
                      "(prompt: grpo), each plain text or conversational (lists of {role, content} messages) as TRL "
                      "takes them; auto: the objective's.",
                      choices=("auto", "text", "alpaca", "chat", "preference", "unpaired", "prompt"))
    text_field: str = opt("text", "Field holding the text for the text format.")
    max_seq_len: int = opt(512, "Tokens per sequence; longer samples are truncated.", minimum=8)
    packing: bool = opt(False, "Pack several samples into each sequence (no attention across samples).")
    train_on_prompt: bool = opt(False, "Also compute the loss on prompt/user tokens (alpaca, chat).")
    eval_path: Optional[str] = opt(None, "Held-out data file for eval loss; else eval_fraction of path is held out.",
                                   path="local")
    eval_fraction: float = opt(0.0, "Fraction of the training samples held out for eval when eval_path is unset.",
                               minimum=0.0)


@dataclass
class VisionChatDataSection:
    path: str = opt(MISSING, "Training data: a .jsonl, .json or .parquet file of chats, each {\"messages\": [...], "
                    "\"images\": [...]} (TRL's vision format): a message's content is a string or a list of parts, "
                    "{\"type\": \"text\", \"text\": ...} or {\"type\": \"image\"} (the record's next image; or "
                    "{\"type\": \"image\", \"image\": PATH}). Image paths are taken from the data file's folder.", path="local")
    max_seq_len: int = opt(1024, "Tokens per sequence, image tokens included; longer chats are truncated after their "
                           "last image (one whose images alone are longer is an error).", minimum=8)
    min_pixels: int = opt(0, "Smallest image area the processor resizes to (its min_pixels); 0: the model's "
                          "preprocessor_config.json.", minimum=0)
    max_pixels: int = opt(0, "Largest image area the processor resizes to (its max_pixels: fewer image tokens); 0: "
                          "the model's preprocessor_config.json.", minimum=0)
    train_on_prompt: bool = opt(False, "Also compute the loss on the prompt/user tokens (never on image tokens).")
    eval_path: Optional[str] = opt(None, "Held-out data file for eval loss; else eval_fraction of path is held out.",
                                   path="local")
    eval_fraction: float = opt(0.0, "Fraction of the training samples held out for eval when eval_path is unset.",
                               minimum=0.0)


FILE_DATA_SCHEMAS = (TextDataSection, VisionChatDataSection)
"""Schemas whose data.path (and data.eval_path) is a file, not a folder."""


@dataclass
class DatasetEntry:
    """One more dataset beside the one data.path names (data.datasets); unset keys take the data section's."""

    path: str = opt(MISSING, "Folder of images with same-name captions (or a metadata.jsonl).", path="local")
    resolution: Optional[int] = opt(None, "Training resolution for this dataset; unset: data.resolution.", minimum=64)
    resolutions: Optional[List[int]] = opt(None, "Several training resolutions for this dataset; unset: "
                                           "data.resolutions.")
    caption_ext: Optional[str] = opt(None, "Caption file extension; unset: data.caption_ext.")
    default_caption: Optional[str] = opt(None, "Caption for images without one; unset: data.default_caption.")
    trigger_word: Optional[str] = opt(None, "Trigger word; unset: data.trigger_word.")
    repeats: int = opt(1, "Times each image of this dataset is trained per epoch (kohya's num_repeats).", minimum=1)
    weight: float = opt(0.0, "Share of the samples drawn from this dataset (see data.weight); 0: by repeats.",
                        minimum=0.0)
    is_regularization: bool = opt(False, "Regularisation (prior) images: trained with train.prior_loss_weight, "
                                  "not with output preservation.")
    masked_loss: Optional[bool] = opt(None, "Masks for this dataset's images; unset: data.masked_loss (a "
                                      "dataset without masks trains every pixel at full weight).")


@dataclass
class ImageDataSection:
    path: str = opt(MISSING, "Folder of images with same-name .txt captions (or a metadata.jsonl).", path="local")
    resolution: int = opt(512, "Training resolution (the side of a square of the same area).", minimum=64)
    caption_ext: str = opt(".txt", "Caption file extension (txt, without the dot, works too).")
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
    resolutions: List[int] = opt([], "Train every image at each of these resolutions (ai-toolkit's resolution list; "
                                 "each an item of its own, bucketed and cached at that size; an image smaller than a "
                                 "resolution trains there at its own size, and a size it already has is not "
                                 "repeated); empty: data.resolution alone.")
    repeats: int = opt(1, "Times each image of data.path is trained per epoch (kohya's num_repeats): an epoch holds "
                       "every image of every dataset its dataset's repeats times.", minimum=1)
    weight: float = opt(0.0, "Sampling weight of data.path's dataset. When any dataset sets a weight, an epoch keeps its "
                        "size (every dataset's images x repeats) and dataset d fills round(size x weight_d / the sum "
                        "of weights) of it, passing over its images in a new order each time round (a dataset left "
                        "at 0 then weighs 1); 0 everywhere: by repeats alone.", minimum=0.0)
    is_regularization: bool = opt(False, "data.path holds regularisation (prior) images: trained with "
                                  "train.prior_loss_weight, not with output preservation.")
    balance_regularization: bool = opt(True, "With regularisation datasets (is_regularization) and repeats (no "
                                       "weight), train as many regularisation samples an epoch as training samples "
                                       "(the training datasets' images x repeats), as kohya's sd-scripts does: the "
                                       "regularisation images in order, each with its repeats, until the count is "
                                       "reached (the rest unused), then one more repeat each in order until it is. "
                                       "false: every dataset by its own repeats. Not applied when a dataset sets a "
                                       "weight (the weights set the shares).")
    datasets: List[DatasetEntry] = opt([], "More datasets beside data.path, each a mapping with its own path and any of "
                                       "resolution, resolutions, caption_ext, default_caption, trigger_word, repeats, "
                                       "weight, is_regularization, masked_loss (unset keys: this section's). A `data:` list in the "
                                       "YAML is read as its first entry here and the rest in data.datasets.")
    masked_loss: bool = opt(False, "Weight the loss by a mask per image (white trained, black weighted "
                            "data.mask_min): name.mask.png beside the image, or masks/name.png (data.mask_folder). "
                            "Masks follow their image's bucket, crop and flip and are cached; an image without one "
                            "is an error.")
    mask_min: float = opt(0.0, "Loss weight outside the mask (black); 0 ignores what the mask leaves out.",
                          minimum=0.0, maximum=1.0)
    mask_folder: Optional[str] = opt(None, "Folder of masks named as the images (name.png); unset: masks/ inside "
                                     "each dataset's folder. A mask beside the image (name.mask.png) comes first.", path="local")


@dataclass
class ReferenceImageDataSection(ImageDataSection):
    """Images with reference images (edit / control training: docs/edit.md)."""

    reference_paths: List[str] = opt([], "Folders of reference images (ai-toolkit's control_path, control_path_1 .. "
                                     "_3): reference i of name.png is folder i's image with the stem name. Empty: "
                                     "references/name_ref0.png, name_ref1.png, ... (or references/name.png) inside "
                                     "the dataset folder, else name_ref0.png, name_ref1.png, ... beside the target.", path="local")
    references: Union[int, str] = opt("auto", "References per target: a number (a target with fewer or more is an "
                                      "error naming it), or auto: each target has the ones it has (at least one for "
                                      "the edit families; FLUX.2 trains plain when the dataset has none).",
                                      minimum=1)


FRAME_EXTRACTION_MODES = ("spread", "head", "chunk", "slide", "uniform", "full")

FRAME_EXTRACTION_SETTINGS: dict[str, tuple[str, ...]] = {
    "target_frames": ("head", "chunk", "slide", "uniform"),
    "frame_stride": ("slide",),
    "frame_sample": ("uniform",),
    "max_frames": ("full",),
}
"""The data keys that only some frame_extraction modes read (data/video.py's clip_spans), and those modes. Set to
other than its default where no dataset's mode reads it, a key is a config error (preflight's
unread_frame_settings), as a setting of another train.objective is: it would be ignored. (data.num_frames is read
by every mode: spread's clip length, the others' when target_frames is empty, and the sample length.)"""


def modes_reaching(key: str, frame_extraction: Any, entries: list) -> list[tuple[str, Any]]:
    """(setting, mode) of each data.frame_extraction mode data.<key> reaches: the section's own, and that of each
    data.datasets entry (a mapping) that leaves the key unset and names a mode of its own. Preflight refuses the key
    where none of them reads it; a resumed run settles it (train/resume_unread.py)."""
    return [("data.frame_extraction", frame_extraction)] + [
        (f"data.datasets[{n}].frame_extraction", entry.get("frame_extraction")) for n, entry in enumerate(entries)
        if entry.get(key) is None and entry.get("frame_extraction") is not None]


@dataclass
class VideoDatasetEntry(DatasetEntry):
    """A video family's further dataset: DatasetEntry's keys and how its clips are cut (musubi-tuner sets these per
    dataset); unset keys take the data section's."""

    frame_extraction: Optional[str] = opt(None, "How this dataset's clips are cut (see data.frame_extraction); unset: "
                                          "data.frame_extraction.", choices=FRAME_EXTRACTION_MODES)
    target_frames: Optional[List[int]] = opt(None, "Frames per extracted clip for this dataset, each 4k+1; unset: "
                                             "data.target_frames.")
    frame_stride: Optional[int] = opt(None, "frame_extraction=slide: frames between two clips' starts; unset: "
                                      "data.frame_stride.", minimum=1)
    frame_sample: Optional[int] = opt(None, "frame_extraction=uniform: clips per video and length; unset: "
                                      "data.frame_sample.", minimum=1)
    max_frames: Optional[int] = opt(None, "frame_extraction=full: the most frames a clip takes; unset: "
                                    "data.max_frames.", minimum=1)


@dataclass
class VideoDataSection(ImageDataSection):
    time_compression: ClassVar[int] = 4  # the VAE's: clips train on time_compression k + 1 frames
    datasets: List[VideoDatasetEntry] = opt([], "More datasets beside data.path, each a mapping with its own path and "
                                            "any of resolution, resolutions, caption_ext, default_caption, "
                                            "trigger_word, repeats, weight, is_regularization, masked_loss, and how "
                                            "its clips are cut: frame_extraction, target_frames, frame_stride, "
                                            "frame_sample, max_frames (musubi-tuner's per-dataset keys; unset keys: "
                                            "this section's). A `data:` list in the YAML is read as its first entry "
                                            "here and the rest in data.datasets.")
    num_frames: int = opt(17, "Frames per clip (4k+1: 1, 5, 9, ... 81) under frame_extraction=spread, taken evenly "
                          "from each whole video (ai-toolkit's num_frames with shrink_video_to_frames); shorter "
                          "clips train on the largest 4k+1 they have; images are 1-frame clips.", minimum=1)
    frame_extraction: str = opt("spread", "How clips are cut from each video (musubi-tuner's names): spread: one "
                                "clip of num_frames frames spread over the whole video; head: the first F "
                                "consecutive frames; chunk: back-to-back clips of F frames (a shorter tail is "
                                "dropped); slide: a clip of F frames starting every frame_stride frames; uniform: "
                                "frame_sample clips of F frames with starts spread evenly from the first frame to "
                                "the last start that fits; full: one clip of every frame, at most max_frames, rounded "
                                "down to 4k+1. F is each of target_frames; a video shorter than F gives no clip of F "
                                "(head, chunk, slide, uniform). Clips are bucketed by their frames and size. Each "
                                "entry of data.datasets may set its own (and its own target_frames, frame_stride, "
                                "frame_sample, max_frames); these are the defaults.",
                                choices=FRAME_EXTRACTION_MODES)
    target_frames: List[int] = opt([], "Frames per extracted clip, each 4k+1 (musubi-tuner's target_frames): one "
                                   "or more lengths, each extracted on its own (head, chunk, slide, uniform; an "
                                   "error where no dataset cuts by one of these); empty: [num_frames].")
    frame_stride: int = opt(1, "frame_extraction=slide: frames between the starts of two clips (an error where "
                            "no dataset slides).", minimum=1)
    frame_sample: int = opt(1, "frame_extraction=uniform: clips per video and length (an error where no dataset's "
                            "mode is uniform).", minimum=1)
    max_frames: int = opt(129, "frame_extraction=full: the most frames a clip takes (4k+1 at most; an error "
                          "where no dataset's mode is full).", minimum=1)


@dataclass
class AudioVideoDataSection(VideoDataSection):
    time_compression: ClassVar[int] = 8  # LTX-2's VAE
    audio: Union[bool, str] = opt("auto", "LTX-2: the clips' soundtracks (mp4/mkv/webm/mov audio, cut to the clip's "
                                  "frames) train the audio branch beside the video. auto: clips with a soundtrack "
                                  "train both, clips without one (and images) the video alone; required: a clip "
                                  "without a soundtrack is an error naming it; off (YAML reads it as false): video "
                                  "only (the audio stream is pure noise, outside the loss).",
                                  choices=("auto", "off", "required", False))
