"""The single files musubi-tuner reads, written from the bench's diffusers pipeline folder (bench/diffusion_models.py):
the Wan DiT, VAE and UMT5 encoder in the original Wan names, and the shapes musubi must build them in.

musubi builds each model from a fixed configuration (wan/configs: the 1.3B or A14B DiT; wan/modules/vae.py: the Wan
2.1 VAE, 96 wide; wan/modules/t5.py: umt5-xxl, 24 layers of 4096) and loads the file into it. The bench's DiT has the
real shape (the tiny one under --tiny does not), its VAE and text encoder are narrow stand-ins that the toolkit rows
use too (they only run while caching). `shapes` records what the files hold; bench/peers/musubi_launch.py sets
musubi's configurations to it before the script runs, so every trainer encodes with the same weights.

Names: diffusers' own converters (diffusers.loaders.single_file_utils: convert_wan_transformer_to_diffusers,
convert_wan_vae_to_diffusers) go from the original names to diffusers'; the maps here go back and are checked against
them key for key (a key that does not come back is an error). The UMT5 map follows the modules of both encoders."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# diffusers WanTransformer3DModel name -> original Wan name (the reverse of convert_wan_transformer_to_diffusers)
DIT_PARTS = (("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
             ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
             ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
             ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
             ("condition_embedder.time_proj", "time_projection.1"),
             ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
             ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
             ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
             ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
             (".attn1.", ".self_attn."), (".attn2.", ".cross_attn."), (".to_out.0.", ".o."), (".to_q.", ".q."),
             (".to_k.", ".k."), (".to_v.", ".v."), (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."),
             (".norm_added_k.", ".norm_k_img."), (".ffn.net.0.proj.", ".ffn.0."), (".ffn.net.2.", ".ffn.2."))


def wan_dit_name(key: str) -> str:
    if key == "scale_shift_table":
        return "head.modulation"
    if key.startswith("proj_out."):
        return "head.head." + key.removeprefix("proj_out.")
    for new, old in DIT_PARTS:
        key = key.replace(new, old)
    if key.startswith("blocks."):
        key = key.replace(".scale_shift_table", ".modulation")
        key = key.replace(".norm2.", ".norm__.").replace(".norm3.", ".norm2.").replace(".norm__.", ".norm3.")
    return key


def wan_dit_state(diffusers_state: dict) -> dict:
    """A diffusers WanTransformer3DModel state dict in the original Wan / ComfyUI names (musubi's load_wan_model)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    out = {wan_dit_name(k): v for k, v in diffusers_state.items()}
    back = convert_wan_transformer_to_diffusers({k: k for k in out})
    wrong = sorted(k for k in diffusers_state if out.get(wan_dit_name(k)) is None or back.get(k) != wan_dit_name(k))
    if wrong:
        raise ValueError(f"diffusers' converter does not bring these Wan DiT keys back: {wrong[:4]}")
    return out


RESIDUAL = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
            "conv_shortcut": "shortcut"}
VAE_PARTS = {"encoder.conv_in": "encoder.conv1", "decoder.conv_in": "decoder.conv1", "quant_conv": "conv1",
             "post_quant_conv": "conv2", "encoder.norm_out": "encoder.head.0", "encoder.conv_out": "encoder.head.2",
             "decoder.norm_out": "decoder.head.0", "decoder.conv_out": "decoder.head.2"}


def wan_vae_name(key: str, resnets: int) -> str:
    """The original Wan VAE name of a diffusers AutoencoderKLWan key, for a VAE of `resnets` residual blocks a
    level (the decoder has resnets + 1 a level, then an upsampler except after the last level)."""
    parts = key.split(".")
    module, leaf = ".".join(parts[:-1]), parts[-1]
    if module in VAE_PARTS:
        return f"{VAE_PARTS[module]}.{leaf}"
    if parts[1] == "mid_block":  # resnets.0, attentions.0, resnets.1 -> middle.0, .1, .2
        index = {"resnets.0": 0, "attentions.0": 1, "resnets.1": 2}[".".join(parts[2:4])]
        rest = parts[4:]
        return ".".join([parts[0], "middle", str(index)] + ([RESIDUAL[rest[0]]] + rest[1:] if index != 1 else rest))
    if key.startswith("encoder.down_blocks."):
        rest = parts[3:]
        rest = [RESIDUAL[rest[0]]] + rest[1:] if rest[0] in RESIDUAL else rest
        return ".".join(["encoder.downsamples", parts[2]] + rest)
    if key.startswith("decoder.up_blocks."):
        level, kind, index, rest = int(parts[2]), parts[3], int(parts[4]), parts[5:]
        per_level = resnets + 2
        if kind == "resnets":
            return ".".join(["decoder.upsamples", str(level * per_level + index), RESIDUAL[rest[0]]] + rest[1:])
        return ".".join(["decoder.upsamples", str(level * per_level + resnets + 1)] + rest)  # upsamplers.0.*
    raise ValueError(f"no original Wan VAE name for {key}")


