"""What holds a training step's GPU memory at its peak, grouped by the code that allocated it.

`recorded(into)` records the CUDA caching allocator's history (PyTorch's `_record_memory_history`, with Python
stacks) while one step runs; `peak_breakdown` replays the allocations and frees of that window, finds the moment
the most memory was allocated, and sums the blocks alive then by the frame that allocated them: the innermost
frame in the toolkit, transformers, peft, diffusers, unsloth or the bench itself, else the innermost one. What
was allocated before the window (weights, optimizer state, what earlier steps keep) is one line of its own.

Used by bench/llm.py --memory for every row (the plain loops, unsloth and the toolkit alike).
"""

from __future__ import annotations

from contextlib import contextmanager

GiB = 2**30
OWN_CODE = ("/toolkit/", "/transformers/", "/peft/", "/diffusers/", "/unsloth", "/bench/", "/liger_kernel/")


def label(frames: list[dict]) -> str:
    """`file:line function` of the frame that stands for an allocation (frames innermost first)."""
    if not frames:
        return "(no Python frame: C++ or a compiled graph's own buffer)"
    chosen = next((f for f in frames if any(mark in f["filename"] for mark in OWN_CODE)), frames[0])
    path = chosen["filename"]
    for mark in OWN_CODE:
        if mark in path:
            path = mark.strip("/") + "/" + path.split(mark, 1)[1]
            break
    return f"{path}:{chosen['line']} {chosen['name']}"


def peak_breakdown(events: list[dict], before: int = 0, top: int = 12) -> dict:
    """{"peak_gib", "before_gib", "rows": [[label, GiB, blocks], ...]} for the allocator trace `events` (in
    order), `before` bytes being allocated when it began. A block counts from its alloc to its free_completed."""
    live: dict[int, int] = {}
    total = best = 0
    best_index = -1
    for index, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > best:
                best, best_index = total, index
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])
    alive: dict[int, dict] = {}
    for event in events[:best_index + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] == "free_completed":
            alive.pop(event["addr"], None)
    groups: dict[str, list[int]] = {}
    for event in alive.values():
        group = groups.setdefault(label(event.get("frames", [])), [0, 0])
        group[0] += event["size"]
        group[1] += 1
    rows = sorted(groups.items(), key=lambda item: -item[1][0])
    return {"peak_gib": (before + best) / GiB, "before_gib": before / GiB,
            "rows": [[name, size / GiB, count] for name, (size, count) in rows[:top]]}


@contextmanager
def recorded(into: dict, top: int = 12):
    """Record the allocator's history while the block runs; put peak_breakdown's answer into `into`."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    # stacks for allocations only (what the breakdown reads); frees record none
    torch.cuda.memory._record_memory_history(max_entries=500_000, context="alloc", stacks="python")
    try:
        yield
        torch.cuda.synchronize()
        device = torch.cuda.current_device()
        traces = torch.cuda.memory._snapshot()["device_traces"]
        into.update(peak_breakdown(traces[device] if device < len(traces) else [], before, top))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def print_breakdown(row: str, result: dict) -> None:
    if "failed" in result:
        print(f"\n{row}: the recorded step failed ({result['failed']})")
        return
    print(f"\n{row}: {result['peak_gib']:.2f} GiB at the peak of the recorded step; "
          f"{result['before_gib']:.2f} GiB allocated before it began")
    for name, gib, count in result["rows"]:
        print(f"  {gib:8.3f} GiB  {count:5d} blocks  {name}")
