"""ComfyUI export for Flux, SD3, Qwen-Image and Wan: the written keys, alphas, and a round trip through diffusers' own readers.

Each test puts a PEFT LoRA (rank 4, non-zero B) on a tiny transformer, saves it with the pipeline's
save_lora_weights, converts it with save_comfyui, reads the ComfyUI file back with the pipeline's lora_state_dict,
loads that into a fresh transformer and checks the forward output matches the original LoRA'd one.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from toolkit.models.lora_export import diffusers_keys_scaled, save_comfyui, wan_native_keys

# Each family's ComfyUI key style, as its adapter names it (comfyui_keys).
KEYS = {"flux": diffusers_keys_scaled, "sd3": diffusers_keys_scaled, "wan21": wan_native_keys, "wan22": wan_native_keys,
        "qwen_image": diffusers_keys_scaled}

RANK = 4
METADATA = {"ss_network_dim": str(RANK), "toolkit_family": "test"}


def _lora(make_transformer, targets: list[str], alpha: float):
    """A fresh tiny transformer (seed 0) with a rank-4 LoRA whose A and B are both random."""
    from peft import LoraConfig

    torch.manual_seed(0)
    transformer = make_transformer().eval()
    transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=alpha, target_modules=targets, init_lora_weights="gaussian"))
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    return transformer


def _export(tmp_path, pipeline_class, transformer, family: str, alpha: float):
    """(diffusers file, ComfyUI file) for the transformer's LoRA."""
    from peft.utils import get_peft_model_state_dict

    pipeline_class.save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(transformer))
    diffusers_file = tmp_path / "pytorch_lora_weights.safetensors"
    out = save_comfyui(diffusers_file, tmp_path / f"{family}_comfyui.safetensors", KEYS[family], alpha,
                       {**METADATA, "ss_network_alpha": str(alpha)})
    return diffusers_file, out


def _reloaded(make_transformer, state: dict[str, torch.Tensor]):
    """A fresh transformer (same base weights) with `state` (diffusers keys, from lora_state_dict) loaded."""
    torch.manual_seed(0)
    transformer = make_transformer().eval()
    transformer.load_lora_adapter(state, prefix="transformer")
    return transformer


