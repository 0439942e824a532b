"""Where the toolkit keeps things: its cache folder; and the prefix of the tiny test models' names (toolkit/tiny
resolves them to folders)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """TOOLKIT_CACHE, default ~/.cache/lora-toolkit: tiny models, latent and text-embedding caches."""
    return Path(os.environ.get("TOOLKIT_CACHE", Path.home() / ".cache" / "lora-toolkit"))


TINY_PREFIX = "tiny:"


def compiled_code_folders() -> None:
    """Where torch.compile keeps compiled code: under the cache folder (inductor's FX graph and AOTAutograd caches
    in TORCHINDUCTOR_CACHE_DIR, Triton's kernels in TRITON_CACHE_DIR), unless the user set them. Set before torch
    is imported (`python -m toolkit` does it first): inductor fixes its folder the first time it asks; the
    variables reach the training processes and torch.compile's workers too."""
    root = cache_root() / "compiled"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
