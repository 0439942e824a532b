"""Where the toolkit keeps things: its cache folder; and the prefix of the tiny test models' names (toolkit/tiny
resolves them to folders)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """TOOLKIT_CACHE, default ~/.cache/lora-toolkit: tiny models, latent and text-embedding caches."""
    return Path(os.environ.get("TOOLKIT_CACHE", Path.home() / ".cache" / "lora-toolkit"))


TINY_PREFIX = "tiny:"
