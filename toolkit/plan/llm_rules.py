"""The static stage's rules for the llm family (and vlm where it reads the same settings): the fused loss, grouped
LoRA projections, attention, GRPO's generation and the data format each objective trains on. Registered after
plan/static_rules.py's (plan/stages.py imports both), so they may read what those decided (train.compile)."""

from __future__ import annotations

from toolkit.config.objectives import OBJECTIVE_FORMATS
from toolkit.config.schema import QUANTIZED
from toolkit.errors import UserError
from toolkit.plan.decisions import Decision
from toolkit.plan.evidence import cite
from toolkit.plan.rules import Facts, rule
from toolkit.plan.static_rules import STATIC, static_decision


@rule("model.kernels", STATIC)
def kernels(f: Facts) -> Decision | None:
    if not f.reads("model.kernels") or f.asked("model.kernels") != "auto":
        return None
    if f.device.backend == "cpu":
        return static_decision("model.kernels", "none", "the CPU keeps the model's own loss")
    return static_decision("model.kernels", "fused", "on a GPU, no tokens x vocabulary logits held: "
                     + cite("llm-fused-loss"), "llm-fused-loss")


@rule("model.fuse_projections", STATIC)
def fuse_projections(f: Facts) -> Decision | None:
    """auto turns it on with train.compile on an NVIDIA GPU; true where it cannot apply is refused, naming what
    stands in the way."""
    if not f.reads("model.fuse_projections"):
        return None
    value = f.asked("model.fuse_projections")
    if not (isinstance(value, bool) or value == "auto"):
        f.problems.append(f"'model.fuse_projections' must be true, false or auto, got {value!r}")
        return None
    blockers = [why for why, blocks in (
        ("network.type=dora (each layer normalises its own weight)", f.asked("network.type") == "dora"),
        (f"network.dropout={f.asked('network.dropout')} (each layer drops its own input)",
         f.asked("network.dropout") > 0),
        (f"model.quantize={f.asked('model.quantize')} (the frozen weights are quantized)",
         f.asked("model.quantize") in QUANTIZED),
        ("device.distributed=fsdp (the frozen weights are sharded per layer)", f.asked("device.distributed") == "fsdp"),
    ) if blocks]
    if value is True and blockers:
        f.problems.append(f"'model.fuse_projections'=true cannot apply with {'; '.join(blockers)}: set "
                          "model.fuse_projections=auto or false")
    if value != "auto":
        return None
    if blockers:
        return static_decision("model.fuse_projections", False, "off with " + "; ".join(blockers))
    if f.asked("train.objective") != "sft":  # true applies: a disabled LoRA (the reference) runs PEFT's own layers
        return static_decision("model.fuse_projections", False, f"off with train.objective={f.asked('train.objective')}: "
                         "measured with sft only (true turns it on)")
    if f.device.backend != "cuda":
        where = "the CPU" if f.device.backend == "cpu" else "ROCm"
        return static_decision("model.fuse_projections", False,
                         f"off on {where}: measured on NVIDIA GPUs only (true turns it on)")
    if f.value("train.compile") is not True:
        return static_decision("model.fuse_projections", False, "off with train.compile off (measured compiled only)")
    return static_decision("model.fuse_projections", True, cite("llm-fuse-projections"), "llm-fuse-projections")


@rule("model.attention", STATIC)
def attention(f: Facts) -> Decision | None:
    if not f.reads("model.attention") or f.asked("model.attention") != "auto":
        return None
    return static_decision("model.attention", "sdpa", "PyTorch scaled_dot_product_attention, the default")


# The shortest GRPO run auto generates compiled for: the decode's compile costs at most 90.5 s once (evidence
# grpo-generation-compiled, bounded from the checkpointed command's wall time) and saves 5.9 s a step, so it is
# repaid within 16 steps.
GENERATION_COMPILED_STEPS = 20


