"""LoRA export for other tools, from a diffusers-format LoRA file.

SD / SDXL (save_kohya): kohya / ComfyUI keys like
`lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight` (`lora_te1_` / `lora_te2_`
for the text encoders), each module with an `.alpha` scalar. The conversion is
diffusers' own (convert_all_state_dict_to_peft, then convert_state_dict_to_kohya).

Flux, SD3, Wan 2.1 / 2.2 (save_comfyui): the key names ComfyUI's LoraLoader reads for each family (see below).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


# ComfyUI export for the flow-matching families. Input: the file that FluxPipeline / StableDiffusion3Pipeline /
# WanPipeline.save_lora_weights writes (`transformer.<module>.lora_A.weight` / `.lora_B.weight`, no alphas).
#
# Flux and SD3: ComfyUI maps diffusers module names itself (comfy/lora.py model_lora_keys_unet:
# `key_map["transformer.{}"...] = to` through comfy.utils.flux_to_diffusers / mmdit_to_diffusers, which slice q/k/v
# into the fused qkv weights), so the keys stay as they are. The alpha/rank scale is folded into lora_A rather than
# written as `.alpha` keys: SD3's diffusers loader rejects keys without "lora" in them, and a folded scale reads the
# same in every loader, alpha-aware or not.
#
# Wan 2.1 / 2.2: ComfyUI has no diffusers-name map for Wan; it reads the original Wan names under `diffusion_model.`
# (its generic "diffusion_model.<module>" key). Block modules get an `.alpha` (ComfyUI and diffusers' Wan reader both
# scale by alpha/rank); the few modules outside the blocks get the scale folded in, because diffusers' Wan reader
# (_convert_non_diffusers_wan_lora_to_diffusers) consumes alphas only inside blocks and refuses leftover keys.

WAN_BLOCK_MODULES = {  # diffusers WanTransformerBlock module -> ComfyUI / original Wan WanAttentionBlock module
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",  # image-to-video models
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
WAN_TOP_MODULES = {  # modules outside the blocks
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "proj_out": "head.head",
}


def lora_modules(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (lora_A, lora_B)} from a diffusers transformer LoRA state dict; anything else is an error."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    unexpected = []
    for key, tensor in state.items():
        module, _, factor = key.removeprefix("transformer.").rpartition(".lora_")
        if not key.startswith("transformer.") or factor not in ("A.weight", "B.weight"):
            unexpected.append(key)
            continue
        modules.setdefault(module, {})[factor[0]] = tensor
    if unexpected:
        raise ValueError(f"only transformer LoRA factors (transformer.<module>.lora_A/lora_B.weight) can be exported "
                         f"to ComfyUI; DoRA, lora_bias and text-encoder LoRAs cannot. Unexpected keys: "
                         f"{sorted(unexpected)[:4]}")
    incomplete = sorted(module for module, factors in modules.items() if len(factors) != 2)
    if incomplete:
        raise ValueError(f"LoRA modules without both lora_A and lora_B: {incomplete[:4]}")
    return {module: (factors["A"], factors["B"]) for module, factors in modules.items()}


def _folded(down: torch.Tensor, scale: float) -> torch.Tensor:
    return (down.float() * scale).to(down.dtype).contiguous()


def diffusers_keys_scaled(modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
                          scale_of: Callable[[int], float]) -> dict[str, torch.Tensor]:
    """Flux / SD3: the diffusers keys ComfyUI maps itself, with each module's scale folded into lora_A."""
    out = {}
    for module, (down, up) in modules.items():
        out[f"transformer.{module}.lora_A.weight"] = _folded(down, scale_of(down.shape[0]))
        out[f"transformer.{module}.lora_B.weight"] = up.contiguous()
    return out


def wan_native_keys(modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
                    scale_of: Callable[[int], float]) -> dict[str, torch.Tensor]:
    """Wan: original module names under diffusion_model.; block modules carry `.alpha` (scale = alpha / rank)."""
    out, unmapped = {}, []
    for module, (down, up) in modules.items():
        rank, scale = down.shape[0], scale_of(down.shape[0])
        parts = module.split(".", 2)  # blocks.N.<block module>
        if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in WAN_BLOCK_MODULES:
            name = f"diffusion_model.blocks.{parts[1]}.{WAN_BLOCK_MODULES[parts[2]]}"
            out[f"{name}.lora_A.weight"] = down.contiguous()
            out[f"{name}.alpha"] = torch.tensor(scale * rank, dtype=torch.float32)
        elif module in WAN_TOP_MODULES:
            name = f"diffusion_model.{WAN_TOP_MODULES[module]}"
            out[f"{name}.lora_A.weight"] = _folded(down, scale)
        else:
            unmapped.append(module)
            continue
        out[f"{name}.lora_B.weight"] = up.contiguous()
    if unmapped:
        raise ValueError(f"no ComfyUI Wan name for the LoRA modules {sorted(unmapped)[:4]}; exportable modules are "
                         f"blocks.N.{{{', '.join(WAN_BLOCK_MODULES)}}} and {', '.join(WAN_TOP_MODULES)}")
    return out


def save_comfyui(diffusers_file: Path, out_file: Path, keys: Callable, alpha: float, metadata: dict[str, str],
                 rslora: bool = False) -> Path:
    """Write out_file, a LoRA that ComfyUI's LoraLoader applies to the family's model, from a diffusers-format
    transformer LoRA file; `keys` is the family's key style (diffusers_keys_scaled, wan_native_keys). The
    applied update is (alpha / rank) * B @ A (alpha / sqrt(rank) with rslora)."""

    def scale_of(rank: int) -> float:
        return float(alpha) / (math.sqrt(rank) if rslora else rank)

    modules = lora_modules(load_file(str(diffusers_file)))
    save_file(keys(modules, scale_of), str(out_file), metadata=metadata)
    return out_file
