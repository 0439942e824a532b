"""AdamW8bit / Lion8bit (pure-torch implementation) against fp32 references, in the style of bitsandbytes' tests."""

import io

import pytest
import torch

from helpers import optim_grads, optim_params
from toolkit.optim import AdamW8bit, Lion, Lion8bit
from toolkit.optim.quant import dequantize_blockwise

def _assert_most_close(actual, expected, atol, rtol, max_errors):
    bad = ~torch.isclose(actual, expected, atol=atol, rtol=rtol)
    assert bad.sum().item() <= max_errors, f"{bad.sum().item()} elements differ beyond atol={atol}, rtol={rtol}"


# bf16 params drift from the fp32 run by their own rounding, so (as bitsandbytes' tests do) they resync every step
@pytest.mark.parametrize("dtype,mean_error,resync", [(torch.float32, 6e-5, 10), (torch.bfloat16, 1.7e-4, 1)])
def test_adamw8bit_tracks_fp32_adamw(dtype, mean_error, resync):
    ours_params = optim_params(dtype)
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in ours_params]
    ours = AdamW8bit(ours_params, lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.01)
    for step, grads in enumerate(optim_grads(60, dtype), start=1):
        for p, r, g in zip(ours_params, ref_params, grads):
            p.grad, r.grad = g, g.float()
        ours.step()
        ref.step()
        for p, r in zip(ours_params, ref_params):
            s, rs = ours.state[p], ref.state[r]
            assert s["step"] == step
            if p.numel() < 4096:
                assert s["state1"].dtype == torch.float32 and "absmax1" not in s
                torch.testing.assert_close(s["state1"], rs["exp_avg"], atol=1e-6, rtol=1e-5)
                continue
            assert s["state1"].dtype == s["state2"].dtype == torch.uint8
            m = dequantize_blockwise(s["state1"], s["absmax1"], signed=True)
            v = dequantize_blockwise(s["state2"], s["absmax2"], signed=False)
            _assert_most_close(m, rs["exp_avg"], atol=3e-3, rtol=1e-3, max_errors=10)
            _assert_most_close(v, rs["exp_avg_sq"], atol=3e-3, rtol=1e-3, max_errors=10)
            assert (p.float() - r).abs().mean().item() <= mean_error
            # as bitsandbytes' tests do: continue the fp32 run from the 8-bit state so errors do not compound
            rs["exp_avg"].copy_(m)
            rs["exp_avg_sq"].copy_(v)
        if step % resync == 0:
            for p, r in zip(ours_params, ref_params):
                r.data.copy_(p.float())


@pytest.mark.parametrize("cls", [AdamW8bit, Lion8bit])
def test_state_dict_round_trip_is_bit_identical(cls):
    grads = optim_grads(20, torch.float32)
    straight_params = optim_params(torch.float32)
    straight = cls(straight_params, lr=1e-3, weight_decay=0.01)
    for g in grads:
        for p, gi in zip(straight_params, g):
            p.grad = gi
        straight.step()

    first_params = optim_params(torch.float32)
    first = cls(first_params, lr=1e-3, weight_decay=0.01)
    for g in grads[:10]:
        for p, gi in zip(first_params, g):
            p.grad = gi
        first.step()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain tensors and numbers only
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = cls(resumed_params, lr=1e-3, weight_decay=0.01)
    resumed.load_state_dict(saved)
    for g in grads[10:]:
        for p, gi in zip(resumed_params, g):
            p.grad = gi
        resumed.step()

    for a, b in zip(straight_params, resumed_params):
        assert torch.equal(a, b)
        sa, sb = straight.state[a], resumed.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]) if torch.is_tensor(sa[key]) else sa[key] == sb[key], key


