"""train.batch_size=auto: the largest micro-batch that fits the GPU, measured at the start of a run.

On a GPU (CUDA or ROCm), once the model, its LoRA, the caches and the blocks' wrappers (checkpointing, block
swap) are ready, the main process runs forward + backward of the adapter's loss on the data's largest batch
(`dataset.largest_batch`) at sizes 1, 2, 4, ... and reads torch.cuda.max_memory_allocated after each; a size
that runs out of memory (torch.OutOfMemoryError) does not fit. Between the largest size that fit and the first
that did not, a few more sizes are tried: where a straight line through the measured peaks meets the limit, then
halfway once a try has failed. No optimizer step is taken; gradients are dropped and every RNG stream is put
back after each try, so a run with the probe trains as one without it does.

The limit is the budget the other auto memory options plan with (device.memory_fraction of the device memory),
less room for what the probe cannot see yet: the optimizer state, the EMA and DDP's gradient buffer (fp32 copies
of the LoRA weights), and FRAGMENTATION of the rest for the allocator over batches of other shapes.

The choice is printed with every measured peak and remembered in the cache folder, keyed by the GPU, the
versions, the settings that change memory and the probe batch's shapes, so the next run with the same key skips
the probe. A resumed run keeps its checkpoint's batch size (its data order is cut in batches of that size); with
train.global_batch_size the gradient accumulation follows from the batch size (`accumulate_to`).
"""

from __future__ import annotations

import gc
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from toolkit.errors import UserError
from toolkit.models.base import trainable_parameters
from toolkit.paths import cache_root
from toolkit.rng import rng_untouched

MAX_BATCH = 64          # the probe stops doubling here
FRAGMENTATION = 0.10    # share of the budget left free for the allocator's fragmentation
REFINE_TRIES = 4        # sizes tried between the largest that fit and the first that did not
GiB = 2**30
# Resolved config keys whose values change a micro-step's memory (besides the batch's shapes, keyed separately).
MEMORY_SETTINGS = ("model", "network.type", "network.rank", "network.lokr_factor",
                   "network.lokr_full_rank", "network.target_modules", "train.precision",
                   "train.gradient_checkpointing", "train.compile", "train.train_text_encoder", "train.experts",
                   "data.resolution", "data.num_frames", "data.max_seq_len", "device.sdpa_backend")


@dataclass(frozen=True)
class Budget:
    """The bytes a micro-step's peak may reach, and how that was worked out."""

    limit: int
    why: str


def probe_budget(memory_gb: float, fraction: float, trainable: int, ema: bool, processes: int) -> Budget:
    """The limit for `trainable` LoRA weights on a device of `memory_gb` GiB (DeviceInfo's figure)."""
    copies = 2 + int(ema) + int(processes > 1)  # Adam's two moments (8-bit ones hold less), the EMA, DDP's bucket
    state = trainable * 4 * copies
    limit = int((memory_gb * GiB * fraction - state) * (1 - FRAGMENTATION))
    return Budget(limit, f"limit {limit / GiB:.2f} GiB = device.memory_fraction {fraction} of {memory_gb:.0f} GiB, "
                         f"less {state / GiB:.2f} GiB for the optimizer state and {FRAGMENTATION:.0%} for "
                         "fragmentation")


def measures_on(device: torch.device) -> bool:
    """Whether the probe can measure on `device`: the CUDA caching allocator's statistics (ROCm's too)."""
    return device.type == "cuda"


def peak_bytes(run: Callable[[], None], device: torch.device) -> int | None:
    """The most memory allocated on `device` while `run()` ran, or None when it ran out of memory."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    except torch.OutOfMemoryError:
        return None  # this size does not fit; reported with the others


def release_probe(params: list[torch.nn.Parameter], device: torch.device) -> None:
    """Drop the try's gradients and hand its memory back, so the next try starts where this one did."""
    for p in params:
        p.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # the run's own peak (logged per step) starts after the probe


