"""The repeated blocks of a denoiser, each wrapped once for what the run asks of it: compiled (train.compile),
gradient-checkpointed (train.gradient_checkpointing: all, none, or N of them spread evenly), and streamed in
from CPU memory (model.block_swap, models/block_swap.py; a swapped block is always checkpointed).

The wrapper replaces the block's `forward` (the module, its parameter names and its hooks stay as they are):

    forward(*args)  ->  checkpoint(run, *args) when checkpointed and grad is on, else run(*args)
    run(*args)      ->  swap.enter(index) for a swapped block; then the block's own forward, compiled or not

so the swap fetches the weights both in the forward pass and in the recompute during backward, and the compiled
code never contains the swap's host logic.

train.checkpoint_keeps=attention: a checkpointed block keeps its attention's outputs (the SDPA kernels' output and
log-sum-exp) and recomputes the rest in backward: PyTorch's selective activation checkpointing, with a policy that
must save the attention ops. For a long sequence (a video DiT's tens of thousands of tokens) attention is most of
the forward, so the recompute shrinks to the cheap part for the memory of one activation per block. A compiled
block is then compiled with its checkpoint inside (torch.compile(checkpoint(forward))) so that the policy sees
the traced ops; the recompute becomes part of the compiled backward. A swapped block keeps the order above, so
compiled it recomputes everything. Only attention with at least as many keys as the model is wide is kept
(`worth_keeping`): self-attention over image or video tokens, not cross-attention to the text. A graph break
inside such a block leaves the whole checkpointed block uncompiled (dynamo cannot split a checkpoint region);
diffusers' DiT blocks compiled without one in every measured run.

Compiling the forward alone (not the module's __call__) keeps module hooks (FSDP's, PEFT's) outside the compiled graph.

CUDA graphs (train.cuda_graphs): a denoiser compiled whole (the SD/SDXL UNet when not checkpointed) is compiled in
torch.compile's reduce-overhead mode, which records its kernels once per shape and replays them as one CUDA/HIP
graph. The host otherwise spends more time launching the UNet's thousands of small kernels than the GPU spends
running them (bench/profile_steps.py). A checkpointed or swapped block, or a step of several micro-batches, would
reuse a graph's output buffers while they are still needed, so those keep ordinary launches.

Shapes: each aspect bucket gives the blocks another input shape. When a run has few batch shapes (at most
STATIC_SHAPES_MAX), each is compiled once with static shapes, the fastest code; with more, dynamo's automatic
dynamic shapes compile a second, shape-generic version at the second shape and reuse it for all others.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Callable, Iterator, Mapping

import torch
from torch.utils.checkpoint import checkpoint

from toolkit.models.block_swap import BlockSwap, spread
from toolkit.train.compile import keep_compiled_code, without_ddp_graph_splitting

STATIC_SHAPES_MAX = 8
# The SDPA kernels' own ops (what F.scaled_dot_product_attention dispatches to, on every backend and the CPU);
# each takes query, key, value as (batch, heads, tokens, head width)
ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


@dataclass
class BlockPlan:
    """What was done to the blocks of each root, for the log and the tests."""

    compiled: int = 0
    graphs: list[str] = field(default_factory=list)  # the roots replayed as CUDA graphs
    checkpointed: dict[str, list[int]] = field(default_factory=dict)
    swapped: dict[str, list[int]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    keeping: dict[str, int] = field(default_factory=dict)  # checkpointed blocks keeping attention (checkpoint_keeps)

    def describe(self) -> list[str]:
        lines = []
        for name, total in self.totals.items():
            ckpt, swap = self.checkpointed.get(name, []), self.swapped.get(name, [])
            kept = self.keeping.get(name, 0)
            kept = (" (attention kept)" if kept == len(ckpt) else f" ({kept} keeping attention)") if kept else ""
            lines.append(f"blocks: {name}: {total} blocks, {len(ckpt)} gradient-checkpointed{kept}, "
                         f"{len(swap)} swapped"
                         f"{', compiled' if self.compiled else ''}{', as a CUDA graph' if name in self.graphs else ''}")
        return lines


def checkpointed_indices(setting, total: int, swapped: list[int]) -> list[int]:
    """train.gradient_checkpointing resolved over `total` blocks: true all, false none, an integer N that many
    spread evenly; swapped blocks are always included."""
    if setting is True:
        chosen = set(range(total))
    elif setting is False or setting is None:
        chosen = set()
    else:
        chosen = set(spread(int(setting), total))
    return sorted(chosen | set(swapped))


def attention_ops() -> set:
    return {getattr(torch.ops.aten, name).default for name in ATTENTION_OPS if hasattr(torch.ops.aten, name)}


def worth_keeping(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether an attention's output is worth keeping rather than recomputing: when it has at least as many keys
    as the model is wide. Per query token it then costs more than a projection of the same width (4 x keys x
    width multiply-adds against 2 x width x width), while keeping it costs what keeping a projection's output
    would. Self-attention over an image or a video qualifies; cross-attention to a few hundred text tokens
    (recomputed in no time, as large to keep) does not."""
    return key.shape[-2] >= query.shape[1] * query.shape[-1]


