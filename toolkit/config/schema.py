"""The config schema: dataclasses used as OmegaConf structured configs.

Every field carries a one-line `doc` (shown by `validate` and in the generated reference) and,
where the value is one of a fixed set, its `choices`. Unknown keys and wrong types are errors.
A run's config is typed for its family (`family_sections`): each section holds the shared settings and the
family-scoped settings its family reads (FamilySpec.settings), so code never meets a key its family does not
have. The `data` section's shape depends on the family too (its FamilySpec's data_schema, config/families.py).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from omegaconf import MISSING

from toolkit.config.families import FAMILIES, FAMILY_SCOPED_SETTINGS, FAMILY_SPECS
from toolkit.config.fields import opt
from toolkit.optim.build import OPTIMIZER_NAMES, optimizer_spec


PRECISIONS = ("auto", "fp32", "bf16", "fp16")
SAVE_FORMATS = ("auto", *dict.fromkeys(fmt for spec in FAMILY_SPECS.values() for fmt in spec.save_formats))
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")
# train.optimizer's and train.optimizer_args' docs, from the optimizer registry (toolkit/optim/build.py).
_OPTIMIZERS = "; ".join(f"{name} ({optimizer_spec(name).description})" for name in OPTIMIZER_NAMES)
_OPTIMIZER_ARGS = "; ".join(f"{name}: {', '.join(sorted(optimizer_spec(name).accepts))}"
                            for name in OPTIMIZER_NAMES if optimizer_spec(name).accepts)


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
class TrainSection:
    steps: int = opt(1000, "Optimizer steps to train.", minimum=1, resume_safe=True)
    batch_size: Union[int, str] = opt("auto", "Samples per micro-batch and process; auto: on a GPU, the largest that "
                                      "fits, measured at the start with forward + backward on the data's largest "
                                      "batch within device.memory_fraction (less room for the optimizer state), "
                                      "remembered per GPU and config in the cache folder; a resumed run keeps its "
                                      "checkpoint's. On the CPU (and with device.distributed=fsdp): the preset's "
                                      "value for the device memory.")
    grad_accum: int = opt(1, "Micro-batches accumulated per optimizer step (derived from train.global_batch_size "
                          "when that is set).", minimum=1)
    global_batch_size: Optional[int] = opt(None, "Samples per optimizer step over all processes; when set, "
                                           "train.grad_accum becomes ceil(global / (batch_size x processes)) (with "
                                           "batch_size auto, the batch is then trimmed so the product overshoots "
                                           "least). null: train.grad_accum as given.", minimum=1)
    lr: float = opt(1e-4, "Peak learning rate.", minimum=0.0)
    lr_scheduler: str = opt("constant", "Learning-rate schedule after warmup.", choices=LR_SCHEDULERS)
    warmup_steps: int = opt(0, "Linear warmup steps from 0 to lr.", minimum=0)
    optimizer: str = opt("adamw8bit", f"Optimizer: {_OPTIMIZERS}.", choices=OPTIMIZER_NAMES)
    optimizer_backend: str = opt("auto", "8-bit optimizer implementation: auto, toolkit or bitsandbytes.",
                                 choices=("auto", "toolkit", "bitsandbytes"), resume_safe=True)
    optimizer_args: Dict[str, Any] = opt({}, "Extra keyword arguments for the optimizer, e.g. {d_coef: 0.5} for "
                                         f"prodigy. Those each optimizer accepts: {_OPTIMIZER_ARGS}; no others.")
    weight_decay: float = opt(0.0, "Decoupled weight decay.", minimum=0.0)
    betas: List[float] = opt([0.9, 0.999], "Adam/Lion betas.")
    eps: float = opt(1e-8, "Adam epsilon.")
    precision: str = opt("auto", "Compute precision: auto (the preset's), fp32, bf16, fp16 (with loss scaling).",
                         choices=PRECISIONS)
    gradient_checkpointing: Union[bool, int, str] = opt(
        "auto", "Recompute activations in backward to save memory: true, false, auto, or for the diffusion families "
        "a number N: N of the denoiser's blocks, spread evenly (memory between none and all). auto on a GPU: off when "
        "one forward + backward at the run's batch size (1 with train.batch_size=auto) fits without it, measured at "
        "the start; otherwise, for a diffusion denoiser with the batch size set, N blocks estimated from the peaks "
        "without and with every block checkpointed (or, when a step without runs out of memory, with half and with "
        "all), when a step with N fits, else all; off on the CPU.",
        resume_safe=True)
    checkpoint_offload: bool = opt(
        False, "With gradient checkpointing: each checkpointed layer's input waits in pinned CPU memory between "
        "forward and backward, copied on a side stream that overlaps the compute (unsloth's offloaded "
        "checkpointing); frees about layers x batch x sequence x hidden x 2 bytes of GPU memory (0.5 GiB on the "
        "Llama-3.2-1B shape at 4 x 2048; measured: bench/results/evidence.json, checkpoint-offload). Off unless "
        "asked for: smaller, not faster.", resume_safe=True)
    checkpoint_keeps: str = opt(
        "auto", "What a gradient-checkpointed denoiser block keeps for its backward. attention: the attention "
        "kernels' outputs (one activation per block, e.g. 100 MB for Wan 2.1 1.3B at 81 x 480 x 832), so backward "
        "recomputes only the rest of the block (selective activation checkpointing); worth it where attention is "
        "most of the block's work (long image and video sequences; cross-attention to the text is recomputed). "
        "nothing: the block recomputes everything. auto: attention for the families measured faster with it (flux, "
        "wan21: the reason names the measurement), nothing for the others, and nothing when "
        "blocks are swapped or, with train.gradient_checkpointing=auto, when a step keeping it does not fit.",
        choices=("auto", "attention", "nothing"), resume_safe=True)
    compile: Union[bool, str] = opt("auto", "Compile each repeated block of the trained model with torch.compile "
                                    "(regional: one compilation reused by every block of a shape; the SD/SDXL UNet as "
                                    "train.compile_regions says); the first step takes longer, a later run of the same "
                                    "model and settings loads what the first compiled (the cache folder). auto: on "
                                    "for the families measured faster with it on a GPU (the reason names the "
                                    "measurement; SD and SDXL for runs long enough to repay a cold compile, or shorter "
                                    "ones whose compiled code an earlier run of the same settings left in the cache), "
                                    "off on the CPU. A "
                                    "block that fails to compile runs uncompiled, with a warning.",
                                    resume_safe=True)
    compile_recompute: str = opt(
        "auto", "What a compiled block keeps for its backward. pointwise: what matmuls and attention produced; the "
        "cheap elementwise results (norms, activations such as SwiGLU's, casts) are recomputed in backward instead "
        "of kept, which lowers activation memory at almost no cost (PyTorch's partitioner with its bans on "
        "recomputing far-apart, long-chain and backward-materialised elementwise ops lifted). none: PyTorch's "
        "default. auto: pointwise for the families measured no slower with it, none for the others; read only "
        "when train.compile is on.", choices=("auto", "pointwise", "none"), resume_safe=True)
    compile_regions: str = opt(
        "auto", "sd, sdxl: what train.compile compiles of a UNet that is not gradient-checkpointed. whole: the UNet "
        "as one graph (the fastest steps, replayed as one CUDA graph; its compile takes minutes the first time). "
        "blocks: each of its transformer and resnet blocks on its own, every block of a shape compiled once and "
        "reused (a far shorter compile), each replayed as a CUDA graph of its own. auto: as measured for the "
        "family (the reason says which measurement). A checkpointed UNet is compiled by its down, mid and up blocks.",
        choices=("auto", "whole", "blocks"), resume_safe=True)
    cuda_graphs: Union[bool, str] = opt(
        "auto", "Replay a compiled denoiser as a CUDA/HIP graph (torch.compile's reduce-overhead mode): the host then "
        "launches one graph instead of thousands of kernels, which bounds a compiled SD/SDXL UNet step. It applies to "
        "a denoiser compiled whole (sd, sdxl without gradient checkpointing), with static shapes, no block swap, "
        "train.grad_accum 1 and one process, on a GPU; auto turns it on there on CUDA (not yet on ROCm, unmeasured), "
        "true on ROCm too; the log says why when it cannot apply.",
        resume_safe=True)
    objective: str = opt("sft", "LLM: what the run optimises (docs/objectives.md). sft: next-token loss on the "
                         "labelled tokens. dpo, orpo: preference pairs (prompt/chosen/rejected, TRL's format, plain "
                         "or conversational); dpo against the reference (the base: the same model with the LoRA "
                         "disabled), orpo without one (NLL on chosen plus the odds-ratio term). kto: unpaired "
                         "examples (prompt/completion/label). grpo: prompts only; the model samples "
                         "train.num_generations completions per prompt, train.reward scores them, and each "
                         "completion's advantage is its reward against its group's.",
                         choices=("sft", "dpo", "orpo", "kto", "grpo"))
    beta: float = opt(0.1, "LLM, dpo and kto: the strength of the pull towards the reference (TRL's beta); orpo: the "
                      "weight of the odds-ratio term (TRL's beta, the paper's lambda).", minimum=0.0)
    reference_logps: str = opt("live", "LLM, dpo and kto: the reference log-probs (the base: the LoRA disabled). "
                               "live: a no-grad forward with the adapter disabled each step. precompute: one pass "
                               "over the training data before the first step, kept in the run folder "
                               "(reference_logps.safetensors, reused on resume), so each step runs the policy "
                               "only (TRL's precompute_ref_log_probs). kto's KL estimate is always live.",
                               choices=("live", "precompute"))
    desirable_weight: float = opt(1.0, "LLM, kto: weight of the examples labelled true.", minimum=0.0)
    undesirable_weight: float = opt(1.0, "LLM, kto: weight of the examples labelled false.", minimum=0.0)
    reward: List[str] = opt(["length"], "LLM, grpo: the reward functions, summed: a built-in (format: 1 when the "
                            "completion is <think>...</think><answer>...</answer>, or matches "
                            "train.reward_pattern when that is set; regex: 1 when train.reward_pattern is found in "
                            "the completion; length: 1 - |characters - train.reward_length| / train.reward_length, "
                            "1 at the target and lower the further off, never flat) or 'module:function', a Python callable (importable from the working "
                            "folder) called as TRL calls one: f(prompts=, completions=, completion_ids=, "
                            "**the record's other fields) -> a list of floats.")
    reward_pattern: Optional[str] = opt(None, "LLM, grpo: the regular expression of the regex reward (and the "
                                        "format reward's, in place of its own).")
    reward_length: int = opt(32, "LLM, grpo: the completion length in characters the length reward is highest at.",
                             minimum=1)
    num_generations: int = opt(4, "LLM, grpo: completions sampled per prompt (the group their advantages are "
                               "measured against; TRL's num_generations).", minimum=2)
    kl_coef: float = opt(0.0, "LLM, grpo: weight of the KL term against the reference (the LoRA disabled), "
                         "k3 estimator per token (TRL's beta; 0 skips the reference pass, TRL's default).",
                         minimum=0.0)
    max_completion_length: int = opt(64, "LLM, grpo: tokens generated per completion at most.", minimum=1)
    generation_temperature: float = opt(1.0, "LLM, grpo: sampling temperature of the completions.", minimum=0.01)
    generation: str = opt("auto", "LLM, grpo: how the completions are generated (docs/objectives.md). eager: the "
                          "trained network itself, the LoRA unmerged, a dynamic KV cache, run eagerly. compiled: "
                          "a copy of the adapted layers' weights with the LoRA merged (W + B A x alpha/r, refreshed "
                          "before each generation; the trained weights are never written; costs one more copy of "
                          "the adapted base weights), a static KV cache with the prompts left-padded to multiples "
                          "of 64 tokens, and on CUDA the decode step compiled with CUDA graphs (transformers' "
                          "CompileConfig, mode reduce-overhead; the CPU decodes eagerly). Plain LoRA over 16-bit "
                          "weights only (not dora, model.quantize, model.fuse_projections=true or fsdp). auto: "
                          "compiled on NVIDIA GPUs for runs of 20 steps or more where it can apply (measured 4.7x eager on one H200) and where the "
                          "base and a copy of its size fit the device's weight budget, else eager; eager on the CPU "
                          "and on AMD GPUs (not measured there yet). A resumed run may change it (the passes "
                          "that train are the same code either way).",
                          choices=("auto", "eager", "compiled"), resume_safe=True)
    max_grad_norm: float = opt(1.0, "Clip the gradient norm to this; 0 disables clipping.", minimum=0.0)
    resume: Union[bool, str] = opt("auto", "auto (resume when the run folder has checkpoints), true, false, or a "
                                   "checkpoint path.", resume_safe=True, path="existing")
    eval_every: int = opt(0, "llm: compute the eval loss every N steps, when there is eval data (0: only at the end); "
                          "the diffusion families: eval.every.",
                          minimum=0, resume_safe=True)
    max_nan_steps: int = opt(5, "Stop after this many non-finite losses in a row (each one skips its step).", minimum=1,
                             resume_safe=True)
    ema_decay: float = opt(0.0, "EMA of the LoRA weights, updated after each optimizer step; saved in checkpoints "
                           "(ema.safetensors) and used for the final export. 0 turns it off; 0.999 is usual.",
                           minimum=0.0)
    train_text_encoder: bool = opt(False, "Diffusion: also put LoRA on the text encoder(s).")
    noise_offset: float = opt(0.0, "Diffusion: noise offset (per-channel constant added to the noise; 0.05-0.1 helps "
                              "very dark/bright images).", minimum=0.0)
    min_snr_gamma: float = opt(0.0, "Diffusion: Min-SNR loss weighting gamma (5 is usual); 0 turns it off.", minimum=0.0)
    prior_loss_weight: float = opt(1.0, "Diffusion: loss weight of regularisation images (datasets with "
                                   "is_regularization; kohya's prior_loss_weight).", minimum=0.0)
    dop_class: Optional[str] = opt(None, "Diffusion: differential output preservation (ai-toolkit's DOP): the class "
                                   "word that replaces data.trigger_word in each training caption; the LoRA's "
                                   "prediction for that class caption is pulled towards the base model's (the adapter "
                                   "switched off, same step, same noise). Unset: off.")
    dop_weight: float = opt(1.0, "Diffusion: weight of the output-preservation loss (ai-toolkit's "
                            "diff_output_preservation_multiplier).", minimum=0.0)
    timestep_sampling: str = opt("auto", "Diffusion: how training timesteps are drawn: uniform, or logit_normal "
                                 "(favours the middle timesteps); auto: uniform for sd/sdxl, logit_normal for the "
                                 "flow-matching families.", choices=("auto", "uniform", "logit_normal"))
    logit_mean: float = opt(0.0, "Diffusion, logit_normal sampling: mean of the normal before the sigmoid.")
    logit_std: float = opt(1.0, "Diffusion, logit_normal sampling: standard deviation of the normal.", minimum=0.01)
    flow_shift: Union[float, str] = opt("auto", "Flow matching: sigma shift s (sigma' = s*sigma / (1 + (s-1)*sigma)); auto: "
                                        "the model's scheduler config (Flux: resolution-dependent).")
    guidance: float = opt(1.0, "Flux-dev: the value fed to the guidance embedding while training (1.0 is usual for "
                          "LoRA); sample.guidance_scale is used when sampling.", minimum=0.0)
    experts: str = opt("both", "Wan 2.2 A14B: which expert gets a LoRA: both, high_noise (timesteps at or above the "
                       "model's boundary) or low_noise.", choices=("both", "high_noise", "low_noise"))
    expert_switch_every: int = opt(10, "Wan 2.2 A14B with experts=both: optimizer steps on one expert before "
                                   "switching to the other (larger values move weights less often).", minimum=1)
    frame_rate: float = opt(24.0, "LTX-2: the frame rate the transformer is told the training clips play at (its "
                            "time positions; LTX-2 was trained at 24-25 fps). Samples play at sample.fps.",
                            minimum=1.0)
    audio_loss_weight: float = opt(1.0, "LTX-2: the audio branch's loss weight; a step's loss is the video loss plus this "
                                   "times the audio loss (clips with a soundtrack, data.audio auto or required).",
                                   minimum=0.0)


@dataclass
class SaveSection:
    every: int = opt(250, "Checkpoint every N steps (0: only at the end).", minimum=0, resume_safe=True)
    keep_last: int = opt(3, "Checkpoints kept; older ones are removed.", minimum=1, resume_safe=True)
    dtype: str = opt("bf16", "dtype of the exported LoRA weights.", choices=("fp32", "bf16", "fp16"), resume_safe=True)
    format: str = opt("auto", "Export format: auto (the family's: peft or diffusers), peft, diffusers; kohya (sd, sdxl) "
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
    width: int = opt(0, "Diffusion: sample width; 0 means data.resolution.", minimum=0, resume_safe=True)
    height: int = opt(0, "Diffusion: sample height; 0 means data.resolution.", minimum=0, resume_safe=True)
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