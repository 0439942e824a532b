"""network.init_from before anything loads: a LoRA that exists, of this family's runs (or its kin's). A run that
resumes never reads it, so a run folder with checkpoints has it checked by nobody (train/trainer.py says the same
when the run starts)."""

from __future__ import annotations

from pathlib import Path

import yaml

from toolkit.config.families import FAMILY_SPECS

INIT_FROM_FIX = "give a LoRA file (.safetensors), an adapter folder, a run folder or a checkpoint folder"


def other_family(path: Path, family: str) -> tuple[str, str] | None:
    """(what is wrong, the fix) for a run folder, its final/ or a checkpoint whose run (config.yaml) trained another
    family than `family` or its kin (FamilySpec.lora_kin: the same denoiser); None otherwise. Preflight lists it with
    the config's other problems; the trainer raises it (network.init_from: ...)."""
    for config in (path / "config.yaml", path.parent / "config.yaml"):
        if not config.is_file():
            continue
        try:
            trained = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("model", {}).get("family")
        except (yaml.YAMLError, OSError, UnicodeDecodeError, AttributeError):
            return None
        kin = FAMILY_SPECS[family].lora_kin if family in FAMILY_SPECS else ()
        if isinstance(trained, str) and trained != family and trained not in kin:
            return (f"{path} is the LoRA of a {trained} run ({config}), and this run trains {family}",
                    f"give a {family} LoRA (a run folder, its final/, a checkpoint or a .safetensors file)")
        return None
    return None


def init_from_problems(init_from: object, family: str, output_dir: object, where: str) -> list[str]:
    """network.init_from (`init_from`, set in `where`) for a run in `output_dir`: it exists and is this family's."""
    if not isinstance(init_from, str) or not init_from:
        return []
    if isinstance(output_dir, str) and output_dir and _has_checkpoints(Path(output_dir)):
        return []  # resuming (unless --fresh, which train checks again)
    path = Path(init_from).expanduser()
    if not path.exists():
        relative = "" if path.is_absolute() else f" (relative paths are taken from {Path.cwd()})"
        return [f"'network.init_from' in {where}: {path} does not exist{relative}; {INIT_FROM_FIX}"]
    foreign = other_family(path, family)
    return [] if foreign is None else [f"'network.init_from' in {where}: {foreign[0]}; {foreign[1]}"]


def _has_checkpoints(run: Path) -> bool:
    folder = run / "checkpoints"
    return folder.is_dir() and any((step / "meta.json").is_file() for step in folder.glob("step-*"))
