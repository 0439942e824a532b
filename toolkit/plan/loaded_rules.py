"""The loaded stage: what the model itself settles. First its size, before its weights load (counted on the meta
device): how several processes share it (device.distributed). Then what loading it decided (its memory plan: the
quantization, expert offload and block swap it chose for the device) and what follows from that for the blocks.

Facts (Facts.extra): "processes" (the run's process count), "base_parameters" (a callable counting the frozen
model's parameters without loading them, None when unknown); then "memory" (the decisions the model's memory plan
made, by setting), "quantized" (how the frozen denoiser ended up quantized), "swapped" (whether blocks stream in),
"regions" (whether the model has denoiser blocks the trainer wraps) and "sharded" (the base sharded by fsdp).
"""

from __future__ import annotations

from toolkit.config.schema import QUANTIZED
from toolkit.plan.decisions import Decision
from toolkit.plan.evidence import cite
from toolkit.plan.rules import Facts, rule
from toolkit.plan.weights import choose_distributed, weight_budget_gb, weights_gb

LOADED = "loaded"


@rule("device.distributed", LOADED, needs=("processes", "base_parameters"))
def distributed(f: Facts) -> Decision | None:
    """Whether the frozen base is sharded (fsdp) rather than copied to every process (ddp), and why."""
    setting, processes = f.asked("device.distributed"), f.extra["processes"]
    if processes < 2:
        why = ("one process, nothing to shard; training as one process" if setting == "fsdp" else "one process")
        return Decision("device.distributed", "ddp", why, LOADED)
    unshardable = ((f.reads("model.quantize") and f.asked("model.quantize") in QUANTIZED)
                   or (f.reads("model.expert_offload") and f.asked("model.expert_offload") is True)
                   or (f.reads("train.train_text_encoder") and f.asked("train.train_text_encoder")))
    if setting == "auto" and unshardable:
        return Decision("device.distributed", "ddp",
                        "auto: the config quantizes, offloads experts or trains text encoders", LOADED)
    mode, why = choose_distributed(setting, processes, f.extra["base_parameters"], f.device,
                                   f.asked("device.memory_fraction"))
    return Decision("device.distributed", mode, why, LOADED)


@rule("train.generation", LOADED, needs=("base_parameters",))
def generation_fits(f: Facts) -> Decision | None:
    """train.generation=auto chose compiled (static stage): its merged copy holds the adapted layers' weights once
    more, up to the base's own size. Where the base and a copy of that size pass the weight budget of the device
    (plan/weights.py: 0.6 x device.memory_fraction of its memory, as for fsdp's choice), auto generates eagerly instead."""
    if f.asked("train.generation") != "auto" or f.value("train.generation") != "compiled":
        return None
    try:
        num_params = f.extra["base_parameters"]()
    except (OSError, ValueError):  # a model that cannot be read: loading it says so, with the fix
        return None
    if num_params is None:
        return None
    dtype = f.value("model.dtype")
    base = weights_gb(num_params, "none") * (2 if dtype == "fp32" else 1)  # weights_gb: 16-bit
    budget = weight_budget_gb(f.device, f.asked("device.memory_fraction"))
    if 2 * base <= budget:
        return None
    return Decision("train.generation", "eager", (
        f"the base ({num_params / 1e9:.2f}B parameters, {base:.1f} GB in {dtype}) and compiled generation's merged "
        f"copy of its adapted layers (up to as much again) would pass the {budget:.1f} GB weight budget of this "
        "device; train.generation=compiled asks for it anyway"), LOADED)


def _from_memory_plan(key: str):
    def decide(f: Facts) -> Decision | None:
        return f.extra["memory"].get(key)
    return decide


for _key in ("model.quantize", "model.expert_offload", "model.block_swap"):
    rule(_key, LOADED, needs=("memory",))(_from_memory_plan(_key))


