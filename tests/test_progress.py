"""What a user watches while training: one tqdm bar on a terminal; W&B asked for but not installed;
sample images into TensorBoard. (The plain lines without a terminal are checked on the report test's run.)"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
from PIL import Image

from conftest import REPO
from toolkit.errors import UserError
from toolkit.train.metrics import MetricsLogger

QUICK = ("train.steps=4", "train.warmup_steps=0", "train.lr_scheduler=constant", "save.every=0", "sample.prompts=[]", "log.tensorboard=false")


def _run_on_terminal(*args: str, timeout: float = 300) -> tuple[int, str]:
    """Run `python -m toolkit ARGS` with stdout and stderr on a pseudo-terminal (200 columns); returns its output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, env=dict(os.environ))
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=timeout), b"".join(chunks).decode("utf-8", "replace")


def test_terminal_gets_one_progress_bar(tmp_path):
    code, output = _run_on_terminal("train", "configs/examples/quickstart_llm.yaml", f"run.output_dir={tmp_path / 'run'}",
                                    *QUICK, "log.every=2")
    assert code == 0, output
    # tqdm redraws one line with carriage returns; the final state of the bar:
    frames = [f for f in re.split(r"[\r\n]", output) if f.startswith("train:")]
    assert frames, output
    final = frames[-1]
    assert re.match(r"train: 100%\|.*\| 4/4 \[\d\d:\d\d<00:00, +[\d.]+(step/s|s/step), loss=\d+\.\d{4}, "
                    r"lr=1\.00e-02, tok/s=[\d,]+\]", final), final
    # no plain per-step lines on a terminal: the bar is the only progress output
    assert not re.search(r"^step \d+/4 ", output, re.MULTILINE), output


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_asked_for_but_not_installed(tmp_path):
    with pytest.raises(UserError) as raised:
        MetricsLogger(tmp_path, total_steps=10, start_step=0, every=5, tensorboard=False, wandb=True,
                      wandb_project="my-project")
    assert str(raised.value) == ("log.wandb is true but wandb is not installed\n"
                                 "  fix: .venv/bin/pip install wandb (then `wandb login`), or set log.wandb=false")
    assert raised.value.exit_code == 2
    assert not (tmp_path / "metrics.jsonl").exists()


def test_sample_images_go_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    image = tmp_path / "grid.png"
    Image.new("RGB", (48, 32), (10, 200, 30)).save(image)
    logs = tmp_path / "logs"
    logs.mkdir()
    metrics = MetricsLogger(logs, total_steps=10, start_step=0, every=5, tensorboard=True)
    metrics.image("samples/grid", image, step=10)
    metrics.close()
    events = EventAccumulator(str(logs / "tensorboard"))
    events.Reload()
    assert events.Tags()["images"] == ["samples/grid"]
    logged = events.Images("samples/grid")[0]
    assert (logged.step, logged.width, logged.height) == (10, 48, 32)
