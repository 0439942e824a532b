"""Device detection (HIP faked on CPU) and arch preset selection."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import run_toolkit
from toolkit.device.detect import DeviceInfo, detect_device
from toolkit.config.presets import choose_preset, load_presets
from toolkit.errors import UserError


def fake_gpu(monkeypatch, *, hip: str | None, name: str, arch: str = "", major: int = 9, minor: int = 0,
             memory_gb: float = 24, integrated: int = 0, count: int = 1) -> None:
    props = SimpleNamespace(name=name, gcnArchName=arch, total_memory=int(memory_gb * 2**30), major=major,
                            minor=minor, is_integrated=integrated)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)


@pytest.mark.parametrize("arch, bf16, preset, batch", [
    ("gfx1151", True, "gfx1151", 4),        # 110 GB unified memory -> the >= 96 GB row
    ("gfx942:sramecc+:xnack-", True, "gfx942", 1),
    ("gfx1100", True, "gfx1100", 1),
    ("gfx1030", False, "gfx1030", 2),   # 16 GB: the >= 16 GB row
    ("gfx906:sramecc+:xnack-", False, "gfx906", 1),
    ("gfx90a:sramecc+:xnack-", True, "gfx90a", 1),
])
def test_hip_detection_and_preset(monkeypatch, arch, bf16, preset, batch):
    memory = 110 if arch == "gfx1151" else 16
    fake_gpu(monkeypatch, hip="6.4.0", name="AMD Radeon", arch=arch, memory_gb=memory, integrated=arch == "gfx1151")
    info = detect_device()
    assert info.backend == "hip"
    assert info.arch == arch.split(":")[0]
    assert info.bf16 is bf16
    assert any(("no bf16" in r) != bf16 for r in info.reasons)
    chosen, reason = choose_preset("auto", info)
    assert chosen.name == preset
    assert f"matches the detected arch {info.arch}" in reason
    assert chosen.batch_size_for(info.memory_gb)[0] == batch


def test_hip_family_fallback_and_generic(monkeypatch):
    fake_gpu(monkeypatch, hip="6.4.0", name="RX 7800 XT", arch="gfx1101")
    chosen, reason = choose_preset("auto", detect_device())
    assert chosen.name == "gfx1100" and "same family (RDNA3)" in reason
    fake_gpu(monkeypatch, hip="6.4.0", name="future", arch="gfx9999")
    info = detect_device()
    assert info.bf16 is False and "not in the toolkit's AMD table" in info.reasons[1]
    chosen, reason = choose_preset("auto", info)
    assert chosen.name == "generic_hip" and "generic hip preset" in reason


def test_hip_bf16_is_decided_by_arch_not_torch(monkeypatch):
    fake_gpu(monkeypatch, hip="6.4.0", name="RX 6900 XT", arch="gfx1030")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert detect_device().bf16 is False


@pytest.mark.parametrize("major, minor, preset, why", [
    (9, 0, "sm_90", "matches"), (8, 0, "sm_80", "matches"), (8, 9, "sm_80", "same family (sm_8x)"),
    (7, 5, "generic_cuda", "generic cuda"),
])
def test_cuda_presets(monkeypatch, major, minor, preset, why):
    fake_gpu(monkeypatch, hip=None, name="NVIDIA", major=major, minor=minor, memory_gb=80)
    info = detect_device()
    assert info.backend == "cuda" and info.arch == f"sm_{major}{minor}" and info.bf16 is (major >= 8)
    chosen, reason = choose_preset("auto", info)
    assert chosen.name == preset and why in reason


def test_cpu_and_explicit_presets():
    info = detect_device(force_cpu=True)
    assert info.backend == "cpu" and info.arch == "cpu"
    assert choose_preset("auto", info)[0].name == "cpu"
    chosen, reason = choose_preset("gfx1151", info)
    assert chosen.name == "gfx1151" and "meant for hip" in reason
    with pytest.raises(UserError, match="unknown preset 'gfx9000'; available: .*gfx1151"):
        choose_preset("gfx9000", info)


def test_required_presets_exist_and_are_valid():
    presets = load_presets()
    for name in ("cpu", "sm_80", "sm_90", "gfx90a", "gfx942", "gfx1100", "gfx1151", "gfx1030", "gfx906"):
        assert name in presets
    for preset in presets.values():
        assert preset.batch_size_by_memory_gb, preset.name
        # a GPU measures whether a step needs it (train/checkpointing_probe.py); the CPU does not
        assert preset.layer.data["train"]["gradient_checkpointing"] == (False if preset.name == "cpu" else "auto")
    assert presets["gfx1030"].layer.data["train"]["precision"] == "fp16"
    assert all(p.layer.data["train"]["optimizer_backend"] == "toolkit" for p in presets.values() if p.backend == "hip")


def test_presets_command_marks_the_preset_that_applies():
    proc = run_toolkit("presets")
    assert proc.returncode == 0, proc.stderr
    assert "* cpu" in proc.stdout and "gfx1151" in proc.stdout and "applies to this machine: cpu" in proc.stdout
