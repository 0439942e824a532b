"""Real-shaped diffusion pipelines with random weights for bench/diffusion.py (nothing downloaded): the denoiser at
its real size (SD1.5 and SDXL UNets, the Flux.1-dev and Chroma1-HD transformers, the Wan 2.1 1.3B transformer, the Wan 2.2 T2V
A14B experts, the LTX-2 19B audio-video transformer, the Qwen-Image 20B transformer); text encoders of the real widths but two layers, and a VAE with the real x8 downsampling but few
channels (the toolkit caches their outputs, so their size does not change a training step). Also the image
folders and the clip the toolkit trains on.

Wan 2.2 A14B has two experts of 14.3B parameters (28.6 GB in bf16 each): the bench writes the high-noise
`transformer` once and `transformer_2` is a symlink to its folder, so the pipeline takes ~29 GB of disk, not 57.
Both load as separate modules, so the step time is the real one; only the weights are the same."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

SD15_UNET = dict(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
SDXL_UNET = dict(sample_size=128, block_out_channels=(320, 640, 1280),
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
                 use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816)
FLUX_DEV = dict(guidance_embeds=True)   # FluxTransformer2DModel's defaults are Flux.1's shape: 19 + 38 blocks, 3072
# ChromaTransformer2DModel's defaults are Chroma1-HD's shape (its transformer/config.json): 19 + 38 blocks, 24 heads of
# 128, T5-XXL's 4096, the approximator 64 channels in, 5 layers of 5120
CHROMA1_HD = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
                  approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5)
WAN_1P3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN22_A14B = dict(WAN_1P3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)  # each expert: 5120 wide
# LTX2VideoTransformer3DModel's defaults are LTX-2's 19B shape (Lightricks/LTX-2 transformer/config.json, which also
# says rope_type split): 48 audio-video blocks, video 32 heads of 128, audio 32 heads of 64, Gemma 3's 3840 in
LTX2_19B = dict(rope_type="split")

# HunyuanVideo15Transformer3DModel's defaults are the 480p models' shape (hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v
# transformer/config.json): 54 blocks, 16 heads of 128, Qwen2.5-VL-7B's 3584, ByT5's 1472, SigLIP's 1152, patch 1
HUNYUAN15_480P = dict(num_layers=54)
# QwenImageTransformer2DModel's defaults are Qwen-Image's 20B shape (Qwen/Qwen-Image transformer/config.json): 60
# dual-stream blocks, 24 heads of 128, Qwen2.5-VL-7B's 3584 in, RoPE axes 16/56/56, no guidance embedding
QWEN_IMAGE_20B = dict()
SHAPES = {  # tiny stand-ins with the same code paths, for checking the bench on the CPU (--tiny)
    "sd15": dict(block_out_channels=(32, 64), layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=768, attention_head_dim=4,
                 sample_size=8),
    "sdxl": dict(block_out_channels=(32, 64), layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2),
                 attention_head_dim=(2, 4), cross_attention_dim=2048, use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=1328,
                 sample_size=8),
    "flux": dict(num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=2,
                 axes_dims_rope=(4, 6, 6), guidance_embeds=True),
    "chroma": dict(CHROMA1_HD, num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=2,
                   axes_dims_rope=(4, 6, 6), approximator_hidden_dim=32, approximator_layers=2),
    "wan": dict(WAN_1P3B, num_layers=4, num_attention_heads=2, attention_head_dim=16, ffn_dim=32),
    "wan22": dict(WAN22_A14B, num_layers=4, num_attention_heads=2, attention_head_dim=16, ffn_dim=32),
    "ltx2": dict(LTX2_19B, num_layers=2, num_attention_heads=2, attention_head_dim=16, audio_num_attention_heads=2,
                 audio_attention_head_dim=16, cross_attention_dim=32, audio_cross_attention_dim=32,
                 caption_channels=256),
    "hunyuan15": dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, rope_axes_dim=(4, 6, 6)),
    "qwen_image": dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=32,
                       axes_dims_rope=(4, 6, 6)),
}


# How far the random VAE's log-variance is pulled down (std by exp(-10)): a trained VAE's posterior is narrow, so a
# trainer that caches one sample of it (kohya sd-scripts, musubi-tuner) and one that caches its mode (the toolkit,
# the loss-parity scorer) train on the same latents. Left at random, the posterior's std (0.18 after scaling on the
# parity images) is 3.4x the mode's rms (0.054): a peer's cached sample is mostly noise the scorer never sees.
NARROW_LOGVAR = 20.0


def _vae(latent_channels: int, **extra):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 16, 32, 32),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=8, sample_size=64, **extra)
    moments = vae.quant_conv if vae.quant_conv is not None else vae.encoder.conv_out  # (mean, logvar) channels
    with torch.no_grad():
        moments.bias[latent_channels:] -= NARROW_LOGVAR
    return vae


def _clip(tokenizer, hidden: int, projection: int | None = None):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    n = len(tokenizer)
    config = CLIPTextConfig(vocab_size=n, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=77, projection_dim=projection or 512,
                            bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1, hidden_act="gelu")
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def _build(cls, config: dict, device: str):
    torch.manual_seed(0)
    with torch.device(device):
        return cls(**config).to(torch.bfloat16)


def write_pipeline(kind: str, folder: Path, device: str, tiny: bool = False) -> None:
    """The pipeline folder of `kind` (sd15, sdxl, flux, flux_kontext, chroma, wan, wan22, ltx2, hunyuan15, qwen_image,
    qwen_image_edit) with its denoiser built on `device`, which gives the GPU memory back afterwards: each row runs
    in a process of its own and needs all of it."""
    _write_pipeline(kind, folder, device, tiny)
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _write_pipeline(kind: str, folder: Path, device: str, tiny: bool) -> None:
    from diffusers import (DDPMScheduler, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline,
                           FluxTransformer2DModel, StableDiffusionPipeline, StableDiffusionXLPipeline,
                           UNet2DConditionModel)
    from transformers import CLIPTokenizer, T5EncoderModel

    from toolkit.tiny.diffusion import write_clip_tokenizer
    from toolkit.tiny.flow import t5_config, write_t5_tokenizer

    config = SHAPES[kind.removesuffix("_kontext").removesuffix("_edit")] if tiny else {
        "sd15": SD15_UNET, "sdxl": SDXL_UNET, "flux": FLUX_DEV, "flux_kontext": FLUX_DEV, "chroma": CHROMA1_HD,
                                        "wan": WAN_1P3B, "wan22": WAN22_A14B, "ltx2": LTX2_19B,
                                        "hunyuan15": HUNYUAN15_480P, "qwen_image": QWEN_IMAGE_20B,
                                        "qwen_image_edit": QWEN_IMAGE_20B}[kind]
    if kind in ("qwen_image", "qwen_image_edit"):  # the edit model: Qwen-Image's transformer, its own pipeline
        from diffusers import QwenImageTransformer2DModel

        from toolkit.tiny.qwen_image_edit import write_tiny_qwen_image_edit

        write = _write_qwen_image if kind == "qwen_image" else write_tiny_qwen_image_edit
        write(folder, _build(QwenImageTransformer2DModel, config, device))
        return
    if kind == "ltx2":
        _write_ltx2(folder, _build(_ltx2_transformer_class(), config, device))
        return
    if kind in ("wan", "wan22"):
        from diffusers import WanPipeline, WanTransformer3DModel
        from transformers import UMT5EncoderModel

        from toolkit.tiny.flow import WAN22_BOUNDARY_RATIO, wan21_vae, wan_scheduler

        tokenizer = write_t5_tokenizer(folder / "tokenizer")
        transformer = _build(WanTransformer3DModel, config, device)
        encoder = UMT5EncoderModel(t5_config(len(tokenizer), d_model=4096, umt5=True))
        # A14B has the Wan 2.1 VAE and flow_shift 3.0 too (toolkit/tiny/flow.py's write_tiny_wan22)
        boundary = {"boundary_ratio": WAN22_BOUNDARY_RATIO} if kind == "wan22" else {}
        WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=wan21_vae(), scheduler=wan_scheduler(3.0),
                    transformer=transformer, **boundary).save_pretrained(folder, safe_serialization=True)
        if kind == "wan22":  # the low-noise expert: the same files (saved as None, then named in model_index.json)
            index = json.loads((folder / "model_index.json").read_text())
            index["transformer_2"] = index["transformer"]
            (folder / "model_index.json").write_text(json.dumps(index, indent=2))
            (folder / "transformer_2").symlink_to("transformer", target_is_directory=True)
        return
    if kind == "hunyuan15":
        from diffusers import HunyuanVideo15Transformer3DModel

        from toolkit.tiny.hunyuan15 import write_hunyuan15

        transformer = _build(HunyuanVideo15Transformer3DModel, config, device)
        write_hunyuan15(folder, transformer, text_width=transformer.config.text_embed_dim,
                        glyph_width=transformer.config.text_embed_2_dim)
        return
    if kind == "chroma":
        from diffusers import ChromaPipeline, ChromaTransformer2DModel

        from toolkit.tiny.chroma import CHROMA_SCHEDULER

        tokenizer = write_t5_tokenizer(folder / "tokenizer")
        transformer = _build(ChromaTransformer2DModel, config, device)
        t5 = T5EncoderModel(t5_config(len(tokenizer), d_model=transformer.config.joint_attention_dim))
        ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**CHROMA_SCHEDULER), tokenizer=tokenizer,
                       vae=_vae(16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                                use_post_quant_conv=False),
                       text_encoder=t5, transformer=transformer, image_encoder=None,
                       feature_extractor=None).save_pretrained(folder)
        return
    write_clip_tokenizer(folder / "tokenizer")
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    ddpm = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                         clip_sample=False, steps_offset=1)
    if kind == "sd15":
        StableDiffusionPipeline(vae=_vae(4, scaling_factor=0.18215), text_encoder=_clip(tokenizer, 768), tokenizer=tokenizer,
                                unet=_build(UNet2DConditionModel, config, device), scheduler=ddpm, safety_checker=None,
                                feature_extractor=None, requires_safety_checker=False).save_pretrained(folder)
    elif kind == "sdxl":
        write_clip_tokenizer(folder / "tokenizer_2")
        tokenizer_2 = CLIPTokenizer.from_pretrained(folder / "tokenizer_2")
        width_2 = config["cross_attention_dim"] - 768
        StableDiffusionXLPipeline(vae=_vae(4, scaling_factor=0.13025), text_encoder=_clip(tokenizer, 768),
                                  text_encoder_2=_clip(tokenizer_2, width_2, projection=width_2), tokenizer=tokenizer,
                                  tokenizer_2=tokenizer_2, unet=_build(UNet2DConditionModel, config, device),
                                  scheduler=ddpm).save_pretrained(folder)
    else:
        tokenizer_2 = write_t5_tokenizer(folder / "tokenizer_2")
        transformer = _build(FluxTransformer2DModel, config, device)
        clip = _clip(tokenizer, transformer.config.pooled_projection_dim)
        t5 = T5EncoderModel(t5_config(len(tokenizer_2), d_model=transformer.config.joint_attention_dim))
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                    base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                    max_image_seq_len=4096)
        pipeline = FluxKontextPipeline if kind == "flux_kontext" else FluxPipeline  # Kontext: Flux dev's shape
        pipeline(scheduler=scheduler, vae=_vae(16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                                                   use_post_quant_conv=False),
                     text_encoder=clip, tokenizer=tokenizer, text_encoder_2=t5, tokenizer_2=tokenizer_2,
                     transformer=transformer, image_encoder=None, feature_extractor=None).save_pretrained(folder)


def _write_qwen_image(folder: Path, transformer) -> None:
    """QwenImagePipeline around `transformer`, the rest as toolkit/tiny/qwen_image.py writes it (its tokenizer, the
    narrow Qwen-Image VAE, the real scheduler) with a 2-layer Qwen2.5-VL text model of the transformer's text width
    (3584 for the real shape: 28 heads of 128 with the 7B's 16/24/24 RoPE sections, 4 key-value heads)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLForConditionalGeneration

    from toolkit.tiny.qwen_image import (QWEN_IMAGE_LATENTS_MEAN, QWEN_IMAGE_LATENTS_STD, QWEN_IMAGE_SCHEDULER,
                                         qwen25_vl_config, write_qwen_tokenizer)

    tokenizer = write_qwen_tokenizer(folder / "tokenizer")
    width = transformer.config.joint_attention_dim
    torch.manual_seed(0)
    encoder = Qwen2_5_VLForConditionalGeneration(qwen25_vl_config(tokenizer, hidden_size=width,
                                                                  real_heads=width % 128 == 0))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], latents_mean=QWEN_IMAGE_LATENTS_MEAN,
                                 latents_std=QWEN_IMAGE_LATENTS_STD)
    QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER), vae=vae, text_encoder=encoder,
                      tokenizer=tokenizer, transformer=transformer).save_pretrained(folder, safe_serialization=True)


