"""LoRA files that load with the scale they were trained at, in every tool that reads the family.

A trained LoRA is first read out of the PEFT modules as factors: {module: Factor(down, up, alpha)}, where
`alpha / rank` is the scale PEFT applied (its own `scaling`, so rsLoRA and rank patterns need no special case).
Each family then writes the factors in one key style that diffusers' `load_lora_weights`, ComfyUI's LoRA
loader and, where the family has one, kohya's sd-scripts or musubi-tuner all read as base + alpha/rank * B @ A:

- sd, sdxl (`kohya_keys`): kohya keys (`lora_unet_...`, `lora_te_` / `lora_te1_` / `lora_te2_`), an `.alpha`
  per module. The key names come from diffusers' convert_state_dict_to_kohya.
- flux (`diffusers_keys_with_alpha`), qwen_image (`qwen_image_keys`): diffusers module names
  (`transformer.<module>.lora_A.weight`; `diffusion_model.` for Qwen-Image) and a `<module>.alpha`, which
  ComfyUI (comfy/lora.py load_lora) and diffusers' Flux and Qwen-Image readers take as the alpha.
- chroma (`chroma_keys`): Flux's, for the modules ComfyUI's Flux map names (not the guidance approximator).
- z_image (`z_image_keys`): as Qwen-Image, diffusers module names under `diffusion_model.` with `.alpha`.
- sd3 (`diffusers_keys_scaled`), flux2 (`flux2_keys`): diffusers module names with the scale folded into lora_A:
  diffusers' SD3 and Flux.2 readers refuse any key without "lora" in it, so an `.alpha` cannot be written. Flux.2's
  save.format=comfyui file (`flux2_comfy_keys`) names the modules ComfyUI's Flux map lacks as ComfyUI's model does.
- wan21, wan22 (`wan_native_keys`): ComfyUI's and the original Wan module names under `diffusion_model.`.
- ltx2 (`ltx2_keys`): the original LTX-2 module names under `diffusion_model.`, as LTX-2 LoRAs are published (for
  the blocks' attention and feed-forward layers they are diffusers' names), the scale folded into lora_A.

A format that cannot hold a module (a Wan module without an original name, DoRA magnitudes) is a ValueError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Factor:
    """One LoRA module: the update applied to the module's weight is (alpha / rank) * up @ down."""

    down: torch.Tensor   # lora_A: (rank, in_features, ...)
    up: torch.Tensor     # lora_B: (out_features, rank, ...)
    alpha: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


Factors = dict[str, Factor]  # module path inside its component (e.g. "down_blocks.1.attentions.0.proj_in") -> factor


