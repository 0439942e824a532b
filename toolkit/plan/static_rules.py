"""The static stage: what the config and the device settle before anything loads (`validate` shows it).

Settings measured later (the batch size, gradient checkpointing) get a provisional value here that says so;
the measured stage (train/memory_plan.py) replaces it.
"""

from __future__ import annotations

from toolkit.config.families import family_spec
from toolkit.config.schema import QUANTIZED
from toolkit.errors import UserError
from toolkit.plan.compiled_runs import signature
from toolkit.plan.decisions import Decision
from toolkit.plan.evidence import cite
from toolkit.plan.rules import Facts, rule

STATIC = "static"


def static_decision(key: str, value, reason: str, evidence: str | None = None) -> Decision:
    return Decision(key, value, reason, STATIC, evidence)


@rule("train.precision", STATIC)
def precision(f: Facts) -> Decision | None:
    """What the run computes in, said once: auto's choice, or the setting with what it means on this device."""
    requested, device = f.asked("train.precision"), f.device
    if requested == "auto":
        if device.backend == "cpu":
            return static_decision("train.precision", "fp32", "auto on the CPU: fp32 (bf16 matmuls are slower than fp32 "
                                                        "on most CPUs)")
        if device.bf16:
            return static_decision("train.precision", "bf16", f"auto: {device.arch} supports bf16")
        return static_decision("train.precision", "fp16", f"auto: {device.arch} has no bf16: fp16 with loss scaling")
    if requested == "bf16" and device.backend != "cpu" and not device.bf16:
        f.problems.append(f"'train.precision' is bf16, but {device.arch} has no bf16 support: "
                          "use train.precision=fp16 (trained with loss scaling) or fp32")
    if requested == "fp16" and device.backend == "cpu":
        f.problems.append("'train.precision' is fp16, which the CPU cannot train in: use fp32 (or bf16) on the CPU")
    where = f.extra["sources"].get("train.precision", "the defaults")
    if device.backend == "cpu":
        note = ("; bf16 matmuls are slower than fp32 on most CPUs (auto chooses fp32 there)" if requested == "bf16"
                else "")
        return static_decision("train.precision", requested, f"set in {where}: the CPU trains in {requested}{note}")
    return static_decision("train.precision", requested, f"set in {where}")


@rule("model.dtype", STATIC)
def base_dtype(f: Facts) -> Decision | None:
    if f.asked("model.dtype") != "auto":
        return None
    return static_decision("model.dtype", f.value("train.precision"), "frozen base weights follow train.precision")


@rule("train.batch_size", STATIC)
def batch_size(f: Facts) -> Decision | None:
    """auto: the preset's table for the device memory (capped for families of large samples), provisional on a
    GPU, where the trainer measures the largest batch that fits."""
    size = f.asked("train.batch_size")
    if size != "auto":
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            f.problems.append(f"'train.batch_size' must be a positive integer or auto, got {size!r}")
        return None
    value, why = f.extra["preset"].batch_size_for(f.device.memory_gb)
    cap = family_spec(f.family).batch_cap
    if cap is not None and value > cap:
        value, why = cap, f"{why}, capped at {cap} for {f.family} (large samples)"
    why += ("; on the CPU auto keeps the preset's table (the batch probe measures on GPUs)" if f.device.backend == "cpu"
            else "; until the trainer measures the largest batch that fits, at the start (train/batch_size.py)")
    return static_decision("train.batch_size", value, why)


@rule("train.gradient_checkpointing", STATIC)
def gradient_checkpointing(f: Facts) -> Decision | None:
    setting = f.asked("train.gradient_checkpointing")
    if f.reads("train.checkpoint_offload") and f.asked("train.checkpoint_offload") and setting is False:
        f.problems.append("'train.checkpoint_offload' moves the inputs of checkpointed layers, and "
                          "train.gradient_checkpointing is false: set it to true or auto, or remove checkpoint_offload")
    if setting == "auto":
        return static_decision("train.gradient_checkpointing", False, (
            "off on the CPU (memory is not measured there)" if f.device.backend == "cpu" else
            "off unless a step at the run's batch size does not fit without it, measured at the start "
            "(train/memory_plan.py; with train.batch_size=auto: unless a batch of 1 does not fit)"))
    if not isinstance(setting, (bool, int)) or (not isinstance(setting, bool) and setting < 0):
        f.problems.append(f"'train.gradient_checkpointing' must be true, false, auto or a number of blocks, got "
                          f"{setting!r}")
    elif not isinstance(setting, bool) and f.family in ("llm", "vlm"):
        f.problems.append(f"'train.gradient_checkpointing': {setting} blocks is read by the diffusion families; an "
                          "LLM checkpoints all its layers or none (true or false), and so does a VLM")
    return None


