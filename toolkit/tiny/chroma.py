"""A tiny, deterministic Chroma pipeline (`tiny:chroma`) in the diffusers layout of lodestones/Chroma1-HD.

It loads with `ChromaPipeline.from_pretrained` and keeps the real model's structure at a width of 32: a T5 encoder
alone (Chroma dropped Flux's CLIP; its pipeline encodes with the tokenizer's attention mask and keeps one padding
token unmasked), a T5-style Unigram tokenizer, a ChromaTransformer2DModel with 1 double-stream and 1 single-stream
block (2 heads of 16, RoPE axes 4/6/6) whose modulation comes from the distilled guidance approximator (no
per-block modulation layers, no guidance or pooled-text input), the 16-channel Flux VAE, and Flux's dynamically
shifted flow-matching scheduler, as Chroma1-HD's scheduler_config.json has it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.tiny.diffusion import keeps_global_rng
from toolkit.tiny.flow import FLUX_VAE_SCALING, FLUX_VAE_SHIFT, _flow_vae, t5_config, write_t5_tokenizer

# lodestones/Chroma1-HD scheduler/scheduler_config.json: Flux's resolution-dependent shift.
CHROMA_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def chroma_transformer(in_channels: int = 64, joint_attention_dim: int = 32):
    """A 1 double + 1 single block ChromaTransformer2DModel (2 heads of 16); the approximator takes 16 channels (4
    each of timestep, guidance and twice 4 of the modulation index, as 64 = 16 x 4 in the real one), 2 layers of 32."""
    from diffusers import ChromaTransformer2DModel

    return ChromaTransformer2DModel(patch_size=1, in_channels=in_channels, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=2,
                                    joint_attention_dim=joint_attention_dim, axes_dims_rope=(4, 6, 6),
                                    approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=2)


@keeps_global_rng
def write_tiny_chroma(out: Path) -> None:
    """Chroma1-HD layout: T5 encoder (d_model 32 = joint_attention_dim), a transformer of 1 double + 1 single block
    on 2x2-packed 16-channel latents, the Flux VAE and the dynamically shifted flow-matching Euler scheduler."""
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler
    from transformers import T5EncoderModel

    out = Path(out)
    tokenizer = write_t5_tokenizer(out / "tokenizer")
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(t5_config(len(tokenizer), d_model=32))
    transformer = chroma_transformer()  # 16 latent channels packed 2x2
    vae = _flow_vae(FLUX_VAE_SCALING, FLUX_VAE_SHIFT)
    scheduler = FlowMatchEulerDiscreteScheduler(**CHROMA_SCHEDULER)
    pipe = ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer, image_encoder=None, feature_extractor=None)
    pipe.save_pretrained(out, safe_serialization=True)
