"""The backward of a gated MLP's activation, `h = act(gate) * up`, with the LoRA A gradient of the down projection
that reads h folded in (models/gated_mlp.py).

    grad_gate = grad_h * up * act'(gate)     grad_up = grad_h * act(gate)     grad_A = grad_low^T @ h

The first two are what any SwiGLU/GeGLU backward computes from gate, up and grad_h. The third needs h, which
a step does not keep (it is as large as gate): without this kernel it is recomputed by a kernel of its own,
written out, and read again by a matrix product. Here each program recomputes its tile of h in registers from
the gate and up it reads anyway, and adds its share of grad_A with one small product on the tensor cores
(`tl.dot`), so h is never written. grad_A is summed over the token axis in SPLITS slices, then the slices
are added (SPLITS x r x F in fp32: 8 MiB at r=16 and F=8192, 112 MiB at r=128 and F=14336).

`gated_backward` runs the Triton kernel on 16-bit GPU tensors once `register` has made it, and the same
arithmetic in PyTorch otherwise (the CPU, fp32 and fp64, and the tests' reference). The kernel is written for CUDA
and ROCm alike (no vendor library calls; tanh as 2·sigmoid(2z) - 1), measured on CUDA only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.kernels import triton_available

SPLITS = 16     # slices of the token axis, each summing its part of grad_A (more programs than the GPU has SMs)
BLOCK_T, BLOCK_F = 32, 128
NUM_WARPS, NUM_STAGES = 4, 3  # the fastest of 72 configurations at 8192 x 8192, r=16 (H100: 0.257 ms, 3.1 TB/s)


def activation(gate: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) as the model computes it (transformers' SiLU and tanh-approximated GELU)."""
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


def gated_backward(gate_up: torch.Tensor, grad_h: torch.Tensor, grad_low: torch.Tensor,
                   act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of gate_up = [gate | up], gradient of A in fp32 or wider) for h = act(gate) * up, given grad_h and the
    gradient of low = h @ A^T. gate_up: [..., 2F]; grad_h: [..., F]; grad_low: [..., r] (any row stride).
    The Triton kernel once `register` has made it (a compiled graph cannot import triton while it traces)."""
    if gate_up.is_cuda and _REGISTERED and gate_up.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.toolkit.gated_backward(gate_up, grad_h, grad_low, act)
    return reference(gate_up, grad_h, grad_low, act)


def register() -> bool:
    """Make the Triton kernel's custom op, once; False where triton does not import (then the PyTorch arithmetic
    runs). Called where a model's MLPs are taken over, before anything is compiled."""
    global _REGISTERED
    if not _REGISTERED and triton_available():
        _define_op()
        _REGISTERED = True
    return _REGISTERED


_REGISTERED = False