def peft_factors(model: torch.nn.Module, dtype: torch.dtype, adapter: str = "default") -> Factors:
    """The factors of a model carrying a PEFT LoRA, on the CPU in `dtype`. The keys come from PEFT's own
    get_peft_model_state_dict; each module's alpha is PEFT's scaling for it times its rank."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=adapter)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    unexpected = []
    for key, tensor in state.items():
        module, _, factor = key.rpartition(".lora_")
        if factor not in ("A.weight", "B.weight"):
            unexpected.append(key)
            continue
        modules.setdefault(module, {})[factor[0]] = tensor.detach().to("cpu", dtype).contiguous()
    if unexpected:
        raise ValueError(f"only plain LoRA factors (lora_A / lora_B) can be exported; DoRA magnitudes and LoRA "
                         f"biases cannot. Unexpected keys: {sorted(unexpected)[:4]}")
    factors = {}
    for module, pair in modules.items():
        layer = model.get_submodule(module)
        rank = pair["A"].shape[0]
        factors[module] = Factor(pair["A"], pair["B"], float(layer.scaling[adapter]) * rank)
    return factors


def _alpha_tensor(alpha: float) -> torch.Tensor:
    return torch.tensor(float(alpha), dtype=torch.float32)


def _folded(factor: Factor) -> torch.Tensor:
    """lora_A times the scale, for formats without alphas (a loader then applies 1 * up @ down)."""
    return (factor.down.float() * factor.scale).to(factor.down.dtype).contiguous()


# -- sd / sdxl: kohya ------------------------------------------------------------------------------------------

def clip_kohya_module(module: str) -> str:
    """A CLIP text-encoder module path as kohya, ComfyUI and sd-scripts name it: under `text_model.`, as in
    transformers 4's CLIPTextModel. transformers 5's CLIPTextModel has no text_model submodule
    (encoder.layers.0...), CLIPTextModelWithProjection keeps it; the file must not depend on which is installed."""
    return module if module.startswith("text_model.") else f"text_model.{module}"


def kohya_keys(unet: Factors, text_encoders: dict[str, Factors], te_prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """kohya keys for the UNet and the text encoders, an `.alpha` per module. Names: diffusers'
    convert_state_dict_to_kohya (unet -> lora_unet_, text_encoder -> lora_te1_, text_encoder_2 -> lora_te2_);
    `te_prefixes` renames a text encoder's prefix where the family's kohya network names it otherwise (SD 1.x:
    sd-scripts' networks/lora.py LORA_PREFIX_TEXT_ENCODER = "lora_te")."""
    from diffusers.utils import convert_state_dict_to_kohya

    peft_state, alphas = {}, {}
    components = {"unet": unet, **{name: factors for name, factors in text_encoders.items()}}
    for component, factors in components.items():
        for module, factor in factors.items():
            name = f"{component}.{clip_kohya_module(module) if component != 'unet' else module}"
            peft_state[f"{name}.lora_A.weight"] = factor.down
            peft_state[f"{name}.lora_B.weight"] = factor.up
            alphas[f"{name}.lora_A.weight"] = factor.alpha
    kohya = convert_state_dict_to_kohya(peft_state)
    # convert_state_dict_to_kohya writes alpha = rank for every module; each module's own alpha replaces it.
    # The kohya key of a module's lora_down is matched back to its PEFT key through the same conversion.
    by_kohya = {next(iter(convert_state_dict_to_kohya({k: v}))): k for k, v in peft_state.items() if ".lora_A." in k}
    out = {}
    for key, tensor in kohya.items():
        if key.endswith(".alpha"):
            continue
        out[key] = tensor.contiguous()
        if key.endswith(".lora_down.weight"):
            out[f"{key.split('.')[0]}.alpha"] = _alpha_tensor(alphas[by_kohya[key]])
    for old, new in te_prefixes.items():
        out = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in out.items()}
    return out


# -- flux, qwen_image, z_image, flux2, sd3: diffusers module names ------------------------------------------------

def diffusers_keys_with_alpha(factors: Factors, prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """`<prefix>.<module>.lora_A/lora_B.weight` and `<prefix>.<module>.alpha`, the diffusers module names.
    Flux (prefix transformer): ComfyUI maps these names itself (comfy/lora.py model_lora_keys_unet,
    `transformer.{diffusers key}` through comfy.utils.flux_to_diffusers) and reads `<key>.alpha`; diffusers' Flux
    reader pops the `.alpha` keys into network alphas."""
    out = {}
    for module, factor in factors.items():
        out[f"{prefix}.{module}.lora_A.weight"] = factor.down
        out[f"{prefix}.{module}.lora_B.weight"] = factor.up
        out[f"{prefix}.{module}.alpha"] = _alpha_tensor(factor.alpha)
    return out


def qwen_image_keys(factors: Factors) -> dict[str, torch.Tensor]:
    """Qwen-Image: the diffusers module names under `diffusion_model.`, with `.alpha`. ComfyUI's QwenImage model
    has the diffusers names (its generic `diffusion_model.<module>` key); diffusers' Qwen-Image reader
    (_convert_non_diffusers_qwen_lora_to_diffusers) strips `diffusion_model.` and applies each alpha, while it
    would take `transformer.`-prefixed keys with alphas for modules of a `transformer` submodule."""
    return diffusers_keys_with_alpha(factors, prefix="diffusion_model")


def z_image_keys(factors: Factors) -> dict[str, torch.Tensor]:
    """Z-Image: the diffusers module names under `diffusion_model.`, with `.alpha`. ComfyUI (comfy/lora.py, its
    Lumina2 branch) maps `diffusion_model.<diffusers module>` through comfy.utils.z_image_to_diffusers, which covers
    every linear layer of the model (to_q/to_k/to_v as slices of the fused qkv); diffusers' Z-Image reader
    (_convert_non_diffusers_z_image_lora_to_diffusers) strips `diffusion_model.` and applies each alpha."""
    return diffusers_keys_with_alpha(factors, prefix="diffusion_model")


# Flux.2 modules a ComfyUI file can name: the blocks' attention and feed-forward layers, the single blocks' fused
# projections, and the input / output layers. The shared modulation layers and the time / guidance embedders are not
# among them (a diffusers-layout file, diffusion_files.py).
FLUX2_COMFYUI_MODULES = re.compile(
    r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|ff\.linear_(in|out)|ff_context\.linear_(in|out))"
    r"|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)|x_embedder|context_embedder|proj_out")


