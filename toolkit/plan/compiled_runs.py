"""Which compiled runs this machine has made: so that `train.compile: auto` compiles a short run whose compiled code
is already in the cache (its first step then loads it in seconds) and keeps a short run eager where the compile
would be paid in full.

A record is keyed by the settings that shape the compiled graphs, as the user asked for them (`auto` included,
so that a plan can compute the key before anything is loaded): the model, network, data and device sections and
the train settings of precision, batch and memory, with the GPU's name and the torch version. A key that matches
while the graphs differ (a new aspect-ratio bucket, say) costs one compile; a changed setting outside the key
cannot make a run compile that auto would have kept eager for long, because the record is only consulted for
runs too short to repay a cold compile. Records are kept beside the compiled code (cache_root()/compiled), and
one whose code folder is gone (a cleared cache) no longer counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from toolkit.paths import cache_root

SECTIONS = ("model", "network", "data", "device")
TRAIN_KEYS = ("batch_size", "precision", "gradient_checkpointing", "checkpoint_offload", "checkpoint_keeps",
              "compile_recompute", "compile_regions", "cuda_graphs", "objective", "train_text_encoder")


def records_file() -> Path:
    return cache_root() / "compiled" / "runs.json"


def _code_folder() -> Path:
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", cache_root() / "compiled" / "inductor"))


def signature(asked: DictConfig, device_name: str) -> str:
    """The key of a run's compiled code: a hash of the shaping settings as asked, the GPU and torch."""
    import torch

    shaping = {name: OmegaConf.to_container(asked[name], resolve=True) for name in SECTIONS if name in asked}
    shaping["train"] = {k: OmegaConf.select(asked, f"train.{k}") for k in TRAIN_KEYS}
    shaping["gpu"], shaping["torch"] = device_name, torch.__version__
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:24]


def compiled_runs() -> dict[str, dict]:
    """key -> {"first_step_s", "family", "date"} of the compiled runs whose code is still cached; {} when there
    are none (or the records file is unreadable: then every short run is planned as if nothing was cached)."""
    folder = _code_folder()
    if not folder.is_dir() or not any(folder.iterdir()):
        return {}
    try:
        records = json.loads(records_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def record_compiled(key: str, family: str, first_step_s: float) -> None:
    """Note that a run of `key` compiled (its first step took `first_step_s`); written whole, then renamed."""
    path = records_file()
    try:
        records = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        records = {}
    records[key] = {"first_step_s": round(first_step_s, 1), "family": family,
                    "date": time.strftime("%Y-%m-%d", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(records, indent=1), encoding="utf-8")
    partial.replace(path)
