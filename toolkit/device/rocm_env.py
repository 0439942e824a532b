"""ROCm environment for the launcher, decided before Python imports torch.

HSA and HIP read their variables once, when the runtime starts, so `start_toolkit.sh` evaluates
this module's output before `python -m toolkit` runs:

    eval "$(python -m toolkit.device.rocm_env)"

It reads the GPUs from the KFD topology in sysfs (or `rocminfo` output; amd_gpus.py), prints `export` lines for
the variables shared/ROCM.md asks for, and prints to stderr each GPU and each decision with its
reason. A variable the user already set is never touched. This module must not import torch: the
one question only torch can answer (which gfx targets the installed build has kernels for) is
asked in a subprocess, and only when the answer changes a decision.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from toolkit.device.amd_gpus import (DEFAULT_ROCM_PATH, KFD_NODES, AmdGpu, detect_gpus, probe_torch_archs,
                                     run_rocminfo)
from toolkit.device.archs import bare_arch_name, gfx_from_target_version, lookup_amd_arch

TORCH_ARCHS_ENV = "TOOLKIT_TORCH_ARCHS"
"""Tests (and users who know better) set this to a comma list to skip the torch probe."""


@dataclass(frozen=True)
class EnvDecision:
    """One variable: the value to export (None: deliberately not set), why, and whether the user's value was kept."""

    name: str
    value: str | None
    reason: str
    kept: bool = False

    @property
    def exported(self) -> bool:
        return self.value is not None and not self.kept


# ---------------------------------------------------------------------------------------- decisions


PATH_LIST_VARIABLES = ("PATH", "LD_LIBRARY_PATH")  # the launcher appends a directory to these, never replaces them


def _append_path(environ: Mapping[str, str], name: str, directory: str, why: str) -> EnvDecision:
    current = environ.get(name, "")
    if directory in current.split(os.pathsep):
        return EnvDecision(name, current, f"already contains {directory}", kept=True)
    value = f"{current}{os.pathsep}{directory}" if current else directory
    return EnvDecision(name, value, f"+= {directory}: {why}")


def _gfx_of_override(value: str) -> str:
    """"11.0.2" -> "gfx1102": the target whose kernels an HSA_OVERRIDE_GFX_VERSION value selects."""
    major, minor, stepping = (int(part) for part in value.split("."))
    return gfx_from_target_version(major * 10000 + minor * 100 + stepping) or value


def _hsa_override_decisions(
    gpus: Sequence[AmdGpu], environ: Mapping[str, str], torch_archs: Sequence[str] | None
) -> list[EnvDecision]:
    """HSA_OVERRIDE_GFX_VERSION (or its per-node form), only for GPUs the installed torch has no kernels for.

    libhsakmt reads HSA_OVERRIDE_GFX_VERSION_<n> before HSA_OVERRIDE_GFX_VERSION, where <n> is the
    KFD topology node number (CPU nodes included, so the first GPU is usually 1). One GPU, or GPUs
    that all need the same value, get the global form; otherwise each GPU that needs one gets its own.
    """
    name = "HSA_OVERRIDE_GFX_VERSION"
    with_override = [g for g in gpus if g.arch is not None and g.arch.hsa_override is not None]
    if not with_override:
        return []
    if name in environ:
        return [EnvDecision(name, environ[name], "kept, already set by you", kept=True)]
    gfx_list = ", ".join(sorted({g.gfx for g in with_override}))
    if torch_archs is None:
        return [EnvDecision(name, None, f"not set: could not tell whether torch has kernels for {gfx_list} "
                                        "(not probed); if it has none, set it yourself")]
    needing = [g for g in with_override if g.gfx not in torch_archs]
    if not needing:
        return [EnvDecision(name, None, f"not set: the installed torch has native kernels for {gfx_list}")]
    values = {g.arch.hsa_override for g in needing}
    if len(needing) == len(gpus) and len(values) == 1:
        (value,) = values
        arches = ", ".join(sorted({g.gfx for g in needing}))
        return [EnvDecision(name, value, f"the installed torch has no {arches} kernels; "
                                         f"run its {_gfx_of_override(value)} kernels instead")]
    decisions = []
    for gpu in needing:
        if gpu.node is None:
            return [EnvDecision(name, None, "not set: GPUs differ and rocminfo gave no node numbers "
                                            "for the per-node form; set HSA_OVERRIDE_GFX_VERSION_<node> yourself")]
        per_node = f"{name}_{gpu.node}"
        if per_node in environ:
            decisions.append(EnvDecision(per_node, environ[per_node], "kept, already set by you", kept=True))
            continue
        decisions.append(EnvDecision(per_node, gpu.arch.hsa_override,
                                     f"node {gpu.node} is {gpu.gfx}, which the installed torch has no kernels for; "
                                     "per-node form because the other GPUs run natively"))
    return decisions


