"""Where a training step's GPU time goes, in a form two stacks can be set side by side: the GPU's busy time per
step beside the wall time, that time split into kinds of kernel (matrix multiplies, attention, Triton-generated
or hand-written fused kernels, the rest), and the kernels that take the most time.

Used by bench/llm.py --profile for the hand-written loops, unsloth and the toolkit alike.
"""

from __future__ import annotations

import json
import tempfile
import time
from bisect import bisect_right
from contextlib import contextmanager
from pathlib import Path

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
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        yield
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    into.update(summarize(prof, steps, wall))
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        into["idle"] = idle_gaps(json.loads(trace.read_text()), steps)


def summarize(prof, steps: int, wall_s: float, top: int = 30) -> dict:
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


def idle_gaps(trace: dict, steps: int, least_us: float = 20.0, top: int = 10) -> dict:
    """The GPU's idle time between kernels (gaps of at least `least_us`), per step, and what the host was doing
    when the kernel that ended each gap was launched: the innermost and the outermost host operation around its
    launch call. A gap is "starved" when that kernel started within 30 us of its launch call's end (the GPU
    waited for the host); the others are waits the GPU's own queue caused (copies, events)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    ops: dict = {}  # tid -> host operations sorted by start
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            ops.setdefault(e["tid"], []).append(e)
    starts, parents = {}, {}  # per thread: start times, and each operation's enclosing one (nested calls)
    for tid, items in ops.items():
        items.sort(key=lambda e: (e["ts"], -e["dur"]))
        starts[tid] = [e["ts"] for e in items]
        stack, parent = [], []
        for i, e in enumerate(items):
            while stack and items[stack[-1]]["ts"] + items[stack[-1]]["dur"] < e["ts"]:
                stack.pop()
            parent.append(stack[-1] if stack else -1)
            stack.append(i)
        parents[tid] = parent

    def around(launch) -> tuple[str, str]:
        tid, ts = launch["tid"], launch["ts"]
        items, i = ops.get(tid, []), bisect_right(starts.get(tid, []), ts) - 1
        while i >= 0 and items[i]["ts"] + items[i]["dur"] < ts:
            i = parents[tid][i]
        if i < 0:
            return "(none)", "(none)"
        inner = i
        while parents[tid][i] >= 0:
            i = parents[tid][i]
        return items[inner]["name"][:70], items[i]["name"][:70]

    total = starved = 0.0
    by_inner: dict[str, list] = {}
    by_outer: dict[str, list] = {}
    for before, kernel in zip(kernels, kernels[1:]):
        gap = kernel["ts"] - (before["ts"] + before["dur"])
        if gap < least_us:
            continue
        total += gap
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None or kernel["ts"] - (launch["ts"] + launch["dur"]) > 30:
            continue
        starved += gap
        inner, outer = around(launch)
        for table, key in ((by_inner, inner), (by_outer, outer)):
            slot = table.setdefault(key, [0.0, 0])
            slot[0] += gap
            slot[1] += 1
    per_step = lambda us: round(us / steps / 1e3, 2)  # noqa: E731
    rank = lambda table: [(k, per_step(v[0]), round(v[1] / steps, 1))  # noqa: E731
                          for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"gaps_ms": per_step(total), "starved_ms": per_step(starved), "inner": rank(by_inner),
            "outer": rank(by_outer)}


def print_summary(row: str, summary: dict) -> None:
    if "failed" in summary:
        print(f"  {row}: the profiled steps failed ({summary['failed']})")
        return
    kinds = ", ".join(f"{k} {v}" for k, v in summary["kinds_ms"].items())
    print(f"  {row}: wall {summary['wall_ms']} ms/step, GPU busy {summary['gpu_busy_ms']} ms "
          f"({summary['launches_per_step']} kernels); {kinds}")
    for name, ms, count in summary["top"]:
        print(f"    {ms:>8.2f} ms {count:>5}x  {name}")
    idle = summary.get("idle")
    if idle:
        print(f"    idle between kernels {idle['gaps_ms']} ms/step, of it waiting for the host {idle['starved_ms']} ms;"
              " by the host operation launching the next kernel (innermost | outermost):")
        for (name, ms, count), (outer, oms, ocount) in zip(idle["inner"], idle["outer"]):
            print(f"    {ms:>7.2f} ms {count:>6}x  {name:<52} | {oms:>7.2f} ms {ocount:>6}x  {outer}")