def flux2_keys(factors: Factors) -> dict[str, torch.Tensor]:
    """Flux.2: `transformer.<diffusers module>` with the scale folded into lora_A, as SD3: diffusers' Flux.2 reader
    takes `transformer.` keys as they are and refuses `.alpha` keys; ComfyUI, finding no alpha, applies B @ A. A
    module ComfyUI has no name for is a ValueError."""
    unmapped = sorted(m for m in factors if not FLUX2_COMFYUI_MODULES.fullmatch(m))
    if unmapped:
        raise ValueError(f"no ComfyUI Flux.2 name for the LoRA modules {unmapped[:4]}")
    return diffusers_keys_scaled(factors)


# ComfyUI's diffusers-name map for Flux.2 is Flux.1's (comfy/lora.py model_lora_keys_unet through
# comfy.utils.flux_to_diffusers): it has the attention layers (to_q/k/v as slices of the fused qkv) and x_embedder / context_embedder / proj_out, but
# none of Flux.2's SwiGLU feed-forwards (ff.linear_in/out) or single-block fused projections (attn.to_qkv_mlp_proj,
# attn.to_out), whose `transformer.` keys it skips ("lora key not loaded"; bench/check_exports.py flux2). Those go
# under ComfyUI's generic `diffusion_model.<module>` key with its Flux.2 model's names (the original BFL layout; the
# same pairs as diffusers' convert_flux2_transformer_checkpoint_to_diffusers).
FLUX2_COMFYUI_RENAMES = {  # (diffusers block list, module in the block) -> (ComfyUI block list, module)
    ("transformer_blocks", "ff.linear_in"): ("double_blocks", "img_mlp.0"),
    ("transformer_blocks", "ff.linear_out"): ("double_blocks", "img_mlp.2"),
    ("transformer_blocks", "ff_context.linear_in"): ("double_blocks", "txt_mlp.0"),
    ("transformer_blocks", "ff_context.linear_out"): ("double_blocks", "txt_mlp.2"),
    ("single_transformer_blocks", "attn.to_qkv_mlp_proj"): ("single_blocks", "linear1"),
    ("single_transformer_blocks", "attn.to_out"): ("single_blocks", "linear2"),
}


def flux2_comfy_keys(factors: Factors) -> dict[str, torch.Tensor]:
    """Flux.2's save.format=comfyui file: flux2_keys, with the modules ComfyUI's Flux map lacks as
    `diffusion_model.<ComfyUI block list>.N.<module>.lora_A/lora_B.weight` (flux2_comfy_module); ComfyUI, finding no
    alpha, applies B @ A. A module ComfyUI has no name for is a ValueError."""
    out = {}
    for key, value in flux2_keys(factors).items():
        module, part, weight = key.rsplit(".", 2)
        out[f"{flux2_comfy_module(module)}.{part}.{weight}"] = value
    return out


def flux2_comfy_module(name: str) -> str:
    """A FLUX.2 module named as diffusers does (`transformer.<block list>.N.<module>`) under ComfyUI's Flux.2 name
    where its Flux map lacks the diffusers one (FLUX2_COMFYUI_RENAMES), else unchanged. Also how the LoKr / LoHa
    files FLUX.2 runs wrote before they took ComfyUI's names are read today."""
    prefix, _, rest = name.partition(".")
    blocks, _, rest = rest.partition(".")
    index, _, inner = rest.partition(".")
    if prefix == "transformer" and (blocks, inner) in FLUX2_COMFYUI_RENAMES:
        comfy_blocks, comfy_inner = FLUX2_COMFYUI_RENAMES[blocks, inner]
        return f"diffusion_model.{comfy_blocks}.{index}.{comfy_inner}"
    return name


