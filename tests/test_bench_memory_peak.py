"""bench/memory_peak.py: the allocator trace replayed to what was alive at the step's peak, by allocating code."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from memory_peak import GiB, label, peak_breakdown  # noqa: E402

LOSS = [{"filename": "/x/torch/nn/functional.py", "line": 3, "name": "cross_entropy"},
        {"filename": "/site/toolkit/kernels/linear_cross_entropy.py", "line": 40, "name": "chunk_loss_and_grad"}]
MLP = [{"filename": "/site/transformers/models/llama/modeling_llama.py", "line": 150, "name": "forward"}]


def alloc(addr, gib, frames):
    return {"action": "alloc", "addr": addr, "size": int(gib * GiB), "frames": frames}


def free(addr, gib, action="free_completed"):
    return {"action": action, "addr": addr, "size": int(gib * GiB), "frames": []}


def test_the_blocks_alive_at_the_peak_are_summed_by_the_code_that_allocated_them():
    events = [alloc(1, 1.0, MLP), alloc(2, 0.5, MLP), free(2, 0.5, "free_requested"), free(2, 0.5),
              alloc(3, 2.0, LOSS), alloc(4, 0.25, LOSS),   # the peak: 1 + 2 + 0.25 = 3.25 GiB in the window
              free(3, 2.0), alloc(5, 1.5, [])]             # 2.75 later: not the peak
    result = peak_breakdown(events, before=int(4 * GiB))
    assert result["peak_gib"] == pytest.approx(7.25) and result["before_gib"] == pytest.approx(4.0)
    assert result["rows"] == [["toolkit/kernels/linear_cross_entropy.py:40 chunk_loss_and_grad", 2.25, 2],
                              ["transformers/models/llama/modeling_llama.py:150 forward", 1.0, 1]]


def test_a_block_counts_until_its_free_completes_and_frames_name_the_innermost_own_code():
    # free_requested alone (a block another stream still reads) keeps the block allocated
    events = [alloc(1, 1.0, MLP), free(1, 1.0, "free_requested"), alloc(2, 1.0, [])]
    assert peak_breakdown(events)["peak_gib"] == pytest.approx(2.0)
    assert label([]).startswith("(no Python frame")
    assert label([{"filename": "/usr/lib/torch/_ops.py", "line": 7, "name": "__call__"}]) == "/usr/lib/torch/_ops.py:7 __call__"
    assert peak_breakdown([])["rows"] == []


def test_measurement_windows_open_after_the_timed_steps_one_after_the_other(monkeypatch):
    """bench/trainer_rate.py: the profile's steps, then the memory step, each inside its own context, after the
    timed launches, and every context closed."""
    from trainer_rate import Windows

    calls = []

    class Window:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            calls.append(f"enter {self.name}")

        def __exit__(self, *exc):
            calls.append(f"exit {self.name}")

    watch = Windows(2, [(2, lambda: Window("profile")), (1, lambda: Window("memory"))], {})
    for step in range(1, 7):  # as the trainer's step events come
        watch.step_started(step)
        calls.append("step")
        watch.step_launched(step, None)
    watch.close()
    assert calls == ["step", "step", "enter profile", "step", "step", "exit profile", "enter memory", "step",
                     "exit memory", "step"]


@pytest.mark.parametrize("breaks", ["profile", "memory"])
def test_a_failing_window_keeps_the_rows_rate(tmp_path, monkeypatch, breaks):
    """A window's own step failing (the allocator's history once did) marks that window failed; the timed steps'
    rate stands, and the other window is left alone (never opened after a failing profile)."""
    import kernel_profile
    import memory_peak
    import trainer_rate
    from contextlib import contextmanager

    from conftest import REPO

    @contextmanager
    def failing(*args, **kwargs):
        raise RuntimeError(f"{breaks} broke")
        yield  # pragma: no cover

    @contextmanager
    def fine(steps, into):
        yield
        into["ran"] = steps

    monkeypatch.setattr(kernel_profile, "profiled", failing if breaks == "profile" else fine)
    monkeypatch.setattr(memory_peak, "recorded", failing)
    profile, memory = {}, {}
    config = (REPO / "configs/examples/quickstart_llm.yaml").read_text()
    rate, _ = trainer_rate.trainer_rate(config, ["sample.every=0", "save.every=0", "log.tensorboard=false"],
                                        tmp_path / "run", "adamw", steps=4, warmup=2, profile=profile, memory=memory)
    assert rate > 0
    if breaks == "profile":
        assert profile == {"failed": "RuntimeError: profile broke"} and memory == {}
    else:
        assert profile == {"ran": trainer_rate.PROFILED_STEPS} and memory == {"failed": "RuntimeError: memory broke"}


def test_a_failure_after_the_last_window_is_the_runs_own(tmp_path, monkeypatch):
    """The final export failing once every window closed fails the row: no window is blamed for it."""
    import kernel_profile
    import trainer_rate
    from contextlib import contextmanager

    from conftest import REPO

    @contextmanager
    def fine(steps, into):
        yield
        into["ran"] = steps

    def export_fails(self):
        raise RuntimeError("export failed")

    from toolkit.train.checkpointer import Checkpointer

    monkeypatch.setattr(kernel_profile, "profiled", fine)
    monkeypatch.setattr(Checkpointer, "export_final", export_fails)
    profile = {}
    config = (REPO / "configs/examples/quickstart_llm.yaml").read_text()
    with pytest.raises(RuntimeError, match="export failed"):
        trainer_rate.trainer_rate(config, ["sample.every=0", "save.every=0", "log.tensorboard=false"],
                                  tmp_path / "run", "adamw", steps=4, warmup=2, profile=profile)
    assert profile == {"ran": trainer_rate.PROFILED_STEPS}
