"""Frozen linear layers stored in 8-bit floats (model.quantize: fp8), with 8-bit matmuls where the device has them.

Each weight row is scaled so that its largest magnitude is the format's largest value, and stored as e4m3
(1 byte a weight, plus one fp32 scale a row): half the memory of bf16, the quality of musubi-tuner's
`--fp8_scaled` (per-row scales instead of per-block ones). Unlike the peers, which upcast the weight and run the
matmul in bf16, the matmuls themselves run in fp8 where the device has fp8 tensor cores (NVIDIA sm_89 and newer,
AMD gfx942/gfx950): torch._scaled_mm with one scale per row of the input and one per column of the weight.

    forward   y  = (x / sx) @ (W / sw)^T * sx * sw         x quantized row by row, on the fly
    backward  gx = ((gy * sw) / sg) @ (W / sw) * sg         the weight's row scale folded into gy first, so
                                                            the same fp8 weight serves both products
Only the input's gradient is computed (the base is frozen), and nothing but the fp8 weight is kept for it. On
other devices (A100, RDNA3, the Strix Halo APU) the weight is stored the same way and upcast to the compute
dtype for a bf16 matmul, in forward and again in backward, so no 16-bit copy outlives its matmul.
"""

from __future__ import annotations

import functools

import torch

from toolkit.device.detect import DeviceInfo

FP8_MATMUL_HIP = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}  # MI300 uses the fnuz variant


def fp8_format(device: DeviceInfo) -> torch.dtype:
    """The e4m3 variant the device's fp8 matmuls take (the storage format follows it)."""
    return FP8_MATMUL_HIP.get(device.arch, torch.float8_e4m3fn) if device.backend == "hip" else torch.float8_e4m3fn


def fp8_matmul_supported(device: DeviceInfo) -> bool:
    """Whether torch._scaled_mm with row scales runs on this device: NVIDIA Ada/Hopper/Blackwell and MI300/MI350
    by architecture, confirmed by one tiny call where a GPU is present (a PyTorch or hipBLASLt build without row
    scales then takes the upcast path instead of failing at the first step); the CPU where this PyTorch has them
    (2.13 does, 2.11 takes one scale a tensor only): a reference kernel, which lets the CPU tests check the GPU
    path's arithmetic."""
    if device.backend == "cuda":
        digits = device.arch.removeprefix("sm_").rstrip("a")
        by_arch = digits.isdigit() and int(digits) >= 89
    elif device.backend == "hip":
        by_arch = device.arch in FP8_MATMUL_HIP
    else:
        return _has_row_scales("cpu", torch.float8_e4m3fn)
    return by_arch and (not torch.cuda.is_available() or _has_row_scales("cuda", fp8_format(device)))


@functools.cache
def _has_row_scales(kind: str, fmt: torch.dtype) -> bool:
    q = torch.zeros(16, 16, dtype=fmt, device=kind)
    ones = torch.ones(16, 1, device=kind)
    try:
        torch._scaled_mm(q, q.t(), scale_a=ones, scale_b=ones.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _quantize_rows(t: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` (rows x columns) as fp8 with one fp32 scale a row: t ~= q * scale."""
    top = torch.finfo(fmt).max
    t = t.float()
    scale = (t.abs().amax(dim=1, keepdim=True) / top).clamp(min=torch.finfo(torch.float32).tiny)
    # contiguous: cuBLASLt takes the first operand row-major only (a transposed input reshapes to a column-major view)
    return (t / scale).clamp(-top, top).to(fmt).contiguous(), scale


def _dequantized(bits: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype`, scaled in fp32 first (an fp16 scale of a small row would be subnormal)."""
    return (bits.view(fmt).float() * scale.view(torch.float32)[:, None]).to(dtype)


class _Float8Matmul(torch.autograd.Function):
    """x @ W^T for a frozen fp8 W (stored as uint8 bits) with row scales `scale` (fp32 stored as int32 bits);
    gradient for x only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype, scaled: bool):
        ctx.save_for_backward(bits, scale)
        ctx.fmt, ctx.scaled = fmt, scaled
        weight, rows = bits.view(fmt), x.reshape(-1, x.shape[-1])
        if scaled:
            q, row_scale = _quantize_rows(rows, fmt)
            out = torch._scaled_mm(q, weight.t(), scale_a=row_scale, scale_b=scale.view(torch.float32).view(1, -1),
                                   out_dtype=x.dtype)
        else:
            out = rows @ _dequantized(bits, scale, fmt, x.dtype).t()
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        bits, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        weight, rows = bits.view(ctx.fmt), grad.reshape(-1, grad.shape[-1])
        if ctx.scaled:
            q, row_scale = _quantize_rows(rows.float() * scale.view(torch.float32)[None, :], ctx.fmt)
            columns = torch.ones(1, weight.shape[1], dtype=torch.float32, device=grad.device)
            # _scaled_mm takes its second operand column-major: W (out x in) laid out as its transpose
            out = torch._scaled_mm(q, weight.t().contiguous().t(), scale_a=row_scale, scale_b=columns,
                                   out_dtype=grad.dtype)
        else:
            out = rows @ _dequantized(bits, scale, ctx.fmt, grad.dtype)
        return out.view(*grad.shape[:-1], out.shape[-1]), None, None, None, None


class Float8Linear(torch.nn.Linear):
    """A frozen nn.Linear with its weight in fp8 and one fp32 scale per output row, both stored as integer bits
    (uint8, int32), so that a whole-model `.to(dtype)` leaves them alone. A subclass of nn.Linear, so PEFT wraps it with its LoRA Linear as it would
    the original; `compute_dtype` tells PEFT the dtype of the LoRA weights, as for bitsandbytes layers."""

    def __init__(self, linear: torch.nn.Linear, fmt: torch.dtype, matmul: bool, compute_dtype: torch.dtype,
                 device: torch.device | None = None):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = _quantize_rows(linear.weight.detach().to(device), fmt)
        self.weight = torch.nn.Parameter(q.view(torch.uint8), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale.view(-1).view(torch.int32), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(device), requires_grad=False)
        self.fmt, self.compute_dtype = fmt, compute_dtype
        # _scaled_mm needs both matrix sides in multiples of 16; other shapes upcast instead
        self.matmul = matmul and self.in_features % 16 == 0 and self.out_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        # the fp8 kernels write bf16; other compute dtypes take the upcast path
        out = _Float8Matmul.apply(x.to(dtype), self.weight, self.weight_scale, self.fmt,
                                  self.matmul and dtype == torch.bfloat16)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight as the compute dtype sees it (for tests and merges)."""
        return _dequantized(self.weight, self.weight_scale, self.fmt, self.compute_dtype)

    @property
    def scale(self) -> torch.Tensor:
        """The fp32 row scales."""
        return self.weight_scale.view(torch.float32)

    def extra_repr(self) -> str:
        how = "fp8 matmul" if self.matmul else "upcast to " + str(self.compute_dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}, {how}"


def float8_linear(linear: torch.nn.Linear, device: torch.device, info: DeviceInfo,
                  compute_dtype: torch.dtype) -> Float8Linear:
    """`linear` quantized on `device`: its 16-bit weight goes there as a temporary copy, one layer at a time,
    and `linear` itself stays where it is (the caller may hold every original layer until all are replaced)."""
    return Float8Linear(linear, fp8_format(info), fp8_matmul_supported(info), compute_dtype, device)
