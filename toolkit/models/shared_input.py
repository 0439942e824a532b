"""LoRA layers that read the same input run as one group: a decoder layer's q, k and v projections, its gate
and up projections (model.fuse_projections).

For each group one buffer holds the frozen weights side by side (each layer's own `weight` becomes a view into
it, so nothing is held twice) and, in r extra columns per member, the members' LoRA up-projections B laid
block-diagonally. At each call the down-projections (scaled) are stacked into one product, `low = x·A^T`, and
the frozen product and the up-projection run as one matrix product over `[x | low]`:

    [x | low] @ [W | block-diag(B)]^T = x·W^T + low·B^T

so no output of the up-projection is written and read back to be added, and backward's one product with the
buffer gives the input's gradient and low's at once. The buffer's B columns are copied from the parameters
before each forward (refresh_slots, through `.data`); B's gradients come from `_FrozenWithLoraB`'s backward.
The arithmetic is PEFT's (`base(x) + lora_B(lora_A(x)) * scaling`, summed inside one product), so saved
adapters, merges and loaders are unchanged. One difference: each layer's frozen weight is now a view of rows of
a wider buffer, not contiguous; transformers' `save_pretrained` of the whole model (after `merge_and_unload` in
the same process) refuses such views, so make them contiguous first (the toolkit saves only the adapter, and
`toolkit merge` loads a fresh base).

The layers that group with nothing and read the wide side, o_proj and down_proj, get the mirror image (A inside
the frozen product, lora_a_rows.py); group_shared_inputs sets up both, and one pre-hook copies what every buffer
holds. A gated MLP whose gate/up group and down layer are both made runs as one Function over them
(gated_mlp.py), so that down's A gradient comes from the activation's backward.

The first member a module calls with an input computes every member's output; the others take theirs from the
group. A member called on another input, with extra arguments, or in a state PEFT handles differently (adapters
disabled or merged, several active) runs its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterable

import torch
import torch.nn.functional as F

from toolkit.models.gated_mlp import fuse_gated_mlp, gated_activation
from toolkit.models.lora_a_rows import LoraARows, in_fused_state

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# layers that group with nothing and whose input is at least as wide as the output: A inside (lora_a_rows.py)
SINGLES = ("o_proj", "down_proj")


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
        self.ranks = [m.lora_A[adapter].weight.shape[0] for m in members.values()]
        self.in_features = bases[0].in_features
        frozen = torch.cat([b.weight.detach() for b in bases])
        # [W | zeros for block-diag(B)]; not persistent: the model's state dict keeps each layer's own weight
        self.register_buffer("weight", torch.cat([frozen, frozen.new_zeros(len(frozen), sum(self.ranks))], dim=1),
                             persistent=False)
        has_bias = [b.bias is not None for b in bases]
        bias = (torch.cat([b.bias.detach() if b.bias is not None else b.weight.new_zeros(b.out_features)
                           for b in bases]) if any(has_bias) else None)
        self.register_buffer("bias", bias, persistent=False)
        first = 0
        for base, size in zip(bases, self.out_sizes):
            base.weight = torch.nn.Parameter(self.weight[first:first + size, :self.in_features],
                                             requires_grad=False)
            if base.bias is not None:
                base.bias = torch.nn.Parameter(self.bias[first:first + size], requires_grad=False)
            first += size
        self._members = list(members.values())  # a list, not submodules: they stay where the model has them
        self._pending = _Pending()

    def lora_slots(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each member's up-projection and its block of the buffer's last columns, a view of `.data`: written
        there, the buffer's version stays (a forward whose backward is still to run keeps working; the values
        only change with an optimizer step, which comes after that backward)."""
        data, adapter, slots, sources = self.weight.data, self.adapter, [], []
        if any(adapter not in member.lora_B for member in self._members):
            return [], []  # the adapter was deleted: the members run PEFT's own forward
        row, column = 0, self.in_features
        for member, size, rank in zip(self._members, self.out_sizes, self.ranks):
            slots.append(data[row:row + size, column:column + rank])
            sources.append(member.lora_B[adapter].weight)
            row, column = row + size, column + rank
        return slots, sources

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
        return dict(zip(self.names, self.product(x).split(self.out_sizes, dim=-1)))

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output side by side, in the order of `names`."""
        members, adapter = self._members, self.adapter
        if not torch.compiler.is_compiling():
            refresh_slots([self])  # compiled layers get theirs from the pre-hook (group_shared_inputs)
        # the scaling goes with A, so that the buffer holds B as it is (refresh_slots: one copy, no product)
        lora_a = torch.cat([m.lora_A[adapter].weight * m.scaling[adapter] for m in members])
        low = F.linear(members[0]._cast_input_dtype(x, lora_a.dtype), lora_a).to(self.weight.dtype)
        x = x.to(self.weight.dtype)
        if torch.is_grad_enabled():
            out = _FrozenWithLoraB.apply(x, low, self.weight, self.bias, tuple(self.out_sizes),
                                         tuple(self.ranks), *[m.lora_B[adapter].weight for m in members])
        else:  # eval and sampling: the same product (the Function would split a compiled layer under no_grad)
            out = F.linear(torch.cat([x, low], dim=-1), self.weight, self.bias)
        return out


class _FrozenWithLoraB(torch.autograd.Function):
    """`[x | low] @ weight^T + bias`, where `weight` is the group's buffer [W | block-diag(B)]: the frozen product
    and the LoRA up-projection in one matrix product. The buffer holds B's values (copied in by refresh_slots), so
    autograd does not see B in it: backward returns B's gradients itself. Where x needs no gradient (the first
    decoder layer's q/k/v: its input comes from frozen embeddings), backward multiplies by B's columns only."""

    @staticmethod
    def forward(ctx, x, low, weight, bias, out_sizes, ranks, *b_weights):
        wide = torch.cat([x, low], dim=-1)
        ctx.save_for_backward(low, weight)
        ctx.out_sizes, ctx.ranks, ctx.wide_dtype, ctx.x_width = out_sizes, ranks, wide.dtype, x.shape[-1]
        ctx.b_dtypes = [b.dtype for b in b_weights]
        return F.linear(wide, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        # backward runs outside autocast: under it the forward's product ran in grad's dtype, so backward's do too
        # (a no-op where the buffer is already in that dtype)
        low, weight = ctx.saved_tensors
        low = low.to(grad.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:  # the input's gradient and low's, side by side, from one product
            grad_wide = (grad @ weight.to(grad.dtype)).to(ctx.wide_dtype)
            grad_x, grad_low = grad_wide[..., :ctx.x_width], grad_wide[..., ctx.x_width:]
        else:  # B's columns only (cast alone: an fp32 buffer under bf16 autocast is not copied whole)
            grad_low = (grad @ weight[:, ctx.x_width:].to(grad.dtype)).to(ctx.wide_dtype)
        grads_b, column = [], 0
        for grad_out, rank, dtype in zip(grad.split(ctx.out_sizes, dim=-1), ctx.ranks, ctx.b_dtypes):
            low_i = low[..., column:column + rank]
            grads_b.append((grad_out.reshape(-1, grad_out.shape[-1]).t() @ low_i.reshape(-1, rank)).to(dtype))
            column += rank
        return (grad_x, grad_low, None, None, None, None, *grads_b)


@torch.no_grad()
def refresh_slots(layers: Iterable["SharedInputGroup | LoraARows"]) -> None:
    """Copy the LoRA weights the layers' buffers hold (B of a group, A of a LoraARows) from their parameters,
    one call for all (`lora_slots`)."""
    slots, sources = [], []
    for layer in layers:
        layer_slots, layer_sources = layer.lora_slots()
        slots += layer_slots
        sources += layer_sources
    if slots:
        torch._foreach_copy_(slots, sources)


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


def _fused_forward(member: torch.nn.Module, adapter: str, run, own):
    """The member's forward: `run(x)` (its group's output, or its single layer) in the one state the fused forms
    cover (in_fused_state, no extra arguments); PEFT's own forward `own` otherwise."""
    def forward(x, *args, **kwargs):
        if args or kwargs or not in_fused_state(member, adapter):
            return own(x, *args, **kwargs)
        return run(x)
    return forward