def _factors(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    modules = {k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")}
    return {m: (state[f"{m}.lora_A.weight"], state[f"{m}.lora_B.weight"]) for m in modules}


def _assert_same_output(original, reloaded, inputs: dict):
    with torch.no_grad():
        expected = original(**inputs, return_dict=False)[0]
        got = reloaded(**inputs, return_dict=False)[0]
        reloaded.disable_adapters()
        base = reloaded(**inputs, return_dict=False)[0]
    # The LoRA moves the output well beyond the tolerance, so matching it means the mapping is right.
    assert (base - expected).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------- Wan

def _tiny_wan_i2v():
    """Wan 2.1 I2V layout (image embedder, add_k/add_v cross-attention), 2 blocks, width 24."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=8,
                                 added_kv_proj_dim=24, rope_max_seq_len=32)


WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "net.0.proj", "net.2", "linear_1",
               "linear_2", "time_proj", "proj_out"]


def _wan_inputs():
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g), "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
            "encoder_hidden_states_image": torch.randn(1, 5, 8, generator=g)}


def test_wan_native_keys_round_trip_through_diffusers(tmp_path):
    from diffusers import WanPipeline

    alpha = 6.0  # scale 1.5: not a power of two, and not alpha == rank
    original = _lora(_tiny_wan_i2v, WAN_TARGETS, alpha)
    diffusers_file, out = _export(tmp_path, WanPipeline, original, "wan21", alpha)
    comfy = load_file(str(out))

    block = "diffusion_model.blocks.1"
    assert {k for k in comfy if k.startswith(f"{block}.")} == {
        f"{block}.{m}.{s}"
        for m in ["self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                  "cross_attn.v", "cross_attn.o", "cross_attn.k_img", "cross_attn.v_img", "ffn.0", "ffn.2"]
        for s in ["lora_A.weight", "lora_B.weight", "alpha"]}
    top = {k.rsplit(".lora_", 1)[0] for k in comfy if not k.startswith("diffusion_model.blocks.")}
    assert top == {f"diffusion_model.{m}" for m in ["time_embedding.0", "time_embedding.2", "time_projection.1",
                                                      "text_embedding.0", "text_embedding.2", "img_emb.proj.1",
                                                      "img_emb.proj.3", "head.head"]}
    assert len(comfy) == 2 * 12 * 3 + 8 * 2  # no `.alpha` outside the blocks: diffusers' Wan reader refuses them
    assert comfy["diffusion_model.blocks.0.self_attn.q.alpha"].item() == alpha
    assert comfy["diffusion_model.blocks.0.ffn.2.lora_B.weight"].shape == (24, RANK)
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["ss_network_alpha"] == "6.0"

    # diffusers' reader maps the names back and applies alpha / rank to lora_A: every tensor equals the original
    # with the scale applied, the same way, whether it came from an `.alpha` (blocks) or was folded in (the rest).
    original_factors = _factors(load_file(str(diffusers_file)))
    back = WanPipeline.lora_state_dict(str(out))
    back_factors = _factors(back)
    assert back_factors.keys() == original_factors.keys()
    for module, (down, up) in original_factors.items():
        assert torch.equal(back_factors[module][0], down * (alpha / RANK)), module
        assert torch.equal(back_factors[module][1], up), module

    _assert_same_output(original, _reloaded(_tiny_wan_i2v, back), _wan_inputs())

    wan22 = load_file(str(save_comfyui(diffusers_file, tmp_path / "wan22.safetensors", KEYS["wan22"], alpha, METADATA)))
    assert wan22.keys() == comfy.keys() and all(torch.equal(wan22[k], comfy[k]) for k in comfy)


def test_wan_module_without_comfyui_name_is_an_error(tmp_path):
    diffusers_file = tmp_path / "lora.safetensors"
    save_file({"transformer.patch_embedding.lora_A.weight": torch.zeros(RANK, 4, 1, 2, 2),
               "transformer.patch_embedding.lora_B.weight": torch.zeros(24, RANK, 1, 1, 1)}, str(diffusers_file))
    with pytest.raises(ValueError, match="no ComfyUI Wan name for the LoRA modules \\['patch_embedding'\\]"):
        save_comfyui(diffusers_file, tmp_path / "out.safetensors", KEYS["wan21"], 8.0, METADATA)


def test_dora_keys_are_errors(tmp_path):
    diffusers_file = tmp_path / "lora.safetensors"
    save_file({"transformer.proj_out.lora_A.weight": torch.zeros(RANK, 8),
               "transformer.proj_out.lora_B.weight": torch.zeros(8, RANK),
               "transformer.proj_out.lora_magnitude_vector": torch.zeros(8)}, str(diffusers_file))
    with pytest.raises(ValueError, match="DoRA.*transformer.proj_out.lora_magnitude_vector"):
        save_comfyui(diffusers_file, tmp_path / "out.safetensors", KEYS["flux"], 8.0, METADATA)


def test_rslora_scale_is_alpha_over_sqrt_rank(tmp_path):
    diffusers_file = tmp_path / "lora.safetensors"
    down, up = torch.randn(RANK, 24), torch.randn(24, RANK)
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": down,
               "transformer.blocks.0.attn1.to_q.lora_B.weight": up,
               "transformer.proj_out.lora_A.weight": down.clone(), "transformer.proj_out.lora_B.weight": up.clone()},
              str(diffusers_file))
    wan = load_file(str(save_comfyui(diffusers_file, tmp_path / "w.safetensors", KEYS["wan21"], 8.0, METADATA, rslora=True)))
    assert wan["diffusion_model.blocks.0.self_attn.q.alpha"].item() == 16.0  # alpha / rank = 8 / sqrt(4)
    assert torch.equal(wan["diffusion_model.head.head.lora_A.weight"], down * 4.0)
    flux = load_file(str(save_comfyui(diffusers_file, tmp_path / "f.safetensors", KEYS["flux"], 8.0, METADATA, rslora=True)))
    assert torch.equal(flux["transformer.proj_out.lora_A.weight"], down * 4.0)


# ------------------------------------------------------------------------------------------------------ Flux / SD3

def _tiny_flux():
    """Flux.1-dev layout (guidance embedder), 1 double + 1 single block, 2 heads of 16."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                  pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))


def _flux_inputs():
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, 8, generator=g),
            "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
            "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([0.5]),
            "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(5, 3), "guidance": torch.tensor([3.5])}


def _tiny_sd35():
    """SD3.5 Medium layout (a dual-attention first block, qk RMS norm), 2 blocks, 4 heads of 8."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                 attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                 joint_attention_dim=16, pooled_projection_dim=24, pos_embed_max_size=16,
                                 dual_attention_layers=(0,), qk_norm="rms_norm")


def _sd3_inputs():
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
            "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
            "pooled_projections": torch.randn(1, 24, generator=g), "timestep": torch.tensor([500])}


def _tiny_qwen_image():
    """Qwen-Image layout (dual-stream blocks with img_mod / txt_mod), 2 blocks, 2 heads of 16."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                       num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6))


def _qwen_image_inputs():
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, 16, generator=g), "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
            "timestep": torch.tensor([0.5]), "img_shapes": [[(1, 4, 4)]]}


