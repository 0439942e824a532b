"""bench/step_phases.py: a toolkit step timed per phase on the host (and the GPU, where there is one), through
bench/trainer_rate.py's windows after the timed steps."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from step_phases import summarize  # noqa: E402


class Event:
    """A stand-in for a CUDA event recorded at GPU time `ms`."""

    def __init__(self, ms):
        self.ms = ms

    def elapsed_time(self, other):
        return other.ms - self.ms


def test_each_phase_is_the_median_of_its_span_between_consecutive_marks():
    steps = [[("start", 0.000, Event(0)), ("queued", 0.004, Event(0)), ("forward", 0.005, Event(0)),
              ("backward", 0.035, Event(48)), ("update", 0.090, Event(97)), ("updated", 0.096, Event(98)),
              ("end", 0.097, Event(98))],
             [("start", 1.000, Event(200)), ("queued", 1.002, Event(200)), ("forward", 1.003, Event(200)),
              ("backward", 1.033, Event(250)), ("update", 1.093, Event(300)), ("updated", 1.097, Event(301)),
              ("end", 1.098, Event(301))]]
    result = summarize(steps, tie=(0.0, Event(0)), clocks=[(1755.0, 690.0), (1830.0, 684.0)])
    phases = {name: (gpu, host) for name, gpu, host, _, _ in result["phases"]}
    ahead = {name: (median, least) for name, _, _, median, least in result["phases"]}
    assert result["steps"] == 2 and result["gpu_step_ms"] == pytest.approx(99.5)
    assert result["host_step_ms"] == pytest.approx(97.5)
    assert phases["collate the batch"] == pytest.approx((0.0, 3.0))
    assert phases["forward (loss included)"] == pytest.approx((49.0, 30.0))
    assert phases["backward"] == pytest.approx((49.5, 57.5))
    assert phases["clip, optimizer step, zero_grad"] == pytest.approx((1.0, 5.0))
    # the GPU's queue ahead of the host where each phase ends: GPU time of the mark's event less its host time
    # (step 1: backward's end at host 90 ms, its event at GPU 97 ms: 7 ms queued; step 2: 300 - 1093 = -793, a
    # GPU clock tied 1 s later than the host's here, so the median of the two and the least differ)
    assert ahead["backward"] == pytest.approx(((7.0 - 793.0) / 2, -793.0))
    assert ahead["forward (loss included)"] == pytest.approx(((13.0 - 783.0) / 2, -783.0))
    assert result["clocks"] == {"sm_mhz": 1792.5, "sm_mhz_least": 1755.0, "sm_mhz_most": 1830.0, "power_w": 687.0}
    # on the CPU there are no events: the GPU columns are None, and no clocks
    cpu = summarize([[(name, host, None) for name, host, _ in step] for step in steps])
    assert cpu["gpu_step_ms"] is None and "clocks" not in cpu
    assert all(gpu is None and median is None and least is None for _, gpu, _, median, least in cpu["phases"])


def test_micro_batches_add_up_within_a_step_and_a_read_of_the_loss_is_its_own_phase():
    """train.grad_accum=2: both batches collated first, then forward and backward twice; an optimizer that cannot
    skip on the device reads the loss before the update (a wait for the GPU)."""
    marks = [("start", 0.000), ("queued", 0.002), ("queued", 0.004), ("forward", 0.005), ("backward", 0.020),
             ("forward", 0.045), ("backward", 0.060), ("read", 0.085), ("read done", 0.095), ("update", 0.096),
             ("updated", 0.100), ("end", 0.101)]
    result = summarize([[(name, host, None) for name, host in marks]])
    phases = {name: host for name, _, host, _, _ in result["phases"]}
    assert result["waits_for_gpu"] and result["host_step_ms"] == pytest.approx(101.0)
    assert phases["collate the batch"] == pytest.approx(4.0)
    assert phases["forward (loss included)"] == pytest.approx(30.0)
    assert phases["backward"] == pytest.approx(50.0)
    assert phases["read the loss (waits for the GPU)"] == pytest.approx(10.0)
    assert sum(phases.values()) == pytest.approx(101.0)
    assert not summarize([[(name, host, None) for name, host in marks if "read" not in name]])["waits_for_gpu"]


def test_phases_are_timed_after_the_timed_steps_of_a_real_run(tmp_path):
    """The Trainer on the tiny LLM (the CPU in CI): the rate of the timed steps, then 10 steps per phase; every
    phase of the step is there, timed through the trainer's step events (nothing of the toolkit is patched)."""
    from step_phases import NAMES
    from trainer_rate import PHASED_STEPS, trainer_rate

    from toolkit.train.step import StepEnd, Stepper

    launch, batch, update, now = Stepper.launch, Stepper._next_batch, Stepper._update, StepEnd.__dict__["now"]
    config = ("model: {family: llm, name_or_path: 'tiny:llm'}\nnetwork: {rank: 4, alpha: 4}\n"
              "train: {lr: 1.0e-3, precision: fp32}\nsave: {every: 0}\nsample: {every: 0}\n"
              "log: {tensorboard: false}\n")
    phases = {}
    rate, _ = trainer_rate(config, [f"data.path={REPO / 'configs/examples/data/quickstart_text.jsonl'}",
                                    "data.max_seq_len=32", "train.batch_size=2"],
                           tmp_path / "run", "adamw", 4, 2, phases=phases)
    assert rate > 0
    assert (Stepper.launch, Stepper._next_batch, Stepper._update, StepEnd.__dict__["now"]) == (launch, batch, update, now)
    assert set(phases) == {"phases"}
    summary = phases["phases"]
    gpu = torch.cuda.is_available()
    assert summary["steps"] == PHASED_STEPS - gpu  # on a GPU the first, behind the clocks' tie, is left out
    assert (summary["gpu_step_ms"] is None) is not gpu  # events on a GPU only
    names = [name for name, _, _, _, _ in summary["phases"]]
    assert names == ["collate the batch", "batch to the loss", "forward (loss included)", "backward",
                     "clip, optimizer step, zero_grad", "scheduler, step's numbers"]
    assert set(names) <= set(NAMES.values()) and not summary["waits_for_gpu"]
    assert all(host >= 0 for _, _, host, _, _ in summary["phases"]) and summary["host_step_ms"] > 0


