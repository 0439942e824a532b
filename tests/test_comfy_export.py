"""The transformer key styles (Flux, SD3, Qwen-Image, Z-Image, Flux.2, Chroma, Wan): the written keys, alphas, and a round trip through
diffusers' own readers on layouts the quickstarts do not have (Wan image-to-video, every linear layer).

Each test puts a PEFT LoRA (rank 4, non-zero B) on a tiny transformer, reads its factors (peft_factors), writes
them in the family's key style, reads the file back with the pipeline's lora_state_dict, loads that into a fresh
transformer and checks the forward output matches the original LoRA'd one.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import REPO
from helpers import diffusion_train_args
from toolkit.models.diffusion_chroma import CHROMA_ALL_LINEAR
from toolkit.models.diffusion_flux2 import FLUX2_ALL_LINEAR
from toolkit.models.lora_export import (Factor, chroma_keys, diffusers_keys_scaled, diffusers_keys_with_alpha,
                                        flux2_comfy_keys, flux2_keys, peft_factors, qwen_image_keys, wan_native_keys,
                                        z_image_keys)

# Each family's key style, as its adapter names it (transformer_key_style).
KEYS = {"flux": diffusers_keys_with_alpha, "sd3": diffusers_keys_scaled, "wan21": wan_native_keys,
        "wan22": wan_native_keys, "qwen_image": qwen_image_keys, "z_image": z_image_keys, "flux2": flux2_keys,
        "chroma": chroma_keys}
SCALED = {"sd3", "flux2"}  # the scale folded into lora_A: their diffusers readers refuse `.alpha` keys

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


def _export(tmp_path, transformer, family: str, alpha: float):
    """(the transformer's PEFT state dict, the file in the family's key style)."""
    from peft.utils import get_peft_model_state_dict

    out = tmp_path / f"{family}.safetensors"
    save_file(KEYS[family](peft_factors(transformer, torch.float32)), str(out),
              metadata={**METADATA, "ss_network_alpha": str(alpha)})
    return {f"transformer.{k}": v for k, v in get_peft_model_state_dict(transformer).items()}, out


def _reloaded(make_transformer, state: dict[str, torch.Tensor]):
    """A fresh transformer (same base weights) with `state` (diffusers keys, from lora_state_dict) loaded."""
    torch.manual_seed(0)
    transformer = make_transformer().eval()
    transformer.load_lora_adapter(state, prefix="transformer")
    return transformer


def _factors(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    modules = {k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")}
    return {m: (state[f"{m}.lora_A.weight"], state[f"{m}.lora_B.weight"]) for m in modules}


def _output(model, inputs: dict) -> torch.Tensor:
    out = model(**inputs, return_dict=False)[0]
    return torch.stack(out) if isinstance(out, list) else out  # Z-Image returns one tensor per sample


def _assert_same_output(original, reloaded, inputs: dict):
    with torch.no_grad():
        expected = _output(original, inputs)
        got = _output(reloaded, inputs)
        reloaded.disable_adapters()
        base = _output(reloaded, inputs)
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
    peft_state, out = _export(tmp_path, original, "wan21", alpha)
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
    original_factors = _factors(peft_state)
    back = WanPipeline.lora_state_dict(str(out))
    back_factors = _factors(back)
    assert back_factors.keys() == original_factors.keys()
    for module, (down, up) in original_factors.items():
        assert torch.equal(back_factors[module][0], down * (alpha / RANK)), module
        assert torch.equal(back_factors[module][1], up), module

    _assert_same_output(original, _reloaded(_tiny_wan_i2v, back), _wan_inputs())


def test_wan_module_without_comfyui_name_is_an_error():
    factors = {"patch_embedding": Factor(torch.zeros(RANK, 4, 1, 2, 2), torch.zeros(24, RANK, 1, 1, 1), 8.0)}
    with pytest.raises(ValueError, match="no ComfyUI Wan name for the LoRA modules \\['patch_embedding'\\]"):
        wan_native_keys(factors)


def test_dora_magnitudes_are_errors():
    from peft import LoraConfig

    torch.manual_seed(0)
    transformer = _tiny_flux()
    transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=8, target_modules=["proj_out"], use_dora=True))
    with pytest.raises(ValueError, match="DoRA.*proj_out.lora_magnitude_vector"):
        peft_factors(transformer, torch.float32)


def test_rslora_alpha_is_the_scale_times_rank():
    """peft_factors reads PEFT's own scaling: with rsLoRA alpha / sqrt(rank), written as alpha' = scale * rank."""
    from peft import LoraConfig

    torch.manual_seed(0)
    transformer = _tiny_flux()
    transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=8, target_modules=["proj_out"], use_rslora=True))
    factor = peft_factors(transformer, torch.float32)["proj_out"]
    assert factor.scale == 4.0 and factor.alpha == 16.0  # 8 / sqrt(4)
    wan = wan_native_keys({"blocks.0.attn1.to_q": factor, "proj_out": factor})
    assert wan["diffusion_model.blocks.0.self_attn.q.alpha"].item() == 16.0
    assert torch.equal(wan["diffusion_model.head.head.lora_A.weight"], factor.down * 4.0)
    assert diffusers_keys_with_alpha({"proj_out": factor})["transformer.proj_out.alpha"].item() == 16.0
    assert torch.equal(diffusers_keys_scaled({"proj_out": factor})["transformer.proj_out.lora_A.weight"],
                       factor.down * 4.0)


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


def _tiny_z_image():
    """Z-Image layout (noise / context refiners, joint layers, fused-in-ComfyUI attention), 1 block each, dim 32."""
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                    cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32])


def _z_image_inputs():
    g = torch.Generator().manual_seed(1)
    return {"x": [torch.randn(4, 1, 8, 8, generator=g)], "t": torch.tensor([0.5]),
            "cap_feats": [torch.randn(5, 16, generator=g)]}


def _tiny_flux2():
    """FLUX.2 layout (shared modulation, fused single-block projections), 1 double + 1 single block, 2 heads of 16."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=12, axes_dims_rope=(4, 4, 4, 4))


