"""A tiny, deterministic Qwen-Image pipeline (`tiny:qwen_image`) in the real diffusers layout.

It loads with `QwenImagePipeline.from_pretrained` and keeps the real model's structure at a width of 32 or so:
a Qwen2.5-VL text encoder (text and vision towers; the pipeline reads the last hidden state of the text model),
a Qwen2-style byte-level BPE tokenizer with the chat special tokens, a dual-stream MMDiT on 2x2-packed 16-channel
latents, the causal-3D Qwen-Image VAE (x8 spatial, the real per-channel latent statistics) and the real scheduler
settings (dynamic exponential shift, max_shift 0.9 at 8192 tokens, shift_terminal 0.02).

The tokenizer's merges are learned here, deterministically, from the words the pipeline's prompt template and the
tests use, so the template's system prefix is exactly `prompt_template_encode_start_idx` (34) tokens long, as with
the real tokenizer, and the pipeline's drop of those tokens leaves the prompt and the template's tail.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from toolkit.tiny.diffusion import _WORDS, _bytes_to_unicode, keeps_global_rng

# Qwen/Qwen-Image scheduler/scheduler_config.json
QWEN_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                            max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                            time_shift_type="exponential", invert_sigmas=False, stochastic_sampling=False,
                            use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False)
# Qwen/Qwen-Image vae/config.json (the Wan 2.1 VAE statistics), one value per latent channel (z_dim 16)
QWEN_IMAGE_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                           0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
QWEN_IMAGE_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                          3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]
# The Qwen2.5 chat / vision special tokens, in the real order (they follow the BPE vocabulary, as in the real one).
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
# The pipeline's prompt template, split into the words its BPE pre-tokenizer sees (specials and newlines apart).
_TEMPLATE_WORDS = ("system Describe the image by detailing the color shape size texture quantity text spatial "
                   "relationships of the objects and background user assistant").split()


def _learn_merges(words: list[str]) -> list[tuple[str, str]]:
    """Byte-level BPE merges learned from `words` (already byte-level strings) until each is one token: the
    most frequent adjacent pair first, ties broken by the pair itself, so the result never depends on hashing."""
    counts = Counter(words)
    pieces = {word: list(word) for word in counts}
    merges: list[tuple[str, str]] = []
    while True:
        pairs: Counter = Counter()
        for word, parts in pieces.items():
            for pair in zip(parts, parts[1:]):
                pairs[pair] += counts[word]
        if not pairs:
            return merges
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        for word, parts in pieces.items():
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            pieces[word] = merged


def byte_level_bpe(words: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a byte-level BPE: the 256 byte symbols, then merges that make each of `words` one token,
    with and without its leading space."""
    byte_map = _bytes_to_unicode()

    def byte_level(text: str) -> str:
        return "".join(byte_map[b] for b in text.encode("utf-8"))

    words = list(dict.fromkeys(words))
    merges = _learn_merges([byte_level(w) for w in words] + [byte_level(" " + w) for w in words])
    vocab_list = list(dict.fromkeys(list(byte_map.values()) + [a + b for a, b in merges]))
    return {token: i for i, token in enumerate(vocab_list)}, merges


def write_qwen_tokenizer(out: Path, extra_words: tuple[str, ...] = (), extra_tokens: tuple[str, ...] = (),
                         chat_template: str | None = None) -> "Qwen2Tokenizer":  # noqa: F821
    """A Qwen2 byte-level BPE tokenizer (vocab.json + merges.txt + tokenizer.json): the 256 byte symbols, merges
    that make every template and test word (and `extra_words`) one token, then the specials and `extra_tokens`
    (added, not special: Qwen3's <think> tags); `chat_template` is saved with it."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = byte_level_bpe(_TEMPLATE_WORDS + list(_WORDS) + list(extra_words))
    for token in QWEN_SPECIALS + list(extra_tokens):
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", model_max_length=32768, errors="replace")
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out)
    return tokenizer


def qwen25_vl_config(tokenizer, hidden_size: int = 32, real_heads: bool = False):
    """A Qwen2.5-VL config: a 2-layer text model (hidden `hidden_size`, multimodal RoPE sections summing to half
    the head dim, as 16/24/24 of 128 in the 7B; `real_heads`: the 7B's heads, 128 wide, 4 key-value heads, for the
    bench's real widths) and a 1-block vision tower, with the tokenizer's special ids."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden_size,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[0])
    if real_heads:
        text.update(num_attention_heads=hidden_size // 128, num_key_value_heads=4, head_dim=128,
                    rope_parameters={**text["rope_parameters"], "mrope_section": [16, 24, 24]})
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


@keeps_global_rng
def write_tiny_qwen_image(out: Path) -> None:
    """Qwen-Image layout: Qwen2.5-VL text encoder (hidden 32 = the transformer's joint_attention_dim), a 2-block
    dual-stream transformer (2 heads of 16, RoPE axes 4/6/6), the Qwen-Image VAE (z_dim 16, x8) and its scheduler."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = Path(out)
    tokenizer = write_qwen_tokenizer(out / "tokenizer")
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(qwen25_vl_config(tokenizer, hidden_size=32))
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16,  # 16 latent channels packed 2x2
        num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32,  # the text encoder's hidden size
        guidance_embeds=False, axes_dims_rope=(4, 6, 6))  # sums to the head dim
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True],  # 3 levels: x8 spatial
                                 latents_mean=QWEN_IMAGE_LATENTS_MEAN, latents_std=QWEN_IMAGE_LATENTS_STD)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    # The pipeline drops the template's system prefix by count; with this vocabulary it is as long as the real one.
    prefix = tokenizer(pipe.prompt_template_encode.split("{}")[0]).input_ids
    if len(prefix) != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(f"tiny Qwen tokenizer: the prompt template's prefix is {len(prefix)} tokens, the pipeline "
                           f"drops {pipe.prompt_template_encode_start_idx}")
    pipe.save_pretrained(out, safe_serialization=True)