def test_a_window_without_steps_gives_none_figures():
    """On a GPU the window's first step is left out (it starts behind the clocks' tie): a window whose only step
    failed, or a one-step window, summarises no step at all, without raising."""
    result = summarize([], tie=(0.0, Event(0)), clocks=[])
    assert result == {"steps": 0, "waits_for_gpu": False, "phases": [], "gpu_step_ms": None, "host_step_ms": None}


@pytest.mark.parametrize("hip, power, want", [(None, 690_000, (1755.0, 690.0)), ("6.2", 690, (1755.0, 690.0)),
                                              ("6.2", 0, None)], ids=["nvml-milliwatts", "amdsmi-watts", "amdsmi-na"])
def test_gpu_clocks_reads_watts_from_either_library(monkeypatch, hip, power, want):
    from step_phases import gpu_clocks

    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: 1755)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device=None: power)
    assert gpu_clocks() == want

    def missing(device=None):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", missing)
    assert gpu_clocks() is None


def test_print_phases_shows_clocks_the_queue_and_failures(capsys):
    from step_phases import print_phases

    steps = [[("start", 0.000, Event(40.0)), ("queued", 0.001, Event(40.0)), ("forward", 0.002, Event(40.0)),
              ("backward", 0.033, Event(88.0)), ("update", 0.090, Event(137.0)), ("updated", 0.096, Event(138.0)),
              ("end", 0.097, Event(138.0))]]
    print_phases("toolkit", {"phases": summarize(steps, tie=(0.0, Event(0)), clocks=[(1650.0, 689.0)])})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("  toolkit: medians of 1 steps, GPU 98.0 ms a step, host 97.0 ms; "
                      "SM clock 1650 MHz (1650-1650), 689 W")
    backward = next(line for line in out if line.strip().startswith("backward"))
    assert backward.split()[1:] == ["49.0", "57.00", "47.0", "47.0"]  # GPU, host, queue ahead (median, least)
    print_phases("toolkit", {"phases": {"failed": "RuntimeError: boom"}})
    assert capsys.readouterr().out == "  toolkit: the phased steps failed (RuntimeError: boom)\n"
    print_phases("toolkit", {})
    assert capsys.readouterr().out == ""
