"""Quantization maps and block-wise (de)quantization of the 8-bit optimizer state."""

import pytest
import torch

from toolkit.optim.quant import create_dynamic_map, dequantize_blockwise, quant_tables, quantize_blockwise


@pytest.mark.parametrize("signed", [True, False])
def test_maps_equal_bitsandbytes(signed):
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    assert torch.equal(create_dynamic_map(signed=signed), bnb_functional.create_dynamic_map(signed=signed))


def test_map_structure():
    signed, unsigned = create_dynamic_map(True), create_dynamic_map(False)
    assert signed.numel() == unsigned.numel() == 256
    assert signed.unique().numel() == 256 and unsigned.unique().numel() == 256
    assert signed[127] == 0.0 and unsigned[0] == 0.0 and signed[255] == unsigned[255] == 1.0
    assert torch.equal(signed[:127], -signed[128:255].flip(0))  # symmetric apart from +1.0


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_picks_nearest_entry(signed):
    torch.manual_seed(0)
    qmap, _ = quant_tables(signed)
    values = torch.randn(3000) * torch.exp(torch.empty(3000).uniform_(-12, 0))
    values = values if signed else values.abs()
    codes = torch.empty(3000, dtype=torch.uint8)
    absmax = torch.empty(12)
    quantize_blockwise(values, codes, absmax, signed=signed)
    blocks = torch.nn.functional.pad(values, (0, 12 * 256 - 3000)).view(12, 256)
    assert torch.equal(absmax, blocks.abs().amax(1))
    scaled = (blocks / absmax[:, None]).reshape(-1)[:3000]
    chosen_error = (qmap[codes.long()] - scaled).abs()
    best_error = (qmap[None, :] - scaled[:, None]).abs().min(1).values
    assert torch.equal(chosen_error, best_error)
    restored = dequantize_blockwise(codes, absmax, signed=signed)
    assert torch.equal(restored, qmap[codes.long()] * absmax.repeat_interleave(256)[:3000])


def test_all_zero_block_stays_zero():
    codes = torch.empty(512, dtype=torch.uint8)
    absmax = torch.empty(2)
    values = torch.cat([torch.zeros(256), torch.full((256,), 0.5)])  # +1.0 is in the map, -1.0 is not
    quantize_blockwise(values, codes, absmax, signed=True)
    assert absmax.tolist() == [0.0, 0.5]
    assert torch.equal(dequantize_blockwise(codes, absmax, signed=True), values)
