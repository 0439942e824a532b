"""The AMD GPU architecture table (shared/ROCM.md), as data. Imports nothing heavy: no torch.

Used before Python starts torch (`toolkit.device.rocm_env`, from the launcher) and after
(`toolkit.device.detect`), so both sides agree on what each architecture can do.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AmdArch:
    """What the toolkit needs to know about one AMD GPU architecture (a gfx target)."""

    name: str
    """Bare target name, e.g. "gfx1151"."""
    family: str
    """Marketing family: "GCN5", "CDNA1".."CDNA4", "RDNA2", "RDNA3", "RDNA3.5", "RDNA4"."""
    products: str
    """Products built on this target, for messages."""
    bf16: bool
    """Whether to train in bf16 (decided by arch: torch.cuda.is_bf16_supported() says True everywhere)."""
    matrix_cores: str
    """"none", "MFMA" (CDNA) or "WMMA" (RDNA3 and later)."""
    sdpa: str
    """Flash / memory-efficient SDPA through AOTriton: "none" (math only), "supported" or "experimental"
    (needs TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1, otherwise SDPA silently uses the math path)."""
    hipblaslt: bool
    """Whether hipBLASLt supports this arch (TORCH_BLAS_PREFER_HIPBLASLT / ROCBLAS_USE_HIPBLASLT)."""
    hsa_override: str | None
    """HSA_OVERRIDE_GFX_VERSION to use ONLY when the installed torch has no kernels for this arch."""
    integrated: bool
    """Unified-memory APU: its "VRAM" is system memory."""
    notes: str = ""
    """Anything a decision message should mention (e.g. gfx908's slow bf16)."""


def _rdna2(name: str, products: str, integrated: bool = False) -> AmdArch:
    # gfx1030 is the one RDNA2 target PyTorch ships kernels for; the others run its code objects.
    return AmdArch(
        name=name, family="RDNA2", products=products, bf16=False, matrix_cores="none", sdpa="none",
        hipblaslt=False, hsa_override=None if name == "gfx1030" else "10.3.0", integrated=integrated,
    )


_TABLE: tuple[AmdArch, ...] = (
    AmdArch("gfx906", "GCN5", "MI50/MI60, Radeon VII", bf16=False, matrix_cores="none",
            sdpa="none", hipblaslt=False, hsa_override=None, integrated=False,
            notes="GCN5 (CDNA0): no bf16, fp16 with loss scaling"),
    AmdArch("gfx908", "CDNA1", "MI100", bf16=True, matrix_cores="MFMA",
            sdpa="none", hipblaslt=False, hsa_override=None, integrated=False,
            notes="bf16 works but is slow on CDNA1 (MFMA bf16 runs at half the fp16 rate)"),
    AmdArch("gfx90a", "CDNA2", "MI210/MI250/MI250X", bf16=True, matrix_cores="MFMA",
            sdpa="supported", hipblaslt=True, hsa_override=None, integrated=False),
    AmdArch("gfx942", "CDNA3", "MI300X/MI300A/MI325X", bf16=True, matrix_cores="MFMA",
            sdpa="supported", hipblaslt=True, hsa_override=None, integrated=False),
    AmdArch("gfx950", "CDNA4", "MI350X/MI355X", bf16=True, matrix_cores="MFMA",
            sdpa="supported", hipblaslt=True, hsa_override=None, integrated=False),
    _rdna2("gfx1030", "RX 6800/6800 XT/6900 XT/6950 XT, W6800 (Navi 21)"),
    _rdna2("gfx1031", "RX 6700/6700 XT/6750 XT (Navi 22)"),
    _rdna2("gfx1032", "RX 6600/6600 XT/6650 XT (Navi 23)"),
    _rdna2("gfx1033", "Van Gogh iGPU (Steam Deck)", integrated=True),
    _rdna2("gfx1034", "RX 6400/6500 XT (Navi 24)"),
    _rdna2("gfx1035", "Radeon 660M/680M iGPU (Rembrandt)", integrated=True),
    _rdna2("gfx1036", "Radeon iGPU (Raphael / Ryzen 7000 desktop)", integrated=True),
    AmdArch("gfx1100", "RDNA3", "RX 7900 XTX/XT/GRE, W7900", bf16=True, matrix_cores="WMMA",
            sdpa="supported", hipblaslt=True, hsa_override=None, integrated=False,
            notes="flash/mem-efficient SDPA was experimental in some older AOTriton releases"),
    AmdArch("gfx1101", "RDNA3", "RX 7800 XT/7700 XT, W7800", bf16=True, matrix_cores="WMMA",
            sdpa="experimental", hipblaslt=True, hsa_override="11.0.0", integrated=False),
    AmdArch("gfx1102", "RDNA3", "RX 7600/7600 XT", bf16=True, matrix_cores="WMMA",
            sdpa="experimental", hipblaslt=True, hsa_override=None, integrated=False),
    AmdArch("gfx1103", "RDNA3", "Radeon 780M/760M iGPU (Phoenix)", bf16=True, matrix_cores="WMMA",
            sdpa="experimental", hipblaslt=True, hsa_override="11.0.2", integrated=True),
    AmdArch("gfx1150", "RDNA3.5", "Radeon 890M/880M (Strix Point)", bf16=True, matrix_cores="WMMA",
            sdpa="experimental", hipblaslt=True, hsa_override="11.0.2", integrated=True),
    AmdArch("gfx1151", "RDNA3.5", "Radeon 8060S (Ryzen AI Max, Strix Halo), up to 128 GB unified",
            bf16=True, matrix_cores="WMMA", sdpa="experimental", hipblaslt=True,
            hsa_override="11.0.0", integrated=True,
            notes="flash/mem-efficient SDPA is experimental before AOTriton 0.12"),
    AmdArch("gfx1200", "RDNA4", "RX 9060/9060 XT", bf16=True, matrix_cores="WMMA",
            sdpa="experimental", hipblaslt=True, hsa_override=None, integrated=False),
    AmdArch("gfx1201", "RDNA4", "RX 9070/9070 XT, AI PRO R9700", bf16=True, matrix_cores="WMMA",
            sdpa="supported", hipblaslt=True, hsa_override=None, integrated=False),
)

AMD_ARCHS: dict[str, AmdArch] = {arch.name: arch for arch in _TABLE}


def bare_arch_name(gcn_arch_name: str) -> str:
    """Strip target features: "gfx942:sramecc+:xnack-" -> "gfx942"."""
    return gcn_arch_name.strip().split(":", 1)[0]


def lookup_amd_arch(name: str) -> AmdArch | None:
    """The table row for a bare or full gcnArchName ("gfx1151", "gfx942:sramecc+:xnack-"), or None."""
    return AMD_ARCHS.get(bare_arch_name(name).lower())


def gfx_from_target_version(v: int) -> str | None:
    """KFD `gfx_target_version` -> gfx name: 110501 -> "gfx1151", 90010 -> "gfx90a"; 0 (CPU node) -> None.

    The number is major*10000 + minor*100 + stepping in decimal; the gfx name writes minor and
    stepping as one hex digit each (9.0.10 -> gfx90a).
    """
    if v <= 0:
        return None
    major, rest = divmod(v, 10000)
    minor, stepping = divmod(rest, 100)
    if minor > 15 or stepping > 15:
        raise ValueError(f"gfx_target_version {v} does not decode to a gfx name (minor {minor}, stepping {stepping})")
    return f"gfx{major}{minor:x}{stepping:x}"
