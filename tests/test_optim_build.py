"""build_optimizer: the registry, backend selection and its reason line."""

import importlib.util

import pytest
import torch

from toolkit.errors import UserError
from toolkit.optim import OPTIMIZER_NAMES, AdamW8bit, Lion, Lion8bit, build_optimizer, optimizer_spec
from toolkit.optim.bnb_compat import bnb_self_check


def _params():
    return [torch.nn.Parameter(torch.randn(64, 128))]


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(UserError) as err:
        build_optimizer("adam8bit", _params(), lr=1e-3)
    assert "'adam8bit'" in str(err.value)
    for name in ("adamw", "adamw8bit", "lion8bit", "lion", "adafactor", "prodigy"):
        assert name in str(err.value) and name in OPTIMIZER_NAMES


def test_names_are_exact_match():
    with pytest.raises(UserError, match="did you mean 'adamw'"):
        build_optimizer("AdamW", _params(), lr=1e-3)
    with pytest.raises(UserError, match="unknown optimizer 'adamw9bit'.*did you mean 'adamw8bit'"):
        optimizer_spec("adamw9bit")


def test_specs_say_which_optimizers_are_memory_light():
    assert {name for name in OPTIMIZER_NAMES if optimizer_spec(name).memory_light} == {"adamw8bit", "lion8bit",
                                                                                        "adafactor"}
    assert not any(optimizer_spec(name).needs_eval_mode for name in OPTIMIZER_NAMES)
    assert all(optimizer_spec(name).description for name in OPTIMIZER_NAMES)


def test_accepted_args_are_constructor_parameters():
    """Every name a spec accepts is a keyword of the class it builds (prodigy: when prodigyopt is installed)."""
    import inspect

    from transformers.optimization import Adafactor

    classes = {"adamw": torch.optim.AdamW, "adafactor": Adafactor}
    if importlib.util.find_spec("prodigyopt") is not None:
        from prodigyopt import Prodigy
        classes["prodigy"] = Prodigy
    for name, cls in classes.items():
        assert optimizer_spec(name).accepts <= set(inspect.signature(cls).parameters), name
    for name in ("adamw8bit", "lion8bit", "lion"):  # bitsandbytes and the toolkit must take the same arguments
        assert optimizer_spec(name).accepts == frozenset()


def test_optimizer_args_are_passed_through():
    opt, reason = build_optimizer("adamw", _params(), lr=1e-3, args={"amsgrad": True})
    assert opt.param_groups[0]["amsgrad"] is True
    assert reason.endswith("; optimizer_args: amsgrad=True")
    opt, _ = build_optimizer("adafactor", _params(), lr=1e-3, args={"clip_threshold": 0.5, "scale_parameter": True})
    assert opt.param_groups[0]["clip_threshold"] == 0.5 and opt.param_groups[0]["scale_parameter"] is True
    assert build_optimizer("adafactor", _params(), lr=1e-3)[0].param_groups[0]["scale_parameter"] is False


def test_prodigy_gets_its_args(monkeypatch):
    """prodigyopt is optional: a stand-in module records what the builder passes to Prodigy."""
    import importlib.machinery
    import sys
    import types

    seen = {}

    class Prodigy(torch.optim.SGD):
        def __init__(self, params, lr, betas, eps, weight_decay, **kwargs):
            seen.update(kwargs, betas=betas)
            super().__init__(params, lr=lr, weight_decay=weight_decay)

    module = types.ModuleType("prodigyopt")
    module.__spec__ = importlib.machinery.ModuleSpec("prodigyopt", None)
    module.Prodigy = Prodigy
    monkeypatch.setitem(sys.modules, "prodigyopt", module)
    opt, reason = build_optimizer("prodigy", _params(), lr=1.0, betas=(0.9, 0.99),
                                  args={"d_coef": 0.5, "safeguard_warmup": True})
    assert type(opt) is Prodigy and seen == {"d_coef": 0.5, "safeguard_warmup": True, "betas": (0.9, 0.99)}
    assert reason.endswith("; optimizer_args: d_coef=0.5, safeguard_warmup=True")


def test_unknown_optimizer_args_are_refused_not_dropped():
    with pytest.raises(UserError, match=r"adamw does not accept 'amsgrd'; it accepts: amsgrad, maximize; "
                                        r"did you mean 'amsgrad'\?"):
        build_optimizer("adamw", _params(), lr=1e-3, args={"amsgrd": True})
    with pytest.raises(UserError, match="adamw8bit accepts no optimizer_args"):
        build_optimizer("adamw8bit", _params(), lr=1e-3, args={"min_8bit_size": 1})
    with pytest.raises(UserError, match="adamw takes lr from train.lr"):
        build_optimizer("adamw", _params(), lr=1e-3, args={"lr": 1.0})


