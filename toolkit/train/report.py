"""report.html: one self-contained page per run (loss plot, samples by step, timings, device, the plan, the config).

Written at each checkpoint and at the end, so an unfinished run has an up-to-date page too. The loss
plot is embedded as a data URI; sample images are linked relative to the run folder. The `sample` command's
folders (samples/cli-*) follow the trainer's steps; `sample` rewrites only the page's samples section
(refresh_samples), between two markers, so the rest of the page stays as the trainer left it.
"""

from __future__ import annotations

import base64
import html
import os
import time
from pathlib import Path

from toolkit.disk import disk_full_named
from toolkit.train.events import StepEvents
from toolkit.train.plots import IMAGE_SUFFIXES, plot_loss, read_metrics
from toolkit.train.run_dir import RunDir

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
table { border-collapse: collapse; } td { padding: 0.15em 1em 0.15em 0; vertical-align: top; }
td:first-child { color: #666; white-space: nowrap; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; }
.sample-step { margin-bottom: 1.2em; } .sample-text { white-space: pre-wrap; }
.prompt { font-weight: bold; } .images img { max-width: 100%; min-width: 128px; margin: 0 0.5em 0.5em 0; }
"""


def _plain(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def _table(rows: list[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in rows) + "</table>"


SAMPLES_START, SAMPLES_END = "<!-- samples:start -->", "<!-- samples:end -->"


def _sample_heading(folder: Path) -> str:
    """"step N" for the trainer's samples/step-N; for a `sample` command's samples/cli-<time>-<tag>, what it
    sampled (its source.txt's first line) and when."""
    if folder.name.startswith("step-"):
        return f"step {folder.name.removeprefix('step-').lstrip('0') or '0'}"
    source = folder / "source.txt"
    what = source.read_text(encoding="utf-8").splitlines()[0] if source.is_file() else folder.name
    stamp = folder.name.split("-")[1:3]  # cli-YYYYmmdd-HHMMSS-...
    when = f"{stamp[0][:4]}-{stamp[0][4:6]}-{stamp[0][6:]} {stamp[1][:2]}:{stamp[1][2:4]}" if (
        len(stamp) == 2 and all(part.isdigit() for part in stamp)) else ""
    return f"sample command: {what}" + (f" ({when})" if when else "")


def samples_html(run_dir: RunDir) -> str:
    """The samples section: the trainer's steps in order, then the `sample` command's folders by time."""
    if not run_dir.samples.exists():
        return "<p>no samples yet</p>"
    folders = sorted(run_dir.samples.glob("step-*")) + sorted(run_dir.samples.glob("cli-*"))
    return "".join(_sample_step_html(run_dir, d) for d in folders if d.is_dir()) or "<p>no samples yet</p>"


def refresh_samples(run_root: Path) -> Path | None:
    """Rewrite the samples section of the run's report.html (after `sample`); None when there is no report, or it
    predates the section's markers."""
    path = Path(run_root) / "report.html"
    if not path.is_file():
        return None
    page = path.read_text(encoding="utf-8")
    start, end = page.find(SAMPLES_START), page.find(SAMPLES_END)
    if start < 0 or end < start:
        return None
    page = page[:start + len(SAMPLES_START)] + samples_html(RunDir(Path(run_root))) + page[end:]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, path)
    return path


def _sample_step_html(run_dir: RunDir, folder: Path) -> str:
    parts = []
    jsonl = folder / "samples.jsonl"
    if jsonl.exists():
        for record in read_metrics(jsonl):  # same format: one JSON object per line
            parts.append(f'<div class="sample-text"><span class="prompt">{_esc(record.get("prompt", ""))}</span>'
                         f'{_esc(record.get("completion", ""))}</div>')
    grid = folder / "grid.png"
    videos = sorted(folder.glob("*.webp"))  # video samples: browsers play animated webp in an <img>
    images = videos or ([grid] if grid.exists() else
                        sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES))
    prompts = folder / "prompts.txt"  # image families: which prompt made which numbered image
    if images and prompts.exists():
        parts.append(f'<pre class="prompts">{_esc(prompts.read_text(encoding="utf-8").strip())}</pre>')
    if images:
        parts.append('<div class="images">' + "".join(
            f'<img class="sample-image" src="{_esc(p.relative_to(run_dir.root).as_posix())}" alt="{_esc(p.name)}">'
            for p in images) + "</div>")
    if not parts:
        return ""
    return (f'<div class="sample-step" id="{_esc(folder.name)}"><h3>{_esc(_sample_heading(folder))}</h3>'
            f'{"".join(parts)}</div>')


