"""A tiny Qwen-Image-Edit-2509 pipeline (`tiny:qwen_image_edit`) in the real diffusers layout, loaded with
`QwenImageEditPlusPipeline.from_pretrained`: tiny:qwen_image's transformer, VAE and Qwen2.5-VL text encoder (its
vision tower sees the reference images in the prompt, as in the real model), plus the Qwen2-VL processor the
pipeline reads them with (min/max pixels small, so a reference is 4 to 16 image tokens).

The tokenizer learns the edit template's words too, so the template's system prefix is exactly the pipeline's
`prompt_template_encode_start_idx` (64) tokens long, as with the real tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.tiny.diffusion import keeps_global_rng
from toolkit.tiny.qwen_image import (QWEN_IMAGE_LATENTS_MEAN, QWEN_IMAGE_LATENTS_STD, QWEN_IMAGE_SCHEDULER,
                                     qwen25_vl_config, write_qwen_tokenizer)

# The words of QwenImageEditPlusPipeline's prompt template and its "Picture N:" image prefix.
EDIT_TEMPLATE_WORDS = tuple(("Describe key features input image color shape size texture objects background then "
                             "explain how user's text instruction should alter or modify Generate new that meets "
                             "requirements while maintaining consistency original where appropriate Picture ( ),").split())
EDIT_PIXELS = {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16}


@keeps_global_rng
def write_tiny_qwen_image_edit(out: Path, transformer=None) -> None:
    """`transformer`: another QwenImageTransformer2DModel (bench/diffusion_models.py's real shape): the text encoder
    is then as wide as its joint_attention_dim, with the 7B's heads at a real width."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from toolkit.data.qwen_vl_processor import ImageQwen2VLProcessor

    out = Path(out)
    tokenizer = write_qwen_tokenizer(out / "tokenizer", extra_words=EDIT_TEMPLATE_WORDS)
    # The processor folder as the real one holds it: its image processor beside the tokenizer (Qwen2VLProcessor's
    # constructor would build a video processor, which needs torchvision: qwen_vl_processor.py).
    write_qwen_tokenizer(out / "processor", extra_words=EDIT_TEMPLATE_WORDS)
    image_processor = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, size=EDIT_PIXELS)
    image_processor.save_pretrained(out / "processor")
    processor = ImageQwen2VLProcessor(image_processor, tokenizer)
    torch.manual_seed(0)
    width = 32 if transformer is None else transformer.config.joint_attention_dim
    text_encoder = Qwen2_5_VLForConditionalGeneration(qwen25_vl_config(tokenizer, hidden_size=width,
                                                                       real_heads=width % 128 == 0))
    if transformer is None:
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True],
                                 latents_mean=QWEN_IMAGE_LATENTS_MEAN, latents_std=QWEN_IMAGE_LATENTS_STD)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    pipe = QwenImageEditPlusPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                     processor=processor, transformer=transformer)
    prefix = tokenizer(pipe.prompt_template_encode.split("{}")[0]).input_ids
    if len(prefix) != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(f"tiny Qwen tokenizer: the edit template's prefix is {len(prefix)} tokens, the pipeline "
                           f"drops {pipe.prompt_template_encode_start_idx}")
    pipe.processor = None  # saved above; model_index.json names transformers' class, as the real folder does
    pipe.save_pretrained(out, safe_serialization=True)
    index = json.loads((out / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