def test_the_registry_imports_no_optional_library():
    import subprocess
    import sys

    code = ("import sys, toolkit.config.schema, toolkit.optim.build; "
            "print(sorted(m for m in ('bitsandbytes', 'prodigyopt', 'transformers', 'triton') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("name,cls", [("adamw8bit", AdamW8bit), ("lion8bit", Lion8bit)])
def test_cpu_auto_uses_the_toolkit_reference(name, cls):
    opt, reason = build_optimizer(name, _params(), lr=1e-3, weight_decay=0.01)
    assert type(opt) is cls
    assert reason == f"{name}: toolkit (pure torch) — CPU device; the reference implementation"
    assert opt.param_groups[0]["weight_decay"] == 0.01


def test_adamw_builds_torch_fused_adamw_on_cpu_which_skips_on_the_device():
    """The fused kernel on the CPU too: it takes GradScaler's found_inf, so a non-finite step is skipped
    without the trainer reading the loss first (a skipped step leaves weights, moments and step count)."""
    params = _params()
    opt, reason = build_optimizer("adamw", params, lr=1e-3, betas=(0.8, 0.9), weight_decay=0.1)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["fused"] and opt._step_supports_amp_scaling
    for p in params:
        p.grad = torch.ones_like(p)
    opt.found_inf = torch.zeros(())
    opt.step()
    before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), float(opt.state[p]["step"])) for p in params]
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    for p, (weight, moment, step) in zip(params, before):
        assert torch.equal(p, weight) and torch.equal(opt.state[p]["exp_avg"], moment)
        assert float(opt.state[p]["step"]) == step == 1.0
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert reason.startswith("adamw: torch.optim.AdamW")


def test_lion_and_adafactor():
    opt, _ = build_optimizer("lion", _params(), lr=1e-4, betas=(0.9, 0.99))
    assert type(opt) is Lion
    opt, _ = build_optimizer("adafactor", _params(), lr=1e-3)
    assert type(opt).__name__ == "Adafactor" and opt.param_groups[0]["relative_step"] is False


@pytest.mark.skipif(importlib.util.find_spec("prodigyopt") is not None, reason="prodigyopt is installed")
def test_prodigy_without_package_names_the_install():
    with pytest.raises(UserError, match="pip install prodigyopt"):
        build_optimizer("prodigy", _params(), lr=1.0)


def test_backend_on_a_non_8bit_optimizer_is_noted_not_refused():
    # Presets set optimizer_backend per device (toolkit on HIP and CPU); adamw must still build there.
    opt, reason = build_optimizer("adamw", _params(), lr=1e-3, backend="toolkit", device_type="hip")
    assert isinstance(opt, torch.optim.AdamW)
    assert reason.endswith("(optimizer_backend=toolkit applies to adamw8bit and lion8bit only)")


def test_unknown_backend_is_an_error():
    with pytest.raises(UserError, match="valid: auto, toolkit, bitsandbytes"):
        build_optimizer("adamw8bit", _params(), lr=1e-3, backend="triton")


def test_explicit_toolkit_backend_reason():
    _, reason = build_optimizer("adamw8bit", _params(), lr=1e-3, backend="toolkit", device_type="cpu")
    assert reason == "adamw8bit: toolkit (pure torch) — optimizer_backend: toolkit"


def test_bitsandbytes_backend_runs_the_self_check():
    bnb = pytest.importorskip("bitsandbytes")
    opt, reason = build_optimizer("adamw8bit", _params(), lr=1e-3, backend="bitsandbytes", device_type="hip")
    assert type(opt) is bnb.optim.AdamW8bit
    assert reason.startswith("adamw8bit: bitsandbytes — optimizer_backend: bitsandbytes; bitsandbytes adamw8bit "
                             "passed the self-check")


def test_bitsandbytes_backend_raises_when_the_self_check_fails(monkeypatch):
    import toolkit.optim.build as build

    monkeypatch.setattr(build, "bnb_self_check", lambda name, device: (False, "bitsandbytes does not import (x)"))
    with pytest.raises(UserError, match="bitsandbytes does not import .* use optimizer_backend: toolkit"):
        build_optimizer("adamw8bit", _params(), lr=1e-3, backend="bitsandbytes", device_type="hip")


def test_cuda_auto_falls_back_to_toolkit_when_bitsandbytes_fails(monkeypatch):
    import toolkit.optim.build as build

    monkeypatch.setattr(build, "bnb_self_check", lambda name, device: (False, "bitsandbytes does not import (x)"))
    opt, reason = build_optimizer("lion8bit", _params(), lr=1e-4, device_type="cuda")
    assert type(opt) is Lion8bit
    assert reason.startswith("lion8bit: toolkit (")
    assert reason.endswith("— bitsandbytes does not import (x), so the toolkit's own is used")


def test_cuda_auto_takes_the_triton_kernels_without_trying_bitsandbytes(monkeypatch):
    import toolkit.optim.build as build

    def never(name, device):
        raise AssertionError("bitsandbytes was tried")

    monkeypatch.setattr(build, "bnb_self_check", never)
    monkeypatch.setattr(build, "triton_available", lambda: True)
    opt, reason = build_optimizer("adamw8bit", _params(), lr=1e-4, device_type="cuda")
    assert type(opt) is AdamW8bit
    assert reason.startswith("adamw8bit: toolkit (Triton kernels) — CUDA device: the Triton kernels step about 5x")


def test_hip_auto_never_tries_bitsandbytes(monkeypatch):
    import toolkit.optim.build as build

    def fail(name, device):
        raise AssertionError("the self-check must not run on HIP with backend auto")

    monkeypatch.setattr(build, "bnb_self_check", fail)
    opt, reason = build_optimizer("adamw8bit", _params(), lr=1e-3, device_type="hip")
    assert type(opt) is AdamW8bit
    assert reason.endswith("— HIP device; bitsandbytes is not used on ROCm unless optimizer_backend: bitsandbytes")


@pytest.mark.parametrize("name", ["adamw8bit", "lion8bit"])
def test_self_check_passes_for_bitsandbytes_on_cpu(name):
    pytest.importorskip("bitsandbytes")
    passed, why = bnb_self_check(name, torch.device("cpu"))
    assert passed, why
