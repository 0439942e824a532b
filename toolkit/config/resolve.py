"""Turn the `auto` values left after merging into concrete ones, each with the reason printed at start."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from toolkit.config.families import applies_to, family_spec
from toolkit.device.detect import DeviceInfo
from toolkit.config.presets import Preset
from toolkit.config.schema import QUANTIZED
from toolkit.errors import ConfigError


@dataclass
class Decision:
    key: str
    value: object
    reason: str

    def __str__(self) -> str:
        return f"{self.key}={self.value}: {self.reason}"


def _precision(cfg: DictConfig, device: DeviceInfo, problems: list[str]) -> Decision | None:
    requested = cfg.train.precision
    if requested == "auto":
        if device.backend == "cpu":
            value, why = "fp32", "CPU trains in fp32"
        elif device.bf16:
            value, why = "bf16", f"{device.arch} supports bf16"
        else:
            value, why = "fp16", f"{device.arch} has no bf16: fp16 with loss scaling"
        cfg.train.precision = value
        return Decision("train.precision", value, why)
    if requested == "bf16" and device.backend != "cpu" and not device.bf16:
        problems.append(f"'train.precision' is bf16, but {device.arch} has no bf16 support: "
                        "use train.precision=fp16 (trained with loss scaling) or fp32")
    if requested == "fp16" and device.backend == "cpu":
        problems.append("'train.precision' is fp16, which the CPU cannot train in: use fp32 (or bf16) on the CPU")
    return None


def _check_fsdp(cfg: DictConfig, problems: list[str]) -> None:
    """What device.distributed=fsdp cannot shard: quantized layers, whole-expert offload, text encoders."""
    refused = "device.distributed=fsdp cannot run this config: "
    if cfg.model.quantize in QUANTIZED:
        problems.append(refused + f"model.quantize={cfg.model.quantize}: quantized weights are not sharded; use "
                        "model.quantize=none (or auto) with fsdp, or device.distributed=ddp")
    if cfg.model.expert_offload is True:
        problems.append(refused + "model.expert_offload=true: offloading moves whole experts, and with fsdp each "
                        "process already holds 1/N of them; leave model.expert_offload=auto")
    if cfg.model.get("block_swap", 0) not in (0, "auto"):
        problems.append(refused + "model.block_swap: fsdp shards the blocks over the processes instead; use "
                        "model.block_swap=0 (or auto) with fsdp, or device.distributed=ddp")
    if cfg.train.train_text_encoder:
        problems.append(refused + "train.train_text_encoder: the text encoders are not sharded; use "
                        "device.distributed=ddp")


FUSE_PROJECTIONS_MEASURED = ("on a GPU with train.compile on: bench/llm.py, one H100, Llama-3.2-1B shape, one command: "
                             "81.9k tokens/s at 10.0 GiB against 73.4k at 9.7 without")


def _compile_auto(family: str, steps: int, device: DeviceInfo) -> tuple[bool, str]:
    """train.compile=auto: on where the family was measured faster compiled and the run is long enough to repay
    the first step's compile (FamilySpec.compile_auto, compile_auto_steps); off on the CPU."""
    spec = family_spec(family)
    if device.backend == "cpu":
        return False, "off on the CPU"
    if not spec.compile_auto:
        return False, f"not measured faster for {family} yet"
    if steps < spec.compile_auto_steps:
        return False, (f"a run of train.steps={steps} (in all, a resumed run's steps counted) is too short to repay "
                       f"the first step's compile: {spec.compile_auto}; auto compiles {family} from "
                       f"{spec.compile_auto_steps} steps, train.compile=true compiles any run")
    return True, spec.compile_auto


