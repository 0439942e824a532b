"""The loaded stage of a run's plan: the model built, loaded, given its data and placed, and what that settles.

First the model's size (counted without loading its weights) decides how several processes share it
(device.distributed); then the weights load (the memory plan of a flow family decides its quantization, expert
offload and block swap there), `network.init_from` fills the LoRA, the data's caches fill and the trainable modules
go onto the device; what loading decided is the rest of the loaded stage (a quantized denoiser runs eagerly, swapped
blocks keep nothing). With fsdp the base is then sharded."""

from __future__ import annotations

from datetime import timedelta

import functools
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable

import torch

from toolkit import startup
from toolkit.errors import UserError
from toolkit.models import build_adapter
from toolkit.models.base import DTYPES, ModelAdapter, Runtime
from toolkit.plan.decisions import Decision, RunPlan
from toolkit.plan.rules import Facts
from toolkit.plan.stages import decide
from toolkit.plan.run import ResolvedRun
from toolkit.train.attention import gradient_in_output_layout
from toolkit.train.lora_source import LoraSnapshot
from toolkit.rng import rng_untouched, seed_everything

LOADED = "loaded"


@dataclass
class LoadedModel:
    adapter: ModelAdapter
    dataset: object
    sharded: bool      # device.distributed=fsdp with several processes: the frozen base is sharded
    plan: RunPlan      # with the loaded stage


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def load_model(run: ResolvedRun, plan: RunPlan, procs, device: torch.device, run_dir, init_from: LoraSnapshot | None,
               exits: ExitStack, log: Callable[[str], None]) -> LoadedModel:
    """Build, load and place the model for `run` on `device`; the plan's loaded stage (see the module docstring)."""
    cfg = run.cfg
    facts = Facts(run.asked, run.device, decided={d.key: d for d in plan}, extra={"processes": procs.world_size})
    runtime = Runtime(device=device, info=run.device, base_dtype=DTYPES[cfg.model.dtype],
                      compute_dtype=DTYPES[cfg.train.precision], run_dir=run_dir, log=log, is_main=procs.is_main,
                      world_size=procs.world_size, rank=procs.rank, main_process_first=procs.main_first,
                      settled=facts.value)
    seed_everything(cfg.run.seed)  # the same LoRA initialisation on every process
    with procs.main_first():  # a tiny:<kind> model is written once (transformers saves on rank 0 only)
        adapter = build_adapter(cfg, runtime)
    facts.extra["base_parameters"] = functools.cache(adapter.memory.base_parameters)  # counted once, for every rule
    sized = decide(LOADED, facts)
    del facts.extra["base_parameters"]  # counted once: the second half of the stage is what loading decided
    for d in sized:
        if d.key != "device.distributed":  # said below, with what it means for the processes
            log(f"{d.key}={_shown(run.asked_value(d.key))} -> {_shown(d.value)}: {d.reason}")
    sharded = facts.value("device.distributed") == "fsdp" and procs.several
    _log_distributed(facts.decided["device.distributed"], cfg.device.distributed, procs.world_size, log)
    startup.mark("model built")
    adapter.load(shard_base=sharded)
    startup.mark("model loaded")
    if init_from is not None:  # before the EMA, the optimizer and any wrapping see the LoRA weights
        adapter.load_lora(init_from.path, partial=True, label=f"network.init_from ({init_from.source.label})")
        log(f"network.init_from: the LoRA starts from {init_from.source.label}; steps, optimizer state and "
            "schedule start fresh")
    # Encoding on a cold cache may draw from the RNG streams where reading a warm one does not: a run trains the
    # same either way.
    with rng_untouched():
        dataset = adapter.prepare_data()
    startup.mark("data")
    if len(dataset) == 0:
        raise UserError(f"data.path: {cfg.data.path} gave no training samples")
    if device.type == "cuda" and torch.version.hip is None:  # cuDNN: NVIDIA only
        # Before anything runs a backward (the batch-size and checkpointing measurements too): until the SDPA probe
        # has chosen, PyTorch's own order may pick cuDNN, whose backward needs it (train/attention.py).
        exits.enter_context(gradient_in_output_layout())
    if sharded:  # before the optimizer and EMA see the LoRA weights: sharding moves them to the device
        for line in procs.shard(adapter.memory.shard_roots(), timedelta(seconds=cfg.device.collective_timeout),
                                 lookup_in_shards=cfg.device.fsdp_embeddings == "shards"):
            log(f"device.distributed=fsdp: sharded {line}")
    memory = adapter.memory
    facts.extra.update(memory=memory.decisions(), quantized=memory.quantized(), swapped=bool(memory.swaps()),
                       regions=bool(memory.regions(checkpointed=False)), sharded=sharded)
    loaded = decide(LOADED, facts)
    for d in loaded:
        if d.key not in memory.decisions():  # the model's memory plan logged its own, where it decided them
            log(f"{d.key}={_shown(run.asked_value(d.key))} -> {_shown(d.value)}: {d.reason}")
    return LoadedModel(adapter, dataset, sharded, plan.with_stage(LOADED, sized + loaded))


def _log_distributed(decision: Decision, setting: str, processes: int, log: Callable[[str], None]) -> None:
    if processes < 2:
        if setting == "fsdp":
            log(f"device.distributed=fsdp: {decision.reason}")
        return
    if decision.value == "ddp":
        log(f"device.distributed=ddp ({decision.reason}): every process holds the whole model, gradients averaged")
    else:
        log(f"device.distributed=fsdp ({decision.reason}): the frozen base is sharded over {processes} processes "
            "(FSDP2, block by block); LoRA weights stay whole on every process")
