"""`doctor`: what the toolkit sees on this machine, as a checklist with a fix for each failure."""

from __future__ import annotations

import os
import subprocess
import sys

ROCM_VARIABLES = ("ROCM_PATH", "PYTORCH_ROCM_ARCH", "HSA_OVERRIDE_GFX_VERSION", "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL",
                  "TORCH_BLAS_PREFER_HIPBLASLT", "ROCBLAS_USE_HIPBLASLT", "MIOPEN_FIND_MODE", "HIP_VISIBLE_DEVICES",
                  "AMD_SERIALIZE_KERNEL", "TORCH_USE_HIP_DSA", "HIP_LAUNCH_BLOCKING")


def bitsandbytes_status(timeout: float = 60.0) -> tuple[bool, str]:
    """Whether bitsandbytes imports, checked in a subprocess (a broken install can crash the importer)."""
    code = "import bitsandbytes, sys; sys.stdout.write(bitsandbytes.__version__)"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"import timed out after {timeout:.0f}s"
    if proc.returncode == 0:
        return True, proc.stdout.strip()
    last = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
    return False, last


def run_doctor(print_=print) -> int:
    import torch

    from toolkit.device.detect import detect_device
    from toolkit.device.presets import choose_preset

    failures = 0

    def check(ok: bool, what: str, fix: str = "") -> None:
        nonlocal failures
        print_(f"[{'PASS' if ok else 'FAIL'}] {what}" + ("" if ok or not fix else f"\n       fix: {fix}"))
        failures += 0 if ok else 1

    device = detect_device()
    hip = getattr(torch.version, "hip", None)
    print_(f"torch {torch.__version__}; CUDA {torch.version.cuda or '-'}; HIP {hip or '-'}; python {sys.version.split()[0]}")
    print_(f"device: {device.summary()}")
    for reason in device.reasons:
        print_(f"  {reason}")
    preset, why = choose_preset("auto", device)
    print_(f"  {why}")
    if device.backend == "cpu":
        print_("[INFO] no GPU visible: training runs on the CPU (fine for the quickstart and tests)")
    else:
        check(True, f"GPU visible: {device.device_count} x {device.name}")
    if hip:
        check(device.arch in preset.archs, f"architecture {device.arch} has its own preset",
              f"using {preset.name}; set device.preset to choose another")
        rocm_path = os.environ.get("ROCM_PATH", "/opt/rocm")
        check(os.path.isdir(rocm_path), f"ROCm found at {rocm_path}", "install ROCm or set ROCM_PATH")
    print_("ROCm variables in force:")
    shown = False
    for name in ROCM_VARIABLES:
        if name in os.environ:
            print_(f"  {name}={os.environ[name]}")
            shown = True
    if not shown:
        print_("  (none)")
    ok, detail = bitsandbytes_status()
    if ok:
        print_(f"[INFO] bitsandbytes {detail} imports"
               + ("; on ROCm the toolkit's own 8-bit optimizers are used unless optimizer_backend: bitsandbytes"
                  if hip else ""))
    else:
        print_(f"[INFO] bitsandbytes does not import ({detail}); adamw8bit uses the toolkit's own 8-bit optimizer")
    return 1 if failures else 0