def compute_rocm_env(
    gpus: Sequence[AmdGpu],
    environ: Mapping[str, str],
    torch_archs: Sequence[str] | None,
    debug_hip: bool,
) -> list[EnvDecision]:
    """Every ROCm variable the launcher manages, in export order; empty when there is no AMD GPU.

    `torch_archs` is the installed torch's gfx targets, or None when unknown (no override is chosen then).
    A variable already in `environ` is kept as it is (kept=True).
    """
    if not gpus:
        return []
    rocm_path = environ.get("ROCM_PATH", DEFAULT_ROCM_PATH)
    gfx_in_order = list(dict.fromkeys(g.gfx for g in gpus))
    arches = [g.arch for g in gpus if g.arch is not None]
    label = ", ".join(gfx_in_order)

    decisions: list[EnvDecision] = []

    def add(name: str, value: str, reason: str) -> None:
        if name in environ:
            decisions.append(EnvDecision(name, environ[name], "kept, already set by you", kept=True))
        else:
            decisions.append(EnvDecision(name, value, reason))

    add("ROCM_PATH", DEFAULT_ROCM_PATH, "where ROCm is installed (its default location)")
    decisions.append(_append_path(environ, "PATH", f"{rocm_path}/bin", "rocminfo, amd-smi, hipcc"))
    decisions.append(_append_path(environ, "LD_LIBRARY_PATH", f"{rocm_path}/lib", "ROCm runtime libraries"))
    bitcode = f"{rocm_path}/llvm/amdgcn/bitcode"
    add("DEVICE_LIB_PATH", bitcode, "device libraries for kernels compiled at run time (Triton, extensions)")
    add("HIP_DEVICE_LIB_PATH", bitcode, "the same device libraries, for hipcc/hiprtc")
    add("PYTORCH_ROCM_ARCH", ";".join(gfx_in_order), f"build extensions and Triton kernels for {label} only")
    decisions.extend(_hsa_override_decisions(gpus, environ, torch_archs))

    experimental = [g for g in gfx_in_order if (a := lookup_amd_arch(g)) and a.sdpa == "experimental"]
    if experimental:
        names = ", ".join(experimental)
        add("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", "1",
            f"{names} flash/mem-efficient SDPA is experimental in AOTriton; "
            "without it SDPA falls back to the slow math path")
    hipblaslt = [a.name for a in dict.fromkeys(arches) if a.hipblaslt]
    # One GPU without hipBLASLt support in the process is enough to keep both switches off.
    if hipblaslt and len(hipblaslt) == len(gfx_in_order):
        names = ", ".join(hipblaslt)
        add("TORCH_BLAS_PREFER_HIPBLASLT", "1", f"hipBLASLt supports {names}: faster GEMMs than rocBLAS")
        add("ROCBLAS_USE_HIPBLASLT", "1", f"hipBLASLt supports {names}: lets rocBLAS hand GEMMs to it too")
    add("MIOPEN_FIND_MODE", "FAST", "avoids minutes-long first-call convolution searches in MIOpen")
    if debug_hip:
        why = "--debug-hip: slow, but HIP errors point at the kernel that failed"
        add("AMD_SERIALIZE_KERNEL", "3", f"{why} (serialize kernel launches)")
        add("TORCH_USE_HIP_DSA", "1", f"{why} (device-side assertions)")
        add("HIP_LAUNCH_BLOCKING", "1", f"{why} (synchronous launches)")
    return decisions


# -------------------------------------------------------------------------------------------- output


