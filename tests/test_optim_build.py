"""build_optimizer: the registry, backend selection and its reason line."""

import importlib.util

import pytest
import torch

from toolkit.errors import UserError
from toolkit.optim import OPTIMIZER_NAMES, AdamW8bit, Lion, Lion8bit, build_optimizer
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
    with pytest.raises(UserError):
        build_optimizer("AdamW", _params(), lr=1e-3)


@pytest.mark.parametrize("name,cls", [("adamw8bit", AdamW8bit), ("lion8bit", Lion8bit)])
def test_cpu_auto_uses_the_toolkit_reference(name, cls):
    opt, reason = build_optimizer(name, _params(), lr=1e-3, weight_decay=0.01)
    assert type(opt) is cls
    assert reason == f"{name}: toolkit (pure torch) — CPU device; the reference implementation"
    assert opt.param_groups[0]["weight_decay"] == 0.01


def test_adamw_builds_torch_adamw_unfused_on_cpu():
    opt, reason = build_optimizer("adamw", _params(), lr=1e-3, betas=(0.8, 0.9), weight_decay=0.1)
    assert type(opt) is torch.optim.AdamW and not opt.param_groups[0]["fused"]
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
