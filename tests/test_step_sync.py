"""On a GPU, launching a training step never waits for the GPU: the host queues step N+1 while the GPU still runs
step N. A copy from pageable memory, a `.item()`, a `nonzero()` or a host-built tensor moved every step makes the
host wait, and the GPU then idles while the next step is launched (about 11 ms a step on an H100: the gap between
the toolkit and the plain loop that bench/llm.py and bench/diffusion.py measured).

Each quickstart trains a few steps through the real entry point with PyTorch's sync debug mode on while steps after
the first two are launched (the first ones compile and fill caches); every synchronizing call is reported with the
line that made it. Every family runs with torch's fused AdamW; the LLM quickstart also with its own default, the
toolkit's adamw8bit, and with lion8bit. Those take `optimizer_backend=toolkit` (bitsandbytes' optimizers, which
`auto` picks on CUDA where bitsandbytes works, read the loss before each update) and LoRA rank 32, at which the tiny
model's LoRA tensors of 4096 elements and more keep 8-bit state (the Triton kernel) and the others fp32 state (the
pure-torch update, on the GPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import REPO

# torch's fused AdamW and the toolkit's 8-bit optimizers skip a non-finite step on the device
CONFIGS = ["quickstart_sd.yaml", "quickstart_sdxl.yaml", "quickstart_flux.yaml", "quickstart_wan21.yaml",
           "quickstart_sd3.yaml", "quickstart_llm.yaml"]
EIGHT_BIT = ["train.optimizer_backend=toolkit", "network.rank=32"]
CASES = ([pytest.param(config, ["train.optimizer=adamw"], "AdamW", id=config.removesuffix(".yaml"))
          for config in CONFIGS]
         + [pytest.param("quickstart_llm.yaml", EIGHT_BIT, "AdamW8bit", id="quickstart_llm-adamw8bit"),
            pytest.param("quickstart_llm.yaml", ["train.optimizer=lion8bit", *EIGHT_BIT], "Lion8bit",
                         id="quickstart_llm-lion8bit")])


def synchronizing_calls(monkeypatch) -> list[str]:
    """'file:line message' of every synchronizing CUDA call made inside Stepper.launch from its third call on."""
    from toolkit.train.step import Stepper

    found: list[str] = []
    launch = Stepper.launch
    calls = {"n": 0}

    def watched(self, stop_requested):
        calls["n"] += 1
        if calls["n"] <= 2:
            return launch(self, stop_requested)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                sums = launch(self, stop_requested)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found.extend(f"{w.filename}:{w.lineno} {str(w.message).splitlines()[0]}" for w in caught
                     if "called a synchronizing" in str(w.message))
        return sums

    monkeypatch.setattr(Stepper, "launch", watched)
    return found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("config, overrides, optimizer", CASES)
def test_launching_a_step_never_waits_for_the_gpu(config, overrides, optimizer, tmp_path, run_cli, monkeypatch):
    from toolkit.train.step import Stepper

    found = synchronizing_calls(monkeypatch)
    skips = []
    init = Stepper.__init__

    def recording(self, parts, events):
        init(self, parts, events)
        skips.append((type(parts.inner).__name__, self.skips_on_device))

    monkeypatch.setattr(Stepper, "__init__", recording)
    code = run_cli("train", REPO / "configs/examples" / config, f"run.output_dir={tmp_path}", "train.steps=6",
                   "train.batch_size=2", "save.every=0", "sample.every=0", "log.every=100", "train.compile=false",
                   *overrides)
    assert code == 0
    assert skips == [(optimizer, True)], f"{skips}: not {optimizer} skipping a step on the device"
    assert found == [], "synchronizing calls while a step launched:\n" + "\n".join(dict.fromkeys(found))


# Put on PYTHONPATH for the launched workers: the same watch as synchronizing_calls, each rank writing what it found.
WORKER_WATCH = '''
import os
if "LOCAL_RANK" in os.environ and os.environ.get("STEP_SYNC_FOUND"):
    import atexit, json, warnings
    import torch
    from toolkit.train.step import Stepper

    _found, _calls, _launch = [], [0], Stepper.launch

    def _watched(self, stop_requested):
        _calls[0] += 1
        if _calls[0] <= 2:
            return _launch(self, stop_requested)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return _launch(self, stop_requested)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                _found.extend(f"{w.filename}:{w.lineno} {str(w.message).splitlines()[0]}" for w in caught
                              if "called a synchronizing" in str(w.message))

    Stepper.launch = _watched
    atexit.register(lambda: open(os.path.join(os.environ["STEP_SYNC_FOUND"], os.environ["RANK"] + ".json"),
                                 "w").write(json.dumps({"launches": _calls[0], "found": _found})))
'''


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("config", ["quickstart_llm.yaml", "quickstart_sdxl.yaml"])
def test_launching_a_step_never_waits_with_two_processes(config, tmp_path):
    """--gpus 2: the loss, token and stop counts are summed over processes every step; that launch does not wait
    for the GPU either (a count tensor copied from pageable memory did)."""
    import json
    import os

    from conftest import run_toolkit

    hook, found = tmp_path / "hook", tmp_path / "found"
    hook.mkdir()
    found.mkdir()
    (hook / "sitecustomize.py").write_text(WORKER_WATCH)
    pythonpath = os.pathsep.join(p for p in (str(hook), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    proc = run_toolkit("train", REPO / "configs/examples" / config, f"run.output_dir={tmp_path / 'run'}",
                       "train.steps=6", "train.batch_size=2", "save.every=0", "sample.every=0", "log.every=100",
                       "train.compile=false", "train.optimizer=adamw", "--gpus", "2",
                       env={"PYTHONPATH": pythonpath, "STEP_SYNC_FOUND": str(found)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = {p.stem: json.loads(p.read_text()) for p in found.glob("*.json")}
    assert sorted(reports) == ["0", "1"], reports
    for rank, report in reports.items():
        assert report["launches"] == 6, (rank, report)
        assert report["found"] == [], f"rank {rank}: synchronizing calls while a step launched:\n" + "\n".join(
            dict.fromkeys(report["found"]))


@pytest.mark.parametrize("several", [False, True])
def test_fetched_step_numbers_read_as_the_direct_read(several):
    """StepSums.fetch() copies the numbers behind the step's own work (read a step later, they wait for that step
    only); what read() then gives equals reading the device tensors directly, to the last bit."""
    from toolkit.train.step import StepSums

    def sums():
        counts = torch.tensor([3.0, 517.0, 0.0]) if several else [3.0, 517.0, 0.0]
        return StepSums(torch.tensor(1.2345678, dtype=torch.float32), counts, grad_norm=torch.tensor(0.3141592))

    direct, fetched = sums(), sums()
    direct.read()
    fetched.fetch()
    fetched.read()
    assert (fetched.mean, fetched.tokens, fetched.stops) == (direct.mean, direct.tokens, direct.stops)
    assert fetched.grad_norm == float(direct.grad_norm) and isinstance(fetched.grad_norm, float)
    assert fetched.mean == float(torch.tensor(1.2345678, dtype=torch.float32)) / 3.0
