"""Worker processes of the several-process CPU tests (gloo): how each opens its group, reports a failure, and
leaves. A process that leaves through the interpreter's shutdown can abort there, after its test passed: a gloo
group's C++ threads or an FSDP unit's pending work are torn down with the interpreter ("terminate called without an
active exception", SIGABRT, seen in CI on test_sharded_embedding). The toolkit's own processes leave the same way
(toolkit/process_exit.py): wait for each other, close the group, and end without the interpreter's shutdown."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

import torch.distributed as dist


@contextlib.contextmanager
def gloo_process(rank: int, world: int, store: str, errors=None):
    """The body of one worker: its group on the file store `store` (a path; no port to race for). A failure is put
    on `errors` (a queue, when given) and ends the process with 1, its traceback on stderr; a success waits for the
    other processes, closes the group and ends the process with 0."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    code = 0
    try:
        yield
        dist.barrier()
    except BaseException as err:  # noqa: BLE001 - reported to the test through the queue and the exit code
        code = 1
        traceback.print_exc()
        if errors is not None:
            errors.put(f"rank {rank}: {err!r}")
    finally:
        if code == 0:
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