def format_exports(decisions: Sequence[EnvDecision]) -> str:
    """`export NAME=value` lines for the decisions that set something."""
    return "".join(f"export {d.name}={shlex.quote(d.value)}\n" for d in decisions if d.exported)


def format_summary(gpus: Sequence[AmdGpu], decisions: Sequence[EnvDecision], notes: Sequence[str]) -> str:
    lines = ["ROCm environment (toolkit.device.rocm_env):"]
    lines += [f"  GPU {gpu.describe()}" for gpu in gpus]
    lines += [f"  note: {note}" for note in notes]
    for d in decisions:
        if d.kept and d.name in PATH_LIST_VARIABLES:
            lines.append(f"  {d.name}: kept, {d.reason}")
        elif d.kept:
            lines.append(f"  {d.name}={d.value}: {d.reason}")
        elif d.value is None:
            lines.append(f"  {d.name}: {d.reason}")
        elif d.name in PATH_LIST_VARIABLES:  # the whole value is noise, the appended part is the news
            lines.append(f"  {d.name} {d.reason}")
        else:
            lines.append(f"  {d.name}={d.value}: {d.reason}")
    return "\n".join(lines) + "\n"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m toolkit.device.rocm_env",
        description="Print `export` lines for the ROCm environment of the GPUs in this machine (no torch import).",
    )
    parser.add_argument("--sysfs-root", type=Path, default=None,
                        help="read <DIR>/sys/class/kfd/... instead of the real /sys (tests use fake trees)")
    parser.add_argument("--rocminfo", type=Path, default=None, metavar="FILE",
                        help="parse this saved rocminfo output instead of reading sysfs")
    parser.add_argument("--debug-hip", action="store_true",
                        help="also set AMD_SERIALIZE_KERNEL=3, TORCH_USE_HIP_DSA=1, HIP_LAUNCH_BLOCKING=1")
    parser.add_argument("--no-probe", action="store_true",
                        help="do not start a torch subprocess to see which gfx targets it has kernels for")
    parser.add_argument("--torch-archs", default=None, metavar="LIST",
                        help=f"comma list of the gfx targets torch has kernels for, instead of probing "
                             f"(also ${TORCH_ARCHS_ENV})")
    parser.add_argument("--format", choices=("sh", "json"), default="sh")
    parser.add_argument("--quiet", action="store_true", help="no summary on stderr")
    return parser.parse_args(argv)


def _torch_archs(args: argparse.Namespace, gpus: Sequence[AmdGpu], environ: Mapping[str, str]
                 ) -> tuple[tuple[str, ...] | None, list[str]]:
    listed = args.torch_archs if args.torch_archs is not None else environ.get(TORCH_ARCHS_ENV)
    if listed is not None:
        archs = tuple(bare_arch_name(a) for a in listed.split(",") if a.strip())
        return archs, [f"torch kernels given as {', '.join(archs) or 'none'} (not probed)"]
    if not any(g.arch is not None and g.arch.hsa_override is not None for g in gpus):
        return None, []  # no GPU here has an override to choose: the answer changes nothing
    if args.no_probe:
        return None, ["torch not probed (--no-probe)"]
    probe = probe_torch_archs()
    return probe.archs, [probe.note]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    environ = os.environ
    if args.rocminfo is not None:
        gpus = detect_gpus(None, args.rocminfo.read_text())
    elif args.sysfs_root is not None:
        gpus = detect_gpus(args.sysfs_root, None)
    elif (Path("/") / KFD_NODES).is_dir():
        gpus = detect_gpus(Path("/"), None)
    else:
        rocminfo_text = run_rocminfo(environ)
        gpus = detect_gpus(None, rocminfo_text) if rocminfo_text is not None else []

    torch_archs, notes = _torch_archs(args, gpus, environ) if gpus else (None, [])
    decisions = compute_rocm_env(gpus, environ, torch_archs, args.debug_hip)
    if args.format == "json":
        print(json.dumps({"gpus": [asdict(g) for g in gpus], "env": [asdict(d) for d in decisions],
                          "notes": notes}, indent=2))
    else:
        sys.stdout.write(format_exports(decisions))
    if gpus and not args.quiet:
        sys.stderr.write(format_summary(gpus, decisions, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
