"""Tiny HunyuanVideo 1.5 pipelines (`tiny:hunyuan15`, `tiny:hunyuan15-i2v`) in the diffusers layout of
hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v / _i2v, loaded by HunyuanVideo15Pipeline /
HunyuanVideo15ImageToVideoPipeline.from_pretrained.

The real structure at a width of 32: a Qwen2.5-VL text model (the pipeline reads its third-last hidden state of a
chat-templated prompt) with a Qwen2 byte-level BPE tokenizer, the ByT5 glyph encoder (a T5 encoder over bytes, for
the quoted text of a prompt) with its ByT5Tokenizer, a HunyuanVideo15Transformer3DModel of 2 dual-stream blocks
(2 heads of 16, RoPE axes 4/6/6) on 32 latent channels + 32 condition channels + 1 mask channel, the causal 3D VAE
(x16 space, x4 time, 32 latent channels), the flow-matching Euler scheduler and classifier-free guidance as the
pipeline's guider. The image-to-video one adds a SigLIP vision encoder and its image processor (the transformer's
image tokens). target_size is 64 (the real one: 640), so the pipeline's default and image-to-video sizes are tiny.
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.tiny.diffusion import keeps_global_rng
from toolkit.tiny.flow import t5_config
from toolkit.tiny.qwen_image import qwen25_vl_config, write_qwen_tokenizer
from toolkit.tiny.vlm import CHAT_TEMPLATE

LATENT_CHANNELS = 32           # the real VAE's
SCHEDULER_SHIFT = 5.0          # the 480p scheduler_config.json's shift
GUIDANCE_SCALE = 6.0           # the guider's default in the 480p folders
TARGET_SIZE = 64               # transformer.config.target_size: the pipeline's default size (real: 640)
SIGLIP_SIZE, SIGLIP_WIDTH = 32, 32   # the tiny image encoder's side and width (real: 384 px, 1152 wide, 729 tokens)
# The words of the pipeline's system message, each made one token of the tiny tokenizer.
_SYSTEM_WORDS = ("You are a helpful assistant Describe the video by detailing following aspects main content and "
                 "theme of color shape size texture quantity text spatial relationships objects Actions events "
                 "behaviors temporal physical movement changes background environment light style atmosphere "
                 "camera angles movements transitions used in").split()


def _vae():
    """The causal 3D VAE with the real compression (x16 space in four levels, x4 time) at widths 8..32."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15(latent_channels=LATENT_CHANNELS, block_out_channels=(8, 16, 32, 64, 64),
                                       layers_per_block=1, spatial_compression_ratio=16, temporal_compression_ratio=4)


def hunyuan15_transformer(image_embed_dim: int = SIGLIP_WIDTH, text_embed_dim: int = 32, text_embed_2_dim: int = 32,
                          task_type: str = "t2v"):
    """2 dual-stream blocks, 2 heads of 16, on latents + condition + mask (2 x 32 + 1 channels)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=2,
        attention_head_dim=16, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
        text_embed_dim=text_embed_dim, text_embed_2_dim=text_embed_2_dim, image_embed_dim=image_embed_dim,
        rope_axes_dim=(4, 6, 6), target_size=TARGET_SIZE, task_type=task_type)


def _siglip():
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(hidden_size=SIGLIP_WIDTH, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=SIGLIP_SIZE, patch_size=8)
    processor = SiglipImageProcessor(size={"height": SIGLIP_SIZE, "width": SIGLIP_SIZE})
    return SiglipVisionModel(config), processor


def _write(out: Path, image_to_video: bool) -> None:
    torch.manual_seed(0)
    write_hunyuan15(out, None, image_to_video=image_to_video)


def write_hunyuan15(out: Path, transformer, text_width: int = 32, glyph_width: int = 32,
                    image_to_video: bool = False) -> None:
    """The pipeline folder around `transformer` (None: the tiny one) with 2-layer text encoders of the widths it
    takes (bench/diffusion_models.py writes the real-shaped transformer with them)."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextModel, T5EncoderModel

    out = Path(out)
    tokenizer = write_qwen_tokenizer(out / "tokenizer", extra_words=tuple(_SYSTEM_WORDS), chat_template=CHAT_TEMPLATE)
    tokenizer_2 = ByT5Tokenizer()
    tokenizer_2.save_pretrained(out / "tokenizer_2")
    text_config = qwen25_vl_config(tokenizer, hidden_size=text_width).text_config
    text_config.num_attention_heads = text_width // 16  # heads of 16: the RoPE sections (2/3/3) span half of one
    text_encoder = Qwen2_5_VLTextModel(text_config)
    text_encoder_2 = T5EncoderModel(t5_config(len(tokenizer_2), d_model=glyph_width))
    if transformer is None:
        transformer = hunyuan15_transformer(task_type="i2v" if image_to_video else "t2v")
    parts = dict(text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                 tokenizer_2=tokenizer_2, transformer=transformer, vae=_vae(),
                 scheduler=FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT),
                 guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE))
    if image_to_video:
        from diffusers import HunyuanVideo15ImageToVideoPipeline

        encoder, processor = _siglip()
        pipe = HunyuanVideo15ImageToVideoPipeline(**parts, image_encoder=encoder, feature_extractor=processor)
    else:
        from diffusers import HunyuanVideo15Pipeline

        pipe = HunyuanVideo15Pipeline(**parts)
    pipe.save_pretrained(out, safe_serialization=True)


@keeps_global_rng
def write_tiny_hunyuan15(out: Path) -> None:
    """HunyuanVideo-1.5-480p_t2v layout: Qwen2.5-VL text model, ByT5, the transformer, the VAE, scheduler, guider."""
    _write(out, image_to_video=False)


@keeps_global_rng
def write_tiny_hunyuan15_i2v(out: Path) -> None:
    """HunyuanVideo-1.5-480p_i2v layout: the text-to-video one plus a SigLIP image encoder and its processor."""
    _write(out, image_to_video=True)