def test_bf16_params_keep_uint8_and_fp32_state_after_load():
    params = optim_params(torch.bfloat16)
    opt = AdamW8bit(params)
    for p, g in zip(params, optim_grads(1, torch.bfloat16)[0]):
        p.grad = g
    opt.step()
    fresh = AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params])
    fresh.load_state_dict(opt.state_dict())
    states = list(fresh.state.values())
    assert [s["state1"].dtype for s in states] == [torch.uint8, torch.uint8, torch.float32]
    assert states[0]["absmax1"].dtype == torch.float32


def test_state_bytes_per_parameter():
    p = torch.nn.Parameter(torch.randn(256, 1024))
    opt = AdamW8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[p]
    state_bytes = sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")
    assert state_bytes / p.numel() == pytest.approx(2 + 8 / 256)  # 2.03
    assert state["step"].dtype == torch.int64 and state["step"].shape == ()  # one count per tensor, on its device


def test_param_groups_use_their_own_lr_and_weight_decay():
    a, b = (torch.nn.Parameter(torch.ones(64, 128)) for _ in range(2))
    opt = AdamW8bit([{"params": [a], "lr": 0.1, "weight_decay": 0.0}, {"params": [b], "lr": 0.01, "weight_decay": 0.5}])
    a.grad = torch.ones_like(a)
    b.grad = torch.ones_like(b)
    opt.step()
    # step 1 of Adam moves by lr * sign(g) (up to eps); decay multiplies first by (1 - lr * wd)
    torch.testing.assert_close(a, torch.full_like(a, 1 - 0.1), atol=1e-6, rtol=0)
    torch.testing.assert_close(b, torch.full_like(b, (1 - 0.01 * 0.5) - 0.01), atol=1e-6, rtol=0)


def test_params_without_grad_are_skipped():
    with_grad, without_grad = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(64, 128))
    before = without_grad.detach().clone()
    opt = AdamW8bit([with_grad, without_grad], weight_decay=0.1)
    with_grad.grad = torch.randn_like(with_grad)
    opt.step()
    assert torch.equal(without_grad, before)
    assert without_grad not in opt.state
    assert opt.state[with_grad]["step"] == 1


def test_lion8bit_tracks_fp32_lion():
    ours_params = optim_params(torch.float32)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    ours = Lion8bit(ours_params, lr=1e-4, weight_decay=0.1)
    ref = Lion(ref_params, lr=1e-4, weight_decay=0.1)
    for step, grads in enumerate(optim_grads(60, torch.float32), start=1):
        for p, r, g in zip(ours_params, ref_params, grads):
            p.grad, r.grad = g, g.clone()
        ours.step()
        ref.step()
        for p, r in zip(ours_params, ref_params):
            s, momentum = ours.state[p], ref.state[r]["exp_avg"]
            if p.numel() < 4096:
                assert torch.equal(s["state1"], momentum) and torch.equal(p, r)
                continue
            m = dequantize_blockwise(s["state1"], s["absmax1"], signed=True)
            _assert_most_close(m, momentum, atol=3e-3, rtol=1e-3, max_errors=10)
            # a sign update flips only where the momentum is within quantization error of 0
            assert (p - r).abs().mean().item() <= 1e-4 * 0.01 * step
            momentum.copy_(m)
        if step % 10 == 0:
            for p, r in zip(ours_params, ref_params):
                r.data.copy_(p)


def test_lion8bit_step_matches_the_lion_rule():
    p = torch.nn.Parameter(torch.zeros(64, 128))
    opt = Lion8bit([p], lr=0.5, betas=(0.9, 0.99), weight_decay=0.0)
    p.grad = torch.randn_like(p)
    opt.step()
    assert torch.equal(p, -0.5 * torch.sign(p.grad))  # zero momentum: the first step is -lr * sign(g)
    m = dequantize_blockwise(opt.state[p]["state1"], opt.state[p]["absmax1"], signed=True)
    torch.testing.assert_close(m, 0.01 * p.grad, atol=0.01 * p.grad.abs().max() * 0.01, rtol=0)
