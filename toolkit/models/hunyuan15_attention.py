"""HunyuanVideo 1.5's joint attention without its dense S x S mask when no token of the batch is padding.

diffusers' HunyuanVideo15AttnProcessor2_0 expands the (B, text + image tokens) mask into a boolean (B, 1, S, S)
mask every layer call (S = video + text tokens: ~225M elements at 480p x 33 frames), and SDPA given a mask cannot
take the flash kernel. When the adapter trimmed every text to its attended tokens and left out the masked
image tokens (`valid_tokens` is then the joint text + image token count), every key is valid: the all-true mask
changes nothing, so the call passes attn_mask None and SDPA is free to pick flash / cuDNN. Any other call (padding
left, the pipeline's own padded call during sampling: another token count) takes diffusers' processor unchanged.
The mask-free path is diffusers 0.42's processor with the mask left out.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0


class MaskFreeAttention(HunyuanVideo15AttnProcessor2_0):
    """One instance shared by the dual-stream blocks; the adapter sets `valid_tokens` before each training forward
    (None: every call masked). A forward's checkpointed recompute in backward sees the same setting."""

    valid_tokens: int | None = None

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if (encoder_hidden_states is None or attention_mask is None
                or attention_mask.shape[1] != self.valid_tokens):  # a shape check: no device sync, one compile guard
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query, key, value = (p(hidden_states).unflatten(2, (attn.heads, -1)) for p in (attn.to_q, attn.to_k, attn.to_v))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_query, text_key, text_value = (p(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                                            for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            text_query = attn.norm_added_q(text_query)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)
        out = dispatch_attention_fn(torch.cat([query, text_query], dim=1), torch.cat([key, text_key], dim=1),
                                    torch.cat([value, text_value], dim=1), attn_mask=None, dropout_p=0.0,
                                    is_causal=False, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        video, text = out[:, :-encoder_hidden_states.shape[1]], out[:, -encoder_hidden_states.shape[1]:]
        if getattr(attn, "to_out", None) is not None:
            video = attn.to_out[1](attn.to_out[0](video))
        if getattr(attn, "to_add_out", None) is not None:
            text = attn.to_add_out(text)
        return video, text


def install(transformer) -> MaskFreeAttention:
    """The shared processor on each dual-stream block's attention (the text refiner's attention keeps its own)."""
    processor = MaskFreeAttention()
    for block in transformer.transformer_blocks:
        block.attn.set_processor(processor)
    return processor
