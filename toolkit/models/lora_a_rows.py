"""A LoRA layer with its down-projection A inside the frozen product: for the layers of a decoder that group with
nothing (o_proj, down_proj; model.fuse_projections), where the input is at least as wide as the output.

One buffer holds the frozen weight with A as r extra output rows, `[W ; A]` (the layer's own `weight` becomes a
view of its first rows, still contiguous, so nothing is held twice). Then

    x @ [W ; A]^T = [x·W^T | low]            the frozen output and low = x·A^T from one product
    y = x·W^T + low · (B·scaling)^T            PEFT's arithmetic
    grad_x = [g | g·B·scaling] @ [W ; A]       the input's gradient with the LoRA term inside, one product

so A's product never reads the input on its own, and the input's gradient, for down_proj the widest tensor of
the layer, is written once, not written and then added to. A's rows are copied from the parameter before each
forward (refresh_slots in shared_input.py, through `.data`); A's gradient comes from `_FrozenWithLoraA`.

The weight being a view of the buffer has one visible effect: `torch.save` of that weight alone writes the
buffer's A rows too (a view saves its whole storage). The toolkit saves only the adapter, and `toolkit merge`
loads a fresh base. PEFT's merge writes into the view, so the buffer follows it.

Shared input groups (shared_input.py) do the mirror image, B inside as extra input columns: that suits layers
whose output is the wide side (q/k/v, gate/up), this suits those whose input is (down_proj).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def in_fused_state(member: torch.nn.Module, adapter: str) -> bool:
    """Whether a fused LoRA layer (a group member, a single layer, a gated MLP's) is in the one state the fused
    forms cover: `adapter` alone active, not merged."""
    return not (member.disable_adapters or member.merged) and list(member.active_adapters) == [adapter]


class LoraARows(torch.nn.Module):
    def __init__(self, member: torch.nn.Module, adapter: str):
        super().__init__()
        base = member.base_layer
        self.adapter = adapter
        self.out_features = base.out_features
        self.rank = member.lora_A[adapter].weight.shape[0]
        weight = base.weight.detach()
        # [W ; zeros for A]; not persistent: the model's state dict keeps the layer's own weight
        self.register_buffer("weight", torch.cat([weight, weight.new_zeros(self.rank, weight.shape[1])]),
                             persistent=False)
        base.weight = torch.nn.Parameter(self.weight[:self.out_features], requires_grad=False)
        bias = None
        if base.bias is not None:  # [bias ; zeros]: added inside the product, in the product's dtype
            bias = torch.cat([base.bias.detach(), base.bias.new_zeros(self.rank)])
            base.bias = torch.nn.Parameter(bias[:self.out_features], requires_grad=False)
        self.register_buffer("bias", bias, persistent=False)
        self._held = [member]  # a list, not a submodule: it stays where the model has it

    @property
    def _member(self) -> torch.nn.Module:
        return self._held[0]

    def lora_slots(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A and its rows of the buffer (a view of `.data`: the buffer's version stays, see refresh_slots); none
        once the adapter is deleted (the layer then runs PEFT's own forward)."""
        if self.adapter not in self._member.lora_A:
            return [], []
        return [self.weight.data[self.out_features:]], [self._member.lora_A[self.adapter].weight]

    def copy_slots(self) -> None:
        """Copy A into the buffer (an eager call; compiled layers get it from the decoder's pre-hook)."""
        with torch.no_grad():
            torch._foreach_copy_(*self.lora_slots())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # compiled layers get A from the decoder's pre-hook
            self.copy_slots()
        x = x.to(self.weight.dtype)
        if torch.is_grad_enabled():
            wide = _FrozenWithLoraA.apply(x, self.weight, self.bias, self._member.lora_A[self.adapter].weight)
        else:  # eval and sampling: the same product (the Function would split a compiled layer under no_grad)
            wide = F.linear(x, self.weight, self.bias)
        return self.finish(wide)

    def finish(self, wide: torch.Tensor) -> torch.Tensor:
        """The layer's output from `wide` = [frozen output | low]: frozen + low·(B·scaling)^T."""
        frozen, low = wide.split([self.out_features, self.rank], dim=-1)
        # low's own copy (r columns): kept for B's gradient, a view would keep the whole product alive until then
        low = low.contiguous()
        member, adapter = self._member, self.adapter
        lora_b = member.lora_B[adapter].weight * member.scaling[adapter]
        return frozen + F.linear(low, lora_b.to(low.dtype))


class _FrozenWithLoraA(torch.autograd.Function):
    """`x @ weight^T + bias`, where `weight` is the buffer [W ; A] (bias: [b ; zeros]): the frozen output and A's
    output side by side. The buffer holds A's values (copied in by refresh_slots), so autograd does not see A in
    it: backward returns A's gradient itself, and the input's from one product with the whole buffer."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a):
        ctx.save_for_backward(x, weight)
        ctx.x_dtype, ctx.a_dtype, ctx.rank = x.dtype, lora_a.dtype, lora_a.shape[0]
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        # backward runs outside autocast: under it the forward's product ran in grad's dtype, so backward's do too
        x, weight = ctx.saved_tensors
        grad_x = (grad @ weight.to(grad.dtype)).to(ctx.x_dtype)
        grad_low = grad[..., grad.shape[-1] - ctx.rank:]
        grad_a = (grad_low.reshape(-1, ctx.rank).t() @ x.to(grad.dtype).reshape(-1, x.shape[-1])).to(ctx.a_dtype)
        return grad_x, None, None, grad_a
