"""Aspect-ratio buckets: a table of sizes of about resolution^2 area, and the choice of one per image.

An image is never upscaled: it goes to the table bucket closest to its aspect ratio when that bucket fits
inside it, else to the largest table bucket that fits, else to its own size rounded down to the step.
"""

from __future__ import annotations

import math
from collections import Counter

# data.bucket_step=auto: kohya's 64 from this resolution up; below it a finer grid (a multiple of 16: the flow
# families' latent patches are 16 pixels).
AUTO_STEP_FROM, AUTO_STEP, AUTO_STEP_MIN = 512, 64, 16
SHRUNK = 0.75  # an image whose bucket keeps less of the area it could have (at most resolution^2) is named


def bucket_step(value: int | str, resolution: int) -> tuple[int, str]:
    """data.bucket_step as pixels, and where the number came from."""
    if value != "auto":
        return int(value), f"data.bucket_step={value}"
    if resolution >= AUTO_STEP_FROM:
        return AUTO_STEP, f"data.bucket_step=auto: {AUTO_STEP} px, as for every resolution from {AUTO_STEP_FROM} up"
    step = max(AUTO_STEP_MIN, 2 ** int(math.log2(resolution / 8)))
    return step, (f"data.bucket_step=auto: {step} px, resolution {resolution} / 8 rounded down to a power of two, at "
                  f"least {AUTO_STEP_MIN}")


def shrunk_by_step(sizes: dict[str, tuple[tuple[int, int], tuple[int, int]]], resolution: int) -> list[str]:
    """'name (WxH -> WxH)' for each file whose bucket keeps under SHRUNK of the area it could train at
    (its own, at most resolution^2): the grid of the bucket step, not the resolution, made it that small."""
    shrunk = []
    for name, ((w, h), (bw, bh)) in sizes.items():
        if bw * bh < SHRUNK * min(w * h, resolution * resolution):
            shrunk.append(f"{name} ({w}x{h} -> {bw}x{bh})")
    return shrunk


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
    # thinner than every bucket on one side: its own size, floored to the step and held to the table's largest side
    # and area (data.max_bucket_side, resolution^2), the long side cropped
    side, area = max(max(s) for s in table), max(w * h for w, h in table)
    w, h = min(width // step * step, side), min(height // step * step, side)
    if w * h > area:
        if w >= h:
            w = max(area // max(h, 1) // step * step, step)
        else:
            h = max(area // max(w, 1) // step * step, step)
    return (w, h) if min(w, h) >= step else None


def format_bucket_table(counts: dict[tuple[int, int], int] | Counter, why: str = "") -> str:
    """One line per used bucket: size, aspect ratio and image count; `why`: where the step came from."""
    lines = [f"  {w:>5} x {h:<5} (ratio {w / h:4.2f}): {n} image{'s' if n != 1 else ''}"
             for (w, h), n in sorted(counts.items(), key=lambda kv: kv[0][0] / kv[0][1])]
    return f"buckets{f' ({why})' if why else ''}:\n" + "\n".join(lines)
