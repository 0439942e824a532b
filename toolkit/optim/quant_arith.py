"""The dynamic maps as piecewise-affine functions, so GPU kernels can (de)quantize without table lookups.

Each map is 7 decades of entries at the middles of equal bins spanning [0.1, 1] * 10**(d - 6), plus 0 and
1.0 (bitsandbytes' create_dynamic_map). So within a decade the nearest entry is a floor of an affine
function of the value, and the entry of a code is an affine function of the code times a power of 5.

Quantizing finds the decade by comparing with the thresholds between decades: the map's own fp32
midpoints there. Inside a decade the affine form agrees with the map's fp32 midpoints to 2e-5 of a code,
so a value within a few ulps of a midpoint may take the neighbouring code (about 1e-5 of random values).
With exact_ties, a value whose position lands within NEAR_BOUNDARY of a code boundary is compared with
the midpoint itself (a table load the kernels make only in the programs that need one): then quantizing
gives searchsorted's code, ties included (ratios of bf16 gradients sit exactly on midpoints often), except
for a negative value exactly on one of the 6 thresholds between decades. Dequantizing lands within 3 ulps
of the map's entries.

The pure-torch functions here follow the kernels' arithmetic step for step, so CPU tests check the
kernels' formulas against `quant.quantize_blockwise` and the map without a GPU.
"""

from __future__ import annotations

import functools
import math

import torch

from toolkit.optim.quant import create_dynamic_map, quant_tables

DECADES = 7
LOG2_5 = math.log2(5.0)
# |position - nearest integer| under which quantizing asks the midpoint table; the affine form's own
# error at a midpoint is under 2e-5 (tests/test_optim_quant_arith.py checks every one)
NEAR_BOUNDARY = 6e-5


def _decade_layout(signed: bool, d: int) -> tuple[int, int]:
    """(first code, number of codes) of the positive entries of decade d (0: 1e-6 .. 6: 1)."""
    if signed:
        return 127 + (1 << d), 1 << d
    return (2 << d) - 1, 2 << d


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


@functools.lru_cache(maxsize=None)
def quantize_steps(signed: bool) -> tuple[float, ...]:
    """Flat (a0, c0, t1, a1, c1, ..., t6, a6, c6, t_top): the code of |x| <= 1 is floor(min(|x| * a + c,
    clamp(c))) with (a, c) from the last decade whose threshold t |x| passes, or 255 past t_top."""
    qmap = create_dynamic_map(signed)
    mid = ((qmap[:-1] + qmap[1:]) * 0.5).tolist()
    steps: list[float] = []
    for d in range(DECADES):
        first, count = _decade_layout(signed, d)
        scale = 10.0 ** (d - 6)
        if d == 0:
            # decade 0 also covers the zero code below its first threshold: a line through
            # (threshold, first code) whose clamp (below) still lands on the decade's last code
            t_zero = mid[first - 1]
            c = 127.8 if signed else 1.0 - t_zero / (mid[first] - t_zero)
            steps += [_f32((first - c) / t_zero), _f32(c)]
            continue
        # code = first + k for x in [0.1 + k * w, 0.1 + (k + 1) * w) * scale, w = 0.9 / count
        steps += [mid[first - 1], _f32(count / (0.9 * scale)), _f32(first - count / 9.0)]
    return tuple(steps + [mid[254]])


def clamp_line(signed: bool) -> tuple[float, float]:
    """(slope, offset): clamp(c) = c * slope + offset lies in [last, last + 1) of the decade of offset c.

    A value past a decade's top (up to the threshold of the next) keeps the decade's last code; the last
    code is a linear function of the step's offset c, so no second table is needed."""
    # signed: c = 127 + 8/9 * 2**d, last = 126 + 2**(d+1); unsigned: c = 8/9 * 2**(d+1) - 1, last = 2**(d+2) - 2
    return (2.25, 126.5 - 2.25 * 127) if signed else (2.25, 2.25 - 1.5)


def dequant_constants(signed: bool) -> tuple[float, float, float, float]:
    """(p, q, r, x0): entry = 5**d * (k * p + j0 * q + r), 5**d = round(2**(bits(j0) * x1 + x0)).

    j = |code - 127| (signed) or code + 1 (unsigned); j0 = 2**floor(log2(j)) is the j of the decade's first
    code, k = j - j0. d comes from j0's exponent bits read as an integer: bits(j0) = (127 + log2 j0) << 23."""
    bias = 127 if signed else 128  # unsigned decades span j0 = 2**(d + 1)
    p, q = (0.9e-6, 1e-7) if signed else (0.45e-6, 0.5e-7)
    return _f32(p), _f32(q), _f32(p * 0.5), -bias * LOG2_5


POW5_SLOPE = LOG2_5 / 2**23  # x1 above: log2(5) per unit of the exponent field


def _fma(x: torch.Tensor, a, c) -> torch.Tensor:
    """fp32 fused multiply-add (through float64: the product of two floats is exact there)."""
    return (x.double() * torch.as_tensor(a).double() + torch.as_tensor(c).double()).float()


def code_position(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """The affine form's position: its floor is the code, an integer is a code boundary (a midpoint)."""
    steps = quantize_steps(signed)
    ax = x.float().abs()
    a = torch.full_like(ax, steps[0])
    c = torch.full_like(ax, steps[1])
    for i in range(2, len(steps) - 1, 3):
        hit = ax > steps[i]
        a = torch.where(hit, steps[i + 1], a)
        c = torch.where(hit, steps[i + 2], c)
    slope, offset = clamp_line(signed)
    z = torch.minimum(_fma(ax, a, c), _fma(c, slope, offset))
    z = torch.where(x > steps[-1], 255.5, z)
    if signed:
        # a negative x takes the mirror of |x|'s code, 254 - floor(z) = floor(255 - z) (z is not an
        # integer there); a -1.0 clamps to decade 6's 254.5 and lands on code 0
        z = torch.where(x < 0, 255.0 - z, z)
    return z


def quantize_arith(x: torch.Tensor, signed: bool, exact_ties: bool = True) -> torch.Tensor:
    """Codes of fp32 values in [-1, 1] (unsigned: [0, 1]) by the kernels' arithmetic; int64."""
    z = code_position(x, signed)
    code = z.long()  # z >= 0: truncation is floor
    if not exact_ties:
        return code
    nearest = (z + 0.5).long()
    near = (z - nearest).abs() < NEAR_BOUNDARY
    _, mid = quant_tables(signed)
    below = (nearest - 1).clamp(0, 254)  # the boundary between codes below and below + 1 is mid[below]
    return torch.where(near, below + (mid[below] < x).long(), code)


def dequantize_arith(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 map entries of integer codes by the kernels' arithmetic."""
    p, q, r, x0 = dequant_constants(signed)
    j = (codes.long() - 127).float() if signed else (codes.long() + 1).float()
    j0_bits = j.view(torch.int32) & 0x7F800000
    j0 = j0_bits.view(torch.float32)  # 0 for j = 0
    # 2**(...) underflows to 0 for j = 0; rounds 0.2 to 0 for unsigned j = 1: both are code 0.0
    pow5 = torch.floor(torch.exp2(_fma(j0_bits.float(), POW5_SLOPE, x0)) + 0.5)
    value = torch.minimum(pow5 * _fma(j.abs() - j0, p, _fma(j0, q, r)), torch.tensor(1.0))  # code 255: 1.0
    return torch.where(codes.long() < 127, -value, value) if signed else value
