"""The fused Triton kernels against the pure-torch reference, on a GPU (CUDA or ROCm)."""

import pytest
import torch

from helpers import assert_optim_unchanged, optim_params, optim_snapshot
from toolkit.optim import AdamW8bit, Lion8bit, build_optimizer
from toolkit.optim.quant import dequantize_blockwise

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")]

SHAPES = [(256, 1024), (4099,), (33, 257), (32, 16)]  # several 8-bit tensors, partial blocks, one fp32-state
QUANT_CONFIGS = [{"blocks": 8, "num_warps": 8, "quant_search": 0, "dequant": 0},  # exact search, table lookups
                 {"blocks": 2, "num_warps": 2, "quant_search": 1, "dequant": 0},
                 None]  # None: the defaults (affine quantize and dequantize)


def _params(dtype):
    return optim_params(dtype, SHAPES, device="cuda")


def _copy_state(src_opt, src_params, dst_opt, dst_params):
    for a, b in zip(src_params, dst_params):
        b.data.copy_(a.data)
        for key, value in src_opt.state[a].items():
            dst_opt.state[b][key] = value.clone() if torch.is_tensor(value) else value


@pytest.mark.parametrize("config", QUANT_CONFIGS, ids=["binary-search", "affine-table", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", [AdamW8bit, Lion8bit])
def test_triton_step_matches_reference(cls, dtype, config, monkeypatch):
    from toolkit.optim import triton_kernels

    monkeypatch.setattr(triton_kernels, "CONFIG_OVERRIDE", config)
    ref_params, tri_params = _params(dtype), _params(dtype)
    lr = 1e-3 if cls is AdamW8bit else 1e-4
    ref = cls(ref_params, lr=lr, weight_decay=0.05, impl="torch")
    tri = cls(tri_params, lr=lr, weight_decay=0.05, impl="triton")
    gen = torch.Generator().manual_seed(1)
    moments = 2 if cls is AdamW8bit else 1
    for step in range(12):
        for a, b in zip(ref_params, tri_params):
            g = (torch.randn(a.shape, generator=gen) * 0.01).to(dtype).cuda()
            a.grad, b.grad = g, g.clone()
        ref.step()
        tri.step()
        for a, b in zip(ref_params, tri_params):
            sa, sb = ref.state[a], tri.state[b]
            assert sa["step"] == sb["step"] == step + 1
            for i in range(1, moments + 1):
                if sa["state1"].dtype == torch.float32:
                    torch.testing.assert_close(sb[f"state{i}"], sa[f"state{i}"], atol=1e-7, rtol=1e-5)
                    continue
                torch.testing.assert_close(sb[f"absmax{i}"], sa[f"absmax{i}"], atol=0, rtol=1e-5)
                code_diff = (sa[f"state{i}"].int() - sb[f"state{i}"].int()).abs()
                # rounding (FMA, division) differs from torch's: a value within ulps of a midpoint may go either way
                allowed = max(8, a.numel() // 2000)
                assert code_diff.max().item() <= 1 and code_diff.sum().item() <= allowed, f"state{i}: {code_diff.sum()}"
            error = (a.float() - b.float()).abs()
            if cls is Lion8bit:  # sign(u) may differ where u is within rounding of 0
                assert (error > 1e-6).sum().item() <= 4
            elif dtype == torch.float32:
                assert error.max().item() <= 1e-6
            else:  # one rounding step of the 16-bit param, rarely
                ulp = a.float().abs() * (2**-7 if dtype == torch.bfloat16 else 2**-10)
                ulp = ulp.clamp_min(2**-24)  # fp16 subnormals have a fixed step
                assert (error > ulp).sum().item() == 0 and (error > 0).float().mean().item() < 1e-3
        _copy_state(ref, ref_params, tri, tri_params)  # each step compares one kernel call from identical inputs


def test_triton_free_run_tracks_fp32_adamw():
    params = _params(torch.float32)
    fp32 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = AdamW8bit(params, lr=1e-3, weight_decay=0.01, impl="triton")
    ref = torch.optim.AdamW(fp32, lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        for p, r in zip(params, fp32):
            p.grad = (torch.randn(p.shape, generator=gen) * 0.01).cuda()
            r.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, r in zip(params, fp32):
        assert (p - r).abs().mean().item() <= 6e-5
        if p.numel() >= 4096:
            m = dequantize_blockwise(ours.state[p]["state1"], ours.state[p]["absmax1"], signed=True)
            bad = ~torch.isclose(m, ref.state[r]["exp_avg"], atol=3e-3, rtol=1e-3)
            assert bad.sum().item() <= 10


def test_triton_resume_is_bit_identical_and_step_never_syncs():
    grads = [[(torch.randn(s, device="cuda") * 0.01).bfloat16() for s in SHAPES] for _ in range(6)]

    def run(params, opt, steps):
        for g in steps:
            for p, gi in zip(params, g):
                p.grad = gi
            opt.step()

    straight_params = _params(torch.bfloat16)
    straight = AdamW8bit(straight_params, impl="triton")
    # two steps first: the first step's kernel (new states) and the later steps' are compiled outside the watch,
    # since Triton's compilation synchronizes
    run(straight_params, straight, grads[:2])
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside step() raises
    try:
        run(straight_params, straight, grads[2:])
    finally:
        torch.cuda.set_sync_debug_mode("default")

    first_params = _params(torch.bfloat16)
    first = AdamW8bit(first_params, impl="triton")
    run(first_params, first, grads[:3])
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = AdamW8bit(resumed_params, impl="triton")
    resumed.load_state_dict(first.state_dict())
    run(resumed_params, resumed, grads[3:])
    for a, b in zip(straight_params, resumed_params):
        assert torch.equal(a, b)
        for key, value in straight.state[a].items():
            assert torch.equal(value, resumed.state[b][key]) if torch.is_tensor(value) else value == resumed.state[b][key]


def test_build_optimizer_on_cuda_reports_its_choice():
    opt, reason = build_optimizer("adamw8bit", _params(torch.float32), lr=1e-3, device_type="cuda")
    assert type(opt) is AdamW8bit and reason.startswith("adamw8bit: toolkit (Triton kernels) — CUDA device"), reason
    opt, reason = build_optimizer("adamw8bit", _params(torch.float32), lr=1e-3, device_type="hip")
    assert type(opt) is AdamW8bit and reason.startswith("adamw8bit: toolkit (Triton kernels) — HIP device")
    opt, reason = build_optimizer("adamw", _params(torch.float32), lr=1e-3, device_type="cuda")
    assert opt.param_groups[0]["fused"] is True
    print(reason)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [AdamW8bit, Lion8bit])
def test_triton_found_inf_skips_on_the_device_like_the_reference(cls, dtype):
    """found_inf (0, or 1 with NaN gradients at the fourth of six steps) on both implementations, as the trainer
    sets it: the skipped step leaves params, moments, absmax and step count exactly as they were; the Triton run
    equals, bit for bit, the Triton run that never called step() for it, and tracks the reference; steps after the
    first two (which compile) never wait for the GPU; a skipped first step leaves a fresh state."""
    lr = 1e-3 if cls is AdamW8bit else 1e-4
    gen = torch.Generator().manual_seed(3)
    grads = [[(torch.randn(s, generator=gen) * 0.01).to(dtype).cuda() for s in SHAPES] for _ in range(6)]
    skipped = 3

    def run(impl, with_found_inf=True, steps=range(6)):
        params = _params(dtype)
        opt = cls(params, lr=lr, weight_decay=0.05, impl=impl)
        for i in steps:
            skip = i == skipped and with_found_inf
            for p, g in zip(params, grads[i]):
                p.grad = torch.full_like(g, float("nan")) if skip else g.clone()
            if with_found_inf:
                opt.found_inf = torch.full((), float(skip), device="cuda")
            before = optim_snapshot(opt, params) if skip else None
            if i >= 2:
                torch.cuda.set_sync_debug_mode("error")  # any host sync inside step() raises
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if skip:
                assert_optim_unchanged(opt, params, before)
        return params, opt

    tri_params, tri = run("triton")
    plain_params, plain = run("triton", with_found_inf=False, steps=[i for i in range(6) if i != skipped])
    assert_optim_unchanged(tri, tri_params, optim_snapshot(plain, plain_params))
    ref_params, ref = run("torch")
    for a, b in zip(tri_params, ref_params):
        assert int(tri.state[a]["step"]) == int(ref.state[b]["step"]) == 5
        assert (a.float() - b.float()).abs().mean().item() <= 6e-5

    params = _params(dtype)
    fresh = cls(params, lr=lr, impl="triton")
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    fresh.found_inf = torch.ones((), device="cuda")
    fresh.step()
    for p, start in zip(params, _params(dtype)):
        state = fresh.state[p]
        assert torch.equal(p, start) and int(state["step"]) == 0
        assert all(not state[k].any() for k in state if k != "step")  # zero moments and absmax, as created


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [AdamW8bit, Lion8bit])
def test_triton_unscales_gradients_with_grad_scale(cls, dtype):
    """GradScaler's grad_scale (gradients of a loss scaled by a power of two, not unscaled before step()): the
    kernel's unscaling is exact, so the run equals the run on unscaled gradients bit for bit."""
    gen = torch.Generator().manual_seed(4)
    grads = [[(torch.randn(s, generator=gen) * 0.01).to(dtype).cuda() for s in SHAPES] for _ in range(3)]
    runs = []
    for scale in (None, 2.0**12):
        params = _params(dtype)
        opt = cls(params, lr=1e-3, weight_decay=0.05, impl="triton")
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g * scale if scale else g.clone()
            if scale:
                opt.grad_scale = torch.full((), scale, device="cuda")
            opt.step()
        runs.append((params, opt))
    (params, opt), (scaled_params, scaled) = runs
    assert_optim_unchanged(scaled, scaled_params, optim_snapshot(opt, params))
