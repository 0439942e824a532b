"""train.gradient_checkpointing=auto, measured at the start of a run on a GPU: whether a step fits without
checkpointing and, for a denoiser with blocks, how many of its blocks to checkpoint (a straight line between two
measured peaks), with what checkpointed blocks keep (train.checkpoint_keeps=auto at attention only where it fits).
Each step is measured as the batch-size probe measures one (batch_size.Probe: forward + backward of the loss on
the data's largest batch, the RNG streams put back and the gradients dropped after it), within the same budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from toolkit.train.batch_size import GiB, Probe
from toolkit.train.blocks import checkpointed_while


@dataclass(frozen=True)
class Checkpointing:
    """train.gradient_checkpointing=auto measured: the setting, what checkpointed blocks keep, and why."""

    setting: bool | int
    keeps: str
    why: str


def checkpointing_for_run(probe: Probe, regions: Callable[[bool], dict], swapped: bool, keeps: str,
                          keeps_auto: bool, size: int, some_blocks: bool = True) -> Checkpointing:
    """train.gradient_checkpointing=auto with a batch size set, measured on micro-steps of `size` on the data's
    largest batch (the main process, before the blocks are wrapped): False when one fits without it. Otherwise,
    with `some_blocks`, for a denoiser with blocks (`regions(True)`) and nothing swapped: a number of blocks N
    estimated by a straight line between the step's peak without checkpointing and its peak with every block
    checkpointed, kept when a step with N checkpointed fits; the blocks differ in size, so when it does not, a
    second line through N's peak gives one more count to measure (_count_after_a_miss); True when that does not
    fit either, and for the others (an LLM). When the step runs out of memory without checkpointing, the line
    goes through every block checkpointed and half of them instead (_count_from_above). `keeps`: train.checkpoint_keeps as planned; with `keeps_auto` at attention, when every
    block keeping its attention does not fit, the blocks keep nothing and are measured again."""
    network = probe.network
    network.train()  # as it trains (transformers checkpoints layers only in training mode)
    budget = probe.budget()
    kept = {"keeps": keeps}

    def peak_with(setting) -> int | None:
        blocks = regions(True) if setting is not False else {}
        with checkpointed_while(blocks, setting, kept["keeps"]):
            return probe.peak(size)

    def said(peak: int | None) -> str:
        return "ran out of memory" if peak is None else f"peaked at {peak / GiB:.2f} GiB"

    def result(setting, why: str) -> Checkpointing:
        return Checkpointing(setting, kept["keeps"], why)

    step = f"a step of batch {size}"
    none = peak_with(False)
    if none is not None and none <= budget.limit:
        return result(False, f"{step} peaked at {none / GiB:.2f} GiB without it, within the {budget.why}")
    every_block = regions(True)

    def attention_fitting(why: str) -> tuple[str, int | None]:
        """train.checkpoint_keeps=auto at attention: every block checkpointed keeping its attention, measured;
        when that does not fit (or the measurement fails), the blocks keep nothing. Returns the reason so far
        and the peak keeping attention when it fit (None otherwise, or when nothing was measured)."""
        if not (kept["keeps"] == "attention" and keeps_auto and every_block and not swapped):
            return why, None
        try:
            peak = peak_with(True)
        except Exception as error:  # noqa: BLE001 (a driver or library fault: the smaller setting)
            peak, fault = None, f"failed ({type(error).__name__}: {error})"
        else:
            fault = said(peak)
            if peak is not None and peak <= budget.limit:
                return why, peak
        kept["keeps"] = "nothing"  # the blocks recompute their attention too
        return (f"{why}; with every block checkpointed keeping its attention it {fault} "
                "(train.checkpoint_keeps=auto -> nothing)"), None

    if none is None:
        without = f"{step} ran out of memory without it ({budget.why})"
    else:
        without = f"{step} peaked at {none / GiB:.2f} GiB without it, over the {budget.why}"
    if not some_blocks or not every_block or swapped:
        return result(True, attention_fitting(without)[0])
    without, every = attention_fitting(without)
    try:  # the step is known not to fit without it: a failing measurement from here on means all blocks
        if every is None:
            every = peak_with(True)
        if every is None or every > budget.limit:
            return result(True, f"{without}; with every block checkpointed it {said(every)}")
        total = max(len(blocks) for blocks in every_block.values())
        if none is None:
            return result(*_count_from_above(peak_with, total, every, budget.limit, without))
        count = min(total, math.ceil(total * (none - budget.limit) / max(none - every, 1)))
        if count == total:
            return result(True, f"{without}; with every block checkpointed it peaked at {every / GiB:.2f} GiB")
        some = peak_with(count)
    except Exception as error:  # noqa: BLE001 (a driver or library fault, not running out of memory)
        return result(True, f"{without}; measuring with blocks checkpointed failed ({type(error).__name__}: {error})")
    if some is not None and some <= budget.limit:
        return result(count, f"{without}; with {count} of its {total} blocks checkpointed it peaked at "
                             f"{some / GiB:.2f} GiB (every block: {every / GiB:.2f} GiB)")
    missed = f"{without}; with {count} of its {total} blocks checkpointed it {said(some)}"
    again = _count_after_a_miss(count, some, total, every, budget.limit)
    if again is not None:
        try:
            peak = peak_with(again)
        except Exception as error:  # noqa: BLE001 (a driver or library fault: every block, as below)
            peak, outcome = None, f"failed ({type(error).__name__}: {error})"
        else:
            outcome = said(peak)
        if peak is not None and peak <= budget.limit:
            return result(again, f"{missed}, with {again} it peaked at {peak / GiB:.2f} GiB (every block: "
                                 f"{every / GiB:.2f} GiB)")
        missed += f", with {again} it {outcome}"
    return result(True, f"{missed}, with every block {every / GiB:.2f} GiB")


def _count_after_a_miss(count: int, some: int | None, total: int, every: int, limit: int) -> int | None:
    """The blocks differ in size, so the first line's N can miss by a little (Qwen-Image-Edit, one H200: 4 of 60
    blocks peaked 0.2 GiB over the limit, and all 60 cost 42% of the step rate). A second line through the step
    measured at N and every block checkpointed gives the count to measure once more; None when it is every block
    (or N ran out of memory, which leaves no line)."""
    if some is None:
        return None
    per_block = max(some - every, 1) / (total - count)
    again = count + math.ceil((some - limit) / per_block)
    return again if count < again < total else None


def _count_from_above(peak_with: Callable, total: int, every: int, limit: int, without: str) -> tuple[bool | int, str]:
    """Blocks to checkpoint when a step without checkpointing ran out of memory, so its peak is unknown: the peak
    with half of them checkpointed (then three quarters, when half does not fit) and with all of them give the
    straight line; N is the fewest on it under the limit, kept when a step with N fits (else that fraction)."""
    parts = sorted({total // 2, (3 * total) // 4} - {0, total})
    if not parts:  # one block: all of it is the only measured setting
        return True, f"{without}; with every block checkpointed it peaked at {every / GiB:.2f} GiB"
    for part in parts:
        peak = peak_with(part)
        if peak is None or peak > limit:
            continue
        per_block = max(peak - every, 1) / (total - part)
        count = max(1, math.ceil(total - (limit - every) / per_block))
        some = peak_with(count) if count < part else None
        if some is None or some > limit:
            count, some = part, peak
        return count, (f"{without}; with {count} of its {total} blocks checkpointed it peaked at {some / GiB:.2f} "
                       f"GiB (every block: {every / GiB:.2f} GiB, {part}: {peak / GiB:.2f} GiB)")
    return True, (f"{without}; with {parts[-1]} of its {total} blocks checkpointed it did not fit either; every "
                  f"block: {every / GiB:.2f} GiB")
