"""Tiny image-to-video Wan pipelines in the real diffusers layout (`WanImageToVideoPipeline.from_pretrained`).

`tiny:wan21-i2v` is Wan2.1-I2V-14B-480P-Diffusers' layout: a CLIP vision encoder and its image processor (the
transformer cross-attends to the encoder's penultimate hidden states) and a transformer on 36 input channels (16
noisy latent + 4 mask + 16 start-frame condition). `tiny:wan22-i2v` is Wan2.2-I2V-A14B-Diffusers': two experts
on 36 channels, no image encoder, boundary 0.9. TI2V-5B trains image-to-video from `tiny:wan22-5b` (model.task).
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.tiny.diffusion import keeps_global_rng
from toolkit.tiny.flow import t5_config, wan21_vae, wan_scheduler, wan_transformer, write_t5_tokenizer

I2V_CHANNELS = 16 + 4 + 16          # noisy latents, the mask (one channel per frame of the VAE's 4), the condition
I2V_BOUNDARY_RATIO = 0.9            # Wan 2.2 I2V-A14B: the high-noise expert runs while t >= 0.9 * 1000
CLIP_SIZE, CLIP_WIDTH = 32, 32      # the tiny image encoder's input side and hidden width (the real one: 224, 1280)


def _image_encoder():
    """A 2-layer CLIP ViT (patch 8 over 32 px: 17 tokens of width 32) and its CLIPImageProcessor (resize the short
    side to 32, centre crop, OpenAI's mean and std), as the pipeline's image_encoder / image_processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=CLIP_WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=CLIP_SIZE, patch_size=8, projection_dim=CLIP_WIDTH)
    processor = CLIPImageProcessor(size={"shortest_edge": CLIP_SIZE},
                                   crop_size={"height": CLIP_SIZE, "width": CLIP_SIZE})
    return CLIPVisionModel(config), processor


def _write_wan_i2v(out: Path, experts: int, image_encoder: bool, flow_shift: float, **pipeline_config) -> None:
    from diffusers import WanImageToVideoPipeline
    from transformers import UMT5EncoderModel

    tokenizer = write_t5_tokenizer(out / "tokenizer")
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(t5_config(len(tokenizer), d_model=32, umt5=True))
    encoder, processor = _image_encoder() if image_encoder else (None, None)
    image_dim = CLIP_WIDTH if image_encoder else None
    transformer = wan_transformer(16, in_channels=I2V_CHANNELS, image_dim=image_dim)
    transformer_2 = wan_transformer(16, in_channels=I2V_CHANNELS, image_dim=image_dim) if experts == 2 else None
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=wan21_vae(),
                                   scheduler=wan_scheduler(flow_shift), image_processor=processor,
                                   image_encoder=encoder, transformer=transformer, transformer_2=transformer_2,
                                   **pipeline_config)
    pipe.save_pretrained(out, safe_serialization=True)


@keeps_global_rng
def write_tiny_wan21_i2v(out: Path) -> None:
    """Wan 2.1 I2V layout: UMT5, CLIP vision encoder, one transformer on 36 channels, Wan 2.1 VAE, flow_shift 3.0."""
    _write_wan_i2v(out, experts=1, image_encoder=True, flow_shift=3.0)


@keeps_global_rng
def write_tiny_wan22_i2v(out: Path) -> None:
    """Wan 2.2 I2V-A14B layout: UMT5, high- and low-noise experts on 36 channels (no image encoder), boundary 0.9,
    Wan 2.1 VAE, flow_shift 5.0."""
    _write_wan_i2v(out, experts=2, image_encoder=False, flow_shift=5.0, boundary_ratio=I2V_BOUNDARY_RATIO)
