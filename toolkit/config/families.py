"""The one family table: what config loading, the trainer and the tiny writers know about each model family.

Pure data (no torch, no diffusers), so the config can be checked before anything heavy is imported. The
adapter class named by `adapter` holds the family's code; everything else that used to be a string-keyed
table elsewhere (the family list, the data schema, auto batch caps, timestep sampling, save formats, tiny
models, which family-scoped settings apply) is read from here.

Adding a family: one FamilySpec below, one adapter file, one tiny writer, an example config and a test
parametrisation (docs/ARCHITECTURE.md, "Adding a family").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.config.data_schemas import (AudioVideoDataSection, ImageDataSection, ReferenceImageDataSection,
                                         TextDataSection, VideoDataSection, VisionChatDataSection)

# Settings that only some families read. A family's spec lists the ones it reads (`settings`); a value set for
# a family that does not read it is a config error, and the resolved config of a run shows only its own.
LLM_SETTINGS = frozenset({"model.attention", "model.kernels", "model.fuse_projections", "model.trust_remote_code",
                          "model.quantize", "model.quantize_backend", "sample.max_new_tokens", "sample.temperature",
                          "train.checkpoint_offload", "train.eval_every", "train.objective", "train.beta", "train.reference_logps",
                          "train.desirable_weight", "train.undesirable_weight", "train.reward", "train.reward_pattern",
                          "train.reward_length", "train.num_generations", "train.kl_coef",
                          "train.max_completion_length", "train.generation_temperature", "train.generation"})
EVAL_SETTINGS = frozenset({"eval.path", "eval.every", "eval.timesteps", "eval.seed"})
DIFFUSION_SETTINGS = frozenset({"device.vae_encode_cudnn", "train.checkpoint_keeps", "train.timestep_sampling",
                                "train.logit_mean", "train.logit_std", "sample.num_inference_steps", "sample.guidance_scale",
                                "sample.width", "sample.height", "train.prior_loss_weight", "train.dop_class",
                                "train.dop_weight"}) | EVAL_SETTINGS
DDPM_SETTINGS = DIFFUSION_SETTINGS | {"train.train_text_encoder", "train.noise_offset", "train.min_snr_gamma",
                                      "train.compile_regions",
                                      "sample.negative_prompt"}
FLOW_SETTINGS = DIFFUSION_SETTINGS | {"train.flow_shift", "model.quantize", "model.quantize_backend",
                                      "model.block_swap"}
VLM_SETTINGS = frozenset({"train.eval_every", "network.vision_layers", "sample.max_new_tokens", "sample.temperature", "sample.images"})
# Edit families: the references of each sample prompt (eval.path's samples and output preservation carry the
# sample's references as training does).
EDIT_SETTINGS = FLOW_SETTINGS | {"sample.references"}
VIDEO_SETTINGS = FLOW_SETTINGS | {"sample.negative_prompt", "sample.num_frames", "sample.fps", "model.task",
                                  "sample.images"}


@dataclass(frozen=True)
class FamilySpec:
    name: str
    adapter: str                        # "module:Class", imported only when the family trains
    data_schema: type                   # the `data` section's dataclass
    settings: frozenset[str]            # family-scoped settings this family reads
    description: str
    timestep_sampling: str | None = None   # train.timestep_sampling=auto resolves to this
    batch_cap: int | None = None        # train.batch_size=auto never exceeds this (large samples)
    save_formats: tuple[str, ...] = ()  # save.format values besides auto (the first is what auto writes)
    tiny: dict[str, str] = field(default_factory=dict)  # tiny:<kind> -> "module:function" writing it
    # Measured choices, each an evidence id (bench/results/evidence.json, cited by toolkit/plan/evidence.py):
    compile_auto: str | None = None     # train.compile=auto on a GPU is on (faster compiled); None: off
    compile_auto_steps: int = 0         # ...for runs of at least this many train.steps (the compile is repaid)
    regions_auto: str | None = None     # train.compile_regions=auto: blocks or whole as measured (None: whole)
    regions_blocks_below: int = 0       # ...blocks for runs shorter than this many train.steps, whole from there
    recompute_auto: str | None = None   # train.compile_recompute=auto is pointwise; None: none
    keeps_auto: str | None = None       # train.checkpoint_keeps=auto is attention; None: nothing
    pipeline_class: str = ""            # model_index.json _class_name of a diffusers folder; "": a transformers folder
    i2v_pipeline: str = ""              # ...of the family's image-to-video folders (model.task=auto reads it)
    # Reference images per target (data.references) and per sample prompt (sample.references): the fewest and the
    # most the family's pipeline takes (None: any number). Families without reference images leave them.
    references: tuple[int, int | None] | None = None
    fixed_captions: str = ""            # why a sample's caption cannot change from step to step ("": it can)
    # A sample's width and height must be multiples of this (the VAE's downscale times the patch: diffusers' pipelines
    # refuse other sizes, or resize them with a warning); 0: the family samples no images
    sample_multiple: int = 16
    # Families whose LoRA this one may start from (network.init_from): the same denoiser (Kontext from Flux.1 dev,
    # Qwen-Image-Edit from Qwen-Image, Wan 2.2 A14B from Wan 2.1 14B); a LoRA of any other family is refused by name
    lora_kin: tuple[str, ...] = ()
    # Why save.format=auto writes the comfyui copy too ("": it does not): ComfyUI reads the main file only in part
    comfyui_auto: str = ""
    # network.init=auto: how the family's LoRA A starts (gaussian: diffusers' training scripts; kaiming: PEFT's own)
    lora_init: str = "gaussian"


FAMILY_SPECS: dict[str, FamilySpec] = {spec.name: spec for spec in (
    FamilySpec("llm", "toolkit.models.llm:LLMAdapter", TextDataSection, LLM_SETTINGS,
               "any transformers causal LM", save_formats=("peft", "gguf"),
               tiny={"llm": "toolkit.tiny.llm:write_tiny_llm"},
               compile_auto="llm-compile",
               recompute_auto="llm-recompute", sample_multiple=0, lora_init="kaiming"),
    FamilySpec("sd", "toolkit.models.diffusion_sd:StableDiffusionAdapter", ImageDataSection, DDPM_SETTINGS,
               "Stable Diffusion 1.x/2.x", timestep_sampling="uniform",
               save_formats=("diffusers", "kohya", "comfyui"), pipeline_class="StableDiffusionPipeline",
               tiny={"sd": "toolkit.tiny.diffusion:write_tiny_sd", "sd-v": "toolkit.tiny.diffusion:write_tiny_sd_v"},
               compile_auto="sd-compile-cold", compile_auto_steps=1000, regions_auto="sd-compile-regions",
               sample_multiple=8),
    FamilySpec("sdxl", "toolkit.models.diffusion_sd:StableDiffusionXLAdapter", ImageDataSection, DDPM_SETTINGS,
               "Stable Diffusion XL", timestep_sampling="uniform", save_formats=("diffusers", "kohya", "comfyui"),
               pipeline_class="StableDiffusionXLPipeline",
               tiny={"sdxl": "toolkit.tiny.diffusion:write_tiny_sdxl"},
               compile_auto="sdxl-compile-blocks", compile_auto_steps=200,
               regions_auto="sdxl-compile-regions", regions_blocks_below=5000, sample_multiple=8),
    FamilySpec("flux", "toolkit.models.diffusion_flow:FluxAdapter", ImageDataSection,
               FLOW_SETTINGS | {"train.guidance"}, "Flux.1 dev/schnell", timestep_sampling="logit_normal",
               batch_cap=2, save_formats=("diffusers", "comfyui"),
               tiny={"flux": "toolkit.tiny.flow:write_tiny_flux"}, pipeline_class="FluxPipeline",
               compile_auto="flux-compile",
               keeps_auto="flux-keeps",
               lora_kin=("flux_kontext",)),
    FamilySpec("sd3", "toolkit.models.diffusion_flow:SD3Adapter", ImageDataSection,
               FLOW_SETTINGS | {"sample.negative_prompt"}, "Stable Diffusion 3 / 3.5",
               timestep_sampling="logit_normal", batch_cap=4, save_formats=("diffusers", "comfyui"),
               tiny={"sd3": "toolkit.tiny.flow:write_tiny_sd3"}, pipeline_class="StableDiffusion3Pipeline"),
    FamilySpec("wan21", "toolkit.models.diffusion_wan:WanAdapter", VideoDataSection, VIDEO_SETTINGS,
               "Wan 2.1 text-to-video and image-to-video", timestep_sampling="logit_normal", batch_cap=1,
               save_formats=("diffusers", "comfyui"), tiny={"wan21": "toolkit.tiny.flow:write_tiny_wan21",
                                                           "wan21-i2v": "toolkit.tiny.wan_i2v:write_tiny_wan21_i2v"},
               pipeline_class="WanPipeline", i2v_pipeline="WanImageToVideoPipeline",
               compile_auto="wan21-compile",
               keeps_auto="wan21-keeps",
               lora_kin=("wan22",)),
    FamilySpec("wan22", "toolkit.models.diffusion_wan:Wan22Adapter", VideoDataSection,
               VIDEO_SETTINGS | {"train.experts", "train.expert_switch_every", "model.expert_offload"},
               "Wan 2.2 A14B (two experts; text- or image-to-video) and TI2V-5B", timestep_sampling="logit_normal",
               batch_cap=1, save_formats=("diffusers", "comfyui"),
               tiny={"wan22": "toolkit.tiny.flow:write_tiny_wan22", "wan22-5b": "toolkit.tiny.flow:write_tiny_wan22_5b",
                     "wan22-i2v": "toolkit.tiny.wan_i2v:write_tiny_wan22_i2v"},
               pipeline_class="WanPipeline", i2v_pipeline="WanImageToVideoPipeline",
               lora_kin=("wan21",)),
    FamilySpec("qwen_image", "toolkit.models.diffusion_qwen:QwenImageAdapter", ImageDataSection,
               FLOW_SETTINGS | {"sample.negative_prompt"}, "Qwen-Image", timestep_sampling="logit_normal",
               batch_cap=2, save_formats=("diffusers", "comfyui"),
               tiny={"qwen_image": "toolkit.tiny.qwen_image:write_tiny_qwen_image"}, pipeline_class="QwenImagePipeline",
               lora_kin=("qwen_image_edit",)),
    FamilySpec("qwen_image_edit", "toolkit.models.diffusion_qwen_edit:QwenImageEditAdapter", ReferenceImageDataSection,
               EDIT_SETTINGS | {"sample.negative_prompt"}, "Qwen-Image-Edit-2509 / 2511 (1-3 reference images)",
               timestep_sampling="logit_normal", batch_cap=1, save_formats=("diffusers", "comfyui"),
               tiny={"qwen_image_edit": "toolkit.tiny.qwen_image_edit:write_tiny_qwen_image_edit"},
               pipeline_class="QwenImageEditPlusPipeline", references=(1, 3),
               compile_auto="qwen-edit-compile", compile_auto_steps=200,
               fixed_captions="qwen_image_edit encodes each caption with its reference images once and caches it "
                              "with the latents",
               lora_kin=("qwen_image",)),
    FamilySpec("z_image", "toolkit.models.diffusion_zimage:ZImageAdapter", ImageDataSection,
               FLOW_SETTINGS | {"sample.negative_prompt"}, "Z-Image / Z-Image-Turbo", timestep_sampling="logit_normal",
               batch_cap=2, save_formats=("diffusers", "comfyui"),
               tiny={"z_image": "toolkit.tiny.z_image:write_tiny_z_image"}, pipeline_class="ZImagePipeline"),
    FamilySpec("flux2", "toolkit.models.diffusion_flux2:Flux2Adapter", ReferenceImageDataSection,
               FLOW_SETTINGS | {"train.guidance", "sample.references"}, "FLUX.2 [dev] (reference images optional)", timestep_sampling="logit_normal", batch_cap=1,
               save_formats=("diffusers", "comfyui"), tiny={"flux2": "toolkit.tiny.flux2:write_tiny_flux2"},
               pipeline_class="Flux2Pipeline", references=(0, None),
               comfyui_auto="ComfyUI's Flux map has no names for FLUX.2's feed-forwards and single-block projections, "
                            "so it skips them in pytorch_lora_weights.safetensors (bench/results/"
                            "check-exports-flux2-cpu-2026-11-29.md)"),
    # Chroma's blocks are Flux's without their modulation layers: compile and the kept attention are on by Flux's
    # measurements (not yet measured on Chroma itself).
    FamilySpec("chroma", "toolkit.models.diffusion_chroma:ChromaAdapter", ImageDataSection,
               FLOW_SETTINGS | {"sample.negative_prompt"}, "Chroma (Chroma1-HD / Base: Flux-derived, T5 only)",
               timestep_sampling="logit_normal", batch_cap=2, save_formats=("diffusers", "comfyui"),
               tiny={"chroma": "toolkit.tiny.chroma:write_tiny_chroma"}, pipeline_class="ChromaPipeline",
               compile_auto="chroma-compile", compile_auto_steps=200,
               keeps_auto="flux-keeps"),
    # LTX-2: the video branch of the audio-video transformer, and its audio branch on clips with a soundtrack.
    FamilySpec("ltx2", "toolkit.models.diffusion_ltx2:LTX2Adapter", AudioVideoDataSection,
               (VIDEO_SETTINGS - {"model.task", "sample.images"}) | {"train.frame_rate", "train.audio_loss_weight"},
               "LTX-2 text-to-video (Lightricks/LTX-2: the video branch, and the audio branch on clips with sound; Gemma 3 text)",
               timestep_sampling="logit_normal", batch_cap=1, save_formats=("diffusers", "comfyui"),
               tiny={"ltx2": "toolkit.tiny.ltx2:write_tiny_ltx2"}, pipeline_class="LTX2Pipeline",
               compile_auto="ltx2-compile", compile_auto_steps=200, sample_multiple=32),
    # HunyuanVideo 1.5 T2V and I2V (one family, model.task as Wan's); diffusers' pipelines have no LoRA loader
    # mixin, so the file is read by the transformer's load_lora_adapter (models/diffusion_hunyuan15.py).
    FamilySpec("hunyuan_video15", "toolkit.models.diffusion_hunyuan15:HunyuanVideo15Adapter", VideoDataSection,
               VIDEO_SETTINGS, "HunyuanVideo 1.5 text-to-video and image-to-video (480p / 720p)",
               timestep_sampling="logit_normal", batch_cap=1, save_formats=("diffusers", "comfyui"),
               tiny={"hunyuan15": "toolkit.tiny.hunyuan15:write_tiny_hunyuan15",
                     "hunyuan15-i2v": "toolkit.tiny.hunyuan15:write_tiny_hunyuan15_i2v"},
               pipeline_class="HunyuanVideo15Pipeline", i2v_pipeline="HunyuanVideo15ImageToVideoPipeline",
               compile_auto="hunyuan15-compile", compile_auto_steps=200,
               comfyui_auto="ComfyUI's HunyuanVideo 1.5 model fuses q, k and v, which pytorch_lora_weights.safetensors "
                            "keeps apart in diffusers' names"),
    FamilySpec("flux_kontext", "toolkit.models.diffusion_flux_kontext:FluxKontextAdapter", ReferenceImageDataSection,
               EDIT_SETTINGS | {"train.guidance"}, "FLUX.1 Kontext [dev] (one reference image)",
               timestep_sampling="logit_normal", batch_cap=1, save_formats=("diffusers", "comfyui"),
               tiny={"flux_kontext": "toolkit.tiny.flow:write_tiny_flux_kontext"}, pipeline_class="FluxKontextPipeline",
               references=(1, 1), compile_auto="kontext-compile", compile_auto_steps=200,
               lora_kin=("flux",)),
    FamilySpec("vlm", "toolkit.models.vlm:VLMAdapter", VisionChatDataSection, VLM_SETTINGS,
               "vision-language chat models through AutoModelForImageTextToText: Qwen2.5-VL, Qwen3-VL",
               save_formats=("peft",),
               tiny={"qwen25_vl": "toolkit.tiny.vlm:write_tiny_qwen25_vl", "qwen3_vl": "toolkit.tiny.vlm:write_tiny_qwen3_vl"},
               sample_multiple=0, lora_init="kaiming"),
)}

FAMILIES: tuple[str, ...] = tuple(FAMILY_SPECS)
FAMILY_SCOPED_SETTINGS: frozenset[str] = frozenset().union(*(spec.settings for spec in FAMILY_SPECS.values()))
TINY_WRITERS: dict[str, str] = {kind: where for spec in FAMILY_SPECS.values() for kind, where in spec.tiny.items()}


def family_spec(name: str) -> FamilySpec:
    """The spec of `name`; model.family's choices check reports unknown names before this is reached."""
    return FAMILY_SPECS[name]


def applies_to(key: str, family: str) -> bool:
    """Whether dotted setting `key` does something for `family` (every shared setting does)."""
    return key not in FAMILY_SCOPED_SETTINGS or key in FAMILY_SPECS[family].settings