@rule("model.block_swap", STATIC)
def block_swap_checks(f: Facts) -> None:
    """Checks only: the swap itself is planned once the model is loaded (loaded stage)."""
    if not f.reads("model.block_swap"):
        return None
    swap = f.asked("model.block_swap")
    if swap != "auto" and (isinstance(swap, bool) or not isinstance(swap, int) or swap < 0):
        f.problems.append(f"'model.block_swap' must be a number of blocks (0: none) or auto, got {swap!r}")
    elif isinstance(swap, int) and swap > 0 and f.asked("model.quantize") in QUANTIZED:
        f.problems.append(f"'model.block_swap'={swap} swaps 16-bit weights; it is not combined with "
                          f"model.quantize={f.asked('model.quantize')}: set one of them to none / 0")
    return None


LYCORIS_TYPES = ("lokr", "loha")


@rule("network.type", STATIC)
def network_type_checks(f: Facts) -> None:
    """LoKr and LoHa are diffusion adapters (their files are LyCORIS files for ComfyUI and kohya)."""
    kind = f.asked("network.type")
    if kind in LYCORIS_TYPES and f.family == "llm":
        f.problems.append(f"'network.type'={kind} is for the diffusion families (LyCORIS files for ComfyUI and "
                          "kohya); an llm trains lora or dora: set network.type=lora")
    if kind in LYCORIS_TYPES:
        for key, plain in (("network.dropout", 0.0), ("network.rslora", False), ("network.init", "auto")):
            if f.asked(key) != plain:
                f.problems.append(f"'{key}'={f.asked(key)} is a LoRA setting that PEFT's {kind} adapter does not "
                                  f"have: set {key}={str(plain).lower()}, or network.type=lora")
    if f.asked("network.lokr_factor") == 0:
        f.problems.append("'network.lokr_factor'=0 splits nothing: use -1 (even split) or a factor of at least 1")
    if f.asked("network.lokr_full_rank") and kind != "lokr":
        f.problems.append(f"'network.lokr_full_rank' applies to network.type=lokr only (network.type is {kind}): "
                          "remove it, or set network.type=lokr")
    if f.asked("network.lokr_factor") != -1 and kind != "lokr":
        f.problems.append(f"'network.lokr_factor' applies to network.type=lokr only (network.type is {kind}): "
                          "remove it, or set network.type=lokr")
    return None


# network.init=auto's reasons, by the start FamilySpec.lora_init gives the family
LORA_INIT_REASONS = {
    "kaiming": "PEFT's own start: A uniform with std 1/sqrt(3 x the layer's input width)",
    "gaussian": "A normal with std 1/rank, as diffusers' training scripts start a LoRA; kohya's sd-scripts, "
                "musubi-tuner and ai-toolkit start it kaiming-uniform, which takes smaller steps at one train.lr on "
                "wide layers: network.init=kaiming carries a learning rate over from them",
}


@rule("network.init", STATIC)
def lora_init(f: Facts) -> Decision | None:
    """auto: the family's start (FamilySpec.lora_init), said, since a learning rate carried over from kohya's
    sd-scripts, musubi-tuner or ai-toolkit assumes kaiming (docs/performance.md, the loss parity beside
    musubi-tuner). LoKr and LoHa start as PEFT starts them."""
    if f.asked("network.init") != "auto" or f.asked("network.type") in LYCORIS_TYPES:
        return None
    start = family_spec(f.family).lora_init
    return static_decision("network.init", start, LORA_INIT_REASONS[start])


@rule("model.quantize", STATIC)
def quantize_checks(f: Facts) -> None:
    """Checks only: auto is settled once the model's size is known (loaded stage)."""
    if not f.reads("model.quantize") or f.asked("model.quantize") != "fp8":
        return None
    if f.asked("network.type") == "dora":
        f.problems.append("'network.type'=dora needs the base weights in 16 bits (DoRA normalises them), and "
                          "model.quantize=fp8 stores them in 8: use network.type=lora, or model.quantize=none")
    if f.asked("model.quantize_backend") != "auto":
        f.problems.append(f"'model.quantize_backend'={f.asked('model.quantize_backend')}: model.quantize=fp8 is the "
                          "toolkit's own layer, not that library's; leave model.quantize_backend=auto")
    return None