# Chroma modules that ComfyUI maps from diffusers names: its Chroma model is a Flux model to the LoRA loader
# (comfy/lora.py model_lora_keys_unet, comfy.utils.flux_to_diffusers). The approximator (distilled_guidance_layer)
# has no entry there.
CHROMA_COMFYUI_MODULES = re.compile(
    r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))"
    r"|single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_out)|x_embedder|context_embedder|proj_out")


def chroma_keys(factors: Factors) -> dict[str, torch.Tensor]:
    """Chroma: Flux's keys, `transformer.<diffusers module>` with `.alpha` (ChromaPipeline reads them with Flux's
    reader). A module ComfyUI has no name for is a ValueError."""
    unmapped = sorted(m for m in factors if not CHROMA_COMFYUI_MODULES.fullmatch(m))
    if unmapped:
        raise ValueError(f"no ComfyUI Chroma name for the LoRA modules {unmapped[:4]}")
    return diffusers_keys_with_alpha(factors)


def diffusers_keys_scaled(factors: Factors) -> dict[str, torch.Tensor]:
    """SD3: the diffusers keys ComfyUI maps itself (comfy.utils.mmdit_to_diffusers), the scale folded into
    lora_A; no `.alpha` keys, which diffusers' SD3 loader refuses."""
    out = {}
    for module, factor in factors.items():
        out[f"transformer.{module}.lora_A.weight"] = _folded(factor)
        out[f"transformer.{module}.lora_B.weight"] = factor.up
    return out


# -- wan21 / wan22: the original Wan names ---------------------------------------------------------------------
# ComfyUI has no diffusers-name map for Wan; it reads the original Wan module names under `diffusion_model.`
# (its generic "diffusion_model.<module>" key). Block modules get an `.alpha` (ComfyUI and diffusers' Wan
# reader, _convert_non_diffusers_wan_lora_to_diffusers, both scale by alpha/rank); the few modules outside
# the blocks get the scale folded in, because diffusers' Wan reader consumes alphas only inside blocks and
# refuses leftover keys.

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


def wan_native_keys(factors: Factors) -> dict[str, torch.Tensor]:
    """Wan: original module names under diffusion_model.; block modules carry `.alpha`."""
    out, unmapped = {}, []
    for module, factor in factors.items():
        parts = module.split(".", 2)  # blocks.N.<block module>
        if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in WAN_BLOCK_MODULES:
            name = f"diffusion_model.blocks.{parts[1]}.{WAN_BLOCK_MODULES[parts[2]]}"
            out[f"{name}.lora_A.weight"] = factor.down
            out[f"{name}.alpha"] = _alpha_tensor(factor.alpha)
        elif module in WAN_TOP_MODULES:
            name = f"diffusion_model.{WAN_TOP_MODULES[module]}"
            out[f"{name}.lora_A.weight"] = _folded(factor)
        else:
            unmapped.append(module)
            continue
        out[f"{name}.lora_B.weight"] = factor.up
    if unmapped:
        raise ValueError(f"no ComfyUI Wan name for the LoRA modules {sorted(unmapped)[:4]}; exportable modules are "
                         f"blocks.N.{{{', '.join(WAN_BLOCK_MODULES)}}} and {', '.join(WAN_TOP_MODULES)}")
    return out


# -- ltx2: the original LTX-2 names -----------------------------------------------------------------------------
# LTX-2 LoRAs (Lightricks' trainer, ComfyUI) use the original model's names under `diffusion_model.`: ComfyUI's
# LTXAV model has them, and its LoRA loader maps them through its generic "diffusion_model.<module>" key (comfy/lora.py
# model_lora_keys_unet); diffusers' LTX-2 reader (_convert_non_diffusers_ltx2_lora_to_diffusers) renames them back.
# The blocks' attention and feed-forward layers have the same name in both models, so those are the modules a file
# holds (video and audio streams alike).
LTX2_NATIVE_MODULES = re.compile(
    r"transformer_blocks\.\d+\.((audio_)?attn[12]|audio_to_video_attn|video_to_audio_attn)\.(to_q|to_k|to_v|to_out\.0)"
    r"|transformer_blocks\.\d+\.(audio_)?ff\.net\.(0\.proj|2)")