def _flux2_inputs():
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, 8, generator=g),
            "encoder_hidden_states": torch.randn(1, 5, 12, generator=g), "timestep": torch.tensor([0.5]),
            "img_ids": torch.zeros(16, 4), "txt_ids": torch.zeros(5, 4), "guidance": torch.tensor([3.5])}


def _tiny_chroma():
    """Chroma layout (approximator-driven modulation, no modulation layers in the blocks), 1 double + 1 single block."""
    from toolkit.tiny.chroma import chroma_transformer

    return chroma_transformer(in_channels=8, joint_attention_dim=16)


def _chroma_inputs():
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, 8, generator=g),
            "encoder_hidden_states": torch.randn(1, 5, 16, generator=g), "timestep": torch.tensor([0.5]),
            "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(5, 3),
            "attention_mask": torch.tensor([[True] * 4 + [False] + [True] * 16])}


# Every linear layer of each: all of them have a name in ComfyUI's maps (comfy.utils.z_image_to_diffusers; for Flux.2
# flux_to_diffusers, which has none for the shared modulation and the embedders, hence the adapter's all-linear).
Z_IMAGE_LINEAR = (r".*(\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123]|adaLN_modulation\.0)"
                  r"|all_x_embedder\.2-1|all_final_layer\.2-1\.(linear|adaLN_modulation\.1)|t_embedder\.mlp\.[02]"
                  r"|cap_embedder\.1)")
QWEN_LINEAR = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "img_mod.1",
               "txt_mod.1", "net.0.proj", "net.2", "img_in", "txt_in", "linear_1", "linear_2", "norm_out.linear",
               "proj_out"]
ALL_LINEAR = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp",
              "proj_out", "norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear", "x_embedder",
              "context_embedder", "linear_1", "linear_2", "net.0.proj", "net.2"]
SD3_LINEAR = [t for t in ALL_LINEAR if t not in ("proj_mlp", "norm.linear", "x_embedder")]


def _loaded_by_the_pipeline(pipeline_class, make_transformer, file):
    """A fresh transformer (same base weights) with `file` loaded by the pipeline's own load_lora_weights."""
    import inspect

    torch.manual_seed(0)
    transformer = make_transformer().eval()
    params = inspect.signature(pipeline_class.__init__).parameters
    pipe = pipeline_class(**{n: None for n, p in params.items() if n != "self" and p.default is inspect.Parameter.empty
                             and n != "transformer"}, transformer=transformer)
    pipe.load_lora_weights(str(file))
    return transformer