def _fuse_projections(cfg: DictConfig, device: DeviceInfo, problems: list[str], decisions: list[Decision]) -> None:
    """model.fuse_projections (llm): auto turns it on with train.compile on a GPU; true where it cannot apply is
    refused, naming what stands in the way."""
    value = cfg.model.fuse_projections
    if not (isinstance(value, bool) or value == "auto"):
        problems.append(f"'model.fuse_projections' must be true, false or auto, got {value!r}")
        return
    blockers = [why for why, blocks in (
        ("network.type=dora (each layer normalises its own weight)", cfg.network.type == "dora"),
        (f"network.dropout={cfg.network.dropout} (each layer drops its own input)", cfg.network.dropout > 0),
        (f"model.quantize={cfg.model.quantize} (the frozen weights are quantized)", cfg.model.quantize in QUANTIZED),
        ("device.distributed=fsdp (the frozen weights are sharded per layer)", cfg.device.distributed == "fsdp"),
    ) if blocks]
    if value is True and blockers:
        problems.append(f"'model.fuse_projections'=true cannot apply with {'; '.join(blockers)}: set "
                        "model.fuse_projections=auto or false")
    if value != "auto":
        return
    if blockers:
        on, why = False, "off with " + "; ".join(blockers)
    elif device.backend != "cuda":
        on, why = False, (f"off on {'the CPU' if device.backend == 'cpu' else 'ROCm'}: measured on NVIDIA GPUs only "
                          "(true turns it on)")
    elif cfg.train.compile is not True:
        on, why = False, "off with train.compile off (measured compiled only)"
    else:
        on, why = True, FUSE_PROJECTIONS_MEASURED
    cfg.model.fuse_projections = on
    decisions.append(Decision("model.fuse_projections", on, why))


