"""AdamW8bit / Lion8bit take GradScaler's `found_inf` and `grad_scale`, as torch's fused AdamW does (pure-torch
implementation; tests/test_optim_gpu.py compares the Triton kernels): a step with found_inf set changes nothing,
decided on the device, and scaled gradients step exactly like unscaled ones."""

import pytest
import torch

from helpers import assert_optim_unchanged, optim_grads, optim_params, optim_snapshot
from toolkit.optim import AdamW8bit, Lion8bit

CLASSES = [AdamW8bit, Lion8bit]


def _run(cls, grads, skipped: set[int] = frozenset(), found_inf: bool = True):
    """Params and optimizer after one step per gradient list; steps in `skipped` get NaN gradients and
    found_inf = 1. found_inf=False: the attribute is never set (the plain path)."""
    params = optim_params()
    opt = cls(params, lr=1e-2, weight_decay=0.05)
    for i, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads):
            p.grad = torch.full_like(g, float("nan")) if i in skipped else g.clone()
        if found_inf:
            opt.found_inf = torch.tensor(float(i in skipped))
        opt.step()
    return params, opt


@pytest.mark.parametrize("found_inf", [1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("cls", CLASSES)
def test_a_step_with_found_inf_changes_nothing(cls, found_inf):
    params, opt = _run(cls, optim_grads(2))
    before = optim_snapshot(opt, params)
    assert {p.numel() >= 4096 for p in params} == {True, False}  # 8-bit and fp32 moments both covered
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.tensor(found_inf)
    opt.step()
    assert_optim_unchanged(opt, params, before)
    assert [int(opt.state[p]["step"]) for p in params] == [2, 2, 2]


@pytest.mark.parametrize("skipped", [2, 0], ids=["middle", "first"])
@pytest.mark.parametrize("cls", CLASSES)
def test_a_skipped_step_is_as_if_step_was_never_called(cls, skipped):
    """The bias correction counts only the steps taken: a run with one step skipped on the device equals, bit for
    bit, the run that never called step() for it (and a first step skipped leaves fresh zero moments)."""
    grads = optim_grads(6)
    params, opt = _run(cls, grads, skipped={skipped})
    plain_params, plain = _run(cls, grads[:skipped] + grads[skipped + 1:], found_inf=False)
    assert_optim_unchanged(opt, params, optim_snapshot(plain, plain_params))
    assert not all(torch.equal(p, q) for p, q in zip(params, optim_params()))  # it trained
    saved = opt.state_dict()["state"]
    assert [s["step"] for s in saved.values()] == [5, 5, 5] and all(type(s["step"]) is int for s in saved.values())


@pytest.mark.parametrize("unscaled_first", [True, False], ids=["unscale_-then-step", "step-unscales"])
@pytest.mark.parametrize("cls", CLASSES)
def test_grad_scaler_steps_exactly_like_unscaled_gradients_and_skips_an_overflow(cls, unscaled_first):
    """Through accelerate's optimizer wrapper with a GradScaler, as the trainer steps with fp16 loss scaling:
    scaled gradients (unscaled by GradScaler first, as clipping does, or handed over with `grad_scale`) step like
    the unscaled ones, bit for bit; an overflow is skipped on the device and lowers the scale, which is how the
    trainer tells (its EMA skips that step too)."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # accelerate's process state, which its optimizer wrapper reads
    grads = optim_grads(3)
    plain_params, plain = _run(cls, grads, found_inf=False)
    params = optim_params()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt = AcceleratedOptimizer(cls(params, lr=1e-2, weight_decay=0.05), device_placement=False, scaler=scaler)

    def step(step_grads):
        loss = sum((p * g).sum() for p, g in zip(params, step_grads))  # its gradient is g, scaled by 2**12
        scaler.scale(loss).backward()
        if unscaled_first:
            scaler.unscale_(opt.optimizer)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i, step_grads in enumerate(grads):
        step(step_grads)
        if i == 1:  # an overflow between the second and third step
            before = optim_snapshot(opt.optimizer, params)
            step([torch.full_like(g, float("inf")) for g in step_grads])
            assert_optim_unchanged(opt.optimizer, params, before)
            assert scaler.get_scale() == 2.0**11
    assert_optim_unchanged(opt.optimizer, params, optim_snapshot(plain, plain_params))
    assert not hasattr(opt.optimizer, "found_inf")  # GradScaler removes what it set


def test_old_checkpoints_with_int_steps_load_and_go_on_identically():
    """A state dict with int steps (every checkpoint written before the step count moved to the device, and
    bitsandbytes') loads, the counts become device tensors, and training goes on as without the save."""
    grads = optim_grads(4)
    straight_params, straight = _run(AdamW8bit, grads)
    first_params, first = _run(AdamW8bit, grads[:2])
    saved = first.state_dict()
    assert all(type(s["step"]) is int for s in saved["state"].values())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = AdamW8bit(resumed_params, lr=1e-2, weight_decay=0.05)
    resumed.load_state_dict(saved)
    assert all(s["step"].dtype == torch.int64 and int(s["step"]) == 2 for s in resumed.state.values())
    for step_grads in grads[2:]:
        for p, g in zip(resumed_params, step_grads):
            p.grad = g.clone()
        resumed.found_inf = torch.tensor(0.0)
        resumed.step()
    assert_optim_unchanged(resumed, resumed_params, optim_snapshot(straight, straight_params))


def test_a_triton_kernel_that_fails_to_compile_falls_back_to_the_torch_implementation(monkeypatch):
    """A kernel that does not compile on this GPU (its first launch raises, before writing anything) is said once
    and the torch implementation steps from then on: the same numbers as an optimizer that used torch throughout.
    A later failure of a kernel that has run before is raised, not hidden."""
    import warnings

    from toolkit.optim import eight_bit

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nmore detail")

    monkeypatch.setattr(eight_bit, "_fusable", lambda p, grad: True)  # as on a GPU, where triton imports
    monkeypatch.setattr(AdamW8bit, "_fused_update", broken)
    runs = {}
    for impl in ("triton", "torch"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(16))]
        opt = AdamW8bit(params, lr=1e-2, impl="torch")
        if impl == "triton":
            opt.implementation_for = lambda device, opt=opt: "triton" if opt.impl != "torch" else "torch"
            opt.impl = "auto"
        g = torch.Generator().manual_seed(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
        runs[impl] = ([p.detach().clone() for p in params], [str(w.message) for w in caught])
    assert all(torch.equal(a, b) for a, b in zip(runs["triton"][0], runs["torch"][0]))
    assert runs["triton"][1] == ["AdamW8bit: the Triton kernel failed on cpu (RuntimeError: PassManager::run failed); "
                                 "stepping with the torch implementation instead (slower; optimizer_backend: "
                                 "bitsandbytes is the other choice)"]
    assert runs["torch"][1] == []
