"""toolkit.device.rocm_env, toolkit.device.amd_gpus and toolkit.device.archs on fake KFD sysfs trees and saved
rocminfo output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.device.amd_gpus import AmdGpu, detect_gpus
from toolkit.device.archs import AMD_ARCHS, bare_arch_name, gfx_from_target_version, lookup_amd_arch
from toolkit.device.rocm_env import compute_rocm_env, format_exports

REPO = Path(__file__).resolve().parents[1]
KFD = REPO / "tests" / "fixtures" / "kfd"
ROCMINFO = REPO / "tests" / "fixtures" / "rocminfo"
BASE_ENV = {"PATH": "/usr/bin:/bin"}  # the variables a bare shell has; nothing ROCm-related

COMMON = {
    "ROCM_PATH": "/opt/rocm",
    "PATH": "/usr/bin:/bin:/opt/rocm/bin",
    "LD_LIBRARY_PATH": "/opt/rocm/lib",
    "DEVICE_LIB_PATH": "/opt/rocm/llvm/amdgcn/bitcode",
    "HIP_DEVICE_LIB_PATH": "/opt/rocm/llvm/amdgcn/bitcode",
    "MIOPEN_FIND_MODE": "FAST",
}
HIPBLASLT = {"TORCH_BLAS_PREFER_HIPBLASLT": "1", "ROCBLAS_USE_HIPBLASLT": "1"}


def run_rocm_env(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real entry point, in a subprocess with a clean environment."""
    return subprocess.run(
        [sys.executable, "-m", "toolkit.device.rocm_env", *args],
        cwd=REPO, env={**BASE_ENV, **(env or {})}, capture_output=True, text=True, timeout=60, check=False,
    )


def exports_of(decisions) -> dict[str, str]:
    return {d.name: d.value for d in decisions if d.exported}


def env_for(fixture: str, torch_archs, debug_hip: bool = False, environ=None) -> dict[str, str]:
    gpus = detect_gpus(KFD / fixture, None)
    return exports_of(compute_rocm_env(gpus, environ if environ is not None else BASE_ENV, torch_archs, debug_hip))


# ------------------------------------------------------------------------------------------ archs


def test_arch_table_covers_every_rocm_md_row():
    expected = {"gfx906", "gfx908", "gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1102", "gfx1103",
                "gfx1150", "gfx1151", "gfx1200", "gfx1201"} | {f"gfx103{i}" for i in range(7)}
    assert set(AMD_ARCHS) == expected
    overrides = {name: arch.hsa_override for name, arch in AMD_ARCHS.items() if arch.hsa_override}
    assert overrides == {
        "gfx1151": "11.0.0", "gfx1101": "11.0.0", "gfx1103": "11.0.2", "gfx1150": "11.0.2",
        **{f"gfx103{i}": "10.3.0" for i in range(1, 7)},
    }
    assert [a for a in AMD_ARCHS.values() if not a.bf16] == [AMD_ARCHS[n] for n in (
        "gfx906", "gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035", "gfx1036")]
    assert {n for n, a in AMD_ARCHS.items() if a.sdpa == "experimental"} == {
        "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1200"}
    assert {n for n, a in AMD_ARCHS.items() if a.sdpa == "none"} == {"gfx906", "gfx908"} | {
        f"gfx103{i}" for i in range(7)}
    assert {n for n, a in AMD_ARCHS.items() if a.hipblaslt} == {
        "gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151",
        "gfx1200", "gfx1201"}
    assert AMD_ARCHS["gfx908"].bf16 and "slow" in AMD_ARCHS["gfx908"].notes
    assert AMD_ARCHS["gfx1151"].integrated and not AMD_ARCHS["gfx942"].integrated


@pytest.mark.parametrize("version, name", [
    (110501, "gfx1151"), (90402, "gfx942"), (90010, "gfx90a"), (90006, "gfx906"), (90008, "gfx908"),
    (90500, "gfx950"), (100300, "gfx1030"), (110000, "gfx1100"), (120001, "gfx1201"), (0, None),
])
def test_gfx_from_target_version(version, name):
    assert gfx_from_target_version(version) == name


