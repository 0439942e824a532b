"""`doctor`: the pre-training checklist, on this CPU machine and on a faked Strix Halo (gfx1151) HIP machine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import toolkit.doctor as doctor
from toolkit.doctor import run_doctor

ROCM_VARS = ("PYTORCH_ROCM_ARCH", "HSA_OVERRIDE_GFX_VERSION", "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL",
             "TORCH_BLAS_PREFER_HIPBLASLT", "ROCBLAS_USE_HIPBLASLT", "MIOPEN_FIND_MODE", "DEVICE_LIB_PATH",
             "HIP_DEVICE_LIB_PATH")


def _doctor_lines() -> tuple[int, list[str]]:
    lines: list[str] = []
    code = run_doctor(print_=lambda text: lines.extend(text.splitlines()))
    return code, lines


def _line_after(lines: list[str], start: str) -> str:
    return lines[next(i for i, line in enumerate(lines) if line.startswith(start)) + 1]


@pytest.fixture
def strix_halo(monkeypatch, tmp_path):
    """torch on this CPU machine made to look like a ROCm build with one gfx1151 (Radeon 8060S, unified memory)."""
    props = SimpleNamespace(name="AMD Radeon 8060S", gcnArchName="gfx1151", total_memory=96 * 2**30,
                            major=11, minor=5, is_integrated=1)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["gfx1151"])
    # The probes run in subprocesses, which would see the real (CPU) torch: answer as the GPU machine would.
    monkeypatch.setattr(doctor, "_ACCELERATE_PROBE",
                        "print('{\"version\": \"1.15.0\", \"device\": \"cuda:0\", \"processes\": 1}')")
    monkeypatch.setattr(doctor, "_BNB_PROBE", "raise SystemExit('OSError: libamdhip64.so.6: cannot open shared object')")
    rocm = tmp_path / "rocm"
    (rocm / "bin").mkdir(parents=True)
    monkeypatch.setenv("ROCM_PATH", str(rocm))
    monkeypatch.setenv("PATH", f"/usr/bin:/bin:{rocm}/bin")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{rocm}/lib")
    for name in ROCM_VARS:
        monkeypatch.delenv(name, raising=False)
    return rocm


def test_doctor_gfx1151_missing_variable_fails_with_its_fix(strix_halo, monkeypatch):
    # What the launcher would have exported, except the AOTriton switch.
    for name, value in {"PYTORCH_ROCM_ARCH": "gfx1151", "TORCH_BLAS_PREFER_HIPBLASLT": "1",
                        "ROCBLAS_USE_HIPBLASLT": "1", "MIOPEN_FIND_MODE": "FAST",
                        "DEVICE_LIB_PATH": f"{strix_halo}/llvm/amdgcn/bitcode",
                        "HIP_DEVICE_LIB_PATH": f"{strix_halo}/llvm/amdgcn/bitcode"}.items():
        monkeypatch.setenv(name, value)
    code, lines = _doctor_lines()
    assert code == 1
    assert "device: hip gfx1151 (AMD Radeon 8060S, 96 GB)" in lines
    assert f"[PASS] ROCm found at {strix_halo}" in lines
    assert "[PASS] PyTorch built with HIP 6.4.43482" in lines
    assert "[PASS] GPU visible: 1 x AMD Radeon 8060S (96 GB)" in lines
    assert any(line.startswith("[PASS] architecture gfx1151 known: RDNA3.5") for line in lines)
    assert "[PASS] preset gfx1151: matches the detected arch gfx1151" in lines
    assert "[PASS] PYTORCH_ROCM_ARCH=gfx1151 is set" in lines
    assert "[PASS] MIOPEN_FIND_MODE=FAST is set" in lines
    assert f"[PASS] PATH already contains {strix_halo}/bin" in lines
    # torch has gfx1151 kernels: no override is needed, and doctor does not ask for one
    assert not any("HSA_OVERRIDE_GFX_VERSION" in line and line.startswith("[FAIL]") for line in lines)
    failed = [line for line in lines if line.startswith("[FAIL]")]
    assert failed == ["[FAIL] TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL is not set; the launcher would set "
                      "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 (gfx1151 flash/mem-efficient SDPA is experimental "
                      "in AOTriton; without it SDPA falls back to the slow math path)"]
    assert _line_after(lines, failed[0]).strip() == ("fix: start through ./start_toolkit.sh, or export "
                                                     "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1")
    assert "[PASS] accelerate 1.15.0 initialises: device cuda:0, 1 process(es)" in lines
    assert any(line.startswith("[INFO] bitsandbytes is not usable (OSError: libamdhip64.so.6") and
               "toolkit's own 8-bit optimizers" in line for line in lines)
    assert lines[-1].startswith("1 check(s) failed")


def test_doctor_gfx1151_without_rocm_or_variables(strix_halo, monkeypatch, tmp_path):
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "nowhere"))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["gfx1100"])  # a wheel without gfx1151 kernels
    code, lines = _doctor_lines()
    assert code == 1
    assert f"[FAIL] ROCm not found at {tmp_path / 'nowhere'}" in lines
    assert "export ROCM_PATH=" in _line_after(lines, "[FAIL] ROCm not found")
    failing = {line.split()[1] for line in lines if line.startswith("[FAIL]") and " is not set;" in line}
    assert {"PYTORCH_ROCM_ARCH", "HSA_OVERRIDE_GFX_VERSION", "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL",
            "MIOPEN_FIND_MODE"} <= failing
    assert f"[FAIL] PATH does not contain {tmp_path / 'nowhere'}/bin" in lines
    assert _line_after(lines, "[FAIL] PATH does not contain").strip() == (
        f'fix: start through ./start_toolkit.sh (it adds it), or export PATH="$PATH:{tmp_path / "nowhere"}/bin"')
    override = next(line for line in lines if line.startswith("[FAIL] HSA_OVERRIDE_GFX_VERSION"))
    assert "HSA_OVERRIDE_GFX_VERSION=11.0.0" in override
    assert _line_after(lines, override).strip() == ("fix: start through ./start_toolkit.sh, or export "
                                                    "HSA_OVERRIDE_GFX_VERSION=11.0.0")


def test_doctor_on_plain_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "_amd_gpus_in_sysfs", lambda: [])
    code, lines = _doctor_lines()
    assert code == 0, lines
    assert lines[0].startswith(f"torch {torch.__version__}; CUDA -; HIP -")
    assert "device: cpu cpu (CPU)" in lines
    assert "[INFO] CPU-only PyTorch and no AMD GPU in /sys/class/kfd: ROCm checks skipped" in lines
    assert "[INFO] no GPU visible: training runs on the CPU (fine for the quickstart and the tests)" in lines
    assert "[INFO] preset cpu: the preset for training on the CPU" in lines
    # the real probes: accelerate initialises on the CPU here; bitsandbytes imports or says why not
    assert any(line.startswith("[PASS] accelerate ") and "device cpu, 1 process(es)" in line for line in lines)
    assert any(line.startswith("[INFO] bitsandbytes ") and "toolkit's own 8-bit optimizer" in line for line in lines)
    assert not any(line.startswith("[FAIL]") for line in lines)
    assert lines[-1] == "all checks passed"
