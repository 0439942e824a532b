"""Arch presets: YAML data (configs/presets/*.yaml) choosing precision, batch size and the rest per GPU.

A preset file:

    description: what hardware it is for
    match: {backend: hip, archs: [gfx1151], families: [RDNA3.5], generic: false}
    batch_size_by_memory_gb: {0: 1, 32: 2, 96: 4}     # least device memory (GB) -> train.batch_size
    config: {train: {precision: bf16, ...}, model: {attention: sdpa}}   # a config layer

`device.preset: auto` picks the preset whose `archs` list the detected arch, else one whose
`families` list the arch's family, else the backend's generic preset, and says which and why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from toolkit.config.layers import Layer, read_yaml_layer
from toolkit.device.archs import lookup_amd_arch
from toolkit.device.detect import DeviceInfo
from toolkit.errors import ConfigError, UserError

_PRESET_KEYS = {"description", "match", "batch_size_by_memory_gb", "config"}
_MATCH_KEYS = {"backend", "archs", "families", "generic"}


def presets_dir() -> Path:
    override = os.environ.get("TOOLKIT_PRESETS_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "configs" / "presets"


@dataclass
class Preset:
    name: str
    path: Path
    description: str
    backend: str
    archs: list[str] = field(default_factory=list)
    families: list[str] = field(default_factory=list)
    generic: bool = False
    batch_size_by_memory_gb: dict[float, int] = field(default_factory=dict)
    layer: Layer | None = None

    def batch_size_for(self, memory_gb: float) -> tuple[int, str]:
        """The batch size for this much device memory, and why."""
        if not self.batch_size_by_memory_gb:
            return 1, f"preset {self.name} has no batch-size table: 1"
        fitting = [gb for gb in self.batch_size_by_memory_gb if memory_gb >= gb]
        floor = max(fitting) if fitting else min(self.batch_size_by_memory_gb)
        size = self.batch_size_by_memory_gb[floor]
        return size, f"preset {self.name}: {memory_gb:.0f} GB of device memory (>= {floor:g} GB) -> batch size {size}"


def _load_preset(path: Path) -> Preset:
    layer = read_yaml_layer(path, label=f"preset {path.stem}")
    if layer.problems:
        raise ConfigError(layer.problems, header=f"bad preset file {path}")
    raw = layer.data
    unknown = set(raw) - _PRESET_KEYS
    match = raw.get("match") or {}
    unknown |= {f"match.{k}" for k in set(match) - _MATCH_KEYS}
    if unknown or "backend" not in match:
        raise UserError(f"{path}: bad preset file: unknown keys {sorted(unknown)}" if unknown
                        else f"{path}: bad preset file: match.backend is required (cuda, hip or cpu)")
    table = {float(k): int(v) for k, v in (raw.get("batch_size_by_memory_gb") or {}).items()}
    config_layer = Layer(layer.label, raw.get("config") or {},
                         {k[len("config."):]: v for k, v in layer.lines.items() if k.startswith("config.")},
                         preset=True)
    return Preset(name=path.stem, path=path, description=str(raw.get("description", "")),
                  backend=match["backend"], archs=list(match.get("archs") or []),
                  families=list(match.get("families") or []), generic=bool(match.get("generic", False)),
                  batch_size_by_memory_gb=table, layer=config_layer)


def load_presets() -> dict[str, Preset]:
    """All presets by name (the file stem)."""
    folder = presets_dir()
    return {p.stem: _load_preset(p) for p in sorted(folder.glob("*.yaml"))}


def arch_family(device: DeviceInfo) -> str | None:
    """The family used for preset fallback: the AMD table's family, or sm_8x-style for CUDA."""
    if device.backend == "hip":
        info = lookup_amd_arch(device.arch)
        return info.family if info else None
    if device.backend == "cuda" and device.arch.startswith("sm_") and len(device.arch) >= 4:
        return f"sm_{device.arch[3]}x"
    return None


def choose_preset(requested: str, device: DeviceInfo, presets: dict[str, Preset] | None = None) -> tuple[Preset, str]:
    """The preset for `device.preset` (a name or auto) on this device, and the reason for the choice."""
    presets = load_presets() if presets is None else presets
    if requested != "auto":
        if requested not in presets:
            raise UserError(f"device.preset: unknown preset '{requested}'; available: {', '.join(presets)} "
                            f"(files in {presets_dir()})")
        chosen = presets[requested]
        note = ""
        if chosen.backend != device.backend:
            note = f" (note: it is meant for {chosen.backend}, and this device is {device.backend})"
        return chosen, f"preset {requested}: chosen by device.preset{note}"
    same_backend = [p for p in presets.values() if p.backend == device.backend]
    for preset in same_backend:
        if device.arch in preset.archs:
            return preset, f"preset {preset.name}: matches the detected arch {device.arch}"
    family = arch_family(device)
    for preset in same_backend:
        if family and family in preset.families:
            return preset, f"preset {preset.name}: no preset for {device.arch}; same family ({family})"
    for preset in same_backend:
        if preset.generic and device.backend == "cpu":
            return preset, f"preset {preset.name}: the preset for training on the CPU"
        if preset.generic:
            return preset, f"preset {preset.name}: no preset for {device.arch} or its family; generic {device.backend} preset"
    raise UserError(f"no preset fits {device.summary()} and no generic {device.backend} preset exists in {presets_dir()}; "
                    "set device.preset to one of: " + ", ".join(presets))


def describe_presets(device: DeviceInfo | None) -> str:
    """The `presets` listing: each preset, what it sets, and which one applies here."""
    presets = load_presets()
    applied = choose_preset("auto", device, presets)[0].name if device else None
    lines = []
    for preset in presets.values():
        mark = "*" if preset.name == applied else " "
        match = ", ".join(preset.archs) or ("generic" if preset.generic else "")
        lines.append(f"{mark} {preset.name:<12} {preset.backend:<5} {match:<22} {preset.description}")
        settings = ", ".join(f"{k}={v}" for k, v in _flat(preset.layer.data if preset.layer else {}))
        if preset.batch_size_by_memory_gb:
            table = ", ".join(f">={gb:g}GB:{bs}" for gb, bs in sorted(preset.batch_size_by_memory_gb.items()))
            settings += f"; batch size {table}"
        lines.append(f"  {'':<12} {settings}")
    if device:
        lines.append(f"\n* applies to this machine: {device.summary()}")
    return "\n".join(lines)


def _flat(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value

