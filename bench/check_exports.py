"""Load the toolkit's LoRA files with loaders the project did not write, and check the numbers.

    TOOLKIT_COMFYUI=/path/ComfyUI TOOLKIT_SD_SCRIPTS=/path/sd-scripts TOOLKIT_MUSUBI=/path/musubi-tuner \\
        PYTHONPATH=. python bench/check_exports.py [family ...] [--deps DIR]

For each family it trains a tiny LoRA through the real entry point (rank 4, alpha 6: scale 1.5, 2 steps, a
checkpoint every step) and takes the update each trained PEFT module stands for (alpha/rank * B @ A, restored
from the checkpoint's exact tensors). Then final/'s file and step 1's checkpoint file go through:

- ComfyUI: comfy.lora.model_lora_keys_unet / model_lora_keys_clip, comfy.lora_convert.convert_lora,
  comfy.lora.load_lora and comfy.lora.calculate_weight (what comfy.sd.load_lora_for_models and the ModelPatcher
  run), on stand-ins of ComfyUI's model classes whose weights are the tiny pipeline's, laid out by ComfyUI's own
  converters (comfy.utils.unet_to_diffusers, comfy.model_detection.convert_diffusers_mmdit; Wan: ComfyUI's
  WanModel names, matched to diffusers' by diffusers' convert_wan_transformer_to_diffusers; Chroma: Flux's
  converter, its keys checked against ComfyUI's own Chroma model, comfy.model_base.Chroma as the model class;
  LTX-2: the blocks' names, checked against ComfyUI's own LTXAV model, comfy.model_base.LTXAV as the class).
  FLUX.2: ComfyUI's own Flux.2 model of the same size (comfy.ldm.flux.model.Flux with model_detection's flux2
  settings), each diffusers weight placed where diffusers' convert_flux2_transformer_checkpoint_to_diffusers takes
  it from, comfy.model_base.Flux2 as the class; the save.format=comfyui file, trained with reference images.
  HunyuanVideo 1.5: the save.format=comfyui file on ComfyUI's own HunyuanVideo model's block keys, each fused
  qkv the diffusers q, k and v stacked, comfy.model_base.HunyuanVideo15 as the model class).
- kohya sd-scripts (sd, sdxl): networks/lora.py create_network_from_weights + merge_to on the diffusers UNet and
  the text encoders, laid out as sd-scripts' transformers 4 has them (text_model.encoder...).
- musubi-tuner (wan21, wan22): convert_lora.convert_from_diffusers (its documented import of diffusers /
  ComfyUI-named files) and utils/lora_utils.load_safetensors_with_lora_and_fp8, which merges while loading.

Where each update landed is found by value (the base weight's values in the tool's layout), never by the key
names under test. A row: tool, family, file, modules applied / expected, LoRA keys left unread, max abs diff.
Extra packages (einops, torchsde, trampoline, opencv-python-headless) go into --deps, never the venv; torchvision is
replaced by an empty module for ComfyUI and sd-scripts (they import it at module level for models and data
loaders this check never runs; PyPI's torchvision wheel does not load with the CPU torch here).
"""

from __future__ import annotations

from toolkit.models.base import load_trainable_state_dict

import argparse
import logging
import os
import re
import sys
import tempfile
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from lora_math import expected_updates, plain_weights  # noqa: E402

