"""Disk cache for VAE latents and text-encoder outputs (safetensors), keyed by everything that changes them.

A latent's key: the image file's content hash, its bucket, the model, and the encoder setting (VAE mode).
A text embedding's key: the caption after the fixed caption rules (default caption, trigger word) and the model.
`hits` / `misses` count what the last fill found, so a second run can show that it encoded nothing.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file, save_file

from toolkit.disk import disk_full_named


def cache_key(*parts: object) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:40]


class TensorCache:
    """One safetensors file of named tensors per key, under root/<kind>/<key[:2]>/<key>.safetensors."""

    def __init__(self, root: Path, kind: str):
        self.kind = kind
        self.root = Path(root) / kind
        self.hits = 0
        self.misses = 0

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def fill(self, keys: Sequence[str], compute: Callable[[list[int]], list[dict[str, torch.Tensor]]],
             batch_size: int = 4) -> list[dict[str, torch.Tensor]]:
        """The cached tensors for each key; missing ones come from compute(indices) in batches and are saved."""
        self.hits = self.misses = 0
        out: list[dict[str, torch.Tensor] | None] = [None] * len(keys)
        missing = []
        for i, key in enumerate(keys):
            path = self._path(key)
            if path.is_file():
                out[i] = load_file(str(path))
                self.hits += 1
            else:
                missing.append(i)
        for start in range(0, len(missing), batch_size):
            chunk = missing[start:start + batch_size]
            for i, tensors in zip(chunk, compute(chunk)):
                tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
                self._save(self._path(keys[i]), tensors)
                out[i] = tensors
                self.misses += 1
        return out  # type: ignore[return-value]

    def _save(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        with disk_full_named(f"the {self.kind} cache", self.root, needed, "this entry", remove=tmp,
                             fix="free space on that disk, or set TOOLKIT_CACHE to a folder on another disk, then "
                                 "run the same command (the entries already cached are kept)"):
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp))
            os.replace(tmp, path)  # atomic: a crash never leaves a half-written cache entry
