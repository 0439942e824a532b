"""A tiny, deterministic FLUX.2 [dev] pipeline (`tiny:flux2`) in the diffusers layout of black-forest-labs/FLUX.2-dev.

It loads with `Flux2Pipeline.from_pretrained` and keeps the real model's structure at a width of 16 to 32:
- a Mistral3ForConditionalGeneration text encoder (Mistral text model and a 1-block Pixtral vision tower) with 30
  layers, because the pipeline stacks the hidden states of layers 10, 20 and 30 (joint_attention_dim is 3 x its
  hidden size, as 15360 = 3 x 5120 in the real one);
- a byte-level BPE tokenizer with Tekken's special tokens in their order and a chat template that renders the
  system prompt and the user's text blocks as Mistral Small 3.1's does ([SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]
  ...[/INST]), its merges learned from the pipeline's system message and the test words so each is one token.
  The real folder's tokenizer is a PixtralProcessor, whose image half needs torchvision; prompt encoding uses only
  its tokenizer and chat template, so the tiny folder holds the tokenizer itself;
- a transformer with 1 double-stream and 1 single-stream block (2 heads of 16, 4-axis RoPE), 128 input channels
  (32 latent channels patchified 2x2), a guidance embedding;
- AutoencoderKLFlux2 (32 latent channels, x8) whose batch-norm statistics over the patchified latents are set to
  non-trivial values, so the normalisation the pipeline applies is exercised;
- the scheduler with Flux's dynamic shift settings (the pipeline computes its own mu).
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.tiny.diffusion import _WORDS, keeps_global_rng
from toolkit.tiny.qwen_image import byte_level_bpe

# Tekken (Mistral Small 3.1) control tokens, in their order: [IMG] is id 10, Mistral3Config's image_token_index.
TEKKEN_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                   "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
# Mistral Small 3.1's chat template, reduced to the turns the pipeline renders (string or text-block content).
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['content'] is string %}"
    "{%- set text = message['content'] %}{%- else %}"
    "{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{%- endif %}{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}{%- else %}{{- text + eos_token }}"
    "{%- endif %}{%- endfor %}")
# black-forest-labs/FLUX.2-dev scheduler/scheduler_config.json
FLUX2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                       max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
TEXT_LAYERS = 30  # the pipeline reads hidden states 10, 20 and 30


def write_mistral_tokenizer(out: Path):
    """A byte-level BPE tokenizer (tokenizer.json) with the Tekken specials first and the Mistral chat template."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SYSTEM_MESSAGE.replace(",", " ").replace(".", " ").split() + list(_WORDS)
    bpe_vocab, merges = byte_level_bpe(words)
    vocab = {token: i for i, token in enumerate(TEKKEN_SPECIALS)}
    for token in bpe_vocab:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", model_max_length=131072,
                                        additional_special_tokens=TEKKEN_SPECIALS[3:])
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def mistral3_config(tokenizer, hidden_size: int = 16):
    """A Mistral3 config: a TEXT_LAYERS-layer Mistral text model (GQA 2:1, head dim 8) and a 1-block Pixtral tower."""
    from transformers import Mistral3Config

    text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=32,
                num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1000000000.0, sliding_window=None,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=8, patch_size=14, image_size=56)
    return Mistral3Config(text_config=text, vision_config=vision, image_token_index=10, spatial_merge_size=2,
                          tie_word_embeddings=False)


@keeps_global_rng
def write_tiny_flux2(out: Path) -> None:
    """FLUX.2-dev layout: Mistral3 text encoder (3 x 16 = joint_attention_dim 48), a guidance-distilled transformer
    (1 double + 1 single block, 2 heads of 16), AutoencoderKLFlux2 (32 channels, x8) and the flow-matching scheduler."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3ForConditionalGeneration

    out = Path(out)
    tokenizer = write_mistral_tokenizer(out / "tokenizer")
    torch.manual_seed(0)
    text_encoder = Mistral3ForConditionalGeneration(mistral3_config(tokenizer))
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=128,  # 32 latent channels patchified 2x2
        num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=3 * 16,  # three stacked hidden states of the text encoder
        timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000,
        guidance_embeds=True)
    vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, latent_channels=32, block_out_channels=(8, 16, 32, 32),
                             layers_per_block=1, norm_num_groups=8, sample_size=64)
    with torch.no_grad():  # the real VAE's batch norm holds the statistics of its patchified latents
        vae.bn.running_mean.copy_(torch.randn(vae.bn.num_features) * 0.2)
        vae.bn.running_var.copy_(torch.rand(vae.bn.num_features) + 0.5)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER)
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)
    pipe.save_pretrained(out, safe_serialization=True)