def _keep_attention(ops: set, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op in ops and worth_keeping(args[0], args[1]):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@lru_cache(maxsize=None)
def checkpoint_context(keeps: str) -> dict:
    """The checkpoint arguments for train.checkpoint_keeps=`keeps`: a selective policy for attention, else none.
    One object per setting for the whole run; callers never change it."""
    if keeps != "attention":
        return {}
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return {"context_fn": partial(create_selective_checkpoint_contexts, partial(_keep_attention, attention_ops()))}


def _checkpointed_call(forward: Callable, context: dict, *args, **kwargs):
    """`forward` checkpointed when grad is on; `context`: checkpoint_context's answer, taken once at wrapping (a
    compiled block then traces no lookup of it)."""
    if torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **context, **kwargs)
    return forward(*args, **kwargs)


@contextmanager
def checkpointed_while(regions: Mapping[str, list[torch.nn.Module]], setting,
                       keeps: str = "nothing") -> Iterator[None]:
    """The blocks of `regions` checkpointed as train.gradient_checkpointing=`setting` (keeping `keeps`) would
    checkpoint them (eager, nothing swapped) for the span of a measurement, then as they were:
    train.gradient_checkpointing=auto measures steps this way before the blocks are wrapped for good
    (train/checkpointing_probe.py)."""
    replaced = []
    for blocks in regions.values():
        for index in checkpointed_indices(setting, len(blocks), []):
            block = blocks[index]
            replaced.append((block, block.__dict__.get("forward")))
            forward = block.forward
            block.forward = partial(_checkpointed_call, forward, checkpoint_context(keeps))
    try:
        yield
    finally:
        for block, own in reversed(replaced):
            if own is None:
                del block.forward  # the class's forward again
            else:
                block.forward = own


def compile_options(shape_count: int) -> tuple[dict, str]:
    """torch.compile's dynamic setting for a run whose blocks see `shape_count` batch shapes, and why."""
    import torch._dynamo

    if shape_count <= STATIC_SHAPES_MAX:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shape_count + 2)
        return {"dynamic": False}, (f"{shape_count} batch shape{'s' if shape_count != 1 else ''}: each compiled once "
                                    "with static shapes")
    return {"dynamic": None}, (f"{shape_count} batch shapes: static for the first, then one shape-generic "
                               "compilation for all others (dynamo's automatic dynamic shapes)")


def graph_refusal(setting, *, compiled: bool, static: bool, blocks: int, checkpointed: bool, swapped: bool,
                  grad_accum: int | None, gpu: bool, ddp: bool = False, hip: bool = False,
                  each_block: bool = False) -> str | None:
    """Why a root's blocks are not replayed as CUDA graphs (train.cuda_graphs), or None when they are
    (`each_block`: a UNet compiled block by block, train.compile_regions=blocks, replays each block's graph)."""
    reasons = [why for refused, why in (
        (setting is False, "train.cuda_graphs=false"), (not gpu, "no GPU"), (not compiled, "train.compile is off"),
        (hip and setting == "auto", "auto: HIP graphs are not measured on ROCm yet (train.cuda_graphs: true tries them)"),
        (not static, f"more than {STATIC_SHAPES_MAX} batch shapes"),
        (blocks != 1 and not each_block, "it is compiled block by block (graphs apply to a denoiser compiled whole, "
                                          "or a UNet's blocks: train.compile_regions=blocks)"),
        (checkpointed, "it is gradient-checkpointed"), (swapped, "it has swapped blocks"),
        (grad_accum is None, "train.grad_accum is decided by the batch probe (train.global_batch_size)"),
        (grad_accum is not None and grad_accum > 1, "train.grad_accum > 1"),
        (ddp, "DistributedDataParallel wraps it (device.gradient_sync=ddp; allreduce keeps the graph)")) if refused]
    return "; ".join(reasons) if reasons else None