def test_lookup_accepts_full_gcn_arch_name():
    assert bare_arch_name("gfx942:sramecc+:xnack-") == "gfx942"
    assert lookup_amd_arch("gfx942:sramecc+:xnack-").family == "CDNA3"
    assert lookup_amd_arch("gfx1151").family == "RDNA3.5"
    assert lookup_amd_arch("gfx803") is None


# -------------------------------------------------------------------------------------- detection


def test_detect_gpus_skips_cpu_nodes():
    assert detect_gpus(KFD / "gfx1151", None) == [AmdGpu(node=1, gfx="gfx1151", name="ip discovery", simd_count=80)]
    assert [(g.node, g.gfx) for g in detect_gpus(KFD / "gfx1100_gfx1030", None)] == [(1, "gfx1100"), (2, "gfx1030")]
    assert detect_gpus(KFD / "no_gpu", None) == []
    assert detect_gpus(REPO / "tests" / "fixtures" / "does-not-exist", None) == []


def test_detect_gpus_from_rocminfo_ignores_cpu_agent_and_isa_names():
    text = (ROCMINFO / "gfx1151.txt").read_text()
    assert detect_gpus(None, text) == [AmdGpu(node=1, gfx="gfx1151", name="AMD Radeon Graphics", simd_count=None)]


# -------------------------------------------------------------------------------------- decisions


def test_gfx1151_without_kernels_in_torch_gets_override_experimental_sdpa_and_hipblaslt():
    assert env_for("gfx1151", ["gfx1100", "gfx942"]) == {
        **COMMON, **HIPBLASLT,
        "PYTORCH_ROCM_ARCH": "gfx1151",
        "HSA_OVERRIDE_GFX_VERSION": "11.0.0",
        "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "1",
    }


def test_gfx1151_with_kernels_in_torch_gets_no_override_and_says_why():
    gpus = detect_gpus(KFD / "gfx1151", None)
    decisions = compute_rocm_env(gpus, BASE_ENV, ["gfx1151", "gfx1100"], debug_hip=False)
    assert "HSA_OVERRIDE_GFX_VERSION" not in exports_of(decisions)
    (override,) = [d for d in decisions if d.name == "HSA_OVERRIDE_GFX_VERSION"]
    assert override.value is None and "native kernels for gfx1151" in override.reason


def test_gfx1151_with_unknown_torch_sets_no_override():
    assert "HSA_OVERRIDE_GFX_VERSION" not in env_for("gfx1151", None)


def test_gfx942_has_hipblaslt_and_no_experimental_flag():
    assert env_for("gfx942", ["gfx942"]) == {**COMMON, **HIPBLASLT, "PYTORCH_ROCM_ARCH": "gfx942"}


def test_gfx1030_is_native_rdna2_no_override_no_hipblaslt():
    # torch without gfx1030 kernels still gets no override: gfx1030 has no better target to pretend to be.
    assert env_for("gfx1030", ["gfx942"]) == {**COMMON, "PYTORCH_ROCM_ARCH": "gfx1030"}


def test_gfx906_has_no_hipblaslt():
    assert env_for("gfx906", ["gfx906"]) == {**COMMON, "PYTORCH_ROCM_ARCH": "gfx906"}


def test_gfx1100():
    assert env_for("gfx1100", ["gfx1100"]) == {**COMMON, **HIPBLASLT, "PYTORCH_ROCM_ARCH": "gfx1100"}


def test_two_different_gpus_list_both_archs_and_drop_hipblaslt_for_the_rdna2_one():
    assert env_for("gfx1100_gfx1030", ["gfx1100", "gfx1030"]) == {**COMMON, "PYTORCH_ROCM_ARCH": "gfx1100;gfx1030"}