@pytest.mark.parametrize("family, make_transformer, targets, inputs, known_module", [
    ("flux", _tiny_flux, ALL_LINEAR, _flux_inputs, "single_transformer_blocks.0.proj_mlp"),
    ("sd3", _tiny_sd35, SD3_LINEAR, _sd3_inputs, "transformer_blocks.0.attn2.to_q"),
    ("qwen_image", _tiny_qwen_image, QWEN_LINEAR, _qwen_image_inputs, "transformer_blocks.1.txt_mod.1"),
    ("z_image", _tiny_z_image, Z_IMAGE_LINEAR, _z_image_inputs, "context_refiner.0.attention.to_out.0"),
    ("flux2", _tiny_flux2, FLUX2_ALL_LINEAR, _flux2_inputs, "single_transformer_blocks.0.attn.to_qkv_mlp_proj"),
    ("chroma", _tiny_chroma, CHROMA_ALL_LINEAR, _chroma_inputs, "single_transformer_blocks.0.proj_mlp"),
])
def test_mmdit_families_keep_diffusers_module_names_with_their_scale(tmp_path, family, make_transformer, targets,
                                                                      inputs, known_module):
    import diffusers

    pipeline_class = getattr(diffusers, {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline",
                                         "qwen_image": "QwenImagePipeline", "z_image": "ZImagePipeline",
                                         "flux2": "Flux2Pipeline", "chroma": "ChromaPipeline"}[family])
    alpha = 6.0
    original = _lora(make_transformer, targets, alpha)
    peft_state, out = _export(tmp_path, original, family, alpha)
    written = load_file(str(out))

    # The module names ComfyUI maps itself (comfy.utils.flux_to_diffusers / mmdit_to_diffusers /
    # z_image_to_diffusers; Qwen-Image's own), with an `.alpha` (flux, qwen_image, z_image) or the scale folded into
    # lora_A (sd3, flux2, whose diffusers readers refuse it).
    prefix = "diffusion_model" if family in ("qwen_image", "z_image") else "transformer"
    assert f"{prefix}.{known_module}.lora_A.weight" in written
    factors = _factors(peft_state)
    assert len(written) == len(factors) * (2 if family in SCALED else 3)
    for module, (down, up) in factors.items():
        name = f"{prefix}.{module.removeprefix('transformer.')}"
        assert torch.equal(written[f"{name}.lora_B.weight"], up), module
        if family in SCALED:
            assert torch.equal(written[f"{name}.lora_A.weight"], down * (alpha / RANK)), module
        else:
            assert torch.equal(written[f"{name}.lora_A.weight"], down) and written[f"{name}.alpha"].item() == alpha

    _assert_same_output(original, _loaded_by_the_pipeline(pipeline_class, make_transformer, out), inputs())


def test_flux2_module_without_comfyui_name_is_an_error():
    """The shared modulation layers have no diffusers-name entry in ComfyUI's Flux map: the file falls back to
    diffusers' own layout (diffusion_files.py) rather than writing keys ComfyUI would skip."""
    factors = {"double_stream_modulation_img.linear": Factor(torch.zeros(RANK, 32), torch.zeros(192, RANK), 8.0),
               "transformer_blocks.0.attn.to_q": Factor(torch.zeros(RANK, 32), torch.zeros(32, RANK), 8.0)}
    with pytest.raises(ValueError, match="no ComfyUI Flux.2 name for the LoRA modules "
                                         "\\['double_stream_modulation_img.linear'\\]"):
        flux2_keys(factors)