def _line_guess(peaks: dict[int, int | None], limit: int, best: int, failed: int) -> int:
    """Where a straight line through the two largest sizes that fit reaches `limit`."""
    fit = sorted(s for s, p in peaks.items() if p is not None and p <= limit)
    if len(fit) < 2:
        return best + 1
    a, b = fit[-2], fit[-1]
    slope = (peaks[b] - peaks[a]) / (b - a)
    return failed - 1 if slope <= 0 else b + int((limit - peaks[b]) // slope)


def search(measure: Callable[[int], int | None], cap: int, limit: int) -> tuple[int, dict[int, int | None]]:
    """The largest size up to `cap` whose peak (`measure(size)`: bytes, None when out of memory) is within `limit`,
    and every peak measured, in the order measured. 1 when even 1 does not fit."""
    peaks: dict[int, int | None] = {}

    def fits(size: int) -> bool:
        peaks[size] = measure(size)
        return peaks[size] is not None and peaks[size] <= limit

    best, failed, size = 0, cap + 1, 1
    while size <= cap:
        if not fits(size):
            failed = size
            break
        best, size = size, size * 2
    if best == 0:
        return 1, peaks
    last_failed = False
    for _ in range(REFINE_TRIES):
        if failed - best <= 1:
            break
        guess = (best + failed) // 2 if last_failed else _line_guess(peaks, limit, best, failed)
        guess = min(max(guess, best + 1), failed - 1)
        last_failed = not fits(guess)
        best, failed = (best, guess) if last_failed else (guess, failed)
    return best, peaks


def describe(size: int, peaks: dict[int, int | None], budget: Budget, cap: str) -> str:
    """The probe's line: every peak measured, the limit, and the choice."""
    def shown(s: int, peak: int | None) -> str:
        if peak is None:
            return f"{s}: out of memory"
        amount = f"{peak / GiB:.2f} GiB" if peak >= GiB else f"{peak / 2**20:.1f} MiB"
        return f"{s}: {amount}" + (" (over)" if peak > budget.limit else "")

    measured = ", ".join(shown(s, p) for s, p in peaks.items())
    line = (f"forward + backward on the data's largest batch peaked at {measured}; {budget.why}; at most {cap}")
    first = peaks.get(1)
    if first is None or first > budget.limit:
        line += ("; even batch 1 goes over the limit, so training may run out of memory: turn on "
                 "train.gradient_checkpointing, lower the data's resolution / frames / max_seq_len, or set "
                 "model.quantize or model.block_swap")
    return line


def probe_cap(items: int, processes: int, global_batch: int | None) -> tuple[int, str]:
    """The largest size worth trying, and why: MAX_BATCH, this process's share of the data, or of the global batch."""
    caps = [(MAX_BATCH, f"{MAX_BATCH} (the probe's cap)"),
            (max(1, items // processes), f"{max(1, items // processes)} (the training items per process)")]
    if global_batch is not None:
        share = math.ceil(global_batch / processes)
        caps.append((share, f"{share} (train.global_batch_size per process)"))
    return min(caps)


def cache_key(container: dict, device_name: str, memory_gb: float, processes: int, budget: Budget, cap: int,
              shapes: dict) -> str:
    """What the measurement depends on: the GPU, the versions, the settings that change memory and the batch."""
    import toolkit

    settings = {}
    for key in MEMORY_SETTINGS:
        node = container
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        settings[key] = node
    return json.dumps({"device": device_name, "memory_gb": round(memory_gb, 2), "toolkit": toolkit.__version__,
                       "torch": torch.__version__, "processes": processes, "limit": budget.limit, "cap": cap,
                       "settings": settings, "shapes": shapes}, sort_keys=True, default=str)


def batch_shapes(batch: dict) -> dict:
    """The tensors' shapes and dtypes of a batch (its other entries, captions say, by type)."""
    return {k: [list(v.shape), str(v.dtype)] if torch.is_tensor(v) else type(v).__name__ for k, v in batch.items()}


def _read_cache(cache_file: Path) -> dict:
    if not cache_file.is_file():
        return {}
    try:
        return json.loads(cache_file.read_text(encoding="utf-8"))
    except ValueError:
        return {}  # a damaged cache is measured again and rewritten


def choose_batch_size(micro_step: Callable[[int], None], params: list[torch.nn.Parameter], device: torch.device,
                      budget: Budget, cap: tuple[int, str], key: str, cache_file: Path) -> tuple[int, str]:
    """train.batch_size=auto: the size and the reason, from the cache or measured now with `micro_step(size)`
    (forward + backward, no update)."""
    cached = _read_cache(cache_file)
    if key in cached:
        entry = cached[key]
        return int(entry["batch_size"]), f"from cache ({cache_file}): {entry['why']}"

    def measure(size: int) -> int | None:
        with rng_untouched():
            try:
                return peak_bytes(lambda: micro_step(size), device)
            finally:
                release_probe(params, device)

    size, peaks = search(measure, cap[0], budget.limit)
    why = describe(size, peaks, budget, cap[1])
    cached[key] = {"batch_size": size, "why": why}
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cached, indent=1), encoding="utf-8")
    os.replace(tmp, cache_file)
    return size, f"measured: {why}"


@dataclass
class Probe:
    """What measuring a training micro-step uses: forward + backward through the adapter's loss on the data's
    largest batch of a size, eager, no optimizer (the main process, before the optimizer exists)."""

    loss: Callable                  # the adapter's loss(batch, modules)
    dataset: object                 # collate, largest_batch
    modules: Mapping[str, torch.nn.Module]   # the trainable modules, unwrapped
    network: torch.nn.Module        # the LoRA weights' root
    device: torch.device
    memory_gb: float                # the device's memory (DeviceInfo)
    memory_fraction: float          # device.memory_fraction
    ema: bool
    processes: int
    autocast: Callable              # () -> the training autocast context
    eager: Callable                 # () -> compiled blocks run eagerly inside

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return trainable_parameters(self.network)

    def budget(self) -> Budget:
        return probe_budget(self.memory_gb, self.memory_fraction, sum(p.numel() for p in self.params), self.ema,
                            self.processes)

    def micro_step(self, size: int) -> None:
        batch = self.dataset.collate(self.dataset.largest_batch(size))
        with self.eager(), self.autocast():
            loss = self.loss(batch, self.modules)
        loss.backward()

    def peak(self, size: int) -> int | None:
        """A micro-step's peak bytes at batch `size` (None: out of memory), every RNG stream put back and the
        gradients dropped after it, so training starts from the same draws and memory."""
        with rng_untouched():
            try:
                return peak_bytes(lambda: self.micro_step(size), self.device)
            finally:
                release_probe(self.params, self.device)


def probe_for_run(probe: Probe, settings: dict, global_batch: int | None) -> tuple[int, str]:
    """The main process's batch-size probe: the budget, the cap, the cache key (`settings`: the run's config as it
    runs, plain data) and the measurement on the data's largest batch."""
    probe.network.train()
    budget = probe.budget()
    dataset, device = probe.dataset, probe.device
    cap = probe_cap(len(dataset), probe.processes, global_batch)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    key = cache_key(settings, name, probe.memory_gb, probe.processes, budget, cap[0],
                    batch_shapes(dataset.collate(dataset.largest_batch(1))))
    return choose_batch_size(probe.micro_step, probe.params, device, budget, cap, key, cache_root() / "batch_size.json")


# -- the global batch and resumed runs ---------------------------------------------------------------------------
def accumulate_to(global_batch: int, batch_size: int, processes: int, trim: bool,
                  requested_accum: int) -> tuple[int, int, str]:
    """(batch size, grad_accum, note) for train.global_batch_size: grad_accum = ceil(global / (batch x processes));
    with `trim` (an auto batch size) the batch then shrinks to the least that still reaches the global batch.
    A train.grad_accum set beside it (not 1) must be the one derived."""
    accum = math.ceil(global_batch / (batch_size * processes))
    procs = f"{processes} process{'es' if processes != 1 else ''}"
    fitting, batch_size = batch_size, math.ceil(global_batch / (accum * processes)) if trim else batch_size
    trimmed = f" (of the {fitting} that fit)" if batch_size != fitting else ""
    if requested_accum not in (1, accum):
        raise UserError(f"train.grad_accum={requested_accum} does not fit train.global_batch_size={global_batch} with "
                        f"{batch_size} per process x {procs}, which takes grad_accum {accum}\n"
                        "  fix: remove train.grad_accum (it follows from train.global_batch_size), or remove "
                        "train.global_batch_size")
    total = batch_size * processes * accum
    over = "" if total == global_batch else f", the least at or above {global_batch} with this batch size"
    return batch_size, accum, (f"train.global_batch_size={global_batch}: {batch_size} per process{trimmed} x {procs} "
                               f"x grad_accum {accum} = {total}{over}")


def checkpoint_batch(saved_batch: int, saved_processes: int, processes: int) -> tuple[int, str]:
    """train.batch_size=auto on a resumed run: the checkpoint's batch size (per process: its global micro-batch
    over this run's processes when that divides), never measured again."""
    size = saved_batch
    if processes != saved_processes and (saved_batch * saved_processes) % processes == 0:
        size = saved_batch * saved_processes // processes
    return size, (f"train.batch_size=auto -> {size}: the checkpoint's batch size (a resumed run keeps it; "
                  "nothing is measured)")


def batch_lines(batch_size: int, world_size: int, grad_accum: int, global_batch: int | None, largest: int,
                samples: int) -> list[str]:
    """The log's batch line, and a note when the data cannot give a micro-batch the size asked for (a batch takes
    its samples from one bucket)."""
    several = world_size > 1
    total = batch_size * world_size * grad_accum
    lines = [f"batch: {batch_size} per process x {world_size} process{'es' if several else ''} x {grad_accum} "
             f"accumulation = {total} per optimizer step"
             + ("" if global_batch is None else f" (train.global_batch_size={global_batch}"
                + (")" if total == global_batch else ": the least at or above it with this batch size)"))]
    asked = batch_size * world_size
    if largest < asked:
        fits = max(1, largest // world_size)
        fix = (f"set train.batch_size={fits} to say what runs, or give more data" if fits < batch_size
               else "give more data, or run on fewer processes")
        lines.append(f"note: a micro-batch asks for {asked} samples{' over the processes' if several else ''}, but "
                     f"the data gives at most {largest} at once ({samples} samples; a batch takes them from one "
                     f"bucket): each micro-batch trains at most {largest}; {fix}")
    return lines