def wan_vae_state(diffusers_state: dict, resnets: int) -> dict:
    """A diffusers AutoencoderKLWan state dict in the original Wan VAE names (musubi's WanVAE). diffusers' converter
    brings every key back except the decoder's up blocks, which it knows for the real VAE's layout only (its
    indices are computed here for any number of residual blocks, so the bench's narrow VAE converts too)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    out = {wan_vae_name(k, resnets): v for k, v in diffusers_state.items()}
    names = {wan_vae_name(k, resnets): k for k in diffusers_state if not k.startswith("decoder.up_blocks.")}
    back = convert_wan_vae_to_diffusers(dict(zip(names, names)))
    wrong = sorted(k for o, k in names.items() if back.get(k) != o)
    if wrong:
        raise ValueError(f"diffusers' converter does not bring these Wan VAE keys back: {wrong[:4]}")
    return out


def umt5_state(hf_state: dict, layers: int) -> dict:
    """transformers' UMT5EncoderModel state dict in the original Wan T5 encoder names (musubi's T5EncoderModel strips
    `encoder.` itself, so none is written)."""
    out = {"token_embedding.weight": hf_state["shared.weight"],
           "norm.weight": hf_state["encoder.final_layer_norm.weight"]}
    for i in range(layers):
        hf, wan = f"encoder.block.{i}.layer.", f"blocks.{i}."
        out[wan + "norm1.weight"] = hf_state[hf + "0.layer_norm.weight"]
        for p in "qkvo":
            out[wan + f"attn.{p}.weight"] = hf_state[hf + f"0.SelfAttention.{p}.weight"]
        out[wan + "pos_embedding.embedding.weight"] = hf_state[hf + "0.SelfAttention.relative_attention_bias.weight"]
        out[wan + "norm2.weight"] = hf_state[hf + "1.layer_norm.weight"]
        out[wan + "ffn.gate.0.weight"] = hf_state[hf + "1.DenseReluDense.wi_0.weight"]
        out[wan + "ffn.fc1.weight"] = hf_state[hf + "1.DenseReluDense.wi_1.weight"]
        out[wan + "ffn.fc2.weight"] = hf_state[hf + "1.DenseReluDense.wo.weight"]
    return out


def write_wan(folder: Path, out: Path, dit_dtype: torch.dtype = torch.bfloat16) -> dict:
    """dit.safetensors (in `dit_dtype`), vae.safetensors, t5.safetensors and shapes.json in `out` (once), from the
    Wan pipeline `folder`; returns the shapes (also the paths under "files")."""
    from safetensors.torch import load_file, save_file

    done = out / "shapes.json"
    if done.exists():
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    dit_config = json.loads((folder / "transformer" / "config.json").read_text())
    dit = {}
    for part in sorted((folder / "transformer").glob("*.safetensors")):
        dit.update(load_file(part))
    save_file({k: v.to(dit_dtype).contiguous() for k, v in wan_dit_state(dit).items()}, out / "dit.safetensors")
    del dit
    vae_config = json.loads((folder / "vae" / "config.json").read_text())
    vae = load_file(next((folder / "vae").glob("*.safetensors")))
    resnets = vae_config["num_res_blocks"]
    save_file({k: v.float().contiguous() for k, v in wan_vae_state(vae, resnets).items()},
              out / "vae.safetensors")
    t5_config = json.loads((folder / "text_encoder" / "config.json").read_text())
    t5 = {}
    for part in sorted((folder / "text_encoder").glob("*.safetensors")):
        t5.update(load_file(part))
    if "shared.weight" not in t5:
        t5["shared.weight"] = t5["encoder.embed_tokens.weight"]
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in umt5_state(t5, t5_config["num_layers"]).items()},
              out / "t5.safetensors")
    heads = dit_config["num_attention_heads"]
    shapes = {
        "family": "wan",
        "dit": dict(dim=heads * dit_config["attention_head_dim"], ffn_dim=dit_config["ffn_dim"], num_heads=heads,
                    num_layers=dit_config["num_layers"], freq_dim=dit_config["freq_dim"],
                    in_dim=dit_config["in_channels"], out_dim=dit_config["out_channels"], eps=dit_config["eps"]),
        "vae": dict(dim=vae_config["base_dim"], dim_mult=vae_config["dim_mult"], num_res_blocks=resnets,
                    temperal_downsample=vae_config["temperal_downsample"]),
        "t5": dict(vocab_size=t5_config["vocab_size"], dim=t5_config["d_model"],
                   dim_attn=t5_config["num_heads"] * t5_config["d_kv"], dim_ffn=t5_config["d_ff"],
                   num_heads=t5_config["num_heads"], encoder_layers=t5_config["num_layers"],
                   decoder_layers=t5_config["num_layers"], num_buckets=t5_config["relative_attention_num_buckets"],
                   max_dist=t5_config["relative_attention_max_distance"]),
        "files": {name: str(out / f"{name}.safetensors") for name in ("dit", "vae", "t5")},
    }
    write_tokenizer_cache(folder / "tokenizer", out / "hf-home")
    shapes["hf_home"] = str(out / "hf-home")
    done.write_text(json.dumps(shapes, indent=1))
    return shapes


def write_tokenizer_cache(tokenizer: Path, hf_home: Path) -> None:
    """musubi's Wan T5 reads its tokenizer from the hub (Wan-AI/Wan2.1-T2V-14B, subfolder google/umt5-xxl): the
    pipeline's tokenizer is placed in a Hugging Face cache under that name, read offline (HF_HUB_OFFLINE)."""
    repo = hf_home / "hub" / "models--Wan-AI--Wan2.1-T2V-14B"
    revision = "0" * 40
    target = repo / "snapshots" / revision / "google" / "umt5-xxl"
    target.mkdir(parents=True, exist_ok=True)
    for file in tokenizer.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    config_file = target / "tokenizer_config.json"  # transformers 5 writes a list here; musubi's 4.57 wants a dict
    config = json.loads(config_file.read_text())
    if isinstance(config.get("extra_special_tokens"), list):
        config["extra_special_tokens"] = {}
    config_file.write_text(json.dumps(config, indent=1))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)


