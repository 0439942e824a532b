"""bench/peers/aitk.py without ai-toolkit itself (it is not in CI): the losses read back from a tqdm bar driven as
ai-toolkit's train loop drives it, the job file it writes, and the row a kind it does not train gets."""

import io
import sys
from pathlib import Path

import pytest
import yaml
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from peers import aitk  # noqa: E402
from peers.common import PeerFailed  # noqa: E402


def test_losses_from_its_bar():
    """jobs/process/BaseSDTrainProcess.py: each step sets the postfix "lr: ... loss: ..." and then updates the bar;
    the losses come back one a step, in order, even where two neighbouring draws repeat a step's loss."""
    out = io.StringIO()
    losses = [1.4353, 1.5171, 0.0123, 1.5171, 2.5e-3]
    bar = tqdm(total=len(losses), desc="bench_flux", file=out, mininterval=0, smoothing=0.7)
    for step, loss in enumerate(losses):
        bar.set_postfix_str(f"lr: {1e-4:.1e} loss: {loss:.3e}")
        bar.update(step + 1 - bar.n)
    bar.close()
    assert aitk.losses(out.getvalue()) == [float(f"{x:.3e}") for x in losses]


@pytest.mark.parametrize("kind", sorted(aitk.KINDS))
def test_job_file(kind, tmp_path):
    """The large-GPU job quantizes nothing; the 24 GB one quantizes as the kind's example does; both run
    warm-up + steps steps with LoRA 16/16, torch AdamW and sampling and saving past the end."""
    w = {"batch": 2, "size": 1024} if kind != "wan" else {"batch": 1, "frames": 81, "height": 480, "width": 832}
    large = aitk.job(kind, "", tmp_path, tmp_path / "data", tmp_path / "out", w, 30, "cuda:0")
    small = aitk.job(kind, "24g", tmp_path, tmp_path / "data", tmp_path / "out", w, 30, "cuda:0")
    for spec in (large, small):
        process = yaml.safe_load(yaml.safe_dump(spec))["config"]["process"][0]
        assert process["train"]["steps"] == 30 and process["train"]["batch_size"] == w["batch"]
        assert process["network"] == {"type": "lora", "linear": 16, "linear_alpha": 16}
        assert process["train"]["optimizer"] == "adamw" and process["train"]["lr"] == 1e-4
        assert process["save"]["save_every"] > 30 and process["sample"]["sample_every"] > 30
        assert process["model"]["arch"] == aitk.ARCH[kind]
    assert not large["config"]["process"][0]["model"]["quantize"]
    quantized = small["config"]["process"][0]["model"]
    assert quantized["quantize"] == (kind != "wan") and quantized.get("quantize_te", False) == (kind != "flux")
    assert quantized["low_vram"] == (kind == "qwen_image")
    if kind == "wan":  # the clip's area, as the example's 632 for 480p
        assert large["config"]["process"][0]["datasets"][0]["resolution"] == [632]
        assert large["config"]["process"][0]["datasets"][0]["num_frames"] == 81


def test_kind_it_does_not_train(tmp_path):
    with pytest.raises(PeerFailed, match="does not train sd15"):
        aitk.row("sd15", "", tmp_path, tmp_path, tmp_path, {"batch": 1, "size": 64}, 3, 2, 60)