@rule("device.distributed", STATIC)
def fsdp_checks(f: Facts) -> None:
    """What device.distributed=fsdp cannot shard: quantized layers, whole-expert offload, swapped blocks, text
    encoders. auto is settled with the processes and the model's size (loaded stage)."""
    if f.asked("device.distributed") != "fsdp":
        return None
    refused = "device.distributed=fsdp cannot run this config: "
    if f.reads("model.quantize") and f.asked("model.quantize") in QUANTIZED:
        f.problems.append(refused + f"model.quantize={f.asked('model.quantize')}: quantized weights are not sharded; "
                          "use model.quantize=none (or auto) with fsdp, or device.distributed=ddp")
    if f.reads("model.expert_offload") and f.asked("model.expert_offload") is True:
        f.problems.append(refused + "model.expert_offload=true: offloading moves whole experts, and with fsdp each "
                          "process already holds 1/N of them; leave model.expert_offload=auto")
    if f.reads("model.block_swap") and f.asked("model.block_swap") not in (0, "auto"):
        f.problems.append(refused + "model.block_swap: fsdp shards the blocks over the processes instead; use "
                          "model.block_swap=0 (or auto) with fsdp, or device.distributed=ddp")
    if f.reads("train.train_text_encoder") and f.asked("train.train_text_encoder"):
        f.problems.append(refused + "train.train_text_encoder: the text encoders are not sharded; use "
                          "device.distributed=ddp")
    return None


@rule("train.dop_class", STATIC)
def dop_checks(f: Facts) -> None:
    """Output preservation (train.dop_class) replaces each training dataset's trigger word by the class word, and
    compares with the base through text encoders that carry no LoRA: checked here, before the model loads."""
    if not f.reads("train.dop_class") or not f.asked("train.dop_class"):
        return None
    from toolkit.data.datasets import dataset_settings

    if f.reads("train.train_text_encoder") and f.asked("train.train_text_encoder"):
        f.problems.append("'train.dop_class': output preservation compares with the base model through the text "
                          "encoders, and train.train_text_encoder puts a LoRA on them: set "
                          "train.train_text_encoder=false, or unset train.dop_class")
    try:
        settings = dataset_settings(f.cfg.data)
    except UserError:
        return None  # named when the data loads
    for dataset in settings:
        if not dataset.is_regularization and not dataset.section.trigger_word:
            f.problems.append(f"'train.dop_class': output preservation replaces the trigger word, and "
                              f"{dataset.label.rsplit('.', 1)[0]} has no trigger_word: set data.trigger_word (the "
                              "word the LoRA learns), or unset train.dop_class")
    return None


@rule("train.compile", STATIC)
def compile_(f: Facts) -> Decision | None:
    """auto: on where the family was measured faster compiled and the run is long enough to repay the first
    step's compile (FamilySpec.compile_auto, compile_auto_steps), or shorter but with its compiled code cached by
    an earlier run of the same settings (plan/compiled_runs.py); off on the CPU."""
    setting = f.asked("train.compile")
    if setting != "auto":
        if not isinstance(setting, bool):
            f.problems.append(f"'train.compile' must be true, false or auto, got {setting!r}")
        return None
    spec, steps = family_spec(f.family), f.asked("train.steps")
    if f.device.backend == "cpu":
        return static_decision("train.compile", False, "off on the CPU")
    if not spec.compile_auto:
        return static_decision("train.compile", False, f"not measured faster for {f.family} yet")
    if f.reads("train.objective") and f.asked("train.objective") == "grpo":
        return static_decision("train.compile", False, "train.objective=grpo: its generation runs eagerly and its scored "
                         "rows keep one width, but compiled GRPO has not been measured faster on a GPU yet (true "
                         "compiles anyway)")
    if steps < spec.compile_auto_steps:
        seen = f.extra["compiled_runs"].get(signature(f.cfg, f.device.name))
        if seen is not None:
            return static_decision("train.compile", True, (
                f"train.steps={steps} is short of the {spec.compile_auto_steps} steps that repay a cold compile "
                f"({cite(spec.compile_auto)}), but a run of these settings compiled on this machine on "
                f"{seen['date']} (first step {seen['first_step_s']:.0f} s) and its code is cached: this run loads "
                "it"), spec.compile_auto)
        return static_decision("train.compile", False, (
            f"a run of train.steps={steps} (in all, a resumed run's steps counted) is too short to repay the first "
            f"step's compile: {cite(spec.compile_auto)}; auto compiles {f.family} from {spec.compile_auto_steps} "
            "steps, train.compile=true compiles any run"), spec.compile_auto)
    return static_decision("train.compile", True, cite(spec.compile_auto), spec.compile_auto)