@rule("train.generation", STATIC)
def generation(f: Facts) -> Decision | None:
    """auto: compiled on NVIDIA GPUs, where it was measured faster (evidence grpo-generation-compiled), unless its
    merged copy cannot be made; eager on the CPU (it decodes eagerly either way) and on AMD GPUs (not measured there
    yet). compiled where its merged copy cannot be made is refused, naming what stands in the way."""
    if not f.reads("train.generation"):
        return None
    asked = f.asked("train.generation")
    blockers = [why for why, blocks in (
        (f"network.type={f.asked('network.type')} (it merges plain LoRA only)", f.asked("network.type") != "lora"),
        (f"model.quantize={f.asked('model.quantize')} (the merged copy needs 16-bit weights)",
         f.asked("model.quantize") in QUANTIZED),
        ("model.fuse_projections=true (the grouped layers are not PEFT's)", f.asked("model.fuse_projections") is True),
        ("device.distributed=fsdp (the frozen weights are sharded)", f.asked("device.distributed") == "fsdp"),
    ) if blocks]
    if asked == "compiled" and blockers:
        f.problems.append(f"'train.generation'=compiled cannot apply with {'; '.join(blockers)}: set "
                          "train.generation=eager (or auto)")
    if asked != "auto":
        return None
    if f.asked("train.objective") != "grpo":
        return static_decision("train.generation", "eager", f"train.objective={f.asked('train.objective')} generates "
                         "nothing while training")
    if f.device.backend != "cuda":
        where = "on the CPU, which decodes eagerly either way" if f.device.backend == "cpu" else \
            f"on {f.device.backend} GPUs, where compiled generation has not been measured yet (compiled turns it on)"
        return static_decision("train.generation", "eager", where)
    if blockers:
        return static_decision("train.generation", "eager", "compiled generation merges the LoRA into a copy of the "
                         f"weights, which cannot be made with {'; '.join(blockers)}")
    if f.asked("train.steps") < GENERATION_COMPILED_STEPS:
        return static_decision("train.generation", "eager", (
            f"train.steps={f.asked('train.steps')} is short of the {GENERATION_COMPILED_STEPS} steps that repay the "
            f"decode's compile ({cite('grpo-generation-compiled')})"), "grpo-generation-compiled")
    return static_decision("train.generation", "compiled", (
        "the LoRA merged into a copy of the adapted weights (one more copy of them in memory), a static KV cache "
        f"and the decode step in CUDA graphs: {cite('grpo-generation-compiled')}"), "grpo-generation-compiled")


@rule("data.format", STATIC)
def data_format(f: Facts) -> Decision | None:
    """llm: auto takes the objective's format for preference, unpaired and prompt data (sft's is read from the
    first record of data.path); a format the objective cannot train on, or packing with a non-sft objective, is
    refused."""
    if not f.reads("train.objective"):
        return None
    objective, asked = f.asked("train.objective"), f.asked("data.format")
    formats = OBJECTIVE_FORMATS[objective]
    if asked != "auto" and asked not in formats:
        f.problems.append(f"'data.format' is {asked}, which train.objective={objective} cannot train on: set "
                          f"data.format={' or '.join(formats)} (or auto)")
    if objective != "sft" and f.asked("data.packing"):
        f.problems.append(f"'data.packing' packs samples for sft; train.objective={objective} compares whole "
                          "sequences: set data.packing=false")
    if objective == "grpo" and (f.asked("data.eval_fraction") > 0 or f.asked("data.eval_path")):
        f.problems.append("'data.eval_fraction' / 'data.eval_path' hold out data for an eval loss, which "
                          "train.objective=grpo has none of: set data.eval_fraction=0 and data.eval_path=null")
    if asked != "auto":
        return None
    if objective == "sft":
        return _sft_format(f)
    return static_decision("data.format", formats[0], f"train.objective={objective} trains on {formats[0]} data")


def _sft_format(f: Facts) -> Decision | None:
    """sft's auto: the format of data.path's first record, so that `validate` shows it (or names fields that match
    none) before the model loads."""
    from toolkit.data.records import first_record
    from toolkit.data.text import format_fields, format_of

    path, text_field = f.asked("data.path"), f.asked("data.text_field")
    try:
        record = first_record(path)
    except UserError:
        return None  # a path that does not exist, or a file that cannot be read, is named by the path checks
    fmt = format_of(record, text_field)
    keys = sorted(k for k in record if k != "__line__")
    if fmt is None:
        f.problems.append(f"'data.format' is auto, and the fields {keys} of the first record of {path} match no "
                          f"format: use {format_fields(text_field)}, or set data.format")
        return None
    fields = {"alpaca": "instruction/output", "text": f"'{text_field}' (data.text_field)",
              "chat": "messages" if "messages" in record else "ShareGPT's conversations (from/value read as "
                                                              "role/content)"}[fmt]
    return static_decision("data.format", fmt, f"the first record of data.path has {fields}")