# -- Qwen-Image ----------------------------------------------------------------------------------------------------
TEXT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "vocab_size", "bos_token_id", "eos_token_id", "rms_norm_eps")
VISION_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
               "spatial_merge_size", "temporal_patch_size", "window_size", "fullatt_block_indexes")


def qwen_vl_state(hf_state: dict) -> dict:
    """transformers 5's Qwen2_5_VLForConditionalGeneration names -> the checkpoint names musubi's load_qwen2_5_vl
    reads (model.* for the language model, visual.*, lm_head.*; it adds language_model / model.visual itself)."""
    out = {}
    for key, value in hf_state.items():
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        elif key.startswith("model.visual."):
            key = key.removeprefix("model.")
        out[key] = value
    return out


def write_qwen_image(folder: Path, out: Path, dit_dtype: torch.dtype = torch.bfloat16) -> dict:
    """dit.safetensors (diffusers names, which musubi's QwenImageTransformer2DModel has), vae.safetensors (the
    diffusers AutoencoderKLQwenImage names musubi's loader reads), text_encoder.safetensors (Qwen2.5-VL checkpoint
    names) and shapes.json in `out` (once); the tokenizer under the hub name musubi asks for (Qwen/Qwen-Image)."""
    from safetensors.torch import load_file, save_file

    done = out / "shapes.json"
    if done.exists():
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)

    def load(part: str) -> dict:
        state = {}
        for file in sorted((folder / part).glob("*.safetensors")):
            state.update(load_file(file))
        return state

    save_file({k: v.to(dit_dtype).contiguous() for k, v in load("transformer").items()}, out / "dit.safetensors")
    save_file({k: v.float().contiguous() for k, v in load("vae").items()}, out / "vae.safetensors")
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in qwen_vl_state(load("text_encoder")).items()},
              out / "text_encoder.safetensors")
    dit = json.loads((folder / "transformer" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    te = json.loads((folder / "text_encoder" / "config.json").read_text())
    text, vision = te["text_config"], te["vision_config"]
    shapes = {
        "family": "qwen_image",
        "dit": {k: dit[k] for k in ("num_layers", "attention_head_dim", "num_attention_heads", "joint_attention_dim",
                                    "axes_dims_rope")},
        "vae": {k: vae[k] for k in ("base_dim", "dim_mult", "num_res_blocks", "temperal_downsample")},
        "text": {**{k: text[k] for k in TEXT_KEYS}, "mrope_section": text["rope_parameters"]["mrope_section"],
                 **{k: te[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                       "vision_end_token_id")}},
        "vision": {k: vision[k] for k in VISION_KEYS},
        "files": {name: str(out / f"{name}.safetensors") for name in ("dit", "vae", "text_encoder")},
    }
    write_qwen_tokenizer_cache(folder / "tokenizer", out / "hf-home")
    shapes["hf_home"] = str(out / "hf-home")
    done.write_text(json.dumps(shapes, indent=1))
    return shapes


def write_qwen_tokenizer_cache(tokenizer: Path, hf_home: Path) -> None:
    """musubi reads Qwen2Tokenizer (the slow one: vocab.json and merges.txt) from Qwen/Qwen-Image, subfolder
    tokenizer: the pipeline's tokenizer, its vocabulary and merges taken from its tokenizer.json."""
    repo = hf_home / "hub" / "models--Qwen--Qwen-Image"
    revision = "0" * 40
    target = repo / "snapshots" / revision / "tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    fast = json.loads((tokenizer / "tokenizer.json").read_text())
    (target / "vocab.json").write_text(json.dumps(fast["model"]["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in fast["model"]["merges"]]
    (target / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("extra_special_tokens", "backend", "tokenizer_class")}
    added = {t["content"]: t for t in fast.get("added_tokens", [])}
    config["added_tokens_decoder"] = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                          "single_word", "special")}
                                      for t in added.values()}
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
