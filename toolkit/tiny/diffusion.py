"""Tiny, deterministic Stable Diffusion / SDXL pipelines in the real diffusers layout, and a toy image set.

`tiny:sd`, `tiny:sd-v` (v-prediction) and `tiny:sdxl` are written by these functions (see tiny.py) and
load with `StableDiffusionPipeline.from_pretrained` / `StableDiffusionXLPipeline.from_pretrained`.
The CLIP tokenizer's vocab.json / merges.txt are built here from a small word list (nothing downloaded).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.rng import rng_untouched

# Words the shapes data set and the tests use; each becomes one BPE token.
_WORDS = ("a an the on of and with in photo picture drawing image background white black red green blue "
          "yellow purple orange circle square triangle star small large big tiny shape shapes colour color "
          "sks toy dog cat style").split()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-level alphabet: every byte maps to a printable unicode character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_clip_tokenizer(out: Path) -> None:
    """A CLIP byte-level BPE tokenizer (vocab.json + merges.txt) whose merges spell out _WORDS."""
    from transformers import CLIPTokenizer

    out.mkdir(parents=True, exist_ok=True)
    alphabet = list(_bytes_to_unicode().values())
    vocab_list = alphabet + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        current = parts[0]
        for part in parts[1:]:
            pair = (current, part)
            current = current + part
            if pair not in merges:
                merges.append(pair)
            if current not in vocab_list:
                vocab_list.append(current)
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    (out / "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab_list)}, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    tokenizer = CLIPTokenizer(str(out / "vocab.json"), str(out / "merges.txt"), model_max_length=77, pad_token="<|endoftext|>")
    tokenizer.save_pretrained(out)


def clip_config(vocab_size: int, projection: bool):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=77, projection_dim=32 if projection else 512,
                          bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
                          hidden_act="gelu")


def _vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=(32, 64), in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         layers_per_block=1, norm_num_groups=32, sample_size=64)


def _scheduler(prediction_type: str):
    from diffusers import DDPMScheduler

    return DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                         clip_sample=False, prediction_type=prediction_type, steps_offset=1)


def keeps_global_rng(writer):
    """Run a writer without touching the caller's RNG streams: a tiny model written on first use inside a
    training run must not change that run's noise (or a resumed run would differ from an uninterrupted one)."""
    def wrapped(*args, **kwargs):
        with rng_untouched():  # CPU and GPU streams: torch.manual_seed reseeds the GPUs' generators too
            return writer(*args, **kwargs)
    wrapped.__doc__, wrapped.__name__ = writer.__doc__, writer.__name__
    return wrapped


@keeps_global_rng
def write_tiny_sd(out: Path, prediction_type: str = "epsilon") -> None:
    """SD 1.x layout: UNet (32/64 channels, cross-attention 32), tiny VAE (x2 downsampling), 2-layer CLIP."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    write_clip_tokenizer(out / "tokenizer")
    tokenizer = CLIPTokenizer.from_pretrained(out / "tokenizer")
    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=(2, 4), norm_num_groups=32)
    vae = _vae()
    text_encoder = CLIPTextModel(clip_config(len(tokenizer), projection=False))
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=_scheduler(prediction_type), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(out, safe_serialization=True)


def write_tiny_sd_v(out: Path) -> None:
    """tiny:sd with a v-prediction scheduler (the SD 2.x 768 setting)."""
    write_tiny_sd(out, prediction_type="v_prediction")


@keeps_global_rng
def write_tiny_sdxl(out: Path) -> None:
    """SDXL layout: two CLIP encoders (hidden 32 each, the second with a 32-d projection), text_time conditioning."""
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    write_clip_tokenizer(out / "tokenizer")
    write_clip_tokenizer(out / "tokenizer_2")
    tokenizer = CLIPTokenizer.from_pretrained(out / "tokenizer")
    tokenizer_2 = CLIPTokenizer.from_pretrained(out / "tokenizer_2")
    torch.manual_seed(0)
    time_embed_dim, projection_dim = 8, 32
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, transformer_layers_per_block=(1, 2),
        cross_attention_dim=64,  # the two encoders' hidden states concatenated: 32 + 32
        addition_embed_type="text_time", addition_time_embed_dim=time_embed_dim,
        # six time ids (original h/w, crop top/left, target h/w), each embedded to time_embed_dim, plus pooled text
        projection_class_embeddings_input_dim=6 * time_embed_dim + projection_dim, norm_num_groups=32)
    vae = _vae()
    text_encoder = CLIPTextModel(clip_config(len(tokenizer), projection=False))
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(len(tokenizer_2), projection=True))
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                                     tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet,
                                     scheduler=_scheduler("epsilon"), force_zeros_for_empty_prompt=True)
    pipe.save_pretrained(out, safe_serialization=True)
