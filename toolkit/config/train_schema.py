"""The `train` section of the config schema (schema.py's RunConfig holds it): the steps and the batch, the
optimizer and its schedule, precision, memory (checkpointing, offload), compilation, the llm objectives beyond
sft, and the diffusion families' training settings. Its fields are OmegaConf structured-config fields made with
`opt`, as every section's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from toolkit.config.fields import opt
from toolkit.optim.specs import OPTIMIZER_NAMES, optimizer_spec

PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # train.precision's choices, and model.dtype's
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")
# train.optimizer's and train.optimizer_args' docs, from the optimizer registry (toolkit/optim/specs.py).
_OPTIMIZERS = "; ".join(f"{name} ({optimizer_spec(name).description})" for name in OPTIMIZER_NAMES)
_OPTIMIZER_ARGS = "; ".join(f"{name}: {', '.join(sorted(optimizer_spec(name).accepts))}"
                            for name in OPTIMIZER_NAMES if optimizer_spec(name).accepts)


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
        "all), when a step with N fits, else the count a second line through N's peak gives when that fits, else "
        "all; off on the CPU.",
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
                                    "measurement; SD from 1,000 steps, SDXL, LTX-2, HunyuanVideo 1.5, Chroma, FLUX.1 "
                                    "Kontext and Qwen-Image-Edit from 200: runs long enough to repay a cold compile, or shorter ones whose "
                                    "compiled code an earlier run of the same settings left in the cache), off on the "
                                    "CPU. A block that fails to compile runs uncompiled, with a warning. Every run "
                                    "says where its start-up went before its first step ended (the start-up line).",
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
                                   "checkpoint path (a run folder: its newest checkpoint).", resume_safe=True,
                                   path="existing")
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
