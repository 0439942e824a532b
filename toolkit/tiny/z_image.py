"""A tiny, deterministic Z-Image pipeline (`tiny:z_image`) in the real diffusers layout (Tongyi-MAI/Z-Image-Turbo's
model_index.json: Qwen3Model, Qwen2Tokenizer, ZImageTransformer2DModel, AutoencoderKL, FlowMatchEulerDiscreteScheduler).

It loads with `ZImagePipeline.from_pretrained` and keeps the real model's structure at a width of 32: a 2-layer Qwen3
text encoder (the pipeline reads its second-to-last hidden state, so cap_feat_dim is its hidden size), a Qwen2
byte-level BPE tokenizer with a chat template that renders a user turn and the generation prompt as Qwen3's does
(with enable_thinking, no empty <think> block), the single-stream S3-DiT (noise and context refiners, then the joint
layers, 2x2 patches of 16-channel latents), the Flux VAE layout and the Turbo scheduler (a fixed shift of 3.0).
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.tiny.diffusion import keeps_global_rng
from toolkit.tiny.flow import FLUX_VAE_SCALING, FLUX_VAE_SHIFT, _flow_vae
from toolkit.tiny.qwen_image import write_qwen_tokenizer

# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a fixed shift (the pipeline passes mu, which a
# scheduler without use_dynamic_shifting ignores).
Z_IMAGE_TURBO_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
# Qwen3's chat template, reduced to what the pipeline renders: user turns, then the assistant's generation prompt
# (an empty think block only when enable_thinking is false, as in Qwen3's own template).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")


def qwen3_config(vocab_size: int, eos_token_id: int, hidden_size: int = 32):
    """A 2-layer Qwen3 config (q/k RMS norm, GQA 2:1, head dim 16), tied embeddings as in Qwen3-4B."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, eos_token_id=eos_token_id, tie_word_embeddings=True)


@keeps_global_rng
def write_tiny_z_image(out: Path) -> None:
    """Z-Image-Turbo layout: Qwen3 text encoder (hidden 32 = cap_feat_dim), a transformer of 2 refiner blocks each
    and 2 joint blocks (dim 32, 2 heads of 16, RoPE axes 4/6/6), the 16-channel Flux VAE and a shift of 3.0."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    out = Path(out)
    tokenizer = write_qwen_tokenizer(out / "tokenizer", extra_tokens=("<think>", "</think>"),
                                     chat_template=QWEN3_CHAT_TEMPLATE)
    torch.manual_seed(0)
    text_encoder = Qwen3Model(qwen3_config(len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>")))
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=2,
        n_heads=2, n_kv_heads=2, qk_norm=True, cap_feat_dim=32,  # the text encoder's hidden size
        rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6], axes_lens=[1536, 512, 512])  # sums to the head dim
    vae = _flow_vae(FLUX_VAE_SCALING, FLUX_VAE_SHIFT)
    scheduler = FlowMatchEulerDiscreteScheduler(**Z_IMAGE_TURBO_SCHEDULER)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    pipe.save_pretrained(out, safe_serialization=True)
