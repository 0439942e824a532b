"""A tiny, deterministic LTX-2 pipeline (`tiny:ltx2`) in the diffusers layout of Lightricks/LTX-2.

It loads with `LTX2Pipeline.from_pretrained` and keeps the real model's structure at a width of 16 to 32: a
Gemma 3 text encoder (Gemma3ForConditionalGeneration, every hidden state stacked as the pipeline reads them) with a
Gemma-style BPE tokenizer (left padding), the text connectors (the stacked states projected, then one 1-D
transformer per modality with learnable registers in place of the padding), an audio-video
LTX2VideoTransformer3DModel of 2 blocks (video 2 heads of 8, audio 2 heads of 4), the video VAE compressing time
by 8 and space by 8 (the real one: 8 and 32) with non-trivial per-channel latent statistics, the audio VAE and
vocoder, and LTX-2's dynamically shifted flow-matching Euler scheduler.
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.tiny.diffusion import keeps_global_rng
from toolkit.tiny.llm import _CORPUS

TEXT_WIDTH, TEXT_LAYERS = 32, 2     # Gemma 3's hidden size and layers (the real one: 3840, 48)
VIDEO_CHANNELS = 8                  # the video VAE's latent channels (the real one: 128)
REGISTERS = 8                       # the connectors' learnable registers (the real ones: 128): text length % 8 == 0
# Lightricks/LTX-2 scheduler/scheduler_config.json: a resolution-dependent shift between 0.95 and 2.05.
LTX2_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                      base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1,
                      time_shift_type="exponential")


def write_gemma_tokenizer(out: Path):
    """A byte-level BPE tokenizer with Gemma's special tokens (<pad>=0, <eos>=1, <bos>=2), padding on the left as
    the pipeline asks of Gemma; saved as GemmaTokenizer(Fast) so `from_pretrained` reads it through the class the
    pipeline names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GemmaTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4 + ["moving right on a white background sks"] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    fast = GemmaTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                              unk_token="<unk>", padding_side="left", model_max_length=1024)
    fast.save_pretrained(out)
    return fast


def _gemma3(vocab_size: int):
    """A 2-layer Gemma 3 (hidden 32, 2 heads of 16) with a 1-layer SigLIP tower, as Gemma3ForConditionalGeneration."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=vocab_size, hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=TEXT_LAYERS,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                sliding_window=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=vocab_size,
                          boi_token_index=vocab_size + 1, eoi_token_index=vocab_size + 2)
    return Gemma3ForConditionalGeneration(config)


def ltx2_transformer():
    """An audio-video LTX2VideoTransformer3DModel: 2 blocks, video 2 heads of 8 over 8 latent channels, audio 2 heads
    of 4 over the audio VAE's 2 channels x 2 mel bins; the prompt projections take the connectors' width."""
    from diffusers import LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel(
        in_channels=VIDEO_CHANNELS, out_channels=VIDEO_CHANNELS, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, vae_scale_factors=(8, 8, 8), audio_in_channels=4,
        audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
        num_layers=2, caption_channels=TEXT_WIDTH, rope_double_precision=False, rope_type="split")


def _connectors():
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    return LTX2TextConnectors(
        caption_channels=TEXT_WIDTH, text_proj_in_factor=TEXT_LAYERS + 1, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=REGISTERS, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=REGISTERS, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")


def _video_vae():
    """Three spatiotemporal downsamplings (time / 8, space / 8), a causal encoder, per-channel latent statistics."""
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=VIDEO_CHANNELS, block_out_channels=(8, 8, 8),
        down_block_types=("LTX2VideoDownBlock3D",) * 3, decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False,) * 4, downsample_type=("spatiotemporal",) * 3,
        upsample_type=("spatiotemporal",) * 3, upsample_residual=(False,) * 3, upsample_factor=(1, 1, 1),
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, VIDEO_CHANNELS))
    vae.latents_std.copy_(torch.linspace(0.5, 1.5, VIDEO_CHANNELS))
    return vae


def _audio_vae_and_vocoder():
    """The audio VAE over stereo log-mel spectrograms of 8 bins at 16 kHz (hop 160), compressing time and mel bins by 4
    as the real one does (two downsamplings), and a vocoder back to 16 kHz stereo."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    vocoder = LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    return audio_vae, vocoder


@keeps_global_rng
def write_tiny_ltx2(out: Path) -> None:
    """Lightricks/LTX-2 layout: Gemma 3 + tokenizer, text connectors, the audio-video transformer, the video and audio
    VAEs, the vocoder and the flow-matching Euler scheduler with LTX-2's dynamic shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    out = Path(out)
    tokenizer = write_gemma_tokenizer(out / "tokenizer")
    torch.manual_seed(0)
    text_encoder = _gemma3(len(tokenizer))
    connectors = _connectors()
    transformer = ltx2_transformer()
    vae = _video_vae()
    audio_vae, vocoder = _audio_vae_and_vocoder()
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, transformer=transformer,
                        vocoder=vocoder)
    pipe.save_pretrained(out, safe_serialization=True)
