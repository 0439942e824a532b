"""A gated MLP, `down(act(gate(x)) * up(x))`, whose three LoRA layers are fused forms (model.fuse_projections):
gate and up a shared-input group (B inside, shared_input.py), down a LoraARows (A inside, lora_a_rows.py).

Run layer by layer, the backward of down's A needs h = act(gate) * up, which a step does not keep (it is as
large as gate): it is recomputed by a kernel of its own, written out, and read again by a matrix product, after
the activation's backward has read gate and up already. Here the MLP runs as one autograd Function between the
group's product and down's: backward computes down's input gradient with one product as before, then one
kernel (kernels/gated_backward.py) computes gate's and up's gradients and A's from a single read of gate and up,
h recomputed in registers. The group receives its gradient as one tensor, not gate's and up's to be joined.

The arithmetic is PEFT's, as for the layers one by one. An MLP is taken over when its forward is transformers'
gated form (that source, checked), its activation is SiLU or tanh-approximated GELU (Llama, Mistral, Qwen,
Gemma and most decoders), and its three layers are fused forms of one dtype and adapter. Any other state runs the
model's own forward, which calls the layers one by one: adapters disabled or merged, another adapter active,
layers replaced (PEFT's unload), forward hooks on a layer or global ones (PEFT's mixed-batch adapter_names).
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module

from toolkit.kernels.gated_backward import activation, gated_backward, register
from toolkit.models.lora_a_rows import in_fused_state

# transformers' gated MLP forward, whitespace removed (127 MLP classes of transformers 5.23 read this way)
GATED_FORWARDS = frozenset({
    "defforward(self,x):down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj",
    "defforward(self,x):returnself.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))",
})


def gated_activation(mlp: torch.nn.Module) -> str | None:
    """'silu' or 'gelu_tanh' when `mlp` computes `down(act(gate(x)) * up(x))` with that activation, else None."""
    if not _gated_form(type(mlp)):
        return None
    act = getattr(mlp, "act_fn", None)
    name = type(act).__name__
    if isinstance(act, torch.nn.SiLU) or name == "SiLUActivation":
        return "silu"
    if (isinstance(act, torch.nn.GELU) and act.approximate == "tanh") or name in ("GELUTanh", "PytorchGELUTanh"):
        return "gelu_tanh"
    return None


@functools.cache
def _gated_form(cls: type) -> bool:
    """Whether the class's forward is transformers' gated MLP (its source, whitespace removed; read once a class)."""
    try:
        return re.sub(r"\s+", "", inspect.getsource(cls.forward)) in GATED_FORWARDS
    except (OSError, TypeError, AttributeError):
        return False


def fuse_gated_mlp(mlp: torch.nn.Module, group, rows, act: str) -> bool:
    """Run `mlp` as one Function over its gate/up group and its down LoraARows; False (nothing changed) when the
    three do not fit: another order of the group, other widths, or other dtypes."""
    if (group.names != ("gate_proj", "up_proj") or group.out_sizes[0] != group.out_sizes[1]
            or rows.weight.shape[1] != group.out_sizes[0] or rows.weight.dtype != group.weight.dtype
            or rows.adapter != group.adapter):
        return False
    register()  # the Triton kernel where triton imports, before anything is compiled
    own = mlp.forward
    members = dict(zip(("gate_proj", "up_proj", "down_proj"), [*group._members, rows._member]))

    def forward(x, *args, **kwargs):
        if args or kwargs or not _still_fused(mlp, members, group.adapter):
            return own(x, *args, **kwargs)
        gate_up = group.product(x)
        if not torch.compiler.is_compiling():  # compiled layers get A from the decoder's pre-hook
            rows.copy_slots()
        lora_a = rows._member.lora_A[rows.adapter].weight
        if torch.is_grad_enabled():
            wide = _GatedDown.apply(gate_up, rows.weight, rows.bias, lora_a, act)
        else:  # eval and sampling: the same products
            gate, up = gate_up.chunk(2, dim=-1)
            wide = F.linear(activation(gate, act) * up, rows.weight, rows.bias)
        return rows.finish(wide)

    mlp.forward = forward
    return True


def _still_fused(mlp: torch.nn.Module, members: dict[str, torch.nn.Module], adapter: str) -> bool:
    """Whether the MLP may skip calling its layers: each is still the fused member (PEFT's unload() puts the base
    layers back), in the fused state, and without forward hooks, its own or global (PEFT's mixed-batch
    `adapter_names` reaches the layers through pre-hooks; a user's hooks expect the layers called)."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return False
    for name, member in members.items():
        if (getattr(mlp, name, None) is not member or member._forward_hooks or member._forward_pre_hooks
                or not in_fused_state(member, adapter)):
            return False
    return True


class _GatedDown(torch.autograd.Function):
    """`(act(gate) * up) @ weight^T + bias` for gate_up = [gate | up] and weight the buffer [W ; A] of down's
    LoraARows: the frozen output and A's side by side. Keeps gate_up (the group's product, kept anyway), not h."""

    @staticmethod
    def forward(ctx, gate_up, weight, bias, lora_a, act):
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up, weight)
        ctx.act, ctx.a_dtype, ctx.rank = act, lora_a.dtype, lora_a.shape[0]
        return F.linear(activation(gate, act) * up, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        # backward runs outside autocast: under it the forward's product ran in grad's dtype, so backward's do too
        gate_up, weight = ctx.saved_tensors
        grad_h = grad @ weight.to(grad.dtype)
        grad_low = grad[..., grad.shape[-1] - ctx.rank:]
        grad_gate_up, grad_a = gated_backward(gate_up, grad_h, grad_low, ctx.act)
        return grad_gate_up, None, None, grad_a.to(ctx.a_dtype), None