@rule("train.compile_recompute", STATIC)
def compile_recompute(f: Facts) -> Decision | None:
    if f.asked("train.compile_recompute") != "auto" or f.value("train.compile") is not True:
        return None  # read only when compiling
    measured = family_spec(f.family).recompute_auto
    value = "pointwise" if measured else "none"
    return static_decision("train.compile_recompute", value,
                     cite(measured) if measured else f"PyTorch's default: pointwise not measured for {f.family} yet",
                     measured)


@rule("train.checkpoint_keeps", STATIC)
def checkpoint_keeps(f: Facts) -> Decision | None:
    """auto: attention where measured faster (compiled), else nothing; the loaded and measured stages may still
    drop it (swapped blocks, a quantized denoiser run eagerly, a step keeping it that does not fit)."""
    if not f.reads("train.checkpoint_keeps") or f.asked("train.checkpoint_keeps") != "auto":
        return None
    measured = family_spec(f.family).keeps_auto
    keep = bool(measured) and f.value("train.compile") is True  # eager, the policy runs in Python per op
    if keep:
        return static_decision("train.checkpoint_keeps", "attention", cite(measured), measured)
    why = ("a checkpointed block recomputes everything: keeping attention was measured compiled, and train.compile "
           "is off" if measured else
           f"a checkpointed block recomputes everything: keeping attention not measured faster for {f.family} yet")
    return static_decision("train.checkpoint_keeps", "nothing", why)


@rule("train.compile_regions", STATIC)
def compile_regions(f: Facts) -> Decision | None:
    """sd/sdxl: a UNet compiled whole (one CUDA graph, a long first compile) or block by block, as measured."""
    if not f.reads("train.compile_regions") or f.asked("train.compile_regions") != "auto":
        return None
    spec, steps = family_spec(f.family), f.asked("train.steps")
    if f.value("train.compile") is not True:
        return static_decision("train.compile_regions", "whole", "not used: train.compile is off")
    if not spec.regions_auto:
        return static_decision("train.compile_regions", "whole", f"block by block not measured for {f.family} yet")
    if steps < spec.regions_blocks_below:
        return static_decision("train.compile_regions", "blocks", f"a run of train.steps={steps} (under "
                         f"{spec.regions_blocks_below}) ends first compiled block by block: {cite(spec.regions_auto)}",
                         spec.regions_auto)
    longer = f"a run of train.steps={steps}: " if spec.regions_blocks_below else ""
    return static_decision("train.compile_regions", "whole", longer + cite(spec.regions_auto), spec.regions_auto)


@rule("train.cuda_graphs", STATIC)
def cuda_graphs_checks(f: Facts) -> None:
    """Checks only: whether a denoiser replays as a graph is known once its blocks are wrapped (measured stage)."""
    setting = f.asked("train.cuda_graphs")
    if not (isinstance(setting, bool) or setting == "auto"):
        f.problems.append(f"'train.cuda_graphs' must be true, false or auto, got {setting!r}")
    return None


@rule("train.timestep_sampling", STATIC)
def timestep_sampling(f: Facts) -> Decision | None:
    if not f.reads("train.timestep_sampling") or f.asked("train.timestep_sampling") != "auto":
        return None
    sampling = family_spec(f.family).timestep_sampling or "uniform"
    return static_decision("train.timestep_sampling", sampling, f"the {f.family} family's usual")


@rule("device.shard_optimizer", STATIC)
def shard_optimizer_fits(f: Facts) -> Decision | None:
    """device.shard_optimizer=true with an optimizer whose step reads every tensor (Prodigy's step size): refused
    before the model loads. The value itself is decided at the loaded stage, once fsdp or ddp is known."""
    from toolkit.optim.specs import OPTIMIZER_NAMES, optimizer_spec

    name = f.asked("train.optimizer")
    if f.asked("device.shard_optimizer") is True and name in OPTIMIZER_NAMES and not optimizer_spec(name).per_tensor:
        f.problems.append(f"'device.shard_optimizer' is true, but train.optimizer={name} steps every LoRA tensor "
                          "together (one step size from all of them): fix: set device.shard_optimizer to auto or "
                          "false, or use adamw")
    return None
