"""Tiny, deterministic flow-matching pipelines (Flux, SD3, Wan 2.1 / 2.2) in the real diffusers layout.

`tiny:flux`, `tiny:sd3`, `tiny:wan21`, `tiny:wan22` and `tiny:wan22-5b` are written by these functions (see
tiny.py) and load with `FluxPipeline` / `StableDiffusion3Pipeline` / `WanPipeline.from_pretrained`. Each keeps the
real model's structure (text encoders, latent channels, VAE factors, scheduler settings) at a width of 32 or so.
The T5 / UMT5 tokenizers are T5-style Unigram tokenizers built here from the same word list as the CLIP ones.
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.tiny.diffusion import _WORDS, clip_config, keeps_global_rng, write_clip_tokenizer

# Flux.1 and SD3 VAEs (ae.safetensors / sd3 vae): latents are (x - shift_factor) * scaling_factor.
FLUX_VAE_SCALING, FLUX_VAE_SHIFT = 0.3611, 0.1159
SD3_VAE_SCALING, SD3_VAE_SHIFT = 1.5305, 0.0609
WAN22_BOUNDARY_RATIO = 0.875  # Wan 2.2 A14B: the high-noise expert runs while t >= 0.875 * 1000

# Wan 2.2 VAE (TI2V-5B, z_dim 48) per-channel latent statistics, as in Wan-AI/Wan2.2-TI2V-5B-Diffusers.
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]


def write_t5_tokenizer(out: Path, model_max_length: int = 512) -> "T5Tokenizer":  # noqa: F821
    """A T5-style Unigram tokenizer (<pad>=0, </s>=1, <unk>=2, "▁") whose pieces are the _WORDS ("▁red") and
    single characters, so an unknown word is spelled out rather than mapped to <unk>. Returns the tokenizer."""
    from transformers import T5Tokenizer

    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"))
    # Unigram picks the segmentation with the highest summed score: a whole word (-1) beats its letters (-5 each).
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + word, -1.0) for word in dict.fromkeys(_WORDS)]
    vocab += [(c, -5.0) for c in chars]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)
    tokenizer.save_pretrained(out)
    return tokenizer


def t5_config(vocab_size: int, d_model: int, umt5: bool = False):
    """A 2-layer T5 v1.1 / UMT5 encoder config (gated-gelu feed-forward, untied embeddings, no dropout)."""
    from transformers import T5Config, UMT5Config

    config_class = UMT5Config if umt5 else T5Config
    return config_class(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
                        feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                        decoder_start_token_id=0)


def _flow_vae(scaling_factor: float, shift_factor: float):
    """A 16-channel AutoencoderKL with the real x8 downsampling (four levels) and no quant convs, as Flux / SD3."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16, 32, 32),
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         layers_per_block=1, norm_num_groups=8, sample_size=64, use_quant_conv=False,
                         use_post_quant_conv=False, scaling_factor=scaling_factor, shift_factor=shift_factor)


@keeps_global_rng
def write_tiny_flux(out: Path, pipeline: str = "FluxPipeline") -> None:
    """Flux.1-dev layout: CLIP-L-like + T5 encoders, a guidance-distilled transformer (1 double + 1 single block,
    2 heads of 16), a 16-channel VAE and the dynamically shifted flow-matching Euler scheduler (`pipeline`: the
    diffusers class that holds them; FLUX.1 Kontext's has the same components)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel

    write_clip_tokenizer(out / "tokenizer")
    tokenizer = CLIPTokenizer.from_pretrained(out / "tokenizer")
    tokenizer_2 = write_t5_tokenizer(out / "tokenizer_2")
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(clip_config(len(tokenizer), projection=False))
    text_encoder_2 = T5EncoderModel(t5_config(len(tokenizer_2), d_model=32))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64,  # 16 latent channels packed 2x2
        num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32,  # T5 d_model
        pooled_projection_dim=32,  # CLIP pooled output (hidden size)
        guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    vae = _flow_vae(FLUX_VAE_SCALING, FLUX_VAE_SHIFT)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    pipe = getattr(diffusers, pipeline)(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                                        transformer=transformer, image_encoder=None, feature_extractor=None)
    pipe.save_pretrained(out, safe_serialization=True)


def write_tiny_flux_kontext(out: Path) -> None:
    """FLUX.1 Kontext [dev] layout: tiny:flux's components in a FluxKontextPipeline folder."""
    write_tiny_flux(out, "FluxKontextPipeline")


