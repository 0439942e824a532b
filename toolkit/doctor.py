"""`doctor`: the checklist to go through before training (on AMD above all), one PASS/FAIL line per
check and a fix under each failure.

Order follows what a user fixes first: ROCm installed, PyTorch built with HIP, GPU visible, its
architecture known and its preset, the ROCm variables the launcher would set, accelerate, and
bitsandbytes (usable or not, and what the toolkit uses instead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROCM_WHEEL_FIX = ("install a ROCm build of PyTorch: pip install torch --index-url "
                  "https://download.pytorch.org/whl/rocm6.4 (pick the ROCm version you have installed)")

_ACCELERATE_PROBE = (
    "import json, sys, accelerate\n"
    "from accelerate import Accelerator\n"
    "a = Accelerator(cpu=sys.argv[1] == 'cpu')\n"
    "print(json.dumps({'version': accelerate.__version__, 'device': str(a.device), 'processes': a.num_processes}))\n"
)
_BNB_PROBE = "import bitsandbytes, sys; sys.stdout.write(bitsandbytes.__version__)"


@dataclass
class Checklist:
    """Collects check lines as they are printed; counts the failures."""

    print_: Callable[[str], None] = print
    failures: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str, fix: str = "") -> bool:
        self.print_(f"[{'PASS' if ok else 'FAIL'}] {what}" + ("" if ok or not fix else f"\n       fix: {fix}"))
        if not ok:
            self.failures.append(what)
        return ok

    def info(self, text: str) -> None:
        self.print_(f"[INFO] {text}")


def _start_probe(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish_probe(proc: subprocess.Popen, timeout: float = 120.0) -> tuple[bool, str]:
    """(ok, stdout) or (False, the last line of stderr): a broken install can crash the importer, hence a subprocess."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return False, f"timed out after {timeout:.0f}s"
    if proc.returncode == 0:
        return True, out.strip()
    return False, (err.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]


def _amd_gpus_in_sysfs() -> list:
    """AMD GPUs the kernel driver reports, whatever torch thinks (finds a CPU-only torch on an AMD machine)."""
    from toolkit.device.amd_gpus import KFD_NODES, detect_gpus

    return detect_gpus(Path("/"), None) if (Path("/") / KFD_NODES).is_dir() else []


def _check_rocm_install(checks: Checklist) -> None:
    rocm_path = os.environ.get("ROCM_PATH", "/opt/rocm")
    found = Path(rocm_path).is_dir()
    checks.check(found, f"ROCm found at {rocm_path}" if found else f"ROCm not found at {rocm_path}",
                 "install ROCm (https://rocm.docs.amd.com, 'Quick start installation'), "
                 "or export ROCM_PATH=<where it is installed>")


def _check_rocm_env(checks: Checklist, device) -> None:
    """Compare what the launcher (toolkit.device.rocm_env) would export with this process's environment."""
    import torch

    from toolkit.device.amd_gpus import AmdGpu
    from toolkit.device.archs import bare_arch_name
    from toolkit.device.rocm_env import PATH_LIST_VARIABLES, compute_rocm_env

    gpus = [AmdGpu(node=None, gfx=device.arch, name=device.name)]
    torch_archs = [bare_arch_name(a) for a in torch.cuda.get_arch_list()]
    for decision in compute_rocm_env(gpus, os.environ, torch_archs, debug_hip=False):
        if decision.value is None:
            checks.info(f"{decision.name}: not needed ({decision.reason})")
        elif decision.kept and decision.name in PATH_LIST_VARIABLES:
            checks.check(True, f"{decision.name} {decision.reason}")
        elif decision.kept:
            checks.check(True, f"{decision.name}={decision.value} is set")
        elif decision.name in PATH_LIST_VARIABLES:
            directory = decision.value.split(os.pathsep)[-1]  # the launcher appends its directory
            checks.check(False, f"{decision.name} does not contain {directory}",
                         f"start through ./start_toolkit.sh (it adds it), or export "
                         f"{decision.name}=\"${decision.name}:{directory}\"")
        else:
            checks.check(False, f"{decision.name} is not set; the launcher would set {decision.name}={decision.value} "
                         f"({decision.reason})",
                         f"start through ./start_toolkit.sh, or export {decision.name}={decision.value}")