FAMILIES = {  # quickstart, extra overrides
    "sd": ("quickstart_sd.yaml", ["train.train_text_encoder=true"]),
    "sdxl": ("quickstart_sdxl.yaml", ["train.train_text_encoder=true"]),
    "flux": ("quickstart_flux.yaml", []),
    "chroma": ("quickstart_chroma.yaml", ["network.target_modules=all-linear"]),  # the embedders and proj_out too
    "sd3": ("quickstart_sd3.yaml", []),
    "qwen_image": ("quickstart_qwen_image.yaml", []),
    "qwen_image_edit": ("quickstart_qwen_image_edit.yaml", []),   # Qwen-Image's file: ComfyUI's QwenImage model
    "flux_kontext": ("quickstart_flux_kontext.yaml", []),         # Flux's file: ComfyUI's Flux model
    "wan21": ("quickstart_wan21.yaml", []),
    "wan22": ("quickstart_wan22.yaml", ["train.expert_switch_every=1"]),
    "ltx2": ("quickstart_ltx2.yaml", ["network.target_modules=all-linear"]),  # the audio-to-video attention too
    # every linear layer of the blocks: the modulation too; its ComfyUI file is the save.format=comfyui one
    "hunyuan_video15": ("quickstart_hunyuan15.yaml", ["network.target_modules=all-linear", "save.format=comfyui",
                                                      "train.batch_size=1"]),
    # every linear layer ComfyUI's Flux map could name (the blocks, x_embedder, context_embedder, proj_out)
    "flux2": ("quickstart_flux2_references.yaml", ["network.target_modules=all-linear", "save.format=comfyui"]),
}
COMFYUI_COPY = {"hunyuan_video15": "quickstart_hunyuan15_comfyui.safetensors",  # diffusers' names in the main file
                "flux2": "quickstart_flux2_references_comfyui.safetensors"}
EXPERTS = {"transformer": "high_noise", "transformer_2": "low_noise"}


# -- the toolkit's side -------------------------------------------------------------------------------------------

def train(family: str, out: Path):
    """Train through `python -m toolkit train`; returns the adapter holding step 2's exact tensors."""
    from toolkit.cli import main
    from toolkit.plan.run import load_run
    from toolkit.models import build_adapter
    from toolkit.models.base import Runtime

    config, extra = FAMILIES[family]
    if family == "sd3":
        extra = [*extra, f"model.name_or_path={sd3_as_comfyui_sizes_it(out.parent / 'sd3-model')}"]
    os.chdir(REPO)
    args = ["train", str(REPO / "configs/examples" / config), f"run.output_dir={out}", "train.steps=2",
            "train.batch_size=2", "train.lr=1e-2", "save.every=1", "sample.prompts=[]", "network.rank=4",
            "network.alpha=6", "save.format=diffusers", *extra]
    # the torchvision stand-in (main) is for ComfyUI's imports only: training and loading (Qwen-Image-Edit's
    # processor) ask importlib whether torchvision is there, which a module without a spec answers with an error
    stand_ins = {name: sys.modules.pop(name) for name in ("torchvision", "torchvision.transforms")
                 if name in sys.modules}
    try:
        assert main(args) == 0, f"{family}: training failed"
        run = load_run([out / "config.yaml"], [])
        adapter = build_adapter(run.cfg, Runtime(torch.device("cpu"), run.device, torch.float32, torch.float32, out))
        adapter.load()
    finally:
        sys.modules.update(stand_ins)
    return adapter


def sd3_as_comfyui_sizes_it(folder: Path) -> Path:
    """tiny:sd3 with a transformer 64 x depth wide: ComfyUI derives an MMDiT's width from its depth that way
    (comfy.model_detection.convert_diffusers_mmdit), so the 32-wide tiny transformer has no ComfyUI layout."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from toolkit.tiny import resolve_model_path

    pipe = StableDiffusion3Pipeline.from_pretrained(resolve_model_path("tiny:sd3"))
    torch.manual_seed(0)
    pipe.transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=64,
        num_attention_heads=2, caption_projection_dim=128, joint_attention_dim=96, pooled_projection_dim=64,
        pos_embed_max_size=32)
    pipe.save_pretrained(folder)
    return folder


def lora_files(out: Path, step: int, name: str, family: str) -> dict[str, Path]:
    """{label: file} of final/ and checkpoint `step` for component `name`."""
    sub = EXPERTS[name] if family == "wan22" else ""
    file = COMFYUI_COPY.get(family, "pytorch_lora_weights.safetensors")
    return {where: folder / sub / file
            for where, folder in (("final", out / "final"), (f"step-{step}", out / "checkpoints" / f"step-{step:06d}"))}


def expected_for(adapter, out: Path, step: int) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """{component: {weight name: (base weight, expected update)}} at checkpoint `step`."""
    from toolkit.train.checkpoint import trainable_from_file

    state = load_file(str(out / "checkpoints" / f"step-{step:06d}" / "trainable_state.safetensors"))
    load_trainable_state_dict(adapter.network, trainable_from_file(state))
    result = {}
    for name, model in adapter.network.items():
        base = plain_weights(model)
        result[name] = {k: (base[k], update) for k, update in expected_updates(model).items()}
    return result


# -- finding an update by value ------------------------------------------------------------------------------------

def locate(weight: torch.Tensor, layout: dict[str, torch.Tensor]) -> tuple[str, int]:
    """(key, row offset) of the one place in `layout` holding `weight`'s values (a whole tensor, or rows of a
    fused one such as Flux's qkv)."""
    found = []
    for key, tensor in layout.items():
        if tensor.ndim != weight.ndim or tensor.shape[1:] != weight.shape[1:] or tensor.shape[0] < weight.shape[0]:
            continue
        rows = (tensor.flatten(1) == weight.flatten(1)[0]).all(dim=1).nonzero().flatten().tolist()
        found += [(key, r) for r in rows if torch.equal(tensor[r:r + weight.shape[0]], weight)]
    assert len(found) == 1, f"base weight found {len(found)} times in the tool's layout"
    return found[0]