@dataclass
class Grouping:
    groups: list[SharedInputGroup]
    left: int   # sibling sets (2 or more present) not grouped: some layer not a plain LoRA Linear over an nn.Linear
    rows: list[LoraARows]  # single layers with A inside the frozen product
    mlps: int   # gated MLPs run as one Function over their group and down's LoraARows (gated_mlp.py)


def group_shared_inputs(model: torch.nn.Module, siblings: Iterable[tuple[str, ...]] = SIBLINGS,
                        reset_before: torch.nn.Module | None = None,
                        singles: Iterable[str] = SINGLES) -> Grouping:
    """Group the LoRA layers of `model` named in `siblings` under one parent (see the module's docstring), and
    give those named in `singles` their down-projection inside the frozen product (lora_a_rows.py).
    Sets where some layer is not a plain LoRA Linear over an nn.Linear (quantized, dropout, DoRA, not adapted),
    or where dtypes or devices differ, are left alone and counted; such single layers are left alone.

    `reset_before`: a module every forward goes through (the decoder stack; `model` when None). Before each of
    its calls every group forgets what an earlier forward left (one that raised between members, e.g. out of
    memory in the batch-size probe), and the LoRA weights the buffers hold are copied in from the parameters,
    which a compiled layer does not do itself (one `_foreach_copy_` for all; measured: no cost on an H100). The
    weights are views of the buffers until something replaces them (`model.to` of another dtype); the numbers
    stay right, the weights are then held twice: group after moving."""
    groups, rows, left, mlps = [], [], 0, 0
    singles = tuple(singles)
    for parent in list(model.modules()):
        made = {}
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
                member.forward = _fused_forward(member, adapter, partial(group.output, name), member.forward)
            groups.append(group)
            made[names] = group
        for name in singles:
            member = getattr(parent, name, None)
            adapter = _shared_adapter({name: member}) if isinstance(member, torch.nn.Module) else None
            if adapter is None or member.base_layer.in_features < member.base_layer.out_features:
                continue
            layer = LoraARows(member, adapter)
            parent.add_module("lora_a_rows_" + name.removesuffix("_proj"), layer)
            member.forward = _fused_forward(member, adapter, layer, member.forward)
            rows.append(layer)
            made[name] = layer
        if ("gate_proj", "up_proj") in made and "down_proj" in made and (act := gated_activation(parent)):
            mlps += fuse_gated_mlp(parent, made["gate_proj", "up_proj"], made["down_proj"], act)
    if groups or rows:
        # A checkpointed layer (transformers' gradient checkpointing) is traced by torch.compile as one
        # higher-order op, which refuses side effects unless they may be skipped when backward recomputes the
        # layer: the group's are (a layer leaves no output pending), so the layer compiles whole instead of
        # running eagerly (dynamo's errors are suppressed in training).
        import torch._dynamo.config as dynamo_config

        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        layers = [*groups, *rows]

        def reset(module, args) -> None:  # a pre-hook that returns something replaces the arguments
            for group in groups:
                group.reset()
            refresh_slots(layers)  # a compiled layer does not copy them itself

        (model if reset_before is None else reset_before).register_forward_pre_hook(reset)
    return Grouping(groups, left, rows, mlps)
