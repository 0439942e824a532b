"""Tiny, deterministic random models written in the real Hugging Face layout.

Tests and the quickstart configs use `model.name_or_path: tiny:<kind>`: the first use writes the
model into the cache folder (TOOLKIT_CACHE, default ~/.cache/lora-toolkit) and everything then
loads it through the same `from_pretrained` path as a Hub id. Nothing is downloaded.

    python -m toolkit.tiny llm /tmp/tiny-llm     # write one to a folder of your choice
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from toolkit.config.families import TINY_WRITERS
from toolkit.paths import TINY_PREFIX, cache_root
from toolkit.rng import rng_untouched

# Bump when a writer changes, so caches of older tiny models are not reused.
TINY_VERSION = "2"  # 2: tiny:ltx2's audio VAE compresses time and mel bins by 4


def tiny_writer(kind: str) -> Callable[[Path], None]:
    module_name, function = TINY_WRITERS[kind].split(":")
    return getattr(importlib.import_module(module_name), function)


def write_tiny(kind: str, out: Path) -> Path:
    """Write tiny model `kind` into `out` atomically (a temporary folder renamed into place)."""
    if kind not in TINY_WRITERS:
        from toolkit.errors import UserError
        raise UserError(f"unknown tiny model 'tiny:{kind}'; available: {', '.join('tiny:' + k for k in TINY_WRITERS)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # Writers seed torch, which reseeds every GPU's generator too: a run that writes its tiny model must find
        # all its streams (CPU and GPU) as they were, or it trains differently from one that finds the model.
        with rng_untouched():
            tiny_writer(kind)(tmp)
        (tmp / "tiny_model.json").write_text(json.dumps({"kind": kind, "version": TINY_VERSION}) + "\n")
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "tiny_model.json").exists():  # another process did not win the race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def tiny_folder(name: str) -> Path:
    """The cache folder of `tiny:<kind>` (written there on first use; tiny_model.json marks it complete)."""
    return cache_root() / "tiny" / f"{name[len(TINY_PREFIX):]}-v{TINY_VERSION}"


def resolve_model_path(name_or_path: str) -> str:
    """Map `tiny:<kind>` to a cached folder (written on first use); anything else is returned as is."""
    if not name_or_path.startswith(TINY_PREFIX):
        return name_or_path
    out = tiny_folder(name_or_path)
    if not (out / "tiny_model.json").exists():
        write_tiny(name_or_path[len(TINY_PREFIX):], out)
    return str(out)
