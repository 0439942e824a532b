"""Sample media: a grid of still images in one PNG."""

from __future__ import annotations

import math
import os
from pathlib import Path


def make_grid(image_paths: list[Path], out_path: Path, columns: int | None = None, cell: int = 256) -> Path:
    """Tile images into one PNG grid, row by row; each is shrunk to fit a square cell of `cell` pixels,
    or of the largest image's side when that is smaller (tiny test images make a tiny grid)."""
    from PIL import Image

    if not image_paths:
        raise ValueError("make_grid needs at least one image")
    sizes = []
    for path in image_paths:
        with Image.open(path) as img:
            sizes.append(max(img.size))
    cell = min(cell, max(sizes))
    columns = columns or math.ceil(math.sqrt(len(image_paths)))
    rows = math.ceil(len(image_paths) / columns)
    grid = Image.new("RGB", (columns * cell, rows * cell), "white")
    for index, path in enumerate(image_paths):
        with Image.open(path) as img:
            tile = img.convert("RGB")
        tile.thumbnail((cell, cell))
        x = (index % columns) * cell + (cell - tile.width) // 2
        y = (index // columns) * cell + (cell - tile.height) // 2
        grid.paste(tile, (x, y))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    grid.save(tmp, format="PNG")
    os.replace(tmp, out_path)
    return out_path