def _ltx2_transformer_class():
    from diffusers import LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel


def _write_ltx2(folder: Path, transformer) -> None:
    """LTX2Pipeline around `transformer`: a 2-layer Gemma 3 of the real width (3840) and the real connectors (they
    run once per caption, then are freed), a video VAE with the real factors (time / 8, space / 32, 128 channels) but
    8 channels a level, the real audio VAE's factors (64 mel bins / 4, 8 channels) and a small vocoder."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from toolkit.tiny.ltx2 import LTX2_SCHEDULER, write_gemma_tokenizer

    tokenizer = write_gemma_tokenizer(folder / "tokenizer")
    width = transformer.config.caption_channels
    n = len(tokenizer)
    text = dict(vocab_size=n, hidden_size=width, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, sliding_window=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    encoder = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                          image_token_index=n, boi_token_index=n + 1,
                                                          eoi_token_index=n + 2))
    connectors = LTX2TextConnectors(caption_channels=width, text_proj_in_factor=3, rope_type="split",
                                    video_connector_num_attention_heads=width // 128,
                                    audio_connector_num_attention_heads=width // 128)
    vae = AutoencoderKLLTX2Video(block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8),
                                 layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
                                 spatial_compression_ratio=32, temporal_compression_ratio=8)  # as LTX-2's config.json
    audio_vae = AutoencoderKLLTX2Audio(base_channels=8, num_res_blocks=1)
    vocoder = LTX2Vocoder(in_channels=2 * 64, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]])
    LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER), vae=vae, audio_vae=audio_vae,
                 text_encoder=encoder, tokenizer=tokenizer, connectors=connectors, transformer=transformer,
                 vocoder=vocoder).save_pretrained(folder, safe_serialization=True)


def write_images(folder: Path, count: int, size: int, references: int = 0) -> None:
    """`count` random-pattern images with captions; with `references`, each with that many reference images beside
    it (name_ref0.png, ...: the edit families' layout, toolkit/data/references.py)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        for name in [f"{i:03d}", *(f"{i:03d}_ref{r}" for r in range(references))]:
            pixels = (torch.rand(size // 8, size // 8, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).resize((size, size), Image.NEAREST).save(folder / f"{name}.png")
        (folder / f"{i:03d}.txt").write_text(f"a random pattern number {i}\n")


def write_clip(folder: Path, frames: int, height: int, width: int) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    base = (torch.rand(height // 8, width // 8, 3, generator=g) * 255).to(torch.uint8)
    images = [Image.fromarray(torch.roll(base, shifts=i, dims=1).numpy()).resize((width, height), Image.NEAREST)
              for i in range(frames)]
    images[0].save(folder / "clip.webp", save_all=True, append_images=images[1:], duration=62, loop=0, quality=60)
    (folder / "clip.txt").write_text("a random pattern drifting right\n")
