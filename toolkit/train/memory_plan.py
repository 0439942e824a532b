"""The measured stage of a run's plan: what fits the device, measured on it once the model is loaded and placed.

In order: gradient checkpointing (train.gradient_checkpointing=auto: train/checkpointing_probe.py, a step without
it, then blocks checkpointed, measured on the main process), the denoiser's blocks wrapped as the plan says
(train/blocks.py: compiled, checkpointed, swapped, replayed as a CUDA graph), the batch size
(train.batch_size=auto: train/batch_size.py's probe on the blocks as they train) and the SDPA backend
(device.sdpa_backend=auto: train/attention.py). Each gives a Decision of the "measured" stage; the settings the
steps use come back as one MemoryPlan. Measurements never move the training RNG streams, so a run with and without
them trains the same LoRA.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from toolkit.config.families import applies_to
from toolkit.data.order import BatchOrder
from toolkit.errors import UserError
from toolkit.models.base import ModelAdapter, trainable_parameters
from toolkit.paths import cache_root
from toolkit.plan.decisions import Decision, RunPlan
from toolkit.plan.run import ResolvedRun
from toolkit.train.attention import choose_for_run
from toolkit.train.batch_size import Probe, accumulate_to, measures_on, probe_cap, probe_for_run, release_probe
from toolkit.train.blocks import prepare_blocks
from toolkit.train.checkpointer import OtherProcessFailed
from toolkit.train.checkpointing_probe import checkpointing_for_run
from toolkit.train.compile import compile_blocks, recompute_elementwise
from toolkit.rng import rng_untouched

MEASURED = "measured"


@dataclass
class MemoryPlan:
    """What the steps run with, as measured."""

    plan: RunPlan
    order: BatchOrder
    batch_size: int
    grad_accum: int
    compiled: int          # blocks compiled (0: eager)
    cuda_graphs: bool      # a denoiser replayed as a CUDA graph


class MemoryPlanner:
    """The measured stage for one run (see the module docstring): everything it uses is handed to it."""

    def __init__(self, run: ResolvedRun, plan: RunPlan, adapter: ModelAdapter, dataset, procs, accelerator,
                 sharded: bool, batch_resumed: bool, exits: ExitStack, log: Callable[[str], None]):
        self.run, self.plan, self.adapter, self.dataset = run, plan, adapter, dataset
        self.procs, self.accelerator, self.sharded, self.batch_resumed = procs, accelerator, sharded, batch_resumed
        self.exits, self.log = exits, log
        self.device = accelerator.device
        self.compiled = 0  # blocks wrapped compiled so far: measurements before the wrapping run them as they load
        self.decisions: list[Decision] = []

    def value(self, key: str):
        """The setting's value as planned so far (the measured stage's decisions included)."""
        for d in reversed(self.decisions):
            if d.key == key:
                return d.value
        return self.run.setting(self.plan, key)

    def decided(self, key: str, value, why: str) -> None:
        """Record a measured decision and log it as `key=auto -> value: why`."""
        self.decisions.append(Decision(key, value, why, MEASURED))
        self.log(f"{key}=auto -> {value}: {why}")

    @contextmanager
    def eager(self):
        """Compiled blocks run eagerly while sampling, evaluating and measuring: generation with a growing KV cache
        would recompile them at every length, and these forwards are not where the time goes."""
        with torch.compiler.set_stance("force_eager") if self.compiled else nullcontext():
            yield

    # -- the stage -------------------------------------------------------------------------------
    def measure(self) -> MemoryPlan:
        cfg, procs = self.run.cfg, self.procs
        probing = self._probes_batch_size()
        if self._measures_checkpointing():
            self._decide_checkpointing(1 if probing else self.value("train.batch_size"), some_blocks=not probing)
        order = self._order(self.value("train.batch_size"))
        self.compiled, graphs = self._prepare_blocks(order, probing)
        if probing:  # with the blocks as they train (checkpointed, swapped), before the optimizer exists
            self._probe_batch_size()
            order = self._order(self.value("train.batch_size"))
        self._choose_attention(order)
        plan = self.plan.with_stage(MEASURED, self.decisions)
        accum = self.value("train.grad_accum")
        return MemoryPlan(plan, order, int(self.value("train.batch_size")), int(accum), self.compiled, graphs)

    def _order(self, batch_size: int) -> BatchOrder:
        return BatchOrder(self.dataset.groups, batch_size, self.run.cfg.run.seed, world_size=self.procs.world_size,
                          rank=self.procs.rank, entries=self.dataset.epoch_entries)

    def _probes_batch_size(self) -> bool:
        """Whether train.batch_size=auto is measured now: on a GPU, for a run that does not resume (the CPU keeps
        the preset's table, as the static plan said)."""
        if not self.run.is_auto("train.batch_size") or self.batch_resumed or not measures_on(self.device):
            return False
        if self.sharded:
            self.log(f"train.batch_size=auto -> {self.value('train.batch_size')}: the preset's table (with "
                     "device.distributed=fsdp every process would have to measure at once; the probe does not run)")
            return False
        return True

    def _measures_checkpointing(self) -> bool:
        """Whether train.gradient_checkpointing=auto is measured now: on a GPU, the base not sharded (every process
        would have to measure)."""
        if not self.run.is_auto("train.gradient_checkpointing") or not measures_on(self.device):
            return False
        if self.sharded:
            self.log("train.gradient_checkpointing=auto -> False: not measured with device.distributed=fsdp; set it "
                     "to true if a step runs out of memory")
            return False
        return True

    def _probe(self) -> Probe:
        cfg = self.run.cfg
        return Probe(self.adapter.loss, self.dataset, self.adapter.trainable_modules(), self.adapter.network,
                     self.device, self.run.device.memory_gb, cfg.device.memory_fraction, cfg.train.ema_decay > 0,
                     self.procs.world_size, self.accelerator.autocast, self.eager)

    def _keeps(self) -> str:
        """train.checkpoint_keeps as planned; nothing for a model that has no such setting (llm)."""
        return self.value("train.checkpoint_keeps") if applies_to("train.checkpoint_keeps", self.adapter.family) \
            else "nothing"

    def _decide_checkpointing(self, size: int, some_blocks: bool) -> None:
        """train.gradient_checkpointing=auto on a GPU: off when a step of `size` (the run's batch size; 1 when the
        batch size is probed next) fits without it; else N of the denoiser's blocks where measured to fit (only
        with `some_blocks`: a probed batch size would otherwise be fitted to the blocks that just hold a batch of
        1), or all, which the probe then fits the batch to (train/batch_size.py). Measured on the main process;
        every process takes the answer."""
        memory, keeps = self.adapter.memory, self._keeps()

        def measure():
            result = checkpointing_for_run(self._probe(), memory.regions, bool(memory.swaps()), keeps,
                                           self.run.is_auto("train.checkpoint_keeps"), size, some_blocks)
            return result.setting, result.why, result.keeps  # auto may have dropped attention

        setting, why, kept = self._measured_on_main(
            measure, lambda failure: (False, f"kept off: the measurement failed ({failure})", keeps))
        if kept != keeps:
            self.decided("train.checkpoint_keeps", kept, "a step with every block keeping its attention did not "
                         "fit, or could not be measured (the train.gradient_checkpointing line says which)")
        if setting is True:
            memory.enable_checkpointing()
        elif setting is False and self.run.asked_value("train.checkpoint_offload"):  # an llm setting
            self.log("train.checkpoint_offload: nothing to move, gradient checkpointing stays off (measured)")
        self.decided("train.gradient_checkpointing", setting, why)

    def _prepare_blocks(self, order: BatchOrder, probing: bool) -> tuple[int, bool]:
        """Compile, checkpoint and swap the denoiser's blocks as the plan says (train/blocks.py); models without
        block regions (llm) compile their repeated blocks whole and checkpoint their own way. Returns the number
        of compiled blocks and whether a denoiser replays as a CUDA graph."""
        cfg, procs, memory = self.run.cfg, self.procs, self.adapter.memory
        checkpointing, compile_ = self.value("train.gradient_checkpointing"), bool(self.value("train.compile"))
        regions = memory.regions(checkpointed=checkpointing is not False)
        if compile_:
            recompute_elementwise(self.value("train.compile_recompute") == "pointwise")
            self.exits.callback(recompute_elementwise, False)  # PyTorch's default again once the run ends
        graphs_setting = cfg.train.cuda_graphs
        if not regions:
            if graphs_setting is True:  # asked for where it does not apply: said, not ignored
                self.log("train.cuda_graphs: applies to a denoiser compiled whole; the decoder blocks keep ordinary "
                         "kernel launches (graphs per block measured no faster for an LLM: docs/performance.md)")
            return (compile_blocks(memory.shard_roots(), self.log) if compile_ else 0), False
        shape_count = len(order.batch_shapes())
        if probing and compile_:  # compiled for every batch size the probe may choose
            cap = probe_cap(len(self.dataset), procs.world_size, cfg.train.global_batch_size)[0]
            shape_count = max(len(self._order(size).batch_shapes()) for size in range(1, cap + 1))
        shape_count *= memory.sequence_variants()
        # train.global_batch_size with a probed batch size: the accumulation is known only after the probe
        accum = None if probing and cfg.train.global_batch_size else self.value("train.grad_accum")
        ddp = procs.several and self.value("device.gradient_sync") == "ddp"
        blocks = prepare_blocks(regions, compile_=compile_, checkpointing=checkpointing, swaps=memory.swaps(),
                                shape_count=shape_count, log=self.log, cuda_graphs=graphs_setting, grad_accum=accum,
                                gpu=self.device.type == "cuda", ddp=ddp, hip=self.run.device.backend == "hip",
                                keeps=self._keeps(), graphs_each_block=checkpointing is False and
                                self.value("train.compile_regions") == "blocks")
        if graphs_setting == "auto":
            self.decisions.append(Decision("train.cuda_graphs", bool(blocks.graphs), "replayed as a CUDA graph: "
                                           + ", ".join(blocks.graphs) if blocks.graphs else
                                           "ordinary kernel launches (see the blocks line)", MEASURED))
        return blocks.compiled, bool(blocks.graphs)

    def _probe_batch_size(self) -> None:
        """train.batch_size=auto on a GPU: the largest micro-batch whose forward + backward fits, measured on the
        main process (train/batch_size.py) or remembered from an earlier run; every process takes it."""
        t = self.run.cfg.train
        settings = self.plan.with_stage(MEASURED, self.decisions).effective(_plain(self.run.asked))
        size, why = self._measured_on_main(
            lambda: probe_for_run(self._probe(), settings, t.global_batch_size),
            lambda failure: (self.value("train.batch_size"), f"the preset's table: the batch probe failed ({failure})"))
        if t.global_batch_size is not None:
            size, accum, note = accumulate_to(t.global_batch_size, size, self.procs.world_size, True, t.grad_accum)
            why += f"; {note}"
            self.decisions.append(Decision("train.grad_accum", accum, note, MEASURED))
        self.decided("train.batch_size", size, why)

    def _measured_on_main(self, measure, fallback):
        """measure() on the main process, its answer taken by every process. A measurement that breaks must not
        stop a run that would train: fallback(what failed) answers instead. A user error or a stop on the main
        process stops the others too, instead of leaving them waiting."""
        procs, choice = self.procs, None
        if procs.is_main:
            try:
                choice = measure()
            except (UserError, KeyboardInterrupt, SystemExit):
                procs.from_main(None)
                raise
            except Exception as error:  # noqa: BLE001
                release_probe(trainable_parameters(self.adapter.network), self.device)
                first = str(error).splitlines()[0] if str(error) else ""
                choice = fallback(f"{type(error).__name__}: {first}")
            except BaseException:
                procs.from_main(None)
                raise
        choice = procs.from_main(choice)
        if choice is None:
            raise OtherProcessFailed()
        return choice

    def _choose_attention(self, order: BatchOrder) -> None:
        """device.sdpa_backend: measured on a GPU from the attention calls of one forward on a real batch, which
        runs eagerly, without gradients and without touching the training RNG streams (train/attention.py)."""
        def forward():  # only called when there is something to measure
            with rng_untouched(), torch.no_grad(), self.eager(), self.accelerator.autocast():
                batch = self.dataset.collate(order.first_batch())
                self.adapter.loss(batch, self.adapter.trainable_modules())

        setting = self.run.cfg.device.sdpa_backend
        unused = self.adapter.memory.attention_without_sdpa()
        if unused is not None:
            self.log(f"attention: {unused}; device.sdpa_backend does not apply")
            if setting == "auto":
                self.decisions.append(Decision("device.sdpa_backend", "auto", f"not used: {unused}", MEASURED))
            return
        context, best, why = choose_for_run(setting, self.device, forward, self.procs.is_main, self.procs.from_main,
                                            cache_root() / "attention.json", self.log)
        if context is not None:
            self.exits.enter_context(context)
        if setting == "auto":
            self.decisions.append(Decision("device.sdpa_backend", best or "auto", why, MEASURED))


def _plain(cfg) -> dict:
    from toolkit.config.load import resolved_container

    return resolved_container(cfg)
