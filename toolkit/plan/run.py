"""From the command line to a resolved run: layers, device, preset, validation and the static plan.

The merged config is frozen here and never written again: `asked` is what the user asked for (`auto` where they
left it; the run folder's config.yaml), `plan` holds what each `auto` became and why, and `cfg` is the two laid
over each other (read-only) for the code that needs the values a run uses. Later stages of the plan (the model
loaded, memory measured) extend `plan`; they never touch either config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from toolkit.config.layers import Layer, dotlist_layer, peek, read_yaml_layer
from toolkit.config.load import LoadedConfig, PathCheck, as_text, merge_layers, resolved_container
from toolkit.config.presets import Preset, choose_preset, load_presets, presets_dir
from toolkit.device.detect import DeviceInfo, detect_device
from toolkit.errors import ConfigError, UserError
from toolkit.plan.compiled_runs import compiled_runs
from toolkit.plan.decisions import Decision, RunPlan
from toolkit.plan.rules import Facts
from toolkit.plan.stages import decide


def frozen(cfg: DictConfig) -> DictConfig:
    """`cfg` read-only: any write raises (omegaconf's ReadonlyConfigError)."""
    OmegaConf.set_readonly(cfg, True)
    return cfg


def settings_view(asked: DictConfig, plan: RunPlan) -> DictConfig:
    """The values a run uses: the config as asked with the plan's decisions in place, read-only. Settings its
    family does not read keep their defaults here (config.yaml and `validate` leave them out)."""
    return frozen(OmegaConf.create(as_text(plan.effective(OmegaConf.to_container(asked, resolve=True)))))



@dataclass
class ResolvedRun:
    asked: DictConfig               # the merged config as the user asked for it (frozen; `auto` left as given)
    sources: dict[str, str]         # dotted key -> the layer (file:line, preset, command line) that set it
    device: DeviceInfo
    preset: Preset
    preset_reason: str
    plan: RunPlan                   # its static stage; the trainer adds the later ones to a plan of its own
    layers: list[Layer] = field(default_factory=list)
    cfg: DictConfig = None          # asked + plan: the values the run uses (frozen)

    def __post_init__(self):
        if self.cfg is None:
            self.cfg = settings_view(self.asked, self.plan)

    @property
    def decisions(self) -> list[Decision]:
        return list(self.plan)

    def setting(self, plan: RunPlan, key: str):
        """Dotted `key` as the run uses it under `plan` (a later stage's plan): the plan's decision, else the
        config's value (None for a setting the family does not have)."""
        return plan.value(key) if key in plan else OmegaConf.select(self.cfg, key)

    def asked_value(self, key: str):
        """Dotted `key` as the user asked for it (`auto` included)."""
        return OmegaConf.select(self.asked, key)

    def is_auto(self, key: str) -> bool:
        """Whether the user left dotted `key` at auto (so a later stage may settle it)."""
        return self.asked_value(key) == "auto"

    def provenance(self) -> list[tuple[str, str, str]]:
        """(key, value, source) for every key of the config the run uses: the layer and line that set it, or the
        reason an auto value was decided (what `validate` prints; the web UI shows the same)."""
        from toolkit.config.load import flatten

        decided = {d.key: d for d in self.plan}
        rows = []
        for key, value in flatten(resolved_container(self.cfg)):
            source = self.sources.get(key, "default")
            if key in decided:
                source = f"{'auto' if self.asked_value(key) == 'auto' else source}: {decided[key].reason}"
            rows.append((key, repr(value) if isinstance(value, str) and not value else str(value), source))
        return rows


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Command-line arguments: YAML files, and key=value overrides."""
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    return files, overrides


def static_plan(asked: DictConfig, device: DeviceInfo, preset: Preset, sources: dict[str, str]) -> RunPlan:
    """The static stage: what the config and the device settle; ConfigError for what this device cannot run.
    `sources`: where each set value came from (a rule names it when it tells what a setting means here)."""
    facts = Facts(asked, device, extra={"preset": preset, "sources": sources, "compiled_runs": compiled_runs()})
    decisions = decide("static", facts)
    if facts.problems:
        raise ConfigError(facts.problems, header=f"config cannot run as set (on this device: {device.summary()})")
    return RunPlan().with_stage("static", decisions)


def load_run(files: list[str | Path], overrides: list[str], device: DeviceInfo | None = None,
             check_paths: PathCheck | None = None) -> ResolvedRun:
    """Merge defaults < preset < files < overrides, validate, and plan the static stage for the device.

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
    asked = frozen(loaded.cfg)
    return ResolvedRun(asked, loaded.sources, device, preset, reason, static_plan(asked, device, preset, loaded.sources),
                       loaded.layers)
