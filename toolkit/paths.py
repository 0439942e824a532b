"""Where the toolkit keeps things: its cache folder, and the folder a model name stands for."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """TOOLKIT_CACHE, default ~/.cache/lora-toolkit: tiny models, latent and text-embedding caches."""
    return Path(os.environ.get("TOOLKIT_CACHE", Path.home() / ".cache" / "lora-toolkit"))


TINY_PREFIX = "tiny:"


def resolve_model_path(name_or_path: str) -> str:
    """Map `tiny:<kind>` to a cached folder (written on first use); anything else is returned as is."""
    from toolkit.tiny import TINY_VERSION, write_tiny

    if not name_or_path.startswith(TINY_PREFIX):
        return name_or_path
    kind = name_or_path[len(TINY_PREFIX):]
    out = cache_root() / "tiny" / f"{kind}-v{TINY_VERSION}"
    if not (out / "tiny_model.json").exists():
        write_tiny(kind, out)
    return str(out)