@rule("train.compile", LOADED, needs=("quantized",))
def compile_quantized(f: Facts) -> Decision | None:
    """train.compile=auto was measured faster with 16-bit weights: a denoiser quantized to 8 or 4 bits stays eager.
    fp8 stays compiled: its row quantization is fused there, and eager its layers ran slower."""
    quantized = f.extra["quantized"]
    if f.asked("train.compile") != "auto" or f.value("train.compile") is not True or quantized in ("none", "fp8"):
        return None
    return Decision("train.compile", False, f"the denoiser is quantized ({quantized}); compiling was measured faster "
                    f"with 16-bit weights only, and fp8 only stays compiled ({cite('fp8-compiled')}); "
                    "train.compile=true compiles it anyway", LOADED, "fp8-compiled")


@rule("train.checkpoint_keeps", LOADED, needs=("quantized", "swapped"))
def keeps_after_loading(f: Facts) -> Decision | None:
    """checkpoint_keeps=auto settled at attention, and the run turns out not to be the one measured: blocks
    swapped (memory is short; a swapped compiled block recomputes everything anyway), or the denoiser runs eagerly
    after all."""
    if not (f.reads("train.checkpoint_keeps") and f.asked("train.checkpoint_keeps") == "auto"
            and f.value("train.checkpoint_keeps") == "attention"):
        return None
    if f.extra["swapped"]:
        why = "blocks are swapped (memory is short); the checkpointed blocks recompute their attention"
    elif f.value("train.compile") is not True:
        why = "keeping attention was measured compiled, and the quantized denoiser runs eagerly"
    else:
        return None
    return Decision("train.checkpoint_keeps", "nothing", why, LOADED)


@rule("device.gradient_sync", LOADED, needs=("processes", "regions", "sharded"))
def gradient_sync(f: Facts) -> Decision | None:
    """How several processes average the LoRA gradients: DDP's buckets, or one flat all-reduce after backward that
    leaves a compiled denoiser (and its CUDA graph) exactly as on one process."""
    setting, processes = f.asked("device.gradient_sync"), f.extra["processes"]
    if processes < 2:
        return None
    if f.extra["sharded"]:
        return Decision("device.gradient_sync", "allreduce", "device.distributed=fsdp: the unsharded LoRA gradients "
                        "are averaged with one all-reduce a step", LOADED)
    if setting != "auto":
        return None
    if f.extra["regions"] and f.value("train.compile") is True:
        return Decision("device.gradient_sync", "allreduce", "a compiled denoiser: one flat all-reduce of the LoRA "
                        "gradients after backward keeps it compiled (and replayed as a CUDA graph) as on one process; "
                        "DDP's bucket hooks would split its compiled graph", LOADED)
    return Decision("device.gradient_sync", "ddp", "DistributedDataParallel's all-reduces overlap backward (the LLM's "
                    "blocks compile one by one, each ending where a bucket can start)", LOADED)


@rule("device.shard_optimizer", LOADED, needs=("processes", "sharded"))
def shard_optimizer(f: Facts) -> Decision | None:
    """Whether each process keeps the optimizer state of its share of the LoRA tensors only (ZeRO stage 1)."""
    from toolkit.optim.specs import optimizer_spec

    setting, processes = f.asked("device.shard_optimizer"), f.extra["processes"]
    if processes < 2:
        return Decision("device.shard_optimizer", False, "one process: it holds the whole optimizer state", LOADED)
    if setting is not True and setting is not False:
        name = f.asked("train.optimizer")
        if not optimizer_spec(name).per_tensor:
            return Decision("device.shard_optimizer", False, f"auto: {name} steps every LoRA tensor together",
                            LOADED)
        if f.extra["sharded"]:  # fsdp is asked for memory: the saving is certain, the speed cost was not
            return Decision("device.shard_optimizer", True, f"auto: on under fsdp, each process keeps about "
                            f"1/{processes} of the LoRA optimizer state ({cite('fsdp-shard-optimizer')})", LOADED,
                            evidence="fsdp-shard-optimizer")
        return Decision("device.shard_optimizer", False, "auto: device.distributed=ddp holds the whole model on every "
                        "process; the optimizer state is small beside it", LOADED)
    return None