def reference(gate_up: torch.Tensor, grad_h: torch.Tensor, grad_low: torch.Tensor,
              act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in PyTorch: math in fp32 (fp64 for fp64 inputs), h rounded to gate_up's dtype for
    grad_A (as the kernel feeds it to the tensor cores); gate_up's gradient in its dtype, grad_A in the math's."""
    math = torch.promote_types(gate_up.dtype, torch.float32)
    gate, up = gate_up.to(math).chunk(2, dim=-1)
    value, slope = _activation_and_slope(gate, act)
    grad = grad_h.to(math)
    grad_gate_up = torch.cat([grad * up * slope, grad * value], dim=-1).to(gate_up.dtype)
    h = (value * up).to(gate_up.dtype).to(math)
    rank = grad_low.shape[-1]
    grad_a = grad_low.reshape(-1, rank).to(math).t() @ h.reshape(-1, h.shape[-1])
    return grad_gate_up, grad_a


_SQRT_2_OVER_PI, _GELU_CUBIC = 0.7978845608028654, 0.044715


def _activation_and_slope(gate: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(gate) and act'(gate), in the dtype of gate."""
    if act == "silu":
        sig = torch.sigmoid(gate)
        return gate * sig, sig * (1 + gate * (1 - sig))
    tanh = torch.tanh(_SQRT_2_OVER_PI * (gate + _GELU_CUBIC * gate ** 3))
    slope = 0.5 * (1 + tanh) + 0.5 * gate * (1 - tanh * tanh) * _SQRT_2_OVER_PI * (1 + 3 * _GELU_CUBIC * gate * gate)
    return 0.5 * gate * (1 + tanh), slope


def _define_op() -> None:
    """The kernel as the custom op toolkit::gated_backward (torch.library.triton_op): torch.compile sees it as
    one node, with output shapes it can infer, and calls the kernel from its generated code."""
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def _kernel(gate_up, grad_h, grad_low, grad_gate_up, partial_a, tokens, features, rank,
                stride_gate_up, stride_grad_h, stride_grad_low, stride_out,
                tokens_per_split, GELU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                BLOCK_R: tl.constexpr):
        columns = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
        split = tl.program_id(1)
        ranks = tl.arange(0, BLOCK_R)
        column_ok = columns < features
        rank_ok = ranks < rank
        acc = tl.zeros((BLOCK_R, BLOCK_F), dtype=tl.float32)
        first = split * tokens_per_split
        for start in range(first, first + tokens_per_split, BLOCK_T):
            rows = start + tl.arange(0, BLOCK_T)
            row_ok = rows < tokens
            ok = row_ok[:, None] & column_ok[None, :]
            rows64 = rows.to(tl.int64)
            at = gate_up + rows64[:, None] * stride_gate_up + columns[None, :]
            gate = tl.load(at, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(at + features, mask=ok, other=0.0).to(tl.float32)
            grad = tl.load(grad_h + rows64[:, None] * stride_grad_h + columns[None, :], mask=ok,
                           other=0.0).to(tl.float32)
            if GELU:
                inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
                tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
                value = 0.5 * gate * (1.0 + tanh)
                slope = (0.5 * (1.0 + tanh) + 0.5 * gate * (1.0 - tanh * tanh) * 0.7978845608028654
                         * (1.0 + 3.0 * 0.044715 * gate * gate))
            else:
                sig = tl.sigmoid(gate)
                value = gate * sig
                slope = sig * (1.0 + gate * (1.0 - sig))
            out = grad_gate_up + rows64[:, None] * stride_out + columns[None, :]
            tl.store(out, (grad * up * slope).to(grad_gate_up.dtype.element_ty), mask=ok)
            tl.store(out + features, (grad * value).to(grad_gate_up.dtype.element_ty), mask=ok)
            h = (value * up).to(gate_up.dtype.element_ty)
            low = tl.load(grad_low + rows64[None, :] * stride_grad_low + ranks[:, None],
                          mask=rank_ok[:, None] & row_ok[None, :], other=0.0).to(gate_up.dtype.element_ty)
            acc += tl.dot(low, h)
        at = partial_a + (split * rank + ranks[:, None]).to(tl.int64) * features + columns[None, :]
        tl.store(at, acc, mask=rank_ok[:, None] & column_ok[None, :])

    @triton_op("toolkit::gated_backward", mutates_args=())
    def _op(gate_up: torch.Tensor, grad_h: torch.Tensor, grad_low: torch.Tensor,
                          act: str) -> tuple[torch.Tensor, torch.Tensor]:
        features = grad_h.shape[-1]
        rank = grad_low.shape[-1]
        gate_up2, grad_h2, grad_low2 = (t.reshape(-1, t.shape[-1]) for t in (gate_up, grad_h, grad_low))
        gate_up2, grad_h2 = gate_up2.contiguous(), grad_h2.contiguous()
        if grad_low2.stride(-1) != 1:
            grad_low2 = grad_low2.contiguous()
        tokens = gate_up2.shape[0]
        grad_gate_up = torch.empty_like(gate_up2)
        partial_a = torch.empty((SPLITS, rank, features), dtype=torch.float32, device=gate_up.device)
        tokens_per_split = triton.cdiv(triton.cdiv(tokens, SPLITS), BLOCK_T) * BLOCK_T
        block_r = max(16, triton.next_power_of_2(rank))  # tl.dot takes 16 rows at least
        block_f = BLOCK_F if block_r <= 64 else BLOCK_F // 2  # the accumulator stays in registers (8 warps too)
        grid = (triton.cdiv(features, block_f), SPLITS)
        wrap_triton(_kernel)[grid](gate_up2, grad_h2, grad_low2, grad_gate_up, partial_a, tokens, features, rank,
                                   gate_up2.stride(0), grad_h2.stride(0), grad_low2.stride(0), grad_gate_up.stride(0),
                                   tokens_per_split, GELU=act == "gelu_tanh", BLOCK_T=BLOCK_T, BLOCK_F=block_f,
                                   BLOCK_R=block_r, num_warps=NUM_WARPS if block_r <= 64 else 8,
                                   num_stages=NUM_STAGES)
        return grad_gate_up.reshape(gate_up.shape), partial_a.sum(0)
