"""Pictures of a run: logs/loss.png from metrics.jsonl, and sample grids for image families."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a crash mid-write) is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records
              if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    # A resumed run appends to the same file: later records for a step replace earlier ones.
    latest = dict(points)
    steps = sorted(latest)
    return steps, [latest[s] for s in steps]


def plot_loss(metrics_path: Path, out_path: Path) -> Path | None:
    """Plot loss, smoothed loss and eval loss against step into out_path (PNG); None when nothing is logged yet."""
    records = read_metrics(metrics_path)
    steps, loss = _series(records, "loss")
    if not steps:
        return None
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5), dpi=100)
    ax = fig.add_subplot()
    marker = "o" if len(steps) < 20 else None  # a line through one or two points is invisible
    ax.plot(steps, loss, color="#9ab", linewidth=1, marker=marker, label="loss")
    smooth_steps, smoothed = _series(records, "loss_smoothed")
    if smooth_steps:
        ax.plot(smooth_steps, smoothed, color="#1f5fa8", linewidth=2, marker=marker, label="loss (smoothed)")
    eval_steps, eval_loss = _series(records, "eval_loss")
    if eval_steps:
        ax.plot(eval_steps, eval_loss, "o-", color="#c0392b", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out_path)  # a reader (the report, a browser) never sees a half-written PNG
    return out_path
