"""The AMD GPUs in this machine and what the installed torch was built for, without importing torch.

The GPUs come from the kernel driver's KFD topology in sysfs, or from `rocminfo` output; which gfx targets the
installed torch has kernels for is asked of a subprocess (torch.cuda.get_arch_list(), which reads the compiled
arch flags and never starts the HIP runtime). rocm_env.py decides the launcher's variables from both, and
`doctor` reads the GPUs the driver reports.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from toolkit.device.archs import AmdArch, bare_arch_name, gfx_from_target_version, lookup_amd_arch

KFD_NODES = Path("sys/class/kfd/kfd/topology/nodes")
AMD_PCI_VENDOR_ID = 0x1002
DEFAULT_ROCM_PATH = "/opt/rocm"
TORCH_PROBE_TIMEOUT_S = 30.0

# Imports nothing but torch, and never starts the HIP runtime: get_arch_list() reads the compiled
# arch flags, so it answers even when the GPU itself is unusable without an override.
_TORCH_PROBE = (
    "import json, torch\n"
    "hip = torch.version.hip\n"
    "print(json.dumps({'hip': hip, 'archs': torch.cuda.get_arch_list() if hip else []}))\n"
)


@dataclass(frozen=True)
class AmdGpu:
    """One AMD GPU as the kernel driver (KFD) or rocminfo reports it."""

    node: int | None
    """KFD topology node number (CPU nodes come first); also the suffix of HSA_OVERRIDE_GFX_VERSION_<node>."""
    gfx: str
    """Bare gfx target, e.g. "gfx1151"."""
    name: str = ""
    """What the source calls it: the KFD node name or rocminfo's Marketing Name (may be empty)."""
    simd_count: int | None = None

    @property
    def arch(self) -> AmdArch | None:
        return lookup_amd_arch(self.gfx)

    def describe(self) -> str:
        arch = self.arch
        where = f"node {self.node}" if self.node is not None else "rocminfo"
        what = f"{arch.family}, {arch.products}" if arch else "not in the toolkit's architecture table"
        label = f" '{self.name}'" if self.name else ""
        simds = f", {self.simd_count} SIMDs" if self.simd_count else ""
        return f"{self.gfx}{label} ({where}{simds}): {what}"


def _read_kfd_properties(text: str) -> dict[str, int]:
    """`name value` lines, as the driver writes them (every value is an unsigned integer)."""
    props: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            props[parts[0]] = int(parts[1])
    return props


def read_kfd_topology(sysfs_root: Path) -> list[AmdGpu]:
    """GPU nodes under `<sysfs_root>/sys/class/kfd/kfd/topology/nodes`; CPU nodes (gfx_target_version 0) are skipped."""
    nodes_dir = Path(sysfs_root) / KFD_NODES
    if not nodes_dir.is_dir():
        return []
    gpus = []
    node_dirs = sorted((p for p in nodes_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    for node_dir in node_dirs:
        try:
            props = _read_kfd_properties((node_dir / "properties").read_text())
        except OSError as exc:
            # The driver answers EPERM for GPUs outside this process's device cgroup.
            print(f"rocm_env: skipping KFD node {node_dir.name}: {exc.strerror}", file=sys.stderr)
            continue
        gfx = gfx_from_target_version(props.get("gfx_target_version", 0))
        if gfx is None or props.get("simd_count", 0) == 0:
            continue
        if props.get("vendor_id", AMD_PCI_VENDOR_ID) != AMD_PCI_VENDOR_ID:
            continue
        name_file = node_dir / "name"
        name = name_file.read_text().strip() if name_file.is_file() else ""
        gpus.append(AmdGpu(node=int(node_dir.name), gfx=gfx, name=name, simd_count=props.get("simd_count")))
    return gpus


_AGENT_HEADER = re.compile(r"^\s*Agent\s+\d+\s*$")


def parse_rocminfo(text: str) -> list[AmdGpu]:
    """GPU agents from `rocminfo` output (`Name: gfx1151`, `Node: 1`, `Device Type: GPU`)."""
    agents: list[dict[str, str]] = []
    for line in text.splitlines():
        if _AGENT_HEADER.match(line):
            agents.append({})
            continue
        if not agents or ":" not in line:
            continue
        key, value = (part.strip() for part in line.split(":", 1))
        # The first occurrence wins: an agent's ISA section repeats `Name:` (amdgcn-amd-amdhsa--gfx1151).
        agents[-1].setdefault(key, value)
    gpus = []
    for agent in agents:
        if agent.get("Device Type") != "GPU" or not agent.get("Name", "").startswith("gfx"):
            continue
        node = agent.get("Node", "")
        gpus.append(AmdGpu(
            node=int(node) if node.isdigit() else None,
            gfx=bare_arch_name(agent["Name"]),
            name=agent.get("Marketing Name", ""),
            simd_count=None,
        ))
    return gpus


def detect_gpus(sysfs_root: Path | str | None, rocminfo_text: str | None) -> list[AmdGpu]:
    """AMD GPUs from rocminfo output when given, otherwise from the KFD topology under `sysfs_root`."""
    if rocminfo_text is not None:
        return parse_rocminfo(rocminfo_text)
    if sysfs_root is None:
        return []
    return read_kfd_topology(Path(sysfs_root))


def run_rocminfo(environ: Mapping[str, str]) -> str | None:
    """Output of the rocminfo binary, if one is installed; None otherwise."""
    rocm_bin = Path(environ.get("ROCM_PATH", DEFAULT_ROCM_PATH)) / "bin" / "rocminfo"
    binary = shutil.which("rocminfo") or (str(rocm_bin) if rocm_bin.is_file() else None)
    if binary is None:
        return None
    try:
        done = subprocess.run([binary], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"rocm_env: could not run {binary}: {exc}", file=sys.stderr)
        return None
    return done.stdout if done.returncode == 0 else None


@dataclass(frozen=True)
class TorchProbe:
    """What the installed torch was built for; archs is None when the probe could not answer."""

    archs: tuple[str, ...] | None
    note: str


def probe_torch_archs(python: str = sys.executable, timeout_s: float = TORCH_PROBE_TIMEOUT_S) -> TorchProbe:
    """Ask a subprocess which gfx targets the installed torch has kernels for (never imports torch here)."""
    try:
        done = subprocess.run([python, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return TorchProbe(None, f"the torch probe took longer than {timeout_s:.0f} s")
    except OSError as exc:
        return TorchProbe(None, f"the torch probe could not start: {exc}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return TorchProbe(None, f"the torch probe failed: {last}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if not answer["hip"]:
        return TorchProbe(None, "the installed torch is not a ROCm build (torch.version.hip is None), "
                                "so it cannot use this GPU; install a ROCm wheel of torch")
    archs = tuple(bare_arch_name(a) for a in answer["archs"])
    return TorchProbe(archs, f"torch {answer['hip']} (HIP) has kernels for {', '.join(archs) or 'nothing'}")
