"""Tiny flow-matching pipelines (tiny:flux, tiny:sd3, tiny:wan21, tiny:wan22, tiny:wan22-5b, the image-to-video
tiny:wan21-i2v and tiny:wan22-i2v, tiny:qwen_image, tiny:z_image, tiny:flux2, tiny:chroma, tiny:ltx2): written
on first use, loaded by their diffusers pipeline class, and able to generate; the family-specific settings are the
real ones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.tiny import resolve_model_path
from toolkit.tiny import TINY_WRITERS, write_tiny

# the class name transformers saves a CLIPImageProcessor under (CLIPImageProcessorPil since transformers 5)
IMAGE_PROCESSOR = __import__("transformers").CLIPImageProcessor().__class__.__name__
# kind -> (pipeline class, components in model_index.json, output shape of a 64x64 generation)
KINDS = {
    "flux": ("FluxPipeline", {"text_encoder": "CLIPTextModel", "tokenizer": "CLIPTokenizer",
                              "text_encoder_2": "T5EncoderModel", "tokenizer_2": "T5Tokenizer",
                              "transformer": "FluxTransformer2DModel", "vae": "AutoencoderKL",
                              "scheduler": "FlowMatchEulerDiscreteScheduler"}, (1, 64, 64, 3)),
    "sd3": ("StableDiffusion3Pipeline", {"text_encoder": "CLIPTextModelWithProjection", "tokenizer": "CLIPTokenizer",
                                         "text_encoder_2": "CLIPTextModelWithProjection", "tokenizer_2": "CLIPTokenizer",
                                         "text_encoder_3": "T5EncoderModel", "tokenizer_3": "T5Tokenizer",
                                         "transformer": "SD3Transformer2DModel", "vae": "AutoencoderKL",
                                         "scheduler": "FlowMatchEulerDiscreteScheduler"}, (1, 64, 64, 3)),
    "wan21": ("WanPipeline", {"text_encoder": "UMT5EncoderModel", "tokenizer": "T5Tokenizer",
                              "transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan",
                              "scheduler": "UniPCMultistepScheduler"}, (1, 5, 64, 64, 3)),
    "wan22": ("WanPipeline", {"text_encoder": "UMT5EncoderModel", "tokenizer": "T5Tokenizer",
                              "transformer": "WanTransformer3DModel", "transformer_2": "WanTransformer3DModel",
                              "vae": "AutoencoderKLWan", "scheduler": "UniPCMultistepScheduler"}, (1, 5, 64, 64, 3)),
    "wan22-5b": ("WanPipeline", {"text_encoder": "UMT5EncoderModel", "tokenizer": "T5Tokenizer",
                                 "transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan",
                                 "scheduler": "UniPCMultistepScheduler"}, (1, 5, 64, 64, 3)),
    "wan21-i2v": ("WanImageToVideoPipeline", {"text_encoder": "UMT5EncoderModel", "tokenizer": "T5Tokenizer",
                                              "image_encoder": "CLIPVisionModel", "image_processor": IMAGE_PROCESSOR,
                                              "transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan",
                                              "scheduler": "UniPCMultistepScheduler"}, (1, 5, 64, 64, 3)),
    "wan22-i2v": ("WanImageToVideoPipeline", {"text_encoder": "UMT5EncoderModel", "tokenizer": "T5Tokenizer",
                                              "transformer": "WanTransformer3DModel",
                                              "transformer_2": "WanTransformer3DModel", "vae": "AutoencoderKLWan",
                                              "scheduler": "UniPCMultistepScheduler"}, (1, 5, 64, 64, 3)),
    "qwen_image": ("QwenImagePipeline", {"text_encoder": "Qwen2_5_VLForConditionalGeneration",
                                         "tokenizer": "Qwen2Tokenizer", "transformer": "QwenImageTransformer2DModel",
                                         "vae": "AutoencoderKLQwenImage",
                                         "scheduler": "FlowMatchEulerDiscreteScheduler"}, (1, 64, 64, 3)),
    "z_image": ("ZImagePipeline", {"text_encoder": "Qwen3Model", "tokenizer": "Qwen2Tokenizer",
                                   "transformer": "ZImageTransformer2DModel", "vae": "AutoencoderKL",
                                   "scheduler": "FlowMatchEulerDiscreteScheduler"}, (1, 64, 64, 3)),
    "chroma": ("ChromaPipeline", {"text_encoder": "T5EncoderModel", "tokenizer": "T5Tokenizer",
                                  "transformer": "ChromaTransformer2DModel", "vae": "AutoencoderKL",
                                  "scheduler": "FlowMatchEulerDiscreteScheduler"}, (1, 64, 64, 3)),
    # LTX-2: Gemma 3 (its tokenizer GemmaTokenizer), the text connectors, the audio VAE and vocoder beside the video's
    "ltx2": ("LTX2Pipeline", {"text_encoder": "Gemma3ForConditionalGeneration", "tokenizer": "GemmaTokenizer",
                              "connectors": "LTX2TextConnectors", "transformer": "LTX2VideoTransformer3DModel",
                              "vae": "AutoencoderKLLTX2Video", "audio_vae": "AutoencoderKLLTX2Audio",
                              "vocoder": "LTX2Vocoder", "scheduler": "FlowMatchEulerDiscreteScheduler"},
             (1, 9, 64, 64, 3)),
    # FLUX.2-dev's tokenizer is a PixtralProcessor (torchvision for its image half); the tiny one holds its tokenizer
    "flux2": ("Flux2Pipeline", {"text_encoder": "Mistral3ForConditionalGeneration", "tokenizer": "TokenizersBackend",
                                "transformer": "Flux2Transformer2DModel", "vae": "AutoencoderKLFlux2",
                                "scheduler": "FlowMatchEulerDiscreteScheduler"}, (1, 64, 64, 3)),
}
# Kinds whose family is not in config/families.py yet (their writer exists; the FamilySpec.tiny entry comes with the
# family): skipped until registered.
AWAITING_FAMILY: set[str] = set()


def _kinds(kinds):
    return [pytest.param(kind, marks=pytest.mark.skipif(kind not in TINY_WRITERS,
                                                        reason=f"tiny:{kind} has no FamilySpec.tiny entry yet"))
            for kind in kinds]


def _load(kind: str):
    import diffusers

    pipeline_class = getattr(diffusers, KINDS[kind][0])
    pipe = pipeline_class.from_pretrained(resolve_model_path(f"tiny:{kind}"))
    assert type(pipe) is pipeline_class
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_every_flow_kind_is_registered():
    assert set(KINDS) - AWAITING_FAMILY <= set(TINY_WRITERS)


@pytest.mark.parametrize("kind", _kinds(KINDS))
def test_tiny_flow_pipeline_loads_and_generates(kind):
    pipeline_name, components, shape = KINDS[kind]
    pipe = _load(kind)
    index = json.loads((Path(resolve_model_path(f"tiny:{kind}")) / "model_index.json").read_text())
    assert index["_class_name"] == pipeline_name
    assert {name: entry[1] for name, entry in index.items() if isinstance(entry, list) and entry[0]} == components

    call = dict(prompt="a sks red circle on a white background", num_inference_steps=2, height=64, width=64,
                generator=torch.Generator().manual_seed(0), output_type="np")
    if pipeline_name == "WanPipeline":
        output = pipe(**call, num_frames=5).frames
    elif pipeline_name == "LTX2Pipeline":
        output = pipe(**call, num_frames=9, max_sequence_length=64).frames
    elif pipeline_name == "WanImageToVideoPipeline":
        from PIL import Image

        output = pipe(**call, num_frames=5, image=Image.new("RGB", (64, 64), "white")).frames
    else:
        output = pipe(**call).images
    assert np.asarray(output).shape == shape
    assert np.isfinite(output).all()


@pytest.mark.parametrize("kind", ["flux", "sd3", "wan21"])
def test_t5_tokenizer_ids_like_t5(kind):
    pipe = _load(kind)
    tokenizer = getattr(pipe, {"flux": "tokenizer_2", "sd3": "tokenizer_3", "wan21": "tokenizer"}[kind])
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer("a sks dog", padding="max_length", max_length=6).input_ids
    assert tokenizer.convert_ids_to_tokens(ids[:3]) == ["▁a", "▁sks", "▁dog"]
    assert ids[3:] == [1, 0, 0]  # </s> then padding
    assert tokenizer.decode(tokenizer("a Squirrel").input_ids, skip_special_tokens=True) == "a Squirrel"  # spelled out


def test_ltx2_keeps_the_real_layout():
    """Gemma 3's states of every layer feed the connectors (left padding); the VAE compresses time by 8 with
    per-channel latent statistics; LTX-2's dynamic shift; the audio stream's width is the audio VAE's."""
    pipe = _load("ltx2")
    assert pipe.tokenizer.padding_side == "left" and pipe.tokenizer.pad_token_id == 0
    text = pipe.text_encoder.config.text_config
    assert pipe.connectors.config.text_proj_in_factor == text.num_hidden_layers + 1
    assert pipe.connectors.config.caption_channels == text.hidden_size == pipe.transformer.config.caption_channels
    assert (pipe.vae_temporal_compression_ratio, pipe.vae_spatial_compression_ratio) == (8, 8)
    assert pipe.vae.latents_std.min() < 1 < pipe.vae.latents_std.max() and pipe.vae.latents_mean.abs().max() > 0
    assert pipe.transformer.config.audio_in_channels == pipe.audio_vae.config.latent_channels * (
        pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio)
    s = pipe.scheduler.config
    assert (s.use_dynamic_shifting, s.base_shift, s.max_shift, s.base_image_seq_len, s.max_image_seq_len) == \
        (True, 0.95, 2.05, 1024, 4096)