def wrap_block(block: torch.nn.Module, index: int, compiled: dict | None, checkpointed: bool,
               swap: BlockSwap | None, keeps: str = "nothing") -> bool:
    """Replace `block.forward` by the wrapper in the module docstring (`compiled`: torch.compile options, or
    None; `keeps`: train.checkpoint_keeps). Returns whether the block is checkpointed keeping its attention."""
    forward = block.forward
    swapped = swap is not None and index in swap.entries
    if keeps != "attention" or (swapped and compiled is not None):
        keeps = "nothing"  # a swapped compiled block: the policy would run around code it cannot see into
    context = checkpoint_context(keeps)
    if compiled is not None and checkpointed and keeps == "attention":
        # The policy must see the traced ops: the checkpoint goes inside the compiled function. Every block shares
        # this function's code, so its compiled versions count against one recompile limit (prepare_blocks
        # raises it by the number of block classes).
        def selective(*args, **kwargs):
            return _checkpointed_call(forward, context, *args, **kwargs)

        block.forward = torch.compile(selective, **compiled)
        return True
    if compiled is not None:
        forward = torch.compile(forward, **compiled)

    def run(*args, **kwargs):
        if swapped:
            swap.enter(index)
        return forward(*args, **kwargs)

    def wrapped(*args, **kwargs):
        return _checkpointed_call(run, context, *args, **kwargs) if checkpointed else run(*args, **kwargs)

    block.forward = wrapped
    return checkpointed and keeps == "attention"


def prepare_blocks(regions: Mapping[str, list[torch.nn.Module]], *, compile_: bool, checkpointing,
                   swaps: Mapping[str, BlockSwap], shape_count: int, log: Callable[[str], None],
                   cuda_graphs=False, grad_accum: int | None = 1, gpu: bool = False,
                   ddp: bool = False, hip: bool = False, keeps: str = "nothing",
                   graphs_each_block: bool = False) -> BlockPlan:
    """Wrap every block of every root in `regions` ({root name: its blocks in forward order}); `keeps`:
    train.checkpoint_keeps; `ddp`: the roots run under DistributedDataParallel (several processes with
    device.gradient_sync=ddp)."""
    plan = BlockPlan()
    options = None
    if compile_:
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True  # a block dynamo cannot compile runs eagerly, with its reason
        options, why = compile_options(shape_count)
        log(f"train.compile: {why}")
        if keeps == "attention" and checkpointing is not False:  # the selective blocks share one code object
            classes = len({type(block) for blocks in regions.values() for block in blocks})
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       classes * (min(shape_count, STATIC_SHAPES_MAX) + 2))
        if all(len(blocks) > 1 for blocks in regions.values()):  # a denoiser compiled whole keeps DDP's splitting
            without_ddp_graph_splitting()
        keep_compiled_code(log)
    for name, blocks in regions.items():
        swap = swaps.get(name)
        swapped = swap.swapped if swap is not None else []
        ckpt = checkpointed_indices(checkpointing, len(blocks), swapped)
        refusal = graph_refusal(cuda_graphs, compiled=compile_, static=shape_count <= STATIC_SHAPES_MAX,
                                blocks=len(blocks), checkpointed=bool(ckpt), swapped=bool(swapped),
                                grad_accum=grad_accum, gpu=gpu, ddp=ddp, hip=hip, each_block=graphs_each_block)
        region_options = options
        if refusal is None:
            region_options = {**options, "mode": "reduce-overhead"}
            plan.graphs.append(name)
        elif compile_ and (cuda_graphs is True or refusal.startswith("auto: HIP")):  # asked for, or ROCm's only
            log(f"train.cuda_graphs: {name} keeps ordinary kernel launches: {refusal}")
        plan.keeping[name] = sum(wrap_block(block, index, region_options, index in ckpt, swap, keeps)
                                 for index, block in enumerate(blocks))
        plan.totals[name], plan.checkpointed[name], plan.swapped[name] = len(blocks), ckpt, swapped
        plan.compiled += len(blocks) if compile_ else 0
    for line in plan.describe():
        log(line)
    return plan
