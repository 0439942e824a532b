"""LoRA layers that read the same input run as one group: a decoder layer's q, k and v projections, its gate
and up projections (model.fuse_projections).

For each group the frozen weights are laid side by side in one buffer (each layer's own `weight` becomes a view
into it, so nothing is held twice); at each call the LoRA down-projections are stacked (r rows each) and the
scaled up-projections laid on the diagonal of one matrix (a few hundred KiB). Forward then runs three matrix
products per group instead of three per layer and reads the input twice per group instead of twice per layer.
Backward has one gradient for the group (the members' side by side), which feeds the input's gradient (one
product per group instead of one per layer, plus the additions between them) and the LoRA gradients alike.
The arithmetic is PEFT's (`result + lora_B(lora_A(x)) * scaling`), so saved adapters, merges and loaders are
unchanged.

The first member a module calls with an input computes every member's output; the others take theirs from the
group. A member called on another input, with extra arguments, or in a state PEFT handles differently (adapters
disabled or merged, several active) runs its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Pending:
    """Outputs computed for the members that have not asked for theirs yet (a plain object: torch.compile
    records its changes as side effects of the graph)."""

    def __init__(self) -> None:
        self.source = None
        self.outputs: dict[str, torch.Tensor] = {}


class SharedInputGroup(torch.nn.Module):
    def __init__(self, members: dict[str, torch.nn.Module], adapter: str):
        super().__init__()
        self.names = tuple(members)
        self.adapter = adapter
        bases = [m.base_layer for m in members.values()]
        self.out_sizes = [b.out_features for b in bases]
        # not persistent: the model's state dict keeps each layer's own weight
        self.register_buffer("weight", torch.cat([b.weight.detach() for b in bases]), persistent=False)
        has_bias = [b.bias is not None for b in bases]
        bias = (torch.cat([b.bias.detach() if b.bias is not None else b.weight.new_zeros(b.out_features)
                           for b in bases]) if any(has_bias) else None)
        self.register_buffer("bias", bias, persistent=False)
        first = 0
        for base, size in zip(bases, self.out_sizes):
            base.weight = torch.nn.Parameter(self.weight[first:first + size], requires_grad=False)
            if base.bias is not None:
                base.bias = torch.nn.Parameter(self.bias[first:first + size], requires_grad=False)
            first += size
        self._members = list(members.values())  # a list, not submodules: they stay where the model has them
        self._pending = _Pending()

    def reset(self) -> None:
        """Forget outputs not taken yet (a forward that raised between members holds its whole graph there)."""
        self._pending.source, self._pending.outputs = None, {}

    def output(self, name: str, x: torch.Tensor) -> torch.Tensor:
        pending = self._pending
        if pending.source is not x or name not in pending.outputs:
            pending.outputs = self._compute(x)
            pending.source = x
        out = pending.outputs.pop(name)
        if not pending.outputs:
            pending.source = None
        return out

    def _compute(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        members, adapter = self._members, self.adapter
        base = F.linear(x, self.weight, self.bias)
        lora_a = torch.cat([m.lora_A[adapter].weight for m in members])
        # the up-projections as one block-diagonal matrix (r columns per member, scaled): one product, one
        # output beside the frozen weights' output, so that backward has one gradient to feed both
        lora_b = torch.block_diag(*[m.lora_B[adapter].weight * m.scaling[adapter] for m in members])
        low = F.linear(members[0]._cast_input_dtype(x, lora_a.dtype), lora_a)
        # Each output is its own sum of two slices, so that it fuses into what reads it (RoPE, SwiGLU) and the
        # backward's one gradient (the members' gradients side by side) feeds both products. One sum over the
        # whole group was written out by a kernel of its own: 1.4% slower (bench/llm.py, one H100, one command).
        lora = F.linear(low, lora_b)
        return {name: (b + l).to(base.dtype) for name, b, l in
                zip(self.names, base.split(self.out_sizes, dim=-1), lora.split(self.out_sizes, dim=-1))}


def _plain_lora(module: torch.nn.Module) -> str | None:
    """The adapter name when `module` is a PEFT LoRA Linear with one vanilla adapter and no dropout, else None."""
    from peft.tuners.lora import Linear

    if not isinstance(module, Linear) or type(module.base_layer) is not torch.nn.Linear:
        return None
    adapters = list(module.lora_A)
    if len(adapters) != 1 or module.lora_variant or module.merged:
        return None
    adapter = adapters[0]
    if not isinstance(module.lora_dropout[adapter], torch.nn.Identity) or module.lora_B[adapter].bias is not None:
        return None
    return adapter


def _shared_adapter(members: dict[str, torch.nn.Module]) -> str | None:
    """The adapter name when every member is a plain LoRA Linear (_plain_lora) of that one adapter, over frozen
    weights of one dtype, device and input width, with LoRA weights of one dtype; else None."""
    adapters = {_plain_lora(m) for m in members.values()}
    if None in adapters or len(adapters) != 1:
        return None
    adapter = adapters.pop()
    weights = [m.base_layer.weight for m in members.values()]
    if (len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1
            or len({m.lora_A[adapter].weight.dtype for m in members.values()}) != 1):
        return None
    return adapter


def _grouped_forward(member: torch.nn.Module, name: str, group: SharedInputGroup, own):
    def forward(x, *args, **kwargs):
        if (args or kwargs or member.disable_adapters or member.merged
                or list(member.active_adapters) != [group.adapter]):
            return own(x, *args, **kwargs)
        return group.output(name, x)
    return forward


@dataclass
class Grouping:
    groups: list[SharedInputGroup]
    left: int   # sibling sets (2 or more present) not grouped: some layer not a plain 16-bit LoRA Linear


def group_shared_inputs(model: torch.nn.Module, siblings: Iterable[tuple[str, ...]] = SIBLINGS,
                        reset_before: torch.nn.Module | None = None) -> Grouping:
    """Group the LoRA layers of `model` named in `siblings` under one parent (see the module's docstring).
    Sets where some layer is not a plain LoRA Linear over a 16-bit nn.Linear (quantized, dropout, DoRA, not
    adapted), or where dtypes or devices differ, are left alone and counted.

    `reset_before`: a module every forward goes through (the decoder stack); before each of its calls every
    group forgets what an earlier forward left (one that raised between members, e.g. out of memory in the
    batch-size probe). The weights are views of the group's buffer until something replaces them (`model.to`
    of another dtype); the numbers stay right, the weights are then held twice: group after moving."""
    groups, left = [], 0
    for parent in list(model.modules()):
        for names in siblings:
            present = [n for n in names if isinstance(getattr(parent, n, None), torch.nn.Module)]
            if not present:
                continue
            members = {n: getattr(parent, n) for n in present}
            adapter = _shared_adapter(members) if len(present) == len(names) else None
            if adapter is None:
                left += len(present) > 1
                continue
            group = SharedInputGroup(members, adapter)
            parent.add_module("shared_input_" + "_".join(n.removesuffix("_proj") for n in names), group)
            for name, member in members.items():
                member.forward = _grouped_forward(member, name, group, member.forward)
            groups.append(group)
    if groups:
        # A checkpointed layer (transformers' gradient checkpointing) is traced by torch.compile as one
        # higher-order op, which refuses side effects unless they may be skipped when backward recomputes the
        # layer: the group's are (a layer leaves no output pending), so the layer compiles whole instead of
        # running eagerly (dynamo's errors are suppressed in training).
        import torch._dynamo.config as dynamo_config

        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        if reset_before is not None:
            def reset(module, args) -> None:  # a pre-hook that returns something replaces the arguments
                for group in groups:
                    group.reset()

            reset_before.register_forward_pre_hook(reset)
    return Grouping(groups, left)
