"""bench/diffusion.py's edit workloads on the CPU (--tiny): flux_kontext and qwen_image_edit, each image with its
reference beside it; the plain loop (the reference's tokens after the image's, as the edit pipeline passes them) and
the toolkit row both train."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.parametrize("kind", ["flux_kontext", "qwen_image_edit"])
def test_edit_workload_runs_plain_and_toolkit_rows(kind, tmp_path):
    out = tmp_path / "edit.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "diffusion.py"), "--models", kind, "--tiny",
                           "--rows", "plain,toolkit-auto", "--steps", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {f"{kind}:plain", f"{kind}:toolkit-auto"}
    assert all(r["s_per_step"] > 0 for r in rows.values())
    losses = rows[f"{kind}:toolkit-auto"]["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) and 0.1 < x < 10 for x in losses)


def test_write_images_puts_each_reference_beside_its_target(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from diffusion_models import write_images

    write_images(tmp_path, 2, 16, references=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "000.png", "000.txt", "000_ref0.png", "000_ref1.png", "001.png", "001.txt", "001_ref0.png", "001_ref1.png"]
    from PIL import Image

    assert Image.open(tmp_path / "000_ref1.png").size == (16, 16)
