"""The config schema: dataclasses used as OmegaConf structured configs.

Every field carries a one-line `doc` (shown by `validate` and in the generated reference) and,
where the value is one of a fixed set, its `choices`. Unknown keys and wrong types are errors.
A run's config is typed for its family (`family_sections`): each section holds the shared settings and the
family-scoped settings its family reads (FamilySpec.settings), so code never meets a key its family does not
have. The `data` section's shape depends on the family too (its FamilySpec's data_schema, config/families.py);
the `train` section is train_schema.py's.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
# Dict: no field here uses it, but family_sections' classes are this module's, so TrainSection's annotations
# (optimizer_args: Dict[str, Any]) resolve against it too.
from typing import Any, Dict, List, Optional, Union  # noqa: F401

from omegaconf import MISSING

from toolkit.config.families import FAMILIES, FAMILY_SCOPED_SETTINGS, FAMILY_SPECS
from toolkit.config.fields import opt
from toolkit.config.train_schema import PRECISIONS, TrainSection


SAVE_FORMATS = ("auto", *dict.fromkeys(fmt for spec in FAMILY_SPECS.values() for fmt in spec.save_formats))


QUANTIZED = ("8bit", "4bit", "fp8")  # model.quantize values that replace the base's 16-bit weights


@dataclass
class RunSection:
    name: str = opt("lora", "Run name; the run folder is named after it by default.", resume_safe=True)
    output_dir: str = opt("outputs/${run.name}", "Run folder: config, checkpoints, samples, logs and the final LoRA.",
                          resume_safe=True, path="local")
    seed: int = opt(42, "Seed for python, numpy and torch RNGs, the data order and the augmentation draws.")


@dataclass
class DeviceSection:
    preset: str = opt("auto", "Arch preset: auto (detect the GPU), or a name from `presets` (gfx1151, sm_90, cpu, ...).",
                      resume_safe=True)
    backend: str = opt("auto", "Device to train on: auto (GPU when one is visible), or cpu to force the CPU.",
                       choices=("auto", "cpu"), resume_safe=True)
    vae_encode_cudnn: bool = opt(True, "Keep cuDNN/MIOpen on while VAE-encoding latents; the HIP presets turn it "
                                 "off (MIOpen convolutions can be 30x slower there).", resume_safe=True)
    sdpa_backend: str = opt("auto", "The kernel PyTorch's scaled_dot_product_attention tries first: cudnn, flash, "
                            "efficient, math, or auto (on a GPU: measured at the start on the model's own attention "
                            "shapes, forward and backward, in a child process; the fastest that runs and agrees with "
                            "the others; the figures are printed and cached). The others stay as fallbacks.",
                            choices=("auto", "cudnn", "flash", "efficient", "math"), resume_safe=True)
    memory_fraction: float = opt(0.9, "Share of the device memory the auto memory options (model.quantize, "
                                 "model.expert_offload) plan with; unified-memory presets lower it.", minimum=0.05,
                                 resume_safe=True)
    distributed: str = opt("auto", "How several processes (`./start_toolkit.sh train CONFIG --gpus N`) share the work: "
                           "ddp keeps a full copy of the model on every GPU and averages gradients; fsdp shards the "
                           "frozen base weights (FSDP2) so a base that does not fit one GPU trains across several; "
                           "auto: fsdp on GPUs where the 16-bit base does not fit one GPU's weight budget, else ddp.",
                           choices=("auto", "ddp", "fsdp"), resume_safe=True)
    gradient_sync: str = opt("auto", "How several processes average the LoRA gradients. ddp: PyTorch's "
                             "DistributedDataParallel (bucketed all-reduces that overlap backward). allreduce: the trainable "
                             "modules run exactly as on one process (compiled, and replayed as CUDA graphs where the run "
                             "does that) and one all-reduce of every LoRA gradient as one flat buffer follows backward: "
                             "LoRA gradients are small. auto: allreduce for a compiled denoiser (DDP splits its compiled "
                             "graph and rules out CUDA graphs), ddp otherwise. With device.distributed=fsdp the LoRA "
                             "gradients are always averaged the allreduce way.",
                             choices=("auto", "ddp", "allreduce"), resume_safe=True)
    shard_optimizer: Union[bool, str] = opt("auto", "Several processes: each keeps the optimizer state (AdamW's two moments) of "
                               "its share of the LoRA tensors only and steps those, then sends the updated tensors to "
                               "the others (ZeRO stage 1, torch's ZeroRedundancyOptimizer): the state per process is "
                               "about 1/N. Every process ends each step with the same weights, and checkpoints hold "
                               "the whole optimizer state, so a run resumes at another process count. auto: on under "
                               "device.distributed=fsdp (asked for memory; measured on a 12B base over 2 GPUs: 0.21 "
                               "GiB less per GPU, no step-rate cost beyond a fresh process's spread), off under ddp "
                               "(the whole model is on every GPU; the state is small beside it). It adds one "
                               "all-gather a step. Needs an optimizer that steps each tensor on its own (not prodigy).",
                               choices=("auto", True, False), resume_safe=True)
    fsdp_embeddings: str = opt("shards", "device.distributed=fsdp: how a process reads an LLM's input embeddings "
                               "(a frozen, plain nn.Embedding; others are always gathered). shards: each process "
                               "looks up the token ids whose rows it holds and the rows are exchanged, so the table "
                               "is never gathered whole (1.25 GiB for a 12B base, at the start of every step); "
                               "gathered: FSDP2 gathers the whole table for the lookup, as for every other unit.",
                               choices=("shards", "gathered"), resume_safe=True)
    collective_timeout: int = opt(1800, "Seconds a process waits for the others at a collective or barrier (cache "
                                  "filling on the main process included) before it stops with an error naming its "
                                  "rank and the collective, instead of hanging (on GPUs, NCCL's watchdog stops it and "
                                  "names the collective). Formerly device.timeout_minutes, still read (x 60) with "
                                  "a note.", minimum=1, resume_safe=True)


@dataclass
class ModelSection:
    family: str = opt(MISSING, "Model family: " + "; ".join(f"{s.name} ({s.description})" for s in FAMILY_SPECS.values())
                      + ".", choices=FAMILIES)
    name_or_path: str = opt(MISSING, "Hub id or local folder loaded with from_pretrained; tiny:<family> for a tiny "
                            "test model.", path="existing")
    revision: Optional[str] = opt(None, "Hub revision (branch, tag or commit) of name_or_path.")
    dtype: str = opt("auto", "dtype of the frozen base weights; auto follows train.precision.", choices=PRECISIONS)
    attention: str = opt("auto", "Attention implementation: auto (the preset's), sdpa, eager, flash_attention_2.",
                         choices=("auto", "sdpa", "eager", "flash_attention_2"), resume_safe=True)
    kernels: str = opt("auto", "Fused kernels for the LLM loss: fused (the output head and cross-entropy in one "
                       "chunked pass, the tokens x vocabulary logits never held whole; compiled when train.compile "
                       "is on), none (the model's own loss), or auto (fused on a GPU, none on the CPU). Models "
                       "whose output head the fused pass does not cover fall back to their own loss, with a note.",
                       choices=("auto", "fused", "none"), resume_safe=True)
    fuse_projections: Union[bool, str] = opt(
        "auto", "LLM: LoRA layers that read the same input (a decoder layer's q/k/v projections, its gate/up "
        "projections) run as one group: their LoRA down-projections as one matrix product, and their frozen weights "
        "with the LoRA up-projections beside them as another (toolkit/models/shared_input.py); o_proj and down_proj "
        "run their LoRA down-projection inside the frozen product (toolkit/models/lora_a_rows.py); a gated MLP (SiLU or "
        "tanh GELU) computes down_proj's LoRA A gradient in its activation's backward (toolkit/models/gated_mlp.py, "
        "a Triton kernel on GPUs). PEFT's "
        "arithmetic otherwise; the saved adapter is unchanged. Applies to "
        "plain LoRA without dropout over unquantized weights, without fsdp. auto: on where measured faster (an NVIDIA GPU "
        "with train.compile on), off on the CPU and, unmeasured, on ROCm.", resume_safe=True)
    quantize: str = opt("auto", "Quantize the frozen base (QLoRA): none, 8bit, 4bit, fp8, or auto (8bit/4bit only when "
                        "the 16-bit weights do not fit the device memory budget; never on the CPU). fp8: the toolkit's "
                        "own e4m3 weights with a scale per row, half of bf16's memory, and fp8 matmuls where the GPU has "
                        "them (NVIDIA sm_89+, AMD gfx942/gfx950; elsewhere upcast to bf16 for each matmul).",
                        choices=("auto", "none", "8bit", "4bit", "fp8"))
    quantize_backend: str = opt("auto", "Library that quantizes the base: auto (bitsandbytes; torchao for 8bit on ROCm), "
                                "bitsandbytes or torchao (8bit only).", choices=("auto", "bitsandbytes", "torchao"))
    expert_offload: Union[bool, str] = opt("auto", "Wan 2.2 A14B: keep only the expert being trained on the device, the "
                                           "other in CPU memory; auto: when both do not fit the memory budget.")
    block_swap: Union[int, str] = opt("auto", "Keep this many of the frozen transformer's blocks in pinned CPU memory and "
                                      "stream each to the GPU just before it runs (on a side stream, overlapped with "
                                      "compute), so a base larger than the GPU trains in 16 bits. Swapped blocks are "
                                      "always gradient-checkpointed. auto: 0 when the 16-bit weights fit the memory "
                                      "budget or the memory is unified, else the fewest blocks that make them fit "
                                      "(instead of model.quantize=auto quantizing).", resume_safe=True)
    trust_remote_code: bool = opt(False, "Allow model code from the Hub repository (transformers trust_remote_code).")
    task: str = opt("auto", "Wan: t2v (text-to-video) or i2v (image-to-video: each clip's start image conditions the "
                    "model as WanImageToVideoPipeline does); auto reads the model folder (a WanImageToVideoPipeline "
                    "is i2v, anything else t2v). TI2V-5B does both: set i2v to train it on start images. "
                    "hunyuan_video15 alike: a HunyuanVideo15ImageToVideoPipeline folder is i2v (the start image's "
                    "latent and SigLIP tokens condition the model).",
                    choices=("auto", "t2v", "i2v"))


@dataclass
class NetworkSection:
    type: str = opt("lora", "Adapter type: lora, dora (weight-decomposed LoRA), or for the diffusion families lokr "
                    "(LyCORIS LoKr: the update is the Kronecker product of a small full matrix and a rank-r factor, "
                    "PEFT's LoKrConfig) or loha (LyCORIS LoHa: the elementwise product of two rank-r updates, PEFT's "
                    "LoHaConfig). LoKr and LoHa files are written in LyCORIS keys (lokr_w1, lokr_w2_a, hada_w1_a, ... "
                    "with .alpha), which ComfyUI, kohya's sd-scripts and the LyCORIS library read; their scale is "
                    "alpha/rank as for LoRA.", choices=("lora", "dora", "lokr", "loha"))
    lokr_factor: int = opt(-1, "network.type=lokr: the factor each dimension is split by (kohya's factor, "
                           "ai-toolkit's lokr_factor): the small Kronecker matrix is about factor x factor; -1 "
                           "splits each dimension as evenly as it divides (the smallest file).", minimum=-1)
    lokr_full_rank: bool = opt(False, "network.type=lokr: both Kronecker factors full matrices (ai-toolkit's "
                               "lokr_full_rank): no rank, network.rank and network.alpha unused, the update "
                               "kron(w1, w2) at scale 1, as LyCORIS and ComfyUI apply a full-rank LoKr.")
    init: str = opt("auto", "How a LoRA's down matrix A starts (its up matrix B starts at zero, so step 0 is the base "
                    "model). gaussian: normal with std 1/rank, as diffusers' training scripts start it; kaiming: uniform "
                    "with std 1/sqrt(3 x the layer's input width), as kohya's sd-scripts, musubi-tuner, ai-toolkit "
                    "and PEFT start it. At one train.lr the two take steps of different size (gaussian's A is the larger "
                    "wherever the rank is below sqrt(3 x the layer's input width): any rank under 67 on a 1,536-wide "
                    "layer): set kaiming to carry a learning rate over from those "
                    "trainers (import-aitk does). auto: gaussian for the diffusion families, kaiming for llm and "
                    "vlm. LoKr and LoHa start as PEFT starts them (auto only).",
                    choices=("auto", "gaussian", "kaiming"))
    rank: int = opt(16, "LoRA rank r.", minimum=1)
    alpha: float = opt(16.0, "LoRA alpha; the update is scaled by alpha/rank (alpha/sqrt(rank) with rslora).")
    dropout: float = opt(0.0, "Dropout on the LoRA input.", minimum=0.0)
    rslora: bool = opt(False, "Rank-stabilised LoRA scaling (alpha/sqrt(rank)).")
    target_modules: Any = opt("auto", "Modules to adapt: auto (the family's default), all-linear, or a list of module names.")
    vision_layers: bool = opt(False, "vlm: LoRA also on the vision tower's linear layers (its blocks and the patch "
                              "merger), besides the language model's (unsloth's finetune_vision_layers).")
    init_from: Optional[str] = opt(None, "Start a new run from an existing LoRA instead of a random one: a LoRA file "
                                   "(the toolkit's, or a diffusers, kohya or ComfyUI .safetensors for the family), a "
                                   "PEFT adapter folder (llm), a run folder (its final/) or a checkpoint folder. Its "
                                   "rank must equal network.rank; its scale is kept (the update is the file's whatever "
                                   "network.alpha says); modules it does not cover start as usual. Steps, optimizer "
                                   "and schedule start fresh. A run that resumes from a checkpoint ignores it.", path="existing")


@dataclass
class SaveSection:
    every: int = opt(250, "Checkpoint every N steps (0: only at the end).", minimum=0, resume_safe=True)
    keep_last: int = opt(3, "Checkpoints kept; older ones are removed.", minimum=1, resume_safe=True)
    dtype: str = opt("bf16", "dtype of the exported LoRA weights.", choices=("fp32", "bf16", "fp16"), resume_safe=True)
    format: str = opt("auto", "Export format: auto (the family's: peft or diffusers; for flux2 and hunyuan_video15, whose "
                      "diffusers file ComfyUI reads only in part, comfyui), peft, diffusers; kohya (sd, sdxl) "
                      "or comfyui (every diffusion family) also write a copy named <run>_<format>.safetensors; gguf "
                      "(llm) also writes <run>.gguf, a llama.cpp LoRA adapter (needs the gguf package). A "
                      "diffusion LoRA file (final/ and every checkpoint) loads at alpha/rank in diffusers, ComfyUI "
                      "and kohya's tools alike.",
                      choices=SAVE_FORMATS, resume_safe=True)


@dataclass
class SampleSection:
    every: int = opt(250, "Sample every N steps (0: only at the end).", minimum=0, resume_safe=True)
    prompts: List[str] = opt([], "Prompts to sample from; none disables sampling.", resume_safe=True)
    seed: int = opt(42, "Sampling seed, fixed so samples are comparable across steps.", resume_safe=True)
    max_new_tokens: int = opt(64, "LLM: tokens generated per prompt.", minimum=1, resume_safe=True)
    temperature: float = opt(0.0, "LLM: sampling temperature; 0 means greedy.", minimum=0.0, resume_safe=True)
    num_inference_steps: int = opt(20, "Diffusion: denoising steps per sample.", minimum=1, resume_safe=True)
    guidance_scale: float = opt(5.0, "Diffusion: classifier-free guidance scale.", resume_safe=True)
    negative_prompt: str = opt("", "Diffusion: negative prompt for classifier-free guidance (families that use it).",
                               resume_safe=True)
    num_frames: int = opt(0, "Video: frames per sample; 0 means data.num_frames.", minimum=0, resume_safe=True)
    fps: int = opt(16, "Video: frames per second of the written samples.", minimum=1, resume_safe=True)
    width: int = opt(0, "Diffusion: sample width, a multiple of what the family's pipeline draws (8 for sd and sdxl, "
                     "32 for ltx2, 16 for the others); 0 means data.resolution, rounded down to it.", minimum=0,
                     resume_safe=True)
    height: int = opt(0, "Diffusion: sample height, as sample.width; 0 means data.resolution, rounded down to the "
                      "multiple.", minimum=0, resume_safe=True)
    images: List[str] = opt([], "Wan image-to-video: the start image of each sample, one per prompt (or one for "
                            "all), resized to cover the sample size and centre-cropped. vlm: the image each prompt "
                            "asks about (one per prompt, or one for all), resized by the model's processor.",
                            resume_safe=True, path="local")
    references: List[List[str]] = opt([], "Edit families (qwen_image_edit, flux_kontext, flux2): the reference images "
                                      "of each sample, one list per prompt (the edit pipeline's `image`), e.g. "
                                      "[[ref0.png, ref1.png], [other.png]]; required for the edit families.",
                                      resume_safe=True, path="local")


@dataclass
class LogSection:
    every: int = opt(10, "Log metrics every N steps.", minimum=1, resume_safe=True)
    tensorboard: bool = opt(True, "Write TensorBoard events under logs/.", resume_safe=True)
    wandb: bool = opt(False, "Also log to Weights & Biases (needs `pip install wandb` and a login).", resume_safe=True)
    wandb_project: Optional[str] = opt(None, "Weights & Biases project; None: the run name.", resume_safe=True)
    profile: bool = opt(False, "Write a PyTorch profiler trace of steps 2-4 (Chrome trace JSON under logs/profile/).",
                        resume_safe=True)


@dataclass
class EvalSection:
    path: Optional[str] = opt(None, "Diffusion: a held-out folder of images (or clips) with captions, laid out as "
                              "data.path (same caption, resolution and bucket settings; no flips or crops). Its "
                              "denoising loss is computed at eval.timesteps fixed noise levels with fixed noise, so "
                              "every evaluation of every run (resumed or not) sees the same inputs; logged as "
                              "eval_loss and plotted in report.html beside the training loss.", path="local")
    every: int = opt(0, "Diffusion: compute the eval loss every N steps when eval.path is set (0: only at the end).",
                     minimum=0, resume_safe=True)
    timesteps: int = opt(4, "Diffusion: the fixed noise levels each eval image is scored at, spread evenly over the "
                         "noise schedule ((i + 0.5) / N of it; the flow families' shift applied as in training); "
                         "the eval loss is the mean over images and levels.", minimum=1)
    seed: int = opt(0, "Diffusion: the seed of the eval noise (one draw per image and level, independent of "
                    "run.seed and of the training's random streams).")


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    device: DeviceSection = field(default_factory=DeviceSection)
    model: ModelSection = field(default_factory=ModelSection)
    network: NetworkSection = field(default_factory=NetworkSection)
    data: Any = None  # replaced by the family's data_schema when the config is loaded
    train: TrainSection = field(default_factory=TrainSection)
    save: SaveSection = field(default_factory=SaveSection)
    sample: SampleSection = field(default_factory=SampleSection)
    log: LogSection = field(default_factory=LogSection)
    eval: EvalSection = field(default_factory=EvalSection)


@functools.cache
def family_sections(family: str) -> type:
    """RunConfig for `family`: every section with the shared settings and the family's own (FamilySpec.settings),
    as dataclasses of their own (DiffusionTrainSection for the sd family, ...), made once per family."""
    settings = FAMILY_SPECS[family].settings
    sections = []
    for section in dataclasses.fields(RunConfig):
        if section.name == "data":
            sections.append(("data", Any, dataclasses.field(default=None)))
            continue
        full = section.default_factory
        kept = [(f.name, f.type, _copied(f)) for f in dataclasses.fields(full)
                if f"{section.name}.{f.name}" not in FAMILY_SCOPED_SETTINGS or f"{section.name}.{f.name}" in settings]
        typed = _here(dataclasses.make_dataclass(f"{_camel(family)}{full.__name__}", kept))
        sections.append((section.name, typed, dataclasses.field(default_factory=typed)))
    return _here(dataclasses.make_dataclass(f"{_camel(family)}RunConfig", sections))


def _here(cls: type) -> type:
    """A generated dataclass as if defined in this module (its string annotations resolve against it)."""
    cls.__module__ = __name__
    return cls


def _copied(f: dataclasses.Field) -> dataclasses.Field:
    """A field with the same default (or default factory) and metadata, for a generated section."""
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))