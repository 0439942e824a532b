"""Aspect-ratio buckets: a table of sizes of about resolution^2 area, and the choice of one per image.

An image is never upscaled: it goes to the table bucket closest to its aspect ratio when that bucket fits
inside it, else to the largest table bucket that fits, else to its own size rounded down to the step.
"""

from __future__ import annotations

import math


def bucket_table(resolution: int, step: int = 64, min_side: int = 0, max_side: int = 0) -> list[tuple[int, int]]:
    """(width, height) pairs, sides multiples of `step`, area <= resolution^2, sorted by aspect ratio."""
    min_side = max(step, min_side or step)
    max_side = max_side or resolution * 2
    area = resolution * resolution
    square = (resolution // step) * step
    sizes = {(square, square)} if square >= min_side else set()
    width = min_side
    while width <= max_side:
        height = min(max_side, (area // width) // step * step)
        if height >= min_side:
            sizes.add((width, height))
        width += step
    if not sizes:
        raise ValueError(f"no bucket between {min_side} and {max_side} px fits resolution {resolution}")
    return sorted(sizes, key=lambda s: (s[0] / s[1], s[0]))


def choose_bucket(width: int, height: int, table: list[tuple[int, int]], step: int = 64) -> tuple[int, int] | None:
    """The bucket for an image of width x height (never larger than the image); None when under one step."""
    ratio = math.log(width / height)
    best = min(table, key=lambda s: (abs(math.log(s[0] / s[1]) - ratio), -s[0] * s[1]))
    if best[0] <= width and best[1] <= height:
        return best
    fitting = [s for s in table if s[0] <= width and s[1] <= height]
    if fitting:
        return max(fitting, key=lambda s: (s[0] * s[1], -abs(math.log(s[0] / s[1]) - ratio)))
    own = (width // step * step, height // step * step)
    return own if min(own) >= step else None


def format_bucket_table(counts: dict[tuple[int, int], int]) -> str:
    """One line per used bucket: size, aspect ratio and image count."""
    lines = [f"  {w:>5} x {h:<5} (ratio {w / h:4.2f}): {n} image{'s' if n != 1 else ''}"
             for (w, h), n in sorted(counts.items(), key=lambda kv: kv[0][0] / kv[0][1])]
    return "buckets:\n" + "\n".join(lines)
