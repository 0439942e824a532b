"""LoRA export in the kohya / ComfyUI key format, from a diffusers-format LoRA file.

Keys look like `lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight`
(`lora_te1_` / `lora_te2_` for the text encoders), each module with an `.alpha` scalar. The conversion is
diffusers' own (convert_all_state_dict_to_peft, then convert_state_dict_to_kohya).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def diffusers_to_kohya(state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """kohya keys for a diffusers LoRA state dict; every module's alpha set to `alpha` (network.alpha)."""
    from diffusers.utils import convert_all_state_dict_to_peft, convert_state_dict_to_kohya

    kohya = convert_state_dict_to_kohya(convert_all_state_dict_to_peft(state))
    dtype = next(iter(state.values())).dtype
    # diffusers writes alpha = rank; the toolkit's scale is network.alpha / rank, so record the real alpha.
    return {k: (torch.tensor(float(alpha), dtype=dtype) if k.endswith(".alpha") else v.contiguous())
            for k, v in kohya.items()}


def save_kohya(diffusers_file: Path, out_file: Path, metadata: dict[str, str]) -> Path:
    """Write out_file (kohya/ComfyUI keys, safetensors metadata) from a diffusers-format LoRA file."""
    alpha = float(metadata["ss_network_alpha"])
    save_file(diffusers_to_kohya(load_file(str(diffusers_file)), alpha), str(out_file), metadata=metadata)
    return out_file