def test_flux_is_dev_like():
    pipe = _load("flux")
    assert pipe.transformer.config.guidance_embeds is True
    assert sum(pipe.transformer.config.axes_dims_rope) == pipe.transformer.config.attention_head_dim
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.latent_channels == 64
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (0.3611, 0.1159)
    assert pipe.vae_scale_factor == 8
    s = pipe.scheduler.config
    assert (s.use_dynamic_shifting, s.base_shift, s.max_shift, s.base_image_seq_len, s.max_image_seq_len) == \
        (True, 0.5, 1.15, 256, 4096)


def test_sd3_settings():
    pipe = _load("sd3")
    assert (pipe.vae.config.latent_channels, pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == \
        (16, 1.5305, 0.0609)
    assert pipe.scheduler.config.shift == 3.0 and not pipe.scheduler.config.use_dynamic_shifting
    assert pipe.transformer.config.pooled_projection_dim == 2 * pipe.text_encoder.config.projection_dim


def test_wan22_has_two_experts():
    pipe = _load("wan22")
    assert pipe.config.boundary_ratio == 0.875
    first, second = pipe.transformer.state_dict(), pipe.transformer_2.state_dict()
    assert first.keys() == second.keys()
    differing = [k for k in first if not torch.equal(first[k], second[k])]
    assert "blocks.0.attn1.to_q.weight" in differing and "proj_out.weight" in differing
    assert pipe.scheduler.config.flow_shift == 3.0 and pipe.scheduler.config.use_flow_sigmas
    assert pipe.scheduler.config.prediction_type == "flow_prediction"
    assert _load("wan21").config.boundary_ratio is None


def test_wan22_5b_settings():
    pipe = _load("wan22-5b")
    vae = pipe.vae.config
    assert (vae.z_dim, vae.is_residual, vae.patch_size, vae.scale_factor_spatial, vae.scale_factor_temporal) == \
        (48, True, 2, 16, 4)
    assert len(vae.latents_mean) == len(vae.latents_std) == 48
    assert (pipe.transformer.config.in_channels, pipe.transformer.config.out_channels) == (48, 48)
    assert pipe.config.expand_timesteps is True and pipe.transformer_2 is None
    assert pipe.scheduler.config.flow_shift == 5.0


def test_writer_is_deterministic_and_keeps_the_callers_rng(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    write_tiny("wan21", tmp_path / "again")
    assert torch.equal(torch.rand(3), expected_next)
    cached = resolve_model_path("tiny:wan21")
    for part in ("transformer", "text_encoder", "vae"):
        name = next(p.name for p in (tmp_path / "again" / part).glob("*.safetensors"))
        a, b = load_file(tmp_path / "again" / part / name), load_file(f"{cached}/{part}/{name}")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_chat_templates_render_the_prompts_as_the_real_models_do():
    """Z-Image: Qwen3's user turn and generation prompt (no empty think block with enable_thinking); FLUX.2: Mistral
    Small 3.1's system prompt and instruction; every word one token, so the 512-token window keeps the prompt."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    z_image = _load("z_image").tokenizer
    text = z_image.apply_chat_template([{"role": "user", "content": "a sks dog"}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=True)
    assert text == "<|im_start|>user\na sks dog<|im_end|>\n<|im_start|>assistant\n"
    assert z_image.tokenize("a sks dog") == ["a", "Ġsks", "Ġdog"]

    flux2 = _load("flux2").tokenizer
    (text,) = flux2.apply_chat_template(format_input(["a sks dog"]), tokenize=False)
    assert text == f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]a sks dog[/INST]"
    ids = flux2.apply_chat_template(format_input(["a sks dog"]), tokenize=True, return_dict=True, padding="max_length",
                                    truncation=True, max_length=512)["input_ids"][0]
    tokens = flux2.convert_ids_to_tokens(ids)
    assert tokens[:2] == ["<s>", "[SYSTEM_PROMPT]"] and tokens[-1] == "<pad>" and len(tokens) == 512
    end = tokens.index("[/INST]")
    assert tokens[end - 4:end + 1] == ["[INST]", "a", "Ġsks", "Ġdog", "[/INST]"] and end < 40
