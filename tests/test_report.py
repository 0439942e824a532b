"""What a run leaves for people to look at: report.html (opened in headless Chromium), loss.png,
metrics.jsonl numbers, TensorBoard events, the profiler trace, and the sample grid helper."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from conftest import REPO, run_toolkit
from helpers import read_metrics
from toolkit.data.media import make_grid
from toolkit.train.plots import plot_loss

STEPS = 6


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("report") / "run"
    proc = run_toolkit("train", "configs/examples/quickstart_llm.yaml", f"run.output_dir={out}", f"train.steps={STEPS}",
                       "train.warmup_steps=0", "save.every=3", "sample.every=3", "log.every=2", "log.profile=true",
                       "sample.max_new_tokens=4")
    assert proc.returncode == 0, proc.stderr
    return out, proc


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_report_files_and_content(run_folder):
    out, proc = run_folder
    report = out / "report.html"
    assert f"report: {report}" in proc.stderr
    page = report.read_text(encoding="utf-8")
    assert f"finished: step {STEPS} of {STEPS}" in page
    assert '<img id="loss-plot" alt="loss" src="data:image/png;base64,' in page
    # text samples at each sample step, shown as text (prompt in bold, completion after it)
    assert re.findall(r'<h3>step (\d+)</h3>', page) == ["3", "6"]
    assert page.count('<span class="prompt">the red circle</span>') == 2
    # the resolved config and the device/preset decisions
    assert "steps: 6" in page and "family: llm" in page
    assert "preset cpu: chosen by device.preset" in page
    with Image.open(out / "logs" / "loss.png") as plot:
        assert plot.format == "PNG" and plot.width >= 600


def test_report_renders_in_chromium(run_folder, tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium is not installed (`apt-get install -y chromium`; .ci/run does it when root)")
    out, _ = run_folder
    # A copy of the real report, next to it (same relative paths), with a probe that reports what rendered.
    probe = out / "report-probe.html"
    probe.write_text(out.joinpath("report.html").read_text(encoding="utf-8").replace(
        "</body>", "<script>window.addEventListener('load', () => {"
        "const img = document.getElementById('loss-plot');"
        "document.title = 'plot=' + img.naturalWidth + 'x' + img.naturalHeight"
        " + ' samples=' + document.querySelectorAll('.sample-text').length; });</script></body>"), encoding="utf-8")
    profile_dir = tmp_path / "chromium-profile"
    profile_dir.mkdir()
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={profile_dir}", "--virtual-time-budget=5000", "--dump-dom",
                           probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    title = re.search(r"<title>(.*?)</title>", proc.stdout)
    assert title is not None, proc.stdout[:2000]
    # matplotlib's 7x3.5 in figure at 100 dpi decodes to 700x350 pixels
    assert title.group(1) == "plot=700x350 samples=2", title.group(1)


def test_without_terminal_a_line_every_n_steps(run_folder):
    _, proc = run_folder  # stderr was a pipe, as under CI or nohup: plain lines, no bar
    lines = [line for line in proc.stderr.splitlines() if re.match(r"step \d+/6 ", line)]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"]
    for line in lines:
        assert re.fullmatch(r"step \d/6  loss \d+\.\d{4} \(smoothed \d+\.\d{4}\)  lr \d\.\d\de[-+]\d\d  [\d,]+ tok/s  "
                            r"mem [\d,]+ MB  eta \d+:\d\d", line), line
    assert "train:" not in proc.stderr and "\r" not in proc.stderr


def test_metrics_jsonl_and_tensorboard(run_folder):
    out, proc = run_folder
    steps = read_metrics(out)
    assert [r["step"] for r in steps] == [2, 4, 6]
    for r in steps:
        # quickstart batches: 8 sequences of 64 tokens per step
        assert r["tokens_per_s"] > 0 and r["steps_per_s"] > 0
        assert r["grad_norm"] > 0
        assert r["memory_kind"] == "process_max_rss" and r["memory_mb"] > 50
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "logs" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "memory_mb"} <= tags
    assert [e.step for e in events.Scalars("loss")] == [2, 4, 6]


def test_profile_trace_is_chrome_json(run_folder):
    out, _ = run_folder
    trace = out / "logs" / "profile" / "trace-steps-2-4.json"
    data = json.loads(trace.read_text())
    names = {e.get("name", "") for e in data["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)


def test_loss_plot_skips_torn_lines_and_empty_logs(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    assert plot_loss(metrics, tmp_path / "loss.png") is None
    metrics.write_text('{"step": 1, "loss": 2.0, "loss_smoothed": 2.0}\n{"step": 2, "loss": 1.5, "loss_smoothed": 1.95}\n'
                       '{"step": 3, "eval_loss": 1.7}\n{"step": 4, "lo')
    png = plot_loss(metrics, tmp_path / "loss.png")
    with Image.open(png) as img:
        assert img.size == (700, 350)
    assert not (tmp_path / ".loss.png.tmp").exists()


def test_make_grid_tiles_images_row_by_row(tmp_path):
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    paths = []
    for i, color in enumerate(colors):
        path = tmp_path / f"sample-{i}.png"
        Image.new("RGB", (64, 32), color).save(path)
        paths.append(path)
    grid = make_grid(paths, tmp_path / "samples" / "step-000010" / "grid.png", cell=64)
    with Image.open(grid) as img:
        assert img.size == (128, 128)  # 3 images: 2 columns, 2 rows
        assert img.getpixel((32, 32)) == (255, 0, 0)
        assert img.getpixel((96, 32)) == (0, 255, 0)
        assert img.getpixel((32, 96)) == (0, 0, 255)
        assert img.getpixel((96, 96)) == (255, 255, 255)  # empty cell stays white
        assert img.getpixel((32, 2)) == (255, 255, 255)   # 64x32 image centred vertically in its cell
    small = [tmp_path / "small-0.png", tmp_path / "small-1.png"]
    for path in small:
        Image.new("RGB", (16, 16), (0, 0, 0)).save(path)
    with Image.open(make_grid(small, tmp_path / "small-grid.png")) as img:
        assert img.size == (32, 16)  # cells no larger than the largest image
    with pytest.raises(ValueError):
        make_grid([], tmp_path / "empty.png")


def test_report_shows_image_samples_by_step(tmp_path):
    """Image families: a step's grid.png when there is one, else each image; paths relative to the run folder."""
    from toolkit.plan.run import load_run
    from toolkit.train.report import RunReport
    from toolkit.train.run_dir import RunDir

    run = load_run([REPO / "configs/examples/quickstart_llm.yaml"], [f"run.output_dir={tmp_path}"])
    run_dir = RunDir(tmp_path)
    run_dir.create()
    first, second = run_dir.sample_dir(10), run_dir.sample_dir(20)
    for folder in (first, second):
        folder.mkdir(parents=True)
    images = []
    for i in range(2):
        Image.new("RGB", (32, 32), (200, 10 * i, 0)).save(first / f"prompt-{i}.png")
        images.append(first / f"prompt-{i}.png")
        Image.new("RGB", (32, 32), (0, 10 * i, 200)).save(second / f"prompt-{i}.png")
    make_grid(sorted(second.glob("*.png")), second / "grid.png")
    (second / "prompts.txt").write_text("00: a red <circle>\n01: a blue square\n", encoding="utf-8")
    (run_dir.logs / "metrics.jsonl").write_text('{"step": 10, "loss": 3.0, "loss_smoothed": 3.0, "steps_per_s": 2.0}\n'
                                                '{"step": 20, "loss": 2.5, "loss_smoothed": 2.9, "steps_per_s": 2.5}\n')
    page = RunReport(run_dir, run, run.plan, "run:\n  name: x\n", 40).update(20, 40, 12.0).read_text(encoding="utf-8")
    sources = re.findall(r'<img class="sample-image" src="([^"]+)"', page)
    assert sources == ["samples/step-000010/prompt-0.png", "samples/step-000010/prompt-1.png",
                       "samples/step-000020/grid.png"]
    assert re.findall(r"<h3>step (\d+)</h3>", page) == ["10", "20"]
    assert '<pre class="prompts">00: a red &lt;circle&gt;\n01: a blue square</pre>' in page
    assert "in progress: step 20 of 40" in page and "0m 12s" in page and "2.50" in page
    assert (run_dir.logs / "loss.png").exists()