@keeps_global_rng
def write_tiny_sd3(out: Path) -> None:
    """SD3 layout: two CLIP encoders with projections (pooled 32 + 32), T5 (d_model 96, so the concatenated CLIP
    states are zero-padded as in the real model), a 2-block MMDiT (patch 2), a 16-channel VAE, shift 3.0."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel

    write_clip_tokenizer(out / "tokenizer")
    write_clip_tokenizer(out / "tokenizer_2")
    tokenizer = CLIPTokenizer.from_pretrained(out / "tokenizer")
    tokenizer_2 = CLIPTokenizer.from_pretrained(out / "tokenizer_2")
    tokenizer_3 = write_t5_tokenizer(out / "tokenizer_3")
    torch.manual_seed(0)
    text_encoder = CLIPTextModelWithProjection(clip_config(len(tokenizer), projection=True))
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(len(tokenizer_2), projection=True))
    text_encoder_3 = T5EncoderModel(t5_config(len(tokenizer_3), d_model=96))
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, caption_projection_dim=32,  # = heads * head dim
        joint_attention_dim=96,  # T5 d_model; the CLIP states (32 + 32) are padded up to it
        pooled_projection_dim=64,  # both CLIP projections concatenated
        pos_embed_max_size=32)
    vae = _flow_vae(SD3_VAE_SCALING, SD3_VAE_SHIFT)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                    tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                                    text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3)
    pipe.save_pretrained(out, safe_serialization=True)


def wan_transformer(channels: int, in_channels: int | None = None, image_dim: int | None = None):
    """A 2-layer WanTransformer3DModel (2 heads of 12, text_dim 32), the diffusers tests' tiny Wan settings, on
    `channels` latent channels; image-to-video models take `in_channels` (condition channels included) and, for
    Wan 2.1 I2V, cross-attend to image embeddings of width `image_dim`."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=in_channels or channels, out_channels=channels, text_dim=32,
                                 freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=1024, image_dim=image_dim,
                                 added_kv_proj_dim=24 if image_dim else None)  # the inner width, as the real model


def wan21_vae():
    """Wan 2.1 VAE layout (z_dim 16, x8 spatial / x4 temporal, the real per-channel latent statistics), width 8."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def wan_scheduler(flow_shift: float):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                                   flow_shift=flow_shift)


def _write_wan(out: Path, experts: int, vae_factory, channels: int, flow_shift: float, **pipeline_config) -> None:
    """Shared by the Wan writers: UMT5 encoder + tokenizer, `experts` transformers, the given VAE and scheduler."""
    from diffusers import WanPipeline
    from transformers import UMT5EncoderModel

    tokenizer = write_t5_tokenizer(out / "tokenizer")
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(t5_config(len(tokenizer), d_model=32, umt5=True))
    transformer = wan_transformer(channels)
    # Drawn after the first expert from the same stream, so the two experts have different weights.
    transformer_2 = wan_transformer(channels) if experts == 2 else None
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae_factory(),
                       scheduler=wan_scheduler(flow_shift), transformer=transformer, transformer_2=transformer_2,
                       **pipeline_config)
    pipe.save_pretrained(out, safe_serialization=True)


@keeps_global_rng
def write_tiny_wan21(out: Path) -> None:
    """Wan 2.1 T2V layout: UMT5 encoder, one transformer (16 latent channels), Wan 2.1 VAE, UniPC flow_shift 3.0."""
    _write_wan(out, experts=1, vae_factory=wan21_vae, channels=16, flow_shift=3.0)


@keeps_global_rng
def write_tiny_wan22(out: Path) -> None:
    """Wan 2.2 T2V A14B layout: a high-noise `transformer` and a low-noise `transformer_2` (different weights)
    switched at boundary_ratio 0.875, with the Wan 2.1 VAE and UniPC flow_shift 3.0."""
    _write_wan(out, experts=2, vae_factory=wan21_vae, channels=16, flow_shift=3.0,
               boundary_ratio=WAN22_BOUNDARY_RATIO)


def _wan22_vae():
    """Wan 2.2 VAE layout (TI2V-5B): z_dim 48, residual blocks, 2x2 pixel patching (x16 spatial, x4 temporal)."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                            dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                            scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=WAN22_LATENTS_MEAN,
                            latents_std=WAN22_LATENTS_STD)


@keeps_global_rng
def write_tiny_wan22_5b(out: Path) -> None:
    """Wan 2.2 TI2V-5B layout: one transformer on 48 latent channels, the Wan 2.2 VAE, per-token timesteps
    (expand_timesteps) and UniPC flow_shift 5.0 as the TI2V-5B Diffusers repo has."""
    _write_wan(out, experts=1, vae_factory=_wan22_vae, channels=48, flow_shift=5.0, expand_timesteps=True)
