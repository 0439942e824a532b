"""The GPU kernels' arithmetic (de)quantization, emulated in torch, against the map and searchsorted."""

import pytest
import torch

from toolkit.optim.quant import quant_tables
from toolkit.optim.quant_arith import NEAR_BOUNDARY, code_position, dequantize_arith, quantize_arith, quantize_steps


def _decade_thresholds(signed: bool) -> torch.Tensor:
    steps = quantize_steps(signed)
    return torch.tensor([steps[i] for i in range(2, len(steps) - 1, 3)] + [steps[-1]])


def _near_midpoints(mid: torch.Tensor, ulps: int) -> torch.Tensor:
    """Values 1..ulps ulps either side of every midpoint."""
    out, up, down = [], mid.clone(), mid.clone()
    for _ in range(ulps):
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
        out += [up, down]
    return torch.cat(out)


@pytest.mark.parametrize("signed", [True, False])
def test_dequantize_arith_is_within_three_ulps_of_the_map(signed):
    qmap, _ = quant_tables(signed)
    values = dequantize_arith(torch.arange(256), signed)
    ulp = torch.nextafter(qmap.abs(), torch.tensor(2.0)) - qmap.abs()
    assert ((values - qmap).abs() <= 3 * ulp).all()
    assert values[127 if signed else 0].item() == 0.0 and values[255].item() == 1.0


@pytest.mark.parametrize("signed", [True, False])
def test_affine_position_is_near_every_midpoint_it_decides(signed):
    """Inside a decade the position lands within NEAR_BOUNDARY / 3 of the boundary's integer at its midpoint,
    so the table check catches every value the affine form could put on the wrong side."""
    _, mid = quant_tables(signed)
    inner = ~torch.isin(mid.abs(), _decade_thresholds(signed))
    error = (code_position(mid, signed) - torch.arange(1, 256))[inner].abs()
    assert error.max() < NEAR_BOUNDARY / 3


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_arith_equals_searchsorted(signed):
    qmap, mid = quant_tables(signed)
    assert torch.equal(quantize_arith(qmap, signed), torch.arange(256))  # entries round-trip
    gen = torch.Generator().manual_seed(0)
    x = 10 ** (torch.rand(1_000_000, generator=gen) * 8 - 8)  # every decade, and below the smallest entry
    ties = mid.clone()  # ties take the code below, as searchsorted does
    if signed:
        x = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -x, x)
        # a negative value exactly on a threshold between decades is the one known exception
        ties = torch.cat([mid, -mid])
        ties = ties[(ties > 0) | ~torch.isin(ties.abs(), _decade_thresholds(signed))]
    x = torch.cat([x, ties, _near_midpoints(mid, 4), torch.tensor([0.0, 1.0, -1.0, 0.99999994, -0.99999994])])
    x = x.clamp(-1 if signed else 0, 1)
    assert torch.equal(quantize_arith(x, signed), torch.searchsorted(mid, x))


def test_quantize_arith_on_bf16_ratios():
    """A first step from zero moments quantizes g / max|g| of bf16 gradients: exact ties at decimal midpoints."""
    g = (torch.randn(1 << 18, generator=torch.Generator().manual_seed(1)) * 0.01).bfloat16().float()
    for x, signed in ((0.1 * g, True), (0.001 * g * g, False)):
        blocks = x.view(-1, 256)
        scaled = (blocks / blocks.abs().amax(1, keepdim=True)).reshape(-1)
        assert torch.equal(quantize_arith(scaled, signed), torch.searchsorted(quant_tables(signed)[1], scaled))


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_arith_without_tie_checks_differs_by_one_code_rarely(signed):
    _, mid = quant_tables(signed)
    gen = torch.Generator().manual_seed(2)
    x = 10 ** (torch.rand(1_000_000, generator=gen) * 7 - 7)
    if signed:
        x = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -x, x)
    diff = quantize_arith(x, signed, exact_ties=False) - torch.searchsorted(mid, x)
    assert diff.abs().max() <= 1 and (diff != 0).sum() <= 50  # 1e-5 expected; the GPU test allows 5e-4
    near = _near_midpoints(mid, 8).clamp(-1 if signed else 0, 1)
    assert (quantize_arith(near, signed, exact_ties=False) - torch.searchsorted(mid, near)).abs().max() <= 1
