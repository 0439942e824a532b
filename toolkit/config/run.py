"""From the command line to a resolved run: layers, device, preset, validation and auto values."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from toolkit.config.layers import Layer, dotlist_layer, peek, read_yaml_layer
from toolkit.config.load import LoadedConfig, merge_layers
from toolkit.config.resolve import Decision, resolve_auto
from toolkit.device.detect import DeviceInfo, detect_device
from toolkit.config.presets import Preset, choose_preset
from toolkit.errors import UserError


@dataclass
class ResolvedRun:
    cfg: DictConfig
    sources: dict[str, str]
    device: DeviceInfo
    preset: Preset
    preset_reason: str
    decisions: list[Decision] = field(default_factory=list)
    layers: list[Layer] = field(default_factory=list)


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Command-line arguments: YAML files, and key=value overrides."""
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    return files, overrides


def load_run(files: list[str | Path], overrides: list[str], device: DeviceInfo | None = None) -> ResolvedRun:
    """Merge defaults < preset < files < overrides, validate, and resolve the auto values for the device."""
    if not files:
        raise UserError("no config file given\n  usage: ./start_toolkit.sh train CONFIG.yaml [more.yaml ...] [key=value ...]")
    user_layers = [read_yaml_layer(f) for f in files] + ([dotlist_layer(overrides)] if overrides else [])
    if device is None:
        device = detect_device(force_cpu=peek(user_layers, "device.backend", "auto") == "cpu")
    preset, reason = choose_preset(str(peek(user_layers, "device.preset", "auto")), device)
    loaded: LoadedConfig = merge_layers([preset.layer] + user_layers)
    decisions = resolve_auto(loaded.cfg, device, preset)
    return ResolvedRun(loaded.cfg, loaded.sources, device, preset, reason, decisions, loaded.layers)