def test_only_the_gpu_that_needs_an_override_gets_the_per_node_form():
    gpus = [AmdGpu(node=1, gfx="gfx1100"), AmdGpu(node=2, gfx="gfx1151")]
    env = exports_of(compute_rocm_env(gpus, BASE_ENV, ["gfx1100"], debug_hip=False))
    assert env["HSA_OVERRIDE_GFX_VERSION_2"] == "11.0.0"
    assert "HSA_OVERRIDE_GFX_VERSION" not in env and "HSA_OVERRIDE_GFX_VERSION_1" not in env
    assert env["PYTORCH_ROCM_ARCH"] == "gfx1100;gfx1151"


def test_gpus_that_all_need_the_same_override_share_the_global_form():
    gpus = [AmdGpu(node=1, gfx="gfx1151"), AmdGpu(node=2, gfx="gfx1101")]
    env = exports_of(compute_rocm_env(gpus, BASE_ENV, ["gfx1100"], debug_hip=False))
    assert env["HSA_OVERRIDE_GFX_VERSION"] == "11.0.0"
    assert not any(name.startswith("HSA_OVERRIDE_GFX_VERSION_") for name in env)


def test_user_set_variables_are_kept():
    environ = {**BASE_ENV, "HSA_OVERRIDE_GFX_VERSION": "11.5.1", "MIOPEN_FIND_MODE": "NORMAL",
               "ROCM_PATH": "/usr/lib/rocm", "LD_LIBRARY_PATH": "/usr/lib/rocm/lib"}
    decisions = compute_rocm_env(detect_gpus(KFD / "gfx1151", None), environ, ["gfx1100"], debug_hip=False)
    kept = {d.name: d.value for d in decisions if d.kept}
    assert kept == {"HSA_OVERRIDE_GFX_VERSION": "11.5.1", "MIOPEN_FIND_MODE": "NORMAL",
                    "ROCM_PATH": "/usr/lib/rocm", "LD_LIBRARY_PATH": "/usr/lib/rocm/lib"}
    env = exports_of(decisions)
    assert not set(kept) & set(env)
    assert env["DEVICE_LIB_PATH"] == "/usr/lib/rocm/llvm/amdgcn/bitcode"  # derived from the user's ROCM_PATH
    assert env["PATH"] == "/usr/bin:/bin:/usr/lib/rocm/bin"


def test_debug_hip_adds_three_switches():
    plain = env_for("gfx942", ["gfx942"])
    debug = env_for("gfx942", ["gfx942"], debug_hip=True)
    assert {k: v for k, v in debug.items() if k not in plain} == {
        "AMD_SERIALIZE_KERNEL": "3", "TORCH_USE_HIP_DSA": "1", "HIP_LAUNCH_BLOCKING": "1"}


def test_exports_are_shell_quoted():
    gpus = [AmdGpu(node=1, gfx="gfx1100"), AmdGpu(node=2, gfx="gfx1030")]
    text = format_exports(compute_rocm_env(gpus, BASE_ENV, ["gfx1100"], debug_hip=False))
    assert "export PYTORCH_ROCM_ARCH='gfx1100;gfx1030'\n" in text


# ------------------------------------------------------------------------------- the real entry point


def test_cli_gfx1151_exports_and_summary():
    done = run_rocm_env("--sysfs-root", str(KFD / "gfx1151"), "--torch-archs", "gfx1100,gfx942")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "export ROCM_PATH=/opt/rocm\n"
        "export PATH=/usr/bin:/bin:/opt/rocm/bin\n"
        "export LD_LIBRARY_PATH=/opt/rocm/lib\n"
        "export DEVICE_LIB_PATH=/opt/rocm/llvm/amdgcn/bitcode\n"
        "export HIP_DEVICE_LIB_PATH=/opt/rocm/llvm/amdgcn/bitcode\n"
        "export PYTORCH_ROCM_ARCH=gfx1151\n"
        "export HSA_OVERRIDE_GFX_VERSION=11.0.0\n"
        "export TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1\n"
        "export TORCH_BLAS_PREFER_HIPBLASLT=1\n"
        "export ROCBLAS_USE_HIPBLASLT=1\n"
        "export MIOPEN_FIND_MODE=FAST\n"
    )
    assert "GPU gfx1151 'ip discovery' (node 1, 80 SIMDs): RDNA3.5" in done.stderr
    assert ("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1: gfx1151 flash/mem-efficient SDPA is experimental in "
            "AOTriton; without it SDPA falls back to the slow math path") in done.stderr


