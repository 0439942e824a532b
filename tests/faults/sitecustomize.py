"""Faults injected into launched training processes (tests only: the tests that use it put this folder on
PYTHONPATH, and Python imports sitecustomize at start-up).

TOOLKIT_TEST_FAULT holds faults separated by commas, each KIND:RANK:STEP[:ATTEMPT]: the process of rank RANK, in the
launcher's attempt ATTEMPT (TORCHELASTIC_RESTART_COUNT; 0, the first start, by default), as step STEP begins,
- kill: SIGKILLs itself (as the kernel's out-of-memory killer would);
- hang: stops answering (asleep, as a process stuck outside Python would be: SIGTERM ends it at once);
- oom: runs out of memory in the step's first backward (torch.OutOfMemoryError, after the forward drew its noise).
tests/test_restarts.py uses kill, tests/test_out_of_memory.py oom; hang is there for trying a hung rank through the
whole trainer by hand (TOOLKIT_TEST_FAULT=hang:1:5 device.collective_timeout=5 --gpus 2). The hook is the loop's
step_started event (train/events.py), which every family passes through.
"""

import os

_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
_STEPS = {}
for _fault in filter(None, os.environ.get("TOOLKIT_TEST_FAULT", "").split(",")):
    _kind, _rank, _step, *_attempt = _fault.split(":")
    if _rank == os.environ.get("RANK", "0") and (_attempt or ["0"])[0] == _ATTEMPT:
        _STEPS[int(_step)] = _kind

if _STEPS:
    import signal
    import time

    from toolkit.train.events import Events

    _step_started = Events.step_started

    def _faulty_step_started(self, step: int) -> None:
        kind = _STEPS.get(step)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "oom":
            _oom_at[0] = True
        if kind == "hang":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the trainer's graceful stop would not run either
            time.sleep(3600)
        return _step_started(self, step)

    Events.step_started = _faulty_step_started

    import torch
    from accelerate import Accelerator

    _oom_at = [False]
    _backward = Accelerator.backward

    def _faulty_backward(self, loss, **kwargs):
        if _oom_at[0]:
            _oom_at[0] = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by tests/faults)")
        return _backward(self, loss, **kwargs)

    Accelerator.backward = _faulty_backward