def compare(expected: dict[str, tuple[torch.Tensor, torch.Tensor]], before: dict[str, torch.Tensor],
            after: dict[str, torch.Tensor]) -> tuple[int, float]:
    """(modules whose update landed, max abs diff): each expected update is looked for where its base weight sits
    in the tool's layout; any change elsewhere counts as a difference."""
    deltas = {k: after[k].double() - before[k].double() for k in after}
    covered = {k: torch.zeros_like(v, dtype=torch.bool) for k, v in deltas.items()}
    worst, landed = 0.0, 0
    for name, (base, update) in expected.items():
        key, row = locate(base.double(), {k: v.double() for k, v in before.items()})
        got = deltas[key][row:row + base.shape[0]]
        covered[key][row:row + base.shape[0]] = True
        worst = max(worst, float((got - update).abs().max()))
        landed += bool(update.abs().max() == 0 or got.abs().max() > 0)
    stray = max((float(d[~covered[k]].abs().max()) for k, d in deltas.items() if (~covered[k]).any()), default=0.0)
    return landed, max(worst, stray)


# -- ComfyUI ------------------------------------------------------------------------------------------------------

class ComfyUI:
    def __init__(self, root: Path):
        sys.argv = [sys.argv[0], "--cpu"]
        sys.path.insert(0, str(root))
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.lora
        import comfy.lora_convert
        import comfy.model_base
        import comfy.model_detection
        import comfy.ops
        import comfy.utils

        self.comfy = comfy

    def stand_in(self, cls, state: dict[str, torch.Tensor], unet_config: dict):
        """An object of ComfyUI's model class `cls` as the key mapping reads it: state_dict() and model_config."""
        stub = cls.__new__(cls)
        torch.nn.Module.__init__(stub)
        stub.state_dict = lambda: state
        stub.model_config = types.SimpleNamespace(unet_config=unet_config)
        return stub

    def denoiser_layout(self, family: str, adapter, name: str) -> tuple[object, dict[str, torch.Tensor]]:
        comfy = self.comfy
        weights = {k: v.detach().clone() for k, v in plain_weights(adapter.component(name)).items()}
        if family in ("sd", "sdxl"):
            config = tiny_unet_config(adapter.component(name).config)
            mapping = comfy.utils.unet_to_diffusers(config)
            state = {f"diffusion_model.{mapping[k]}": v for k, v in weights.items() if k in mapping}
            cls = comfy.model_base.SDXL if family == "sdxl" else comfy.model_base.BaseModel
            return self.stand_in(cls, state, config), state
        if family in ("flux", "flux_kontext", "sd3"):
            state = comfy.model_detection.convert_diffusers_mmdit(weights, "diffusion_model.")
            config = comfy.model_detection.detect_unet_config(state, "diffusion_model.")
            cls = comfy.model_base.SD3 if family == "sd3" else comfy.model_base.Flux
            return self.stand_in(cls, state, config), state
        if family == "chroma":
            return self.chroma_layout(adapter.component(name), weights)
        if family == "ltx2":
            return self.ltx2_layout(adapter.component(name), weights)
        if family == "hunyuan_video15":
            return self.hunyuan15_layout(adapter.component(name), weights)
        if family == "flux2":
            return self.flux2_layout(adapter.component(name), weights)
        if family in ("qwen_image", "qwen_image_edit"):
            state = {f"diffusion_model.{k}": v for k, v in weights.items()}
            return self.stand_in(comfy.model_base.QwenImage, state, {}), state
        state = {f"diffusion_model.{k}": v for k, v in wan_original_layout(adapter.component(name), weights).items()}
        return self.stand_in(comfy.model_base.WAN21, state, {}), state

    def chroma_layout(self, transformer, weights: dict[str, torch.Tensor]) -> tuple[object, dict[str, torch.Tensor]]:
        """The diffusers Chroma weights in ComfyUI's layout (convert_diffusers_mmdit's Flux map: ComfyUI's Chroma is
        a Flux model to its LoRA loader), every key and shape checked against ComfyUI's own Chroma model of the same
        size (comfy.ldm.chroma.model.Chroma)."""
        from comfy.ldm.chroma.model import Chroma

        comfy = self.comfy
        state = comfy.model_detection.convert_diffusers_mmdit(weights, "diffusion_model.")
        c = transformer.config
        hidden = c.num_attention_heads * c.attention_head_dim
        own = Chroma(in_channels=c.in_channels, out_channels=c.in_channels, context_in_dim=c.joint_attention_dim,
                     hidden_size=hidden, mlp_ratio=4.0, num_heads=c.num_attention_heads, depth=c.num_layers,
                     depth_single_blocks=c.num_single_layers, axes_dim=list(c.axes_dims_rope), theta=10000,
                     patch_size=2, qkv_bias=True, in_dim=c.approximator_num_channels, out_dim=hidden,
                     hidden_dim=c.approximator_hidden_dim, n_layers=c.approximator_layers, txt_ids_dims=[],
                     vec_in_dim=None, operations=torch.nn).state_dict()
        shapes = {f"diffusion_model.{k}": v.shape for k, v in own.items()}
        wrong = sorted(k for k, v in state.items() if shapes.get(k) != v.shape)
        assert not wrong, f"not in ComfyUI's Chroma (or another shape there): {wrong[:4]}"
        config = {"image_model": "chroma", "depth": c.num_layers, "depth_single_blocks": c.num_single_layers,
                  "hidden_size": hidden}  # what comfy.utils.flux_to_diffusers reads of it
        return self.stand_in(comfy.model_base.Chroma, state, config), state

    def ltx2_layout(self, transformer, weights: dict[str, torch.Tensor]) -> tuple[object, dict[str, torch.Tensor]]:
        """The diffusers LTX-2 weights of the blocks' attention and feed-forward layers under the names ComfyUI's own
        LTX-2 model of the same size has for them (comfy.ldm.lightricks.av_model.LTXAVModel; the same names), every
        key and shape checked against it; comfy.model_base.LTXAV is the model class the key map is made for."""
        from comfy.ldm.lightricks.av_model import LTXAVModel

        comfy, c = self.comfy, transformer.config
        sizes = ("in_channels", "audio_in_channels", "cross_attention_dim", "audio_cross_attention_dim",
                 "attention_head_dim", "audio_attention_head_dim", "num_attention_heads", "audio_num_attention_heads",
                 "caption_channels", "num_layers")
        own = LTXAVModel(**{k: c[k] for k in sizes}, operations=comfy.ops.disable_weight_init).state_dict()
        shapes = {f"diffusion_model.{k}": v.shape for k, v in own.items()}
        linear = re.compile(r"transformer_blocks\.\d+\.(\w*attn\d?|(audio_)?ff)\..+\.(weight|bias)")
        state = {f"diffusion_model.{k}": v for k, v in weights.items() if linear.fullmatch(k) and "norm" not in k}
        wrong = sorted(k for k, v in state.items() if shapes.get(k) != v.shape)
        assert not wrong, f"not in ComfyUI's LTXAV model (or another shape there): {wrong[:4]}"
        return self.stand_in(comfy.model_base.LTXAV, state, {}), state

    def hunyuan15_layout(self, transformer, weights: dict[str, torch.Tensor]) -> tuple[object, dict[str, torch.Tensor]]:
        """ComfyUI's own HunyuanVideo 1.5 model of the tiny one's size (comfy.ldm.hunyuan_video.model), its double
        blocks holding the diffusers weights: each stream's qkv the diffusers q, k and v stacked (Flux's order),
        the rest one to one; every such key and shape must be ComfyUI's."""
        from comfy.ldm.hunyuan_video.model import HunyuanVideo

        c = transformer.config
        hidden = c.num_attention_heads * c.attention_head_dim
        own = HunyuanVideo(in_channels=c.in_channels, out_channels=c.out_channels, vec_in_dim=None,
                           context_in_dim=c.text_embed_dim, hidden_size=hidden, mlp_ratio=c.mlp_ratio,
                           num_heads=c.num_attention_heads, depth=c.num_layers, depth_single_blocks=0,
                           axes_dim=list(c.rope_axes_dim), theta=256, patch_size=[1, 1, 1], qkv_bias=True,
                           guidance_embed=False, byt5=True, meanflow=False, use_cond_type_embedding=True,
                           vision_in_dim=c.image_embed_dim, meanflow_sum=False, operations=torch.nn).state_dict()
        state = {f"diffusion_model.{k}": v.float() for k, v in own.items()}
        one_to_one = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0",
                      "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
                      "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin"}
        fused = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
        placed = {}
        for i in range(c.num_layers):
            ours, theirs = f"transformer_blocks.{i}.", f"diffusion_model.double_blocks.{i}."
            for kind in ("weight", "bias"):
                placed.update({f"{theirs}{comfy}.{kind}": weights[f"{ours}{module}.{kind}"]
                               for module, comfy in one_to_one.items()})
                placed.update({f"{theirs}{comfy}.{kind}": torch.cat([weights[f"{ours}{p}.{kind}"] for p in parts])
                               for comfy, parts in fused.items()})
        wrong = sorted(k for k, v in placed.items() if k not in state or state[k].shape != v.shape)
        assert not wrong, f"not in ComfyUI's HunyuanVideo 1.5 (or another shape there): {wrong[:4]}"
        state.update(placed)
        return self.stand_in(self.comfy.model_base.HunyuanVideo15, state, {}), state

    def flux2_layout(self, transformer, weights: dict[str, torch.Tensor]) -> tuple[object, dict[str, torch.Tensor]]:
        """The diffusers FLUX.2 weights in the layout of ComfyUI's own Flux.2 model of the same size
        (comfy.ldm.flux.model.Flux with the settings comfy.model_detection gives flux2). Where each diffusers row
        sits: diffusers' convert_flux2_transformer_checkpoint_to_diffusers run on that model's tensors, filled with
        distinct random values (rows of a fused qkv, the swapped halves of the final modulation); its keys and shapes
        must be the tiny transformer's, and every ComfyUI weight must be filled."""
        from comfy.ldm.flux.model import Flux
        from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

        comfy, c = self.comfy, transformer.config
        own = Flux(image_model="flux2", in_channels=c.in_channels, out_channels=c.out_channels or c.in_channels,
                   vec_in_dim=None, context_in_dim=c.joint_attention_dim,
                   hidden_size=c.num_attention_heads * c.attention_head_dim, mlp_ratio=c.mlp_ratio,
                   num_heads=c.num_attention_heads, depth=c.num_layers, depth_single_blocks=c.num_single_layers,
                   axes_dim=list(c.axes_dims_rope), theta=c.rope_theta, patch_size=c.patch_size, qkv_bias=False,
                   guidance_embed=c.guidance_embeds, txt_ids_dims=[3], global_modulation=True, mlp_silu_act=True,
                   ops_bias=False, operations=torch.nn).state_dict()
        torch.manual_seed(0)
        filled = {k: torch.randn(v.shape, dtype=torch.float64) for k, v in own.items()}
        converted = convert_flux2_transformer_checkpoint_to_diffusers(dict(filled))
        wrong = sorted(k for k in set(weights) | set(converted)
                       if k not in weights or k not in converted or weights[k].shape != converted[k].shape)
        assert not wrong, f"diffusers' FLUX.2 converter and the tiny transformer differ on {wrong[:4]}"

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(t.shape[0], -1) if t.ndim > 1 else t[None]

        source = {row.numpy().tobytes(): (key, r) for key, t in filled.items() for r, row in enumerate(rows(t))}
        placed = {k: rows(torch.full_like(v, float("nan"), dtype=torch.float32)) for k, v in own.items()}
        for name, tensor in converted.items():
            for i, row in enumerate(rows(tensor)):
                key, r = source[row.numpy().tobytes()]
                placed[key][r] = rows(weights[name])[i]
        empty = sorted(k for k, v in placed.items() if v.isnan().any())
        assert not empty, f"ComfyUI's Flux.2 weights no diffusers weight fills: {empty[:4]}"
        state = {f"diffusion_model.{k}": placed[k].reshape(v.shape) for k, v in own.items()}
        config = comfy.model_detection.detect_unet_config(state, "diffusion_model.")
        assert config["image_model"] == "flux2", f"ComfyUI detects the layout as {config['image_model']}"
        return self.stand_in(comfy.model_base.Flux2, state, config), state

    def clip_layout(self, adapter) -> tuple[object, dict[str, torch.Tensor]]:
        """ComfyUI's CLIP models keep transformers 4's CLIPTextModel names under clip_l.transformer / clip_g.transformer
        (comfy/sd1_clip.py, sdxl_clip.py, clip_model.py); SD's one encoder is clip_l, SDXL's second clip_g."""
        from comfy.clip_model import CLIPTextModel

        state = {}
        for name, prefix in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
            if name not in adapter.network:
                continue
            encoder = adapter.component(name)
            own = CLIPTextModel(encoder.config.to_dict(), torch.float32, "cpu", torch.nn).state_dict()
            for key, value in plain_weights(encoder).items():
                comfy_key = key if key.startswith("text_model.") else f"text_model.{key}"
                if comfy_key in own:
                    state[f"{prefix}.transformer.{comfy_key}"] = value.float()
        return types.SimpleNamespace(state_dict=lambda: state), state

    def apply(self, file: Path, family: str, adapter, names: list[str]) -> tuple[dict, dict, int]:
        """(weights before, after, LoRA keys left unread) of load_lora_for_models' steps on the stand-ins."""
        comfy = self.comfy
        key_map, before = {}, {}
        for name in names:
            if name in ("unet", "transformer", "transformer_2"):
                model, state = self.denoiser_layout(family, adapter, name)
                key_map = comfy.lora.model_lora_keys_unet(model, key_map)
                before.update(state)
        if any(n.startswith("text_encoder") for n in names):
            clip, state = self.clip_layout(adapter)
            key_map = comfy.lora.model_lora_keys_clip(clip, key_map)
            before.update(state)
        lora = comfy.lora_convert.convert_lora(load_file(str(file)))
        unread = []
        handler = _Collect(unread)
        logging.getLogger().addHandler(handler)
        try:
            patches = comfy.lora.load_lora(lora, key_map)
        finally:
            logging.getLogger().removeHandler(handler)
        after = {k: v.clone().float() for k, v in before.items()}
        for target, patch in patches.items():
            key, offset = (target[0], target[1]) if isinstance(target, tuple) else (target, None)  # as add_patches
            if key not in after:
                unread.append(f"patch for a weight the model lacks: {key}")
                continue
            after[key] = comfy.lora.calculate_weight([(1.0, patch, 1.0, offset, None)], after[key], key)
        return before, after, len(unread)