def test_cli_eval_in_bash_sets_the_variables():
    script = (f"eval \"$({sys.executable} -m toolkit.device.rocm_env --quiet "
              f"--sysfs-root {KFD / 'gfx1100_gfx1030'} --torch-archs gfx1100,gfx1030)\"; "
              "echo \"$PYTORCH_ROCM_ARCH|$MIOPEN_FIND_MODE|${TORCH_BLAS_PREFER_HIPBLASLT-unset}\"")
    done = subprocess.run(["bash", "-c", script], cwd=REPO, env=BASE_ENV, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "gfx1100;gfx1030|FAST|unset\n"
    assert done.stderr == ""


def test_cli_no_gpu_prints_nothing():
    done = run_rocm_env("--sysfs-root", str(KFD / "no_gpu"))
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_cli_keeps_user_variables_and_says_so():
    done = run_rocm_env("--sysfs-root", str(KFD / "gfx942"), "--no-probe",
                        env={"MIOPEN_FIND_MODE": "NORMAL", "ROCBLAS_USE_HIPBLASLT": "0"})
    assert done.returncode == 0, done.stderr
    assert "MIOPEN_FIND_MODE" not in done.stdout and "ROCBLAS_USE_HIPBLASLT" not in done.stdout
    assert "export TORCH_BLAS_PREFER_HIPBLASLT=1\n" in done.stdout
    assert "MIOPEN_FIND_MODE=NORMAL: kept, already set by you" in done.stderr
    assert "ROCBLAS_USE_HIPBLASLT=0: kept, already set by you" in done.stderr


def test_cli_debug_hip_and_torch_archs_from_env():
    done = run_rocm_env("--sysfs-root", str(KFD / "gfx1151"), "--debug-hip", "--quiet",
                        env={"TOOLKIT_TORCH_ARCHS": "gfx1151"})
    assert done.returncode == 0, done.stderr
    assert "HSA_OVERRIDE_GFX_VERSION" not in done.stdout
    assert done.stdout.endswith(
        "export AMD_SERIALIZE_KERNEL=3\nexport TORCH_USE_HIP_DSA=1\nexport HIP_LAUNCH_BLOCKING=1\n")
    assert done.stderr == ""


def test_cli_rocminfo_fixture():
    done = run_rocm_env("--rocminfo", str(ROCMINFO / "gfx1151.txt"), "--torch-archs", "gfx942", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "export PYTORCH_ROCM_ARCH=gfx1151\n" in done.stdout
    assert "export HSA_OVERRIDE_GFX_VERSION=11.0.0\n" in done.stdout


def test_cli_probe_of_a_non_rocm_torch_sets_no_override():
    # The venv's torch is a CPU build: the probe runs for real and must say so instead of guessing.
    done = run_rocm_env("--sysfs-root", str(KFD / "gfx1151"))
    assert done.returncode == 0, done.stderr
    assert "HSA_OVERRIDE_GFX_VERSION" not in done.stdout
    assert "not a ROCm build" in done.stderr or "no gfx1151" in done.stderr


def test_main_does_not_import_torch():
    script = (
        "import sys\n"
        "from toolkit.device import rocm_env\n"
        f"rocm_env.main(['--sysfs-root', {str(KFD / 'gfx1151')!r}, '--quiet'])\n"
        f"rocm_env.main(['--rocminfo', {str(ROCMINFO / 'gfx1151.txt')!r}, '--quiet', '--no-probe'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ}, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("ok\n")
