"""Where a training step's GPU time goes, in a form two stacks can be set side by side: the GPU's busy time per
step beside the wall time, that time split into kinds of kernel (matrix multiplies, attention, Triton-generated
or hand-written fused kernels, the rest), and the kernels that take the most time.

Used by bench/llm.py --profile for the hand-written loops, unsloth and the toolkit alike.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

KINDS = (  # first match wins; names as the CUDA and ROCm profilers print them
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_", "sm80_", "cublas", "ampere_", "hopper", "xmma", "Cijk")),
    ("triton", ("triton",)),
    ("optimizer", ("multi_tensor", "adam", "fused_adam")),
)


def kind(name: str) -> str:
    low = name.lower()
    for label, marks in KINDS:
        if any(mark.lower() in low for mark in marks):
            return label
    return "other"


@contextmanager
def profiled(steps: int, into: dict):
    """Profile what runs inside (`steps` training steps) and put the summary in `into`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        yield
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    into.update(summarize(prof, steps, wall))


def summarize(prof, steps: int, wall_s: float, top: int = 12) -> dict:
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_step = lambda us: round(us / steps / 1e3, 2)  # noqa: E731  (microseconds in total -> ms per step)
    kinds: dict[str, float] = {}
    for e in kernels:
        kinds[kind(e.key)] = kinds.get(kind(e.key), 0.0) + e.self_device_time_total
    busy = sum(kinds.values())
    ranked = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    return {"wall_ms": round(wall_s * 1e3, 2), "gpu_busy_ms": per_step(busy),
            "launches_per_step": round(sum(e.count for e in kernels) / steps),
            "kinds_ms": {k: per_step(v) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [(e.key[:90], per_step(e.self_device_time_total), round(e.count / steps)) for e in ranked]}


def print_summary(row: str, summary: dict) -> None:
    kinds = ", ".join(f"{k} {v}" for k, v in summary["kinds_ms"].items())
    print(f"  {row}: wall {summary['wall_ms']} ms/step, GPU busy {summary['gpu_busy_ms']} ms "
          f"({summary['launches_per_step']} kernels); {kinds}")
    for name, ms, count in summary["top"]:
        print(f"    {ms:>8.2f} ms {count:>5}x  {name}")