def resolve_auto(cfg: DictConfig, device: DeviceInfo, preset: Preset) -> list[Decision]:
    """Replace auto values in place; raise ConfigError for settings this device cannot run."""
    problems: list[str] = []
    family = cfg.model.family
    decisions = [d for d in [_precision(cfg, device, problems)] if d]
    if cfg.model.dtype == "auto":
        cfg.model.dtype = cfg.train.precision
        decisions.append(Decision("model.dtype", cfg.model.dtype, "frozen base weights follow train.precision"))
    if cfg.train.batch_size == "auto":
        size, why = preset.batch_size_for(device.memory_gb)
        cap = family_spec(family).batch_cap
        if cap is not None and size > cap:
            size, why = cap, f"{why}, capped at {cap} for {family} (large samples)"
        on_cpu = device.backend == "cpu"
        why += ("; on the CPU auto keeps the preset's table (the batch probe measures on GPUs)" if on_cpu
                else "; until the trainer measures the largest batch that fits, at the start (train/batch_size.py)")
        cfg.train.batch_size = size
        decisions.append(Decision("train.batch_size", size, why))
    elif not isinstance(cfg.train.batch_size, int) or cfg.train.batch_size < 1:
        problems.append(f"'train.batch_size' must be a positive integer or auto, got {cfg.train.batch_size!r}")
    if cfg.train.get("checkpoint_offload") and cfg.train.gradient_checkpointing is False:
        problems.append("'train.checkpoint_offload' moves the inputs of checkpointed layers, and "
                        "train.gradient_checkpointing is false: set it to true or auto, or remove checkpoint_offload")
    if cfg.train.gradient_checkpointing == "auto":
        cfg.train.gradient_checkpointing = False
        decisions.append(Decision("train.gradient_checkpointing", False, (
            "off on the CPU (memory is not measured there)" if device.backend == "cpu" else
            "off unless a step at the run's batch size does not fit without it, measured at the start "
            "(train/batch_size.py; with train.batch_size=auto: unless a batch of 1 does not fit)")))
    elif not isinstance(cfg.train.gradient_checkpointing, (bool, int)) or (
            not isinstance(cfg.train.gradient_checkpointing, bool) and cfg.train.gradient_checkpointing < 0):
        problems.append(f"'train.gradient_checkpointing' must be true, false, auto or a number of blocks, got "
                        f"{cfg.train.gradient_checkpointing!r}")
    elif not isinstance(cfg.train.gradient_checkpointing, bool) and family == "llm":
        problems.append(f"'train.gradient_checkpointing': {cfg.train.gradient_checkpointing} blocks is read by the "
                        "diffusion families; an LLM checkpoints all its layers or none (true or false)")
    block_swap = cfg.model.get("block_swap", 0)
    if block_swap != "auto" and (isinstance(block_swap, bool) or not isinstance(block_swap, int) or block_swap < 0):
        problems.append(f"'model.block_swap' must be a number of blocks (0: none) or auto, got {block_swap!r}")
    elif isinstance(block_swap, int) and block_swap > 0:
        if cfg.model.quantize in QUANTIZED:
            problems.append(f"'model.block_swap'={block_swap} swaps 16-bit weights; it is not combined with "
                            f"model.quantize={cfg.model.quantize}: set one of them to none / 0")
    if cfg.model.get("quantize") == "fp8":
        if cfg.network.type == "dora":
            problems.append("'network.type'=dora needs the base weights in 16 bits (DoRA normalises them), and "
                            "model.quantize=fp8 stores them in 8: use network.type=lora, or model.quantize=none")
        if cfg.model.get("quantize_backend", "auto") != "auto":
            problems.append(f"'model.quantize_backend'={cfg.model.quantize_backend}: model.quantize=fp8 is the "
                            "toolkit's own layer, not that library's; leave model.quantize_backend=auto")
    if cfg.device.distributed == "fsdp":
        _check_fsdp(cfg, problems)
    if cfg.train.compile == "auto":
        value, why = _compile_auto(family, cfg.train.steps, device)
        cfg.train.compile = value
        decisions.append(Decision("train.compile", value, why))
    elif not isinstance(cfg.train.compile, bool):
        problems.append(f"'train.compile' must be true, false or auto, got {cfg.train.compile!r}")
    if cfg.train.compile_recompute == "auto":
        measured = family_spec(family).recompute_auto
        cfg.train.compile_recompute = "pointwise" if measured else "none"
        if cfg.train.compile is True:
            decisions.append(Decision("train.compile_recompute", cfg.train.compile_recompute,
                                      measured or f"PyTorch's default: pointwise not measured for {family} yet"))
    if applies_to("train.checkpoint_keeps", family) and cfg.train.checkpoint_keeps == "auto":
        measured = family_spec(family).keeps_auto
        keep = bool(measured) and cfg.train.compile is True  # measured compiled: eager it runs a Python policy per op
        cfg.train.checkpoint_keeps = "attention" if keep else "nothing"
        why = (measured if keep else
               f"a checkpointed block recomputes everything: keeping attention was measured compiled, and "
               f"train.compile is off" if measured else
               f"a checkpointed block recomputes everything: keeping attention not measured faster for {family} yet")
        if cfg.train.gradient_checkpointing is not False:
            decisions.append(Decision("train.checkpoint_keeps", cfg.train.checkpoint_keeps, why))
    if not (isinstance(cfg.train.cuda_graphs, bool) or cfg.train.cuda_graphs == "auto"):
        problems.append(f"'train.cuda_graphs' must be true, false or auto, got {cfg.train.cuda_graphs!r}")
    if cfg.train.timestep_sampling == "auto" and applies_to("train.timestep_sampling", family):
        sampling = family_spec(family).timestep_sampling or "uniform"
        cfg.train.timestep_sampling = sampling
        decisions.append(Decision("train.timestep_sampling", sampling, f"the {family} family's usual"))
    if cfg.model.kernels == "auto" and applies_to("model.kernels", family):
        value, why = (("none", "the CPU keeps the model's own loss") if device.backend == "cpu" else
                      ("fused", "on a GPU: no tokens x vocabulary logits held (bench/llm.py, H100, Llama-3.2-1B shape: "
                                "12.9 GiB instead of 24.1 and 1.11x the tokens/s, both compiled)"))
        cfg.model.kernels = value
        decisions.append(Decision("model.kernels", value, why))
    if applies_to("model.fuse_projections", family):
        _fuse_projections(cfg, device, problems, decisions)
    if cfg.model.attention == "auto" and applies_to("model.attention", family):
        cfg.model.attention = "sdpa"
        decisions.append(Decision("model.attention", "sdpa", "PyTorch scaled_dot_product_attention, the default"))
    resume = cfg.train.resume
    if isinstance(resume, str) and resume.lower() in ("true", "false"):
        cfg.train.resume = resume.lower() == "true"
    if problems:
        raise ConfigError(problems, header=f"config does not fit this device ({device.summary()})")
    return decisions
