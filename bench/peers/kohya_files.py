"""The model files kohya sd-scripts reads, written from the bench's diffusers pipeline folders.

SD1.5 and SDXL: sd-scripts reads a diffusers folder itself (train_util._load_target_model,
sdxl_train_util._load_target_model) but converts the UNet into its own class, built at the real SD1.5 / SDXL shape
only (library/original_unet.py, sdxl_original_unet.py): a pipeline with a smaller UNet (--tiny) gets a copy of its
folder with a real-shaped random UNet. Tokenizers: sd-scripts asks the Hub for them unless --tokenizer_cache_dir
holds a folder named after the Hub id ("openai/clip-vit-large-patch14" -> openai_clip-vit-large-patch14).

Flux.1: flux_train_network.py reads single files: the transformer in BFL names (written here from the diffusers
names, the reverse of diffusers' convert_flux_transformer_checkpoint_to_diffusers), and CLIP-L, T5-XXL and the
AutoEncoder, which library/flux_utils.py builds from fixed real configs (a transformer's width too: only its block
counts are read from the file). The speed rows (write_flux_encoders): the pipeline's text encoders are copied where
their shapes are those; otherwise (the bench's two-layer stand-ins, its small VAE) kohya_shapes.py writes random
weights of the shapes kohya builds. The loss parity (write_flux_pipeline): every model is the pipeline's own, whole,
in the names kohya's loaders read, and shapes.json the shapes kohya_launch.py sets kohya's configs to.

transformers 5 (the toolkit's, which writes the pipelines) saves a CLIPTextModel without the `text_model.` prefix
that kohya's transformers 4.54 names its weights with (CLIP_PREFIX): every CLIP file written for kohya has it.

Back from kohya: its Flux LoRA file, which diffusers' converter reads at Flux.1's width only, for the loss parity's
scorer on the tiny pipeline (kohya_flux_lora_at_width)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

TOKENIZERS = {  # the Hub ids sd-scripts loads, by pipeline tokenizer folder
    "sd15": {"tokenizer": "openai/clip-vit-large-patch14"},
    "sdxl": {"tokenizer": "openai/clip-vit-large-patch14", "tokenizer_2": "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k"},
    "flux": {"tokenizer": "openai/clip-vit-large-patch14", "tokenizer_2": "google/t5-v1_1-xxl"},
}


def tokenizer_cache(kind: str, folder: Path, out: Path) -> Path:
    """A --tokenizer_cache_dir holding the pipeline's own tokenizers under the names sd-scripts looks for. The
    `extra_special_tokens: []` transformers 5 writes is left out: its pinned transformers 4.54 reads a dict there."""
    for sub, hub_id in TOKENIZERS[kind].items():
        target = out / hub_id.replace("/", "_")
        if not target.exists():
            shutil.copytree(folder / sub, target)
            config = json.loads((target / "tokenizer_config.json").read_text())
            if config.get("extra_special_tokens") == []:
                del config["extra_special_tokens"]
            (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def unet_is_real(kind: str, folder: Path) -> bool:
    import diffusion_models

    real = diffusion_models.SD15_UNET if kind == "sd15" else diffusion_models.SDXL_UNET
    config = json.loads((folder / "unet" / "config.json").read_text())
    return list(config["block_out_channels"]) == list(real.get("block_out_channels", (320, 640, 1280, 1280)))


SDXL_TEXT_LAYERS = 12  # sdxl_train_util / strategy_sdxl.py reads text_encoder's hidden_states[11]: CLIP-L's 12 layers


def text_encoder_too_shallow(kind: str, folder: Path) -> bool:
    """True when sd-scripts would index past the pipeline's first SDXL text encoder (the bench's two-layer stand-in)."""
    if kind != "sdxl":
        return False
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    return config["num_hidden_layers"] < SDXL_TEXT_LAYERS


def linked_copy(folder: Path, out: Path, leave_out) -> None:
    """`out` holding a link to each entry of the pipeline `folder` but those in `leave_out` (written there anew)."""
    out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name not in leave_out and not item.name.startswith(".") and not (out / item.name).exists():
            (out / item.name).symlink_to(item.resolve())


def real_unet_folder(kind: str, folder: Path, out: Path, device: str) -> tuple[Path, list[str]]:
    """`folder` if sd-scripts can read it as it is, else a copy (links) with what it cannot: a random real-shaped
    UNet in place of a smaller one, and for SDXL a random 12-layer first text encoder (same width and vocabulary) in
    place of a shallower one. The text encoders' outputs are cached before the first step, so their depth changes
    the caching time only."""
    import diffusion_models

    replace = {name for name, wrong in (("unet", not unet_is_real(kind, folder)),
                                        ("text_encoder", text_encoder_too_shallow(kind, folder))) if wrong}
    if not replace:
        return folder, []
    notes = []
    if "unet" in replace:
        notes.append(f"UNet written at the real {kind} shape (sd-scripts builds no other); the pipeline's is smaller")
    if "text_encoder" in replace:
        notes.append(f"text_encoder written with {SDXL_TEXT_LAYERS} random layers (sd-scripts reads its hidden state "
                     "11); the pipeline's has fewer")
    if all((out / name / "config.json").exists() for name in replace):
        return out, notes
    linked_copy(folder, out, leave_out=replace)
    if "unet" in replace:
        from diffusers import UNet2DConditionModel

        real = diffusion_models.SD15_UNET if kind == "sd15" else diffusion_models.SDXL_UNET
        unet = diffusion_models._build(UNet2DConditionModel, real, device)
        unet.save_pretrained(out / "unet")
        del unet
    if "text_encoder" in replace:
        from transformers import CLIPTextConfig, CLIPTextModel

        config = CLIPTextConfig.from_pretrained(folder / "text_encoder")
        config.num_hidden_layers = SDXL_TEXT_LAYERS
        torch.manual_seed(0)
        CLIPTextModel(config).to(torch.bfloat16).save_pretrained(out / "text_encoder")
    return out, notes


# -- Flux.1 transformer: diffusers names -> BFL names -----------------------------------------------------------------
_DIRECT = {"time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
           "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
           "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
           "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
           "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
           "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
           "txt_in": "context_embedder", "img_in": "x_embedder", "final_layer.linear": "proj_out"}
_DOUBLE = {"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear", "img_mlp.0": "ff.net.0.proj",
           "img_mlp.2": "ff.net.2", "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
           "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out"}
_DOUBLE_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
               "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_DOUBLE_NORMS = {"img_attn.norm.query_norm.scale": "attn.norm_q.weight",
                 "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
                 "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
                 "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight"}
_SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out"}
_SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}


def flux_to_bfl(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers FluxTransformer2DModel state dict in the original (BFL) names flux1-dev.safetensors uses."""
    sd = dict(sd)
    out: dict[str, torch.Tensor] = {}

    def move(bfl: str, diffusers: str) -> None:
        for part in ("weight", "bias"):
            if f"{diffusers}.{part}" in sd:
                out[f"{bfl}.{part}"] = sd.pop(f"{diffusers}.{part}")

    def fuse(bfl: str, parts: tuple[str, ...]) -> None:
        for kind in ("weight", "bias"):
            out[f"{bfl}.{kind}"] = torch.cat([sd.pop(f"{p}.{kind}") for p in parts])

    for bfl, diffusers in _DIRECT.items():
        move(bfl, diffusers)
    shift_scale = [sd.pop(f"norm_out.linear.{part}") for part in ("weight", "bias")]
    for part, tensor in zip(("weight", "bias"), shift_scale):  # diffusers keeps (scale, shift), BFL (shift, scale)
        scale, shift = tensor.chunk(2, dim=0)
        out[f"final_layer.adaLN_modulation.1.{part}"] = torch.cat([shift, scale])
    doubles = sorted({int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks.")})
    singles = sorted({int(k.split(".")[1]) for k in sd if k.startswith("single_transformer_blocks.")})
    for i in doubles:
        src, dst = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for bfl, diffusers in _DOUBLE.items():
            move(dst + bfl, src + diffusers)
        for bfl, parts in _DOUBLE_QKV.items():
            fuse(dst + bfl, tuple(src + p for p in parts))
        for bfl, diffusers in _DOUBLE_NORMS.items():
            out[dst + bfl] = sd.pop(src + diffusers)
    for i in singles:
        src, dst = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for bfl, diffusers in _SINGLE.items():
            move(dst + bfl, src + diffusers)
        fuse(dst + "linear1", tuple(src + p for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")))
        for bfl, diffusers in _SINGLE_NORMS.items():
            out[dst + bfl] = sd.pop(src + diffusers)
    if sd:
        raise ValueError(f"diffusers Flux keys with no BFL name: {sorted(sd)[:5]}")
    return out


# -- Flux.1 AutoEncoder: diffusers AutoencoderKL names -> BFL (ldm) names --------------------------------------------
_VAE = [(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.", lambda m: f"{m[1]}.mid.block_{int(m[2]) + 1}."),
        (r"(encoder|decoder)\.mid_block\.attentions\.0\.group_norm\.", r"\1.mid.attn_1.norm."),
        (r"(encoder|decoder)\.mid_block\.attentions\.0\.to_(q|k|v)\.", r"\1.mid.attn_1.\2."),
        (r"(encoder|decoder)\.mid_block\.attentions\.0\.to_out\.0\.", r"\1.mid.attn_1.proj_out."),
        (r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.down.\1.block.\2."),
        (r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
        (r"(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out."), (r"\.conv_shortcut\.", ".nin_shortcut.")]


def flux_vae_to_bfl(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL of Flux's kind (no quant convs) in the names of BFL's ae.safetensors: the decoder's
    up blocks in reverse order, attention projections as 1x1 convolutions."""
    if any("quant_conv" in k for k in sd):
        raise ValueError("a VAE with quant_conv / post_quant_conv is not Flux's AutoEncoder")
    ups = 1 + max((int(k.split(".")[2]) for k in sd if k.startswith("decoder.up_blocks.")), default=-1)
    out = {}
    for key, tensor in sd.items():
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.",
                     lambda m: f"decoder.up.{ups - 1 - int(m[1])}.block.{m[2]}.", key)
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                     lambda m: f"decoder.up.{ups - 1 - int(m[1])}.upsample.", new)
        for pattern, repl in _VAE:
            new = re.sub(pattern, repl, new)
        if ".mid.attn_1." in new and new.endswith("weight") and tensor.dim() == 2:
            tensor = tensor[:, :, None, None]
        out[new] = tensor
    return out


def write_flux_transformer(folder: Path, out: Path) -> Path:
    """folder/transformer (diffusers) -> out (one safetensors file in BFL names), once."""
    from safetensors.torch import load_file, save_file

    if not out.exists():
        sd = {}
        for shard in sorted((folder / "transformer").glob("*.safetensors")):
            sd.update(load_file(shard))
        save_file({k: v.contiguous() for k, v in flux_to_bfl(sd).items()}, str(out))
    return out


def write_flux_encoders(folder: Path, out: Path, env: dict, device: str, log: Path,
                        timeout: float) -> tuple[dict, list[str]]:
    """{"clip_l", "t5xxl", "ae": file} for --clip_l/--t5xxl/--ae, written once under `out` by kohya_shapes.py in the
    peer's own environment (its library builds the shapes); the notes say which are random."""
    from peers.common import run_logged

    files = {name: out / f"{name}.safetensors" for name in ("clip_l", "t5xxl", "ae")}
    if not all(f.exists() for f in files.values()):
        out.mkdir(parents=True, exist_ok=True)
        run_logged([sys.executable, str(Path(__file__).with_name("kohya_shapes.py")), str(folder), str(out), device],
                   out, env, log, timeout)
    notes = (out / "notes.txt").read_text().splitlines()
    return files, notes


# -- Flux.1 for the loss parity: the pipeline's own models, whole ------------------------------------------------------
CLIP_PREFIX = "text_model."


def transformers4_clip_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CLIPTextModel state dict in transformers 4's names (`text_model.*`), whichever transformers saved it."""
    return {k if k.startswith(CLIP_PREFIX) else CLIP_PREFIX + k: v for k, v in state.items()}


def _weights(sub: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for shard in sorted(sub.glob("*.safetensors")):
        state.update(load_file(shard))
    return state


def _config(sub: Path) -> dict:
    return json.loads((sub / "config.json").read_text())


def flux_shapes(folder: Path) -> dict:
    """What kohya_launch.py sets kohya's fixed Flux.1 configs to: the pipeline's transformer (kohya reads its block
    counts from the file), its AutoEncoder and group count, its CLIP-L and T5 configs."""
    dit, vae = _config(folder / "transformer"), _config(folder / "vae")
    heads, widths = dit["num_attention_heads"], vae["block_out_channels"]
    if any(width % widths[0] for width in widths):
        raise ValueError(f"{folder}/vae: block_out_channels {widths} are not multiples of the first (kohya's ch_mult)")
    return {"flux": dict(in_channels=dit["in_channels"], vec_in_dim=dit["pooled_projection_dim"],
                         context_in_dim=dit["joint_attention_dim"], hidden_size=heads * dit["attention_head_dim"],
                         num_heads=heads, axes_dim=list(dit["axes_dims_rope"]), guidance_embed=dit["guidance_embeds"]),
            "ae": dict(in_channels=vae["in_channels"], out_ch=vae["out_channels"], ch=widths[0],
                       ch_mult=[width // widths[0] for width in widths], num_res_blocks=vae["layers_per_block"],
                       z_channels=vae["latent_channels"], scale_factor=vae["scaling_factor"],
                       shift_factor=vae["shift_factor"]),
            "ae_groups": vae["norm_num_groups"],
            "clip_l": _config(folder / "text_encoder"), "t5xxl": _config(folder / "text_encoder_2")}


FLUX_FILES = ("flux", "clip_l", "t5xxl", "ae")  # kohya's --pretrained_model_name_or_path, --clip_l, --t5xxl, --ae


def write_flux_pipeline(folder: Path, out: Path) -> tuple[dict[str, Path], Path]:
    """({name: file} of FLUX_FILES, shapes.json), written once under `out`: the Flux pipeline `folder`'s transformer
    in BFL names, CLIP-L in transformers 4's, T5 with its tied embedding under both names transformers 4 has, the VAE
    in BFL names, each tensor as the pipeline holds it (kohya casts to its own precision)."""
    from safetensors.torch import save_file

    files, shapes = {name: out / f"{name}.safetensors" for name in FLUX_FILES}, out / "shapes.json"
    if shapes.exists():
        return files, shapes
    out.mkdir(parents=True, exist_ok=True)
    write_flux_transformer(folder, files["flux"])
    save_file(transformers4_clip_names(_weights(folder / "text_encoder")), str(files["clip_l"]))
    t5 = _weights(folder / "text_encoder_2")
    t5.setdefault("encoder.embed_tokens.weight", t5["shared.weight"].clone())  # saved once, tied in the model
    save_file(t5, str(files["t5xxl"]))
    save_file({k: v.contiguous() for k, v in flux_vae_to_bfl(_weights(folder / "vae")).items()}, str(files["ae"]))
    shapes.write_text(json.dumps(flux_shapes(folder), indent=1))  # last: it marks the folder done
    return files, shapes


# -- kohya's Flux LoRA file read by diffusers at any width (the loss parity's scorer) ------------------------------
KOHYA_LINEAR1 = re.compile(r"(lora_unet_single_blocks_(\d+)_linear1)\.lora_down\.weight")
FLUX_SPLIT = [3072] * 3 + [12288]  # what diffusers' converter splits a kohya single block's linear1 into


def kohya_flux_lora_at_width(pipe, lora: Path) -> dict | None:
    """A kohya Flux LoRA file in diffusers' names for the pipeline's transformer when diffusers cannot convert it
    itself, else None. diffusers' converter splits a single block's fused linear1 (q, k, v and the MLP's input) at
    Flux.1's sizes (FLUX_SPLIT); on another width (the bench's tiny Flux) that split is made here at the
    transformer's own sizes, alpha / rank folded into the down weights as diffusers does, and the rest of the file
    is left to diffusers' converter."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers
    from safetensors.torch import load_file

    if not hasattr(pipe, "transformer") or not hasattr(pipe.transformer, "single_transformer_blocks"):
        return None
    state = load_file(str(lora))
    fused = [m for key in state if (m := KOHYA_LINEAR1.fullmatch(key))]
    block = pipe.transformer.single_transformer_blocks[0]
    parts = {"attn.to_q": block.attn.to_q, "attn.to_k": block.attn.to_k, "attn.to_v": block.attn.to_v,
             "proj_mlp": block.proj_mlp}
    sizes = [layer.out_features for layer in parts.values()]
    if not fused or sizes == FLUX_SPLIT:
        return None
    split = {}
    for match in fused:
        name, block_index = match[1], match[2]
        down, up = state.pop(f"{name}.lora_down.weight"), state.pop(f"{name}.lora_up.weight")
        alpha = state.pop(f"{name}.alpha", torch.tensor(float(down.shape[0]))).item()
        for part, rows in zip(parts, up.split(sizes)):
            prefix = f"transformer.single_transformer_blocks.{block_index}.{part}"
            split[f"{prefix}.lora_A.weight"] = down * (alpha / down.shape[0])
            split[f"{prefix}.lora_B.weight"] = rows
    return {**_convert_kohya_flux_lora_to_diffusers(state), **split}
