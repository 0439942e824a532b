"""Block-wise dynamic 8-bit quantization of optimizer state, bit-compatible with bitsandbytes.

The maps are the 256-entry "dynamic" data types of Dettmers et al. (signed for the first moment,
unsigned for the second). Their values are computed exactly as `bitsandbytes.functional.
create_dynamic_map` computes them, so a bitsandbytes state converts without loss.
Quantization picks the nearest map entry: the code is the number of midpoints between consecutive
entries that lie below the value (`searchsorted` over the 255 midpoints).
"""

from __future__ import annotations

import functools

import torch

BLOCK_SIZE = 256
MIN_8BIT_SIZE = 4096  # tensors with fewer elements keep fp32 state, as in bitsandbytes
SIGNED_ZERO_CODE = 127  # index of 0.0 in the signed map
UNSIGNED_ZERO_CODE = 0


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The sorted 256-entry dynamic map; same float32 values as bitsandbytes' create_dynamic_map."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        shift = i + non_sign_bits - max_exponent_bits + (0 if signed else 1)
        fraction_items = int(2**shift + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data += [0] * (2**total_bits - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _cpu_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    qmap = create_dynamic_map(signed=signed)
    midpoints = (qmap[:-1] + qmap[1:]) * 0.5
    return qmap, midpoints


_device_tables: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def quant_tables(signed: bool, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(map, midpoints) on `device`, cached; the midpoints are the 255 decision thresholds."""
    device = torch.device(device)
    key = (signed, device)
    if key not in _device_tables:
        qmap, midpoints = _cpu_tables(signed)
        _device_tables[key] = (qmap.to(device), midpoints.to(device))
    return _device_tables[key]


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCK_SIZE)


def _pad_to_blocks(flat: torch.Tensor) -> torch.Tensor:
    pad = num_blocks(flat.numel()) * BLOCK_SIZE - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)) if pad else flat


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of uint8 `codes` (any shape) with one absmax per 256-block of the flattened tensor."""
    qmap, _ = quant_tables(signed, codes.device)
    values = _pad_to_blocks(qmap[codes.reshape(-1).long()]).view(-1, BLOCK_SIZE) * absmax.view(-1, 1)
    return values.reshape(-1)[: codes.numel()].view(codes.shape)


def quantize_blockwise(values: torch.Tensor, codes_out: torch.Tensor, absmax_out: torch.Tensor, signed: bool) -> None:
    """Quantize fp32 `values` into `codes_out` (uint8, same shape) and `absmax_out` (one per block), in place."""
    _, midpoints = quant_tables(signed, values.device)
    blocks = _pad_to_blocks(values.reshape(-1).float()).view(-1, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=1)
    # an all-zero block has absmax 0; dividing by 1 keeps its values (all 0) finite
    scaled = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(1)
    codes = torch.searchsorted(midpoints, scaled.reshape(-1).contiguous())
    codes_out.view(-1).copy_(codes[: codes_out.numel()])
    absmax_out.copy_(absmax)
