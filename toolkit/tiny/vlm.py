"""Tiny vision-language models behind `tiny:qwen25_vl` and `tiny:qwen3_vl`: 2-layer Qwen2.5-VL / Qwen3-VL models
(a 2-block vision tower, the patch merger, a 2-layer language model) with a small BPE tokenizer, Qwen's special
tokens and chat template, and the real image processor (min/max pixels small, so a test image is a few patches)."""

from __future__ import annotations

from pathlib import Path

import torch

# Qwen's chat template, cut to what the data uses: string or list content, image parts as the vision tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "describe the image a red square on a blue background a green circle",
    "what colour is the shape red blue green yellow white black",
    "the picture shows a small square in the middle of the frame",
    "user assistant system question answer",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
PIXELS = {"min_pixels": 32 * 32, "max_pixels": 64 * 64}   # 4 to 16 merged image tokens an image


def write_vlm_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])


def _write(out: Path, model_cls, config_cls, processor_cls, image_processor_cls,
           text: dict, vision: dict) -> None:
    tokenizer = write_vlm_tokenizer(out)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, **text}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, **vision}
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    torch.manual_seed(0)
    model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    patch = vision["patch_size"]
    image_processor = image_processor_cls(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                          size={"shortest_edge": PIXELS["min_pixels"],
                                                "longest_edge": PIXELS["max_pixels"]})
    image_processor.save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)


def write_tiny_qwen25_vl(out: Path) -> None:
    """A tiny Qwen2.5-VL (multimodal rotary sections over a head of 16)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessorPil)

    _write(out, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil,
           text={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
           vision={"window_size": 56, "fullatt_block_indexes": [1]})


def write_tiny_qwen3_vl(out: Path) -> None:
    """A tiny Qwen3-VL (interleaved multimodal rotary; deepstack features from the first vision block)."""
    from transformers import (Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLProcessor)

    _write(out, Qwen3VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLProcessor, Qwen2VLImageProcessorPil,
           text={"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
           vision={"patch_size": 16, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]})