QWEN_LINEAR = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "img_mod.1",
               "txt_mod.1", "net.0.proj", "net.2", "img_in", "txt_in", "linear_1", "linear_2", "norm_out.linear",
               "proj_out"]
ALL_LINEAR = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp",
              "proj_out", "norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear", "x_embedder",
              "context_embedder", "linear_1", "linear_2", "net.0.proj", "net.2"]
SD3_LINEAR = [t for t in ALL_LINEAR if t not in ("proj_mlp", "norm.linear", "x_embedder")]


@pytest.mark.parametrize("family, make_transformer, targets, inputs, known_module", [
    ("flux", _tiny_flux, ALL_LINEAR, _flux_inputs, "single_transformer_blocks.0.proj_mlp"),
    ("sd3", _tiny_sd35, SD3_LINEAR, _sd3_inputs, "transformer_blocks.0.attn2.to_q"),
    ("qwen_image", _tiny_qwen_image, QWEN_LINEAR, _qwen_image_inputs, "transformer_blocks.1.txt_mod.1"),
])
def test_flux_sd3_keep_diffusers_keys_with_the_scale_folded_in(tmp_path, family, make_transformer, targets, inputs,
                                                                 known_module):
    from diffusers import FluxPipeline, QwenImagePipeline, StableDiffusion3Pipeline

    pipeline_class = {"flux": FluxPipeline, "sd3": StableDiffusion3Pipeline, "qwen_image": QwenImagePipeline}[family]
    alpha = 8.0
    original = _lora(make_transformer, targets, alpha)
    diffusers_file, out = _export(tmp_path, pipeline_class, original, family, alpha)
    diffusers_state, comfy = load_file(str(diffusers_file)), load_file(str(out))

    # The keys ComfyUI maps itself (comfy.utils.flux_to_diffusers / mmdit_to_diffusers), unchanged, and no `.alpha`.
    assert comfy.keys() == diffusers_state.keys()
    assert f"transformer.{known_module}.lora_A.weight" in comfy
    for module, (down, up) in _factors(diffusers_state).items():
        comfy_down, comfy_up = comfy[f"{module}.lora_A.weight"], comfy[f"{module}.lora_B.weight"]
        assert torch.equal(comfy_down, down * (alpha / RANK)) and torch.equal(comfy_up, up), module
        torch.testing.assert_close(comfy_up @ comfy_down, (alpha / RANK) * (up @ down))

    back = pipeline_class.lora_state_dict(str(out))
    _assert_same_output(original, _reloaded(make_transformer, back), inputs())