# The Flux.2 modules ComfyUI's diffusers-name map (Flux.1's, comfy.utils.flux_to_diffusers) has; the rest of the
# blocks' layers it skipped as "lora key not loaded" (bench/results/check-exports-flux2-cpu-2026-11-29.md).
FLUX2_IN_COMFYUI_FLUX_MAP = {"transformer_blocks.0.attn." + m for m in (
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")} | {
    "x_embedder", "context_embedder", "proj_out"}


def test_flux2_comfyui_file_names_the_feed_forwards_and_single_block_projections_as_comfyuis_flux2_model():
    """save.format=comfyui for flux2: the modules ComfyUI's Flux map names keep their `transformer.` keys; the
    feed-forwards and the single blocks' fused projections go under `diffusion_model.` with the original (BFL) names
    of ComfyUI's Flux.2 model, which diffusers' own FLUX.2 checkpoint converter turns back into those modules. The
    tensors are flux2_keys' (the scale folded into lora_A, no alphas)."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    factors = peft_factors(_lora(_tiny_flux2, FLUX2_ALL_LINEAR, alpha=6.0), torch.float32)
    diffusers_file, comfy_file = flux2_keys(factors), flux2_comfy_keys(factors)

    kept = {k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in comfy_file
            if k.startswith("transformer.") and k.endswith(".lora_A.weight")}
    assert kept == FLUX2_IN_COMFYUI_FLUX_MAP
    renamed = {k.removeprefix("diffusion_model.").removesuffix(".lora_A.weight") for k in comfy_file
               if k.startswith("diffusion_model.") and k.endswith(".lora_A.weight")}
    assert renamed == {"double_blocks.0.img_mlp.0", "double_blocks.0.img_mlp.2", "double_blocks.0.txt_mlp.0",
                       "double_blocks.0.txt_mlp.2", "single_blocks.0.linear1", "single_blocks.0.linear2"}
    modules = {}  # ComfyUI name -> the diffusers module diffusers' converter makes of it
    for name in renamed:
        (key,) = convert_flux2_transformer_checkpoint_to_diffusers({f"{name}.weight": torch.zeros(1)})
        modules[name] = key.removesuffix(".weight")
    assert set(modules.values()) == set(factors) - FLUX2_IN_COMFYUI_FLUX_MAP
    assert len(comfy_file) == len(diffusers_file) == 2 * len(factors)
    for key, tensor in comfy_file.items():
        name, part = key.removeprefix("diffusion_model.").rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        source = f"transformer.{modules[name]}.{part}.weight" if key.startswith("diffusion_model.") else key
        assert torch.equal(tensor, diffusers_file[source]), key


@pytest.mark.usefixtures("own_data_caches")  # the flux2 quickstart's captions: other tests count their encodings
def test_flux2_quickstart_writes_its_comfyui_file_in_comfyuis_names(tmp_path, run_cli):
    """`python -m toolkit train` on the flux2 quickstart (save.format=comfyui): pytorch_lora_weights.safetensors keeps
    diffusers' names; the ComfyUI file holds the same tensors with the feed-forwards and single-block projections
    renamed (lora_export.FLUX2_COMFYUI_RENAMES)."""
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_flux2.yaml", out)) == 0
    main = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    comfy = load_file(str(out / "final" / "quickstart_flux2_comfyui.safetensors"))
    assert all(k.startswith("transformer.") for k in main)
    renames = {"transformer_blocks.0.ff.linear_in": "double_blocks.0.img_mlp.0",
               "transformer_blocks.0.ff.linear_out": "double_blocks.0.img_mlp.2",
               "transformer_blocks.0.ff_context.linear_in": "double_blocks.0.txt_mlp.0",
               "transformer_blocks.0.ff_context.linear_out": "double_blocks.0.txt_mlp.2",
               "single_transformer_blocks.0.attn.to_qkv_mlp_proj": "single_blocks.0.linear1",
               "single_transformer_blocks.0.attn.to_out": "single_blocks.0.linear2"}

    def comfy_name(key: str) -> str:
        module, part, weight = key.removeprefix("transformer.").rsplit(".", 2)
        return f"diffusion_model.{renames[module]}.{part}.{weight}" if module in renames else key

    assert sorted(comfy) == sorted(comfy_name(k) for k in main)
    assert all(torch.equal(comfy[comfy_name(k)], v) for k, v in main.items())
    assert sum(k.startswith("diffusion_model.") for k in comfy) == 2 * len(renames)


def test_chroma_approximator_without_comfyui_name_is_an_error():
    """Chroma's guidance approximator has no diffusers-name entry in ComfyUI's Flux map (its layers are named
    in_layer / out_layer there): the file falls back to diffusers' own layout rather than writing keys ComfyUI skips."""
    factors = {"distilled_guidance_layer.layers.0.linear_1": Factor(torch.zeros(RANK, 32), torch.zeros(32, RANK), 8.0),
               "single_transformer_blocks.0.proj_mlp": Factor(torch.zeros(RANK, 32), torch.zeros(128, RANK), 8.0)}
    with pytest.raises(ValueError, match="no ComfyUI Chroma name for the LoRA modules "
                                         "\\['distilled_guidance_layer.layers.0.linear_1'\\]"):
        chroma_keys(factors)


@pytest.mark.parametrize("config, family", [("quickstart_flux2.yaml", "flux2"),
                                            ("quickstart_hunyuan15.yaml", "hunyuan_video15")])
def test_save_format_auto_writes_the_comfyui_copy_where_comfyui_reads_the_main_file_in_part(config, family, tmp_path,
                                                                                          run_cli, capsys,
                                                                                          own_data_caches):
    """FLUX.2 and HunyuanVideo 1.5: ComfyUI skips part of pytorch_lora_weights.safetensors (diffusers' names), so
    save.format=auto writes <run>_comfyui.safetensors too, in final/ and every checkpoint, and says why; save.format=
    diffusers writes the main file alone."""
    from toolkit.config.families import family_spec

    out = tmp_path / "auto"
    assert run_cli("train", REPO / "configs/examples" / config, f"run.output_dir={out}", "train.steps=1",
                   "save.every=1", "sample.prompts=[]", "save.format=auto") == 0
    err = capsys.readouterr().err
    assert (f"save.format=comfyui: also <run>_comfyui.safetensors, which ComfyUI reads whole: "
            f"{family_spec(family).comfyui_auto}; pytorch_lora_weights.safetensors is for diffusers") in err
    for folder in (out / "final", out / "checkpoints" / "step-000001"):
        assert (folder / "pytorch_lora_weights.safetensors").is_file()
        assert len(list(folder.glob("*_comfyui.safetensors"))) == 1, sorted(folder.iterdir())
    plain = tmp_path / "plain"
    assert run_cli("train", REPO / "configs/examples" / config, f"run.output_dir={plain}", "train.steps=1",
                   "sample.prompts=[]", "save.format=diffusers") == 0
    assert sorted(p.name for p in (plain / "final").glob("*.safetensors")) == ["pytorch_lora_weights.safetensors"]
