"""What one run folder holds, read as the trainer writes it: metrics.jsonl, samples/, checkpoints/ (meta.json),
config.yaml, plan.json and report.html. Every reader tolerates a folder that changes or disappears under it."""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import yaml

from toolkit.train.plots import IMAGE_SUFFIXES

TAIL_BYTES = 16384  # enough for the last few records of metrics.jsonl
# train/checkpoint.py's STEP_DIR, without importing torch with it: the runs pages start and answer without torch.
STEP_DIR = re.compile(r"^step-(\d{6,})$")


def _finite_numbers(record: dict) -> dict:
    """JSON has no NaN: a non-finite loss (a skipped step) is sent as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def read_records(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """The complete records of a JSON-lines file from byte `offset`, and the offset after the last complete line
    (a line still being written is left for the next call)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(_finite_numbers(record))
    return records, offset + end


def last_record(path: Path, key: str) -> dict | None:
    """The last complete record of a JSON-lines file that has `key`, read from the file's tail."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - TAIL_BYTES))
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    for line in reversed(data.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line, or the cut first one
        if isinstance(record, dict) and key in record:
            return _finite_numbers(record)
    return None


def read_config(run: Path) -> dict:
    """The run's resolved config.yaml as data ({} when missing or unreadable)."""
    try:
        data = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def checkpoints(run: Path) -> list[dict]:
    """Finished checkpoints (meta.json written), lowest step first, with their LoRA files."""
    try:
        folders = [(int(m.group(1)), p) for p in (run / "checkpoints").iterdir() if (m := STEP_DIR.match(p.name))]
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for step, folder in sorted(folders):
        try:
            meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # being written, or a folder of someone else's
        files = meta.get("lora_files") or []
        found.append({"step": step, "time": meta.get("time"), "path": str(folder),
                      "files": [{"name": name, "url_path": f"checkpoints/{folder.name}/{name}",
                                 "bytes": meta.get("files", {}).get(name, {}).get("bytes")} for name in files]})
    return found


def final_files(run: Path) -> list[dict]:
    final = run / "final"
    try:
        return [{"name": p.name, "url_path": f"final/{p.name}", "bytes": p.stat().st_size}
                for p in sorted(final.iterdir()) if p.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _prompts_by_index(folder: Path) -> dict[str, str]:
    """prompts.txt of an image family: "00: the prompt" lines."""
    try:
        text = (folder / "prompts.txt").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def sample_set(run: Path, folder: Path) -> dict:
    """One sampling round: its items (prompt with an image or video file, or with text) and its grid."""
    items = []
    records, _ = read_records(folder / "samples.jsonl")
    for record in records:
        items.append({"prompt": record.get("prompt", ""), "text": record.get("completion", "")})
    prompts = _prompts_by_index(folder)
    try:
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.stem != "grid")
    except (FileNotFoundError, NotADirectoryError):
        files = []
    by_stem: dict[str, Path] = {}
    for path in files:  # a video's still (00.png) and its clip (00.webp): the clip is shown
        if path.stem not in by_stem or path.suffix.lower() == ".webp":
            by_stem[path.stem] = path
    for stem, path in sorted(by_stem.items()):
        items.append({"prompt": prompts.get(stem, stem), "url_path": path.relative_to(run).as_posix()})
    grid = folder / "grid.png"
    match = re.fullmatch(r"step-(\d+)", folder.name)
    return {"name": folder.name, "step": int(match.group(1)) if match else None, "items": items,
            "grid": grid.relative_to(run).as_posix() if grid.is_file() else None}


def sample_sets(run: Path) -> list[dict]:
    """Every sampling round with something in it: the training's steps in order, then `sample` command folders."""
    try:
        folders = [p for p in (run / "samples").iterdir() if p.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    sets = [sample_set(run, p) for p in sorted(folders, key=lambda p: (not p.name.startswith("step-"), p.name))]
    return [s for s in sets if s["items"] or s["grid"]]


class _DeviceTable(HTMLParser):
    """The rows of report.html's device table (div#device): (label, text)."""

    def __init__(self):
        super().__init__()
        self.rows: list[list[str]] = []
        self._inside = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "div":
            self._inside = dict(attrs).get("id") == "device"
        elif self._inside and tag == "tr":
            self.rows.append([])
        elif self._inside and tag == "td":
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None and self.rows:
            self.rows[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "div":
            self._inside = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


_report_cache: dict[Path, tuple[float, list[list[str]]]] = {}


def report_device_rows(run: Path) -> list[list[str]]:
    """report.html's device rows (cached by the file's time: the report embeds its loss plot)."""
    path = run / "report.html"
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return []
    cached = _report_cache.get(path)
    if cached and cached[0] == mtime:
        return cached[1]
    parser = _DeviceTable()
    try:
        parser.feed(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return []
    rows = [r for r in parser.rows if len(r) == 2]
    _report_cache[path] = (mtime, rows)
    return rows


_LOGGED_DECISION = re.compile(r"^  ([a-z_]+\.[a-z_.]+)=(.*?): (.+)$")


def decisions(run: Path, log: Path | None = None) -> tuple[list[dict], str]:
    """The auto decisions with their reasons, and where they were read: plan.json when the run has one, else the
    run report's device table, else the decisions printed at the start of the UI job's log."""
    try:
        plan = json.loads((run / "plan.json").read_text(encoding="utf-8"))
        return [{"key": d.get("key"), "value": d.get("value"), "reason": d.get("reason"), "stage": d.get("stage"),
                 "evidence": d.get("evidence")} for d in plan.get("decisions", [])], "plan.json"
    except (OSError, ValueError, AttributeError):
        pass
    config = read_config(run)
    rows = [r for r in report_device_rows(run) if r[0] == "auto" and ": " in r[1]]
    if rows:
        found = []
        for _, text in rows:
            key, reason = text.split(": ", 1)
            found.append({"key": key, "value": _lookup(config, key), "reason": reason})
        return found, "report.html"
    found = []
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[:80] if log else []
    except OSError:
        lines = []
    for line in lines:
        match = _LOGGED_DECISION.match(line)
        if match:
            found.append({"key": match.group(1), "value": match.group(2), "reason": match.group(3)})
    return found, "the run's log" if found else ""


def device_summary(run: Path, log: Path | None = None) -> str:
    """The device the run trains on, as the run report (or the job's log) names it."""
    for label, text in report_device_rows(run):
        if label == "device":
            return text
    try:
        with log.open(encoding="utf-8", errors="replace") as f:
            for _, line in zip(range(80), f):
                if line.startswith("device: "):
                    return line[len("device: "):].strip()
    except (OSError, AttributeError):
        pass
    device = read_config(run).get("device") or {}
    return f"preset {device['preset']}" if device.get("preset") else ""


def _lookup(data: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data