class RunReport(StepEvents):
    """Refreshes logs/loss.png and report.html for one run, at each checkpoint and at the end."""

    def __init__(self, run_dir: RunDir, run, plan, config_yaml: str, total_steps: int):
        self.run_dir = run_dir
        self.run = run  # toolkit.plan.run.ResolvedRun
        self.plan = plan  # its RunPlan, every stage
        self.config_yaml = config_yaml
        self.total_steps = total_steps
        self.started = time.time()
        self._clock = time.perf_counter()

    def saved(self, step: int, path: Path) -> None:
        self.update(step, self.total_steps, time.perf_counter() - self._clock)

    def finished(self, step: int, final: Path) -> None:
        self.update(step, self.total_steps, time.perf_counter() - self._clock, finished=True)

    @property
    def path(self) -> Path:
        return self.run_dir.root / "report.html"

    @property
    def loss_png(self) -> Path:
        return self.run_dir.logs / "loss.png"

    def update(self, step: int, total_steps: int, elapsed_s: float, finished: bool = False) -> Path:
        """Redraw loss.png from metrics.jsonl and rewrite report.html."""
        metrics_path = self.run_dir.logs / "metrics.jsonl"
        with disk_full_named("the loss plot", self.run_dir.logs, remove=self.loss_png.with_name(".loss.png.tmp")):
            plot = plot_loss(metrics_path, self.loss_png)
        everything = read_metrics(metrics_path)
        records = [r for r in everything if "loss" in r]
        evals = [r for r in everything if "eval_loss" in r]
        last = records[-1] if records else {}
        name = self.run.cfg.run.name
        status = "finished" if finished else "in progress"
        timings = [("status", f"{status}: step {step} of {total_steps}"),
                   ("started", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))),
                   ("updated", time.strftime("%Y-%m-%d %H:%M:%S")),
                   ("training time (this session)", _format_seconds(elapsed_s))]
        if "steps_per_s" in last:
            timings.append(("steps/s (last interval)", f"{last['steps_per_s']:.2f}"))
        if "tokens_per_s" in last:
            timings.append(("tokens/s (last interval)", f"{last['tokens_per_s']:,.0f}"))
        if "memory_mb" in last:
            timings.append((f"peak memory ({last.get('memory_kind', '')})", f"{last['memory_mb']:,.0f} MB"))
        if "loss_smoothed" in last and last["loss_smoothed"] is not None:
            timings.append(("loss (smoothed)", f"{last['loss_smoothed']:.4f}"))
        if evals:
            timings.append(("eval loss (last, plotted beside the loss)",
                            f"{evals[-1]['eval_loss']:.4f} at step {evals[-1]['step']}"))
        device = self.run.device
        device_rows = [("device", device.summary()), ("preset", self.run.preset_reason)]
        device_rows += [("", reason) for reason in device.reasons]
        plan_rows = [(f"{d.key} ({d.stage})", f"{_plain(d.value)}: {d.reason}") for d in self.plan]
        if plot is not None:
            data = base64.b64encode(plot.read_bytes()).decode("ascii")
            plot_html = f'<img id="loss-plot" alt="loss" src="data:image/png;base64,{data}">'
        else:
            plot_html = "<p>no loss logged yet</p>"
        page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_esc(name)} report</title>'
                f"<style>{_STYLE}</style></head><body>\n"
                f"<h1>{_esc(name)}</h1><p>{_esc(self.run.cfg.model.family)} LoRA on "
                f"{_esc(self.run.cfg.model.name_or_path)}; run folder {_esc(self.run_dir.root)}</p>\n"
                f'<h2>Progress and timings</h2><div id="timings">{_table(timings)}</div>\n'
                f'<h2>Loss</h2><div id="loss">{plot_html}</div>\n'
                f'<h2>Samples</h2><div id="samples">{SAMPLES_START}{samples_html(self.run_dir)}{SAMPLES_END}</div>\n'
                f'<h2>Device and preset</h2><div id="device">{_table(device_rows)}</div>\n'
                f'<h2>Plan: what auto became, and why</h2><div id="plan">{_table(plan_rows)}</div>\n'
                f'<h2>Config (as asked)</h2><pre id="config">{_esc(self.config_yaml)}</pre>\n'
                "</body></html>\n")
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with disk_full_named("the report", self.run_dir.root, len(page.encode()), remove=tmp):
            tmp.write_text(page, encoding="utf-8")
            os.replace(tmp, self.path)
        return self.path