class _Collect(logging.Handler):
    """Log messages containing `marker`, each turned into a list of entries by `parse` (default: the message)."""

    def __init__(self, into: list, marker: str = "lora key not loaded", parse=lambda message: [message]):
        super().__init__()
        self.into, self.marker, self.parse = into, marker, parse

    def emit(self, record: logging.LogRecord) -> None:
        if self.marker in record.getMessage():
            self.into += self.parse(record.getMessage())


def tiny_unet_config(config) -> dict:
    """The ComfyUI unet_config of a diffusers UNet2DConditionModel config (what comfy.model_detection derives for
    the real SD and SDXL UNets): blocks, resnets per block and transformer depths."""
    per_block = config.transformer_layers_per_block
    depth_of = per_block if isinstance(per_block, (list, tuple)) else [per_block] * len(config.down_block_types)
    down = []
    for block, depth in zip(config.down_block_types, depth_of):
        down += [depth if block.startswith("CrossAttn") else 0] * config.layers_per_block
    output = []
    for block, depth in zip(config.up_block_types, reversed(depth_of)):
        output += [depth if block.startswith("CrossAttn") else 0] * (config.layers_per_block + 1)
    return {"num_res_blocks": [config.layers_per_block] * len(config.down_block_types),
            "channel_mult": [c // config.block_out_channels[0] for c in config.block_out_channels],
            "transformer_depth": down, "transformer_depth_output": list(reversed(output)),
            "transformer_depth_middle": depth_of[-1]}


def wan_original_layout(transformer, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The diffusers Wan weights under the original Wan names, as ComfyUI's WanModel has them: ComfyUI's WanModel
    of the same size gives the names, diffusers' convert_wan_transformer_to_diffusers says which diffusers weight
    each one is (matched by tensor identity)."""
    from comfy.ldm.wan.model import WanModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    c = transformer.config
    torch.manual_seed(0)
    wan = WanModel(model_type="t2v", patch_size=tuple(c.patch_size), in_dim=c.in_channels, out_dim=c.out_channels,
                   dim=c.num_attention_heads * c.attention_head_dim, ffn_dim=c.ffn_dim, freq_dim=c.freq_dim,
                   text_dim=c.text_dim, num_heads=c.num_attention_heads, num_layers=c.num_layers,
                   cross_attn_norm=c.cross_attn_norm, qk_norm=c.qk_norm is not None, eps=c.eps, operations=torch.nn)
    original = dict(wan.state_dict())
    converted = convert_wan_transformer_to_diffusers(dict(original))
    by_id = {id(t): k for k, t in original.items()}
    return {by_id[id(t)]: weights[k] for k, t in converted.items() if id(t) in by_id and k in weights}


# -- kohya sd-scripts ---------------------------------------------------------------------------------------------

class TextModel4(torch.nn.Module):
    """A transformers 5 CLIPTextModel under `text_model`, the layout sd-scripts' transformers 4 gives it."""

    def __init__(self, encoder):
        super().__init__()
        self.text_model = encoder


def sd_scripts_apply(root: Path, file: Path, family: str, adapter) -> tuple[dict, dict, int]:
    sys.path.insert(0, str(root))
    from networks import lora as kohya_lora

    pipe = type(adapter.pipe).from_pretrained(adapter.model_path)
    unet = pipe.unet
    encoders = [pipe.text_encoder] + ([pipe.text_encoder_2] if family == "sdxl" else [])
    wrapped = [e if hasattr(e, "text_model") else TextModel4(e) for e in encoders]
    modules = {"unet": unet, "text_encoder": encoders[0], **({"text_encoder_2": encoders[1]} if family == "sdxl" else {})}
    before = {f"{n}.{k}": v for n, m in modules.items() for k, v in plain_weights(m).items()}
    weights = load_file(str(file))
    network, weights = kohya_lora.create_network_from_weights(1.0, None, None, wrapped if family == "sdxl" else wrapped[0],
                                                              unet, weights_sd=weights, for_inference=True)
    network.merge_to(wrapped if family == "sdxl" else wrapped[0], unet, weights, torch.float32, "cpu")
    built = {lora.lora_name for lora in network.text_encoder_loras + network.unet_loras}
    unread = {k.split(".")[0] for k in weights} - built
    after = {f"{n}.{k}": v for n, m in modules.items() for k, v in plain_weights(m).items()}
    return before, after, len(unread)


# -- musubi-tuner -------------------------------------------------------------------------------------------------

def musubi_apply(root: Path, file: Path, adapter, name: str) -> tuple[dict, dict, int]:
    sys.path.insert(0, str(root / "src"))
    from musubi_tuner.convert_lora import convert_from_diffusers
    from musubi_tuner.utils.lora_utils import load_safetensors_with_lora_and_fp8

    transformer = adapter.component(name)
    before = wan_original_layout(transformer, {k: v.detach().clone() for k, v in plain_weights(transformer).items()})
    with tempfile.TemporaryDirectory() as tmp:
        model_file = Path(tmp) / "dit.safetensors"
        save_file({k: v.contiguous() for k, v in before.items()}, str(model_file))
        converted = convert_from_diffusers("lora_unet_", load_file(str(file)))
        unread = []
        handler = _Collect(unread, "not all LoRA keys are used",
                           lambda message: message.split(": ", 1)[1].split(", "))
        logging.getLogger("musubi_tuner.utils.lora_utils").addHandler(handler)
        try:
            after = load_safetensors_with_lora_and_fp8(str(model_file), [converted], [1.0], False, torch.device("cpu"))
        finally:
            logging.getLogger("musubi_tuner.utils.lora_utils").removeHandler(handler)
    return before, {k: after[k] for k in before}, len(unread)



# -- the run ------------------------------------------------------------------------------------------------------

def prefixed(expected: dict, names: list[str], with_prefix: bool) -> dict:
    return {(f"{n}.{k}" if with_prefix else k): v for n in names for k, v in expected[n].items()}


def check(family: str, tools: dict[str, Path], work: Path) -> list[tuple]:
    out = work / family
    adapter = train(family, out)
    rows = []
    for step in (2, 1):  # final/ is step 2; step 1's checkpoint holds other weights
        expected = expected_for(adapter, out, step)
        names = list(expected)
        files = {n: lora_files(out, step, n, family) for n in names}
        label = "final" if step == 2 else "step-1"
        groups = [[n] for n in names] if family == "wan22" else [names]  # one file per Wan 2.2 expert
        for group in groups:
            file = files[group[0]][label]
            want = prefixed(expected, group, with_prefix=True)
            if "comfyui" in tools:
                before, after, unread = ComfyUI(tools["comfyui"]).apply(file, family, adapter, group)
                rows.append(("ComfyUI", family, f"{label}:{'+'.join(group)}", *compare(want, before, after), len(want), unread))
            if "sd_scripts" in tools and family in ("sd", "sdxl"):
                before, after, unread = sd_scripts_apply(tools["sd_scripts"], file, family, adapter)
                rows.append(("sd-scripts", family, f"{label}:{'+'.join(group)}",
                             *compare(want, before, after), len(want), unread))
            if "musubi" in tools and family in ("wan21", "wan22"):
                before, after, unread = musubi_apply(tools["musubi"], file, adapter, group[0])
                rows.append(("musubi-tuner", family, f"{label}:{group[0]}", *compare(want, before, after), len(want), unread))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--deps", default=None, help="folder of the extra packages (pip install --target)")
    args = parser.parse_args()
    import diffusers.loaders.peft  # noqa: F401  (before the torchvision stand-in: diffusers checks for the real one)

    if args.deps:
        sys.path.append(args.deps)
    stand_in = types.ModuleType("torchvision")
    stand_in.transforms = types.ModuleType("torchvision.transforms")
    sys.modules.setdefault("torchvision", stand_in)
    sys.modules.setdefault("torchvision.transforms", stand_in.transforms)
    tools = {name: Path(os.environ[var]) for name, var in
             (("comfyui", "TOOLKIT_COMFYUI"), ("sd_scripts", "TOOLKIT_SD_SCRIPTS"), ("musubi", "TOOLKIT_MUSUBI"))
             if os.environ.get(var)}
    if not tools:
        print("set TOOLKIT_COMFYUI, TOOLKIT_SD_SCRIPTS and/or TOOLKIT_MUSUBI to checkouts of the tools", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for family in args.families:
            rows += check(family, tools, Path(work))
    print(f"\n{'tool':<13} {'family':<11} {'file':<30} {'applied':>9} {'unread':>6} {'max abs diff':>13}")
    failed = False
    for tool, family, file, landed, worst, count, unread in rows:
        ok = landed == count and unread == 0 and worst < 1e-5
        failed |= not ok
        print(f"{tool:<13} {family:<11} {file:<30} {f'{landed}/{count}':>9} {unread:>6} {worst:>13.2e}"
              f"{'' if ok else '  FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