def _check_accelerate(checks: Checklist, probe: subprocess.Popen, device) -> None:
    ok, out = _finish_probe(probe)
    if not ok:
        checks.check(False, f"accelerate does not initialise: {out}",
                     "pip install -U accelerate; remove a broken ~/.cache/huggingface/accelerate/default_config.yaml")
        return
    info = json.loads(out.splitlines()[-1])
    expected = device.torch_device
    checks.check(info["device"].split(":")[0] == expected,
                 f"accelerate {info['version']} initialises: device {info['device']}, {info['processes']} process(es)"
                 + ("" if info["device"].split(":")[0] == expected else f", but the toolkit expected {expected}"),
                 "check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES and `accelerate config` "
                 "(~/.cache/huggingface/accelerate/default_config.yaml)")


def _report_bitsandbytes(checks: Checklist, probe: subprocess.Popen, backend: str) -> None:
    ok, detail = _finish_probe(probe)
    if not ok:
        checks.info(f"bitsandbytes is not usable ({detail}); adamw8bit and lion8bit use the toolkit's own "
                    "8-bit optimizers instead (Triton on GPU, pure torch on CPU): nothing to fix")
    elif backend == "hip":
        checks.info(f"bitsandbytes {detail} imports; on ROCm the toolkit's own 8-bit optimizers are used unless "
                    "train.optimizer_backend=bitsandbytes (then a one-step self-check runs first)")
    elif backend == "cuda":
        checks.info(f"bitsandbytes {detail} imports: adamw8bit uses it after a one-step self-check "
                    "(the toolkit's own 8-bit optimizer if the check fails)")
    else:
        checks.info(f"bitsandbytes {detail} imports; on the CPU adamw8bit uses the toolkit's own 8-bit optimizer "
                    "(pure torch)")


def run_doctor(print_=print) -> int:
    import torch

    from toolkit.device.archs import lookup_amd_arch
    from toolkit.device.detect import detect_device
    from toolkit.config.presets import choose_preset

    checks = Checklist(print_)
    device = detect_device()
    hip = getattr(torch.version, "hip", None)
    # The slow probes (each imports torch in a subprocess) run while the in-process checks print.
    accelerate_probe = _start_probe(_ACCELERATE_PROBE, device.torch_device)
    bnb_probe = _start_probe(_BNB_PROBE)
    print_(f"torch {torch.__version__}; CUDA {torch.version.cuda or '-'}; HIP {hip or '-'}; "
           f"python {sys.version.split()[0]}")
    print_(f"device: {device.summary()}")
    for reason in device.reasons:
        print_(f"  {reason}")

    amd_in_sysfs = _amd_gpus_in_sysfs()
    if hip or amd_in_sysfs:
        _check_rocm_install(checks)
        checks.check(bool(hip), f"PyTorch built with HIP {hip}" if hip else
                     f"PyTorch {torch.__version__} is not a ROCm build, but the driver reports "
                     f"{', '.join(g.gfx for g in amd_in_sysfs)}", ROCM_WHEEL_FIX)
    elif torch.version.cuda:
        checks.info(f"PyTorch built with CUDA {torch.version.cuda}; no AMD GPU in /sys/class/kfd: ROCm checks skipped")
    else:
        checks.info("CPU-only PyTorch and no AMD GPU in /sys/class/kfd: ROCm checks skipped")

    if device.backend == "cpu":
        if hip or torch.version.cuda or amd_in_sysfs:
            checks.check(False, "no GPU visible to PyTorch",
                         "check that your user is in the 'render' and 'video' groups, that HIP_VISIBLE_DEVICES / "
                         "CUDA_VISIBLE_DEVICES do not hide it, and `rocminfo` (or `nvidia-smi`) lists it")
        else:
            checks.info("no GPU visible: training runs on the CPU (fine for the quickstart and the tests)")
    else:
        checks.check(True, f"GPU visible: {device.device_count} x {device.name} ({device.memory_gb:.0f} GB)")

    preset, why = choose_preset("auto", device)
    if device.backend == "hip":
        arch = lookup_amd_arch(device.arch)
        checks.check(arch is not None,
                     f"architecture {device.arch} known: {arch.family}, {arch.products}" if arch else
                     f"architecture {device.arch} is not in the toolkit's table (shared/ROCM.md)",
                     "set device.preset and train.precision yourself (see `./start_toolkit.sh presets`)")
        checks.check(device.arch in preset.archs, f"{why}",
                     f"no preset made for {device.arch}; check `./start_toolkit.sh presets` and set device.preset")
        _check_rocm_env(checks, device)
    else:
        checks.info(why)

    _check_accelerate(checks, accelerate_probe, device)
    _report_bitsandbytes(checks, bnb_probe, device.backend)
    if checks.failures:
        print_(f"{len(checks.failures)} check(s) failed: fix them from the top (later checks often follow from earlier ones)")
        return 1
    print_("all checks passed")
    return 0
