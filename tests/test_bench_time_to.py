"""bench/diffusion.py's time to N steps (issue 39: where compile time counts, a short run's end beside each
peer's), and the toolkit-auto row planned for a user's run length rather than the few steps the bench times."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import diffusion  # noqa: E402
from trainer_rate import planned  # noqa: E402


def test_time_to_n_steps_counts_start_up_caching_and_the_rest_at_the_rate(capsys):
    musubi = {"s_per_step": 3.0, "seconds_to_first_step": 24.0, "caching_s": 32.0}
    toolkit = {"s_per_step": 1.5, "seconds_to_first_step": 60.0}
    assert diffusion.time_to(musubi, 200) == pytest.approx(32.0 + 24.0 + 199 * 3.0)
    assert diffusion.time_to(toolkit, 2000) == pytest.approx(60.0 + 1999 * 1.5)
    assert diffusion.time_to({"s_per_step": 1.0}, 200) is None  # a plain loop: its start is not timed
    diffusion.print_time_to("wan", {"musubi": musubi, "toolkit-auto": toolkit, "plain": {"s_per_step": 1.0}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["musubi", "56.0s", "653s", "6053s"]
    assert lines[3].split() == ["toolkit-auto", "60.0s", "358s", "3058s"] and len(lines) == 4
    assert toolkit["time_to"] == {"200": 358.5, "2000": 3058.5}


def test_toolkit_auto_is_planned_for_the_run_length_a_user_trains(monkeypatch):
    """On a GPU, SD1.5's compile=auto is off for the bench's 30 steps and on for a 2,000-step run: the row pins
    what the longer run settles. (The plan is made with a faked GPU; nothing runs on it.)"""
    from toolkit.device import detect
    from toolkit.device.detect import DeviceInfo

    monkeypatch.setattr(detect, "detect_device", lambda *a, **k: DeviceInfo("cuda", "sm_90", "H100", 80.0, True))
    monkeypatch.setattr("toolkit.plan.run.detect_device", detect.detect_device)
    config = "model: {family: sd, name_or_path: tiny:sd}\ndata: {path: .}\n"
    assert planned(config, [], diffusion.STEP_PLANNED, 30) == ["train.compile=false",
                                                                "train.compile_regions=whole"]
    assert planned(config, [], diffusion.STEP_PLANNED, 2000)[0] == "train.compile=true"
    assert planned(config, ["train.compile=false"], diffusion.STEP_PLANNED, 2000) == ["train.compile_regions=whole"]
