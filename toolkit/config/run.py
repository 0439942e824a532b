"""From the command line to a resolved run: layers, device, preset, validation and auto values."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from toolkit.config.layers import Layer, dotlist_layer, peek, read_yaml_layer
from toolkit.config.load import LoadedConfig, PathCheck, merge_layers
from toolkit.config.resolve import Decision, resolve_auto
from toolkit.device.detect import DeviceInfo, detect_device
from toolkit.config.presets import Preset, choose_preset, load_presets, presets_dir
from toolkit.errors import ConfigError, UserError


@dataclass
class ResolvedRun:
    cfg: DictConfig
    sources: dict[str, str]
    device: DeviceInfo
    preset: Preset
    preset_reason: str
    decisions: list[Decision] = field(default_factory=list)
    layers: list[Layer] = field(default_factory=list)
    batch_size_auto: bool = False   # train.batch_size was auto: the trainer may measure it (train/batch_size.py)
    checkpointing_auto: bool = False  # train.gradient_checkpointing was auto: the trainer may measure it (same file)
    keeps_auto: bool = False  # train.checkpoint_keeps was auto: the trainer may keep nothing where memory is short
    compile_auto: bool = False  # train.compile was auto: the trainer turns it off for a quantized base (not measured)


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Command-line arguments: YAML files, and key=value overrides."""
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    return files, overrides


def load_run(files: list[str | Path], overrides: list[str], device: DeviceInfo | None = None,
             check_paths: PathCheck | None = None) -> ResolvedRun:
    """Merge defaults < preset < files < overrides, validate, and resolve the auto values for the device.

    Every problem of the files (keys given twice), the preset name, the merged config and, with `check_paths`,
    the data, model and output locations is reported in one ConfigError."""
    if not files:
        raise UserError("no config file given\n  usage: ./start_toolkit.sh train CONFIG.yaml [more.yaml ...] [key=value ...]")
    problems: list[str] = []
    user_layers = []
    for f in files:
        try:
            user_layers.append(read_yaml_layer(f))
        except ConfigError as err:
            problems += err.problems
    if overrides:
        user_layers.append(dotlist_layer(overrides))
    if device is None:
        device = detect_device(force_cpu=peek(user_layers, "device.backend", "auto") == "cpu")
    presets = load_presets()
    requested = str(peek(user_layers, "device.preset", "auto"))
    if requested != "auto" and requested not in presets:
        problems.append(f"'device.preset': unknown preset '{requested}'; available: auto, {', '.join(presets)} "
                        f"(files in {presets_dir()})")
        requested = "auto"  # so that the rest of the config is still checked
    preset, reason = choose_preset(requested, device, presets)
    loaded: LoadedConfig = merge_layers([preset.layer] + user_layers, problems, check_paths)
    batch_size_auto = loaded.cfg.train.batch_size == "auto"
    checkpointing_auto = loaded.cfg.train.gradient_checkpointing == "auto"
    keeps_auto = loaded.cfg.train.get("checkpoint_keeps") == "auto"
    compile_auto = loaded.cfg.train.compile == "auto"
    decisions = resolve_auto(loaded.cfg, device, preset)
    return ResolvedRun(loaded.cfg, loaded.sources, device, preset, reason, decisions, loaded.layers, batch_size_auto,
                       checkpointing_auto, keeps_auto, compile_auto)