def ltx2_keys(factors: Factors) -> dict[str, torch.Tensor]:
    """LTX-2: `diffusion_model.<module>.lora_A/lora_B.weight`, the scale folded into lora_A as for SD3: diffusers'
    LTX-2 reader refuses any key without "lora" in it (an `.alpha`), and ComfyUI, finding no alpha, applies B @ A. A
    module without the same name in the original model is a ValueError (the file then falls back to diffusers' own
    layout)."""
    unmapped = sorted(m for m in factors if not LTX2_NATIVE_MODULES.fullmatch(m))
    if unmapped:
        raise ValueError(f"no ComfyUI LTX-2 name for the LoRA modules {unmapped[:4]}")
    out = {}
    for module, factor in factors.items():
        out[f"diffusion_model.{module}.lora_A.weight"] = _folded(factor)
        out[f"diffusion_model.{module}.lora_B.weight"] = factor.up
    return out


# -- hunyuan_video15: ComfyUI's HunyuanVideo names ---------------------------------------------------------------
# ComfyUI's HunyuanVideo 1.5 (comfy/ldm/hunyuan_video/model.py) keeps the original Tencent layout: Flux-style
# double_blocks with one fused qkv per stream. Its LoRA key map (comfy/lora.py model_lora_keys_unet) has no
# diffusers names for it; it reads `diffusion_model.<module>` (its generic key). The q, k and v LoRAs of a stream
# become one LoRA of the fused qkv: A stacked (rank 3r), B block-diagonal, so B @ A is the three updates stacked.

HUNYUAN15_BLOCK_MODULES = {  # diffusers HunyuanVideo15TransformerBlock module -> ComfyUI double block module
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
    "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
}
HUNYUAN15_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}


def hunyuan15_comfy_keys(factors: Factors) -> dict[str, torch.Tensor]:
    """HunyuanVideo 1.5 in ComfyUI's names: `diffusion_model.double_blocks.N.<module>.lora_A/lora_B.weight`, the
    scale folded into lora_A (no alphas: the fused qkv's parts may have different scales); q/k/v fused. A module
    outside the blocks, or a q/k/v without its two siblings, is a ValueError."""
    out, used = {}, set()
    blocks = sorted({int(m.split(".")[1]) for m in factors if m.startswith("transformer_blocks.")})
    for i in blocks:
        prefix, name = f"transformer_blocks.{i}.", f"diffusion_model.double_blocks.{i}."
        for module, comfy in HUNYUAN15_BLOCK_MODULES.items():
            if prefix + module in factors:
                factor = factors[prefix + module]
                out[f"{name}{comfy}.lora_A.weight"] = _folded(factor)
                out[f"{name}{comfy}.lora_B.weight"] = factor.up
                used.add(prefix + module)
        for comfy, parts in HUNYUAN15_QKV.items():
            present = [prefix + p for p in parts if prefix + p in factors]
            if not present:
                continue
            if len(present) != 3:
                raise ValueError(f"{prefix}{parts[0].rsplit('.', 1)[0]}: ComfyUI's {comfy} is one layer; a LoRA on "
                                 f"{', '.join(present)} needs q, k and v")
            parts_f = [factors[p] for p in present]
            out[f"{name}{comfy}.lora_A.weight"] = torch.cat([_folded(f) for f in parts_f]).contiguous()
            out[f"{name}{comfy}.lora_B.weight"] = torch.block_diag(*[f.up for f in parts_f]).contiguous()
            used.update(present)
    unmapped = sorted(set(factors) - used)
    if unmapped:
        raise ValueError(f"no ComfyUI HunyuanVideo name for the LoRA modules {unmapped[:4]}; exportable modules are "
                         f"transformer_blocks.N.{{{', '.join([*HUNYUAN15_BLOCK_MODULES, 'attn.to_q/k/v'])}}}")
    return out
