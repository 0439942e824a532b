"""device.sdpa_backend: which kernel PyTorch's scaled_dot_product_attention uses first, chosen by measuring.

auto on a GPU records the attention calls of one forward pass of the model on a real batch (shapes, dtype,
mask, causal), then times each backend (cuDNN, flash, memory-efficient) on the most expensive of those shapes,
forward and backward, in a child process, since a backend can crash on a shape and poison the CUDA context (cuDNN
9.19 did on Flux shapes, FINDINGS.md). A backend that fails, crashes, or gives outputs that differ from the
others is left out. The fastest goes first in PyTorch's priority order; the others stay enabled for calls it
cannot take (a mask it does not support, say). The choice and the figures are printed and kept in the cache
folder, keyed by the GPU, the library versions and the shapes, so the next run with the same shapes skips
the measurement. On the CPU nothing is measured: PyTorch's own choice stands.

    python -m toolkit.train.attention CALLS.json DEVICE     (the child: one line of JSON per backend)
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.nn.attention import SDPBackend

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
PROBED = ("cudnn", "flash", "efficient")   # math is the fallback, never the fastest
MAX_SHAPES = 3                              # the most expensive call shapes timed
PROBE_TIMEOUT_S = 180
_SDPA = torch.nn.functional.scaled_dot_product_attention  # PyTorch's own, also while gradient_in_output_layout wraps it


@dataclass(frozen=True)
class AttentionCall:
    """One distinct scaled_dot_product_attention call of the model's forward, and how often it ran."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: str
    mask: tuple[int, ...] | None
    causal: bool
    gqa: bool
    count: int = 1

    def cost(self) -> float:
        """Forward multiply-adds of all its calls (batch x heads x q length x k length x head dims)."""
        *lead, sq, d = self.q
        sk, dv = self.k[-2], self.v[-1]
        n = 1
        for x in lead:
            n *= x
        return float(n * sq * sk * (d + dv) * self.count)


class _Recorder(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: dict[tuple, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA or func is torch.nn.functional.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
            bound = {**dict(zip(names, args)), **kwargs}
            q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
            key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), str(q.dtype).removeprefix("torch."),
                   tuple(mask.shape) if isinstance(mask, torch.Tensor) else None, bool(bound.get("is_causal", False)),
                   bool(bound.get("enable_gqa", False)))
            self.calls[key] = self.calls.get(key, 0) + 1
        return func(*args, **kwargs)


def record_attention_calls(forward: Callable[[], object]) -> list[AttentionCall]:
    """The attention calls `forward()` makes, most expensive first."""
    recorder = _Recorder()
    with recorder:
        forward()
    calls = [AttentionCall(*key, count=count) for key, count in recorder.calls.items()]
    return sorted(calls, key=AttentionCall.cost, reverse=True)


# -- the measurement (in the child process) ---------------------------------------------------------------------
def _inputs(call: AttentionCall, device: torch.device):
    g = torch.Generator(device).manual_seed(0)
    dtype = getattr(torch, call.dtype)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g).requires_grad_()
               for shape in (call.q, call.k, call.v))
    mask = None if call.mask is None else torch.zeros(call.mask, device=device, dtype=dtype)
    return q, k, v, mask


def time_backend(name: str, calls: list[AttentionCall], device: torch.device, reps: int = 5) -> tuple[float, list]:
    """Seconds for forward + backward of `calls` (each weighted by its count) with only backend `name`, and the
    outputs of the first call (to compare backends)."""
    from torch.nn.attention import sdpa_kernel
    from torch.utils.benchmark import Timer

    total, outputs = 0.0, []
    with sdpa_kernel([BACKENDS[name]]):
        for call in calls:
            q, k, v, mask = _inputs(call, device)

            def once():
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=call.causal,
                                                                       enable_gqa=call.gqa)
                out.backward(torch.ones_like(out))
                return out

            out = once()
            if not outputs:
                outputs.append(out.detach().float())
            seconds = Timer("once()", globals={"once": once}).timeit(reps).mean  # synchronises CUDA itself
            total += seconds * call.count
    return total, outputs


def _child(calls_file: str, device_name: str) -> None:
    device = torch.device(device_name)
    calls = [AttentionCall(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()})
             for c in json.loads(Path(calls_file).read_text())]
    reference = None
    for name in PROBED:
        print(json.dumps({"backend": name, "started": True}), flush=True)
        try:
            seconds, outputs = time_backend(name, calls, device)
        except Exception as err:  # not supported for these inputs, or failed: left out
            print(json.dumps({"backend": name, "error": str(err).splitlines()[0][:200]}), flush=True)
            continue
        if reference is None:
            reference = outputs[0]
        difference = float((outputs[0] - reference).abs().max())
        print(json.dumps({"backend": name, "seconds": seconds, "difference": difference}), flush=True)


# -- the decision (in the trainer's process) ----------------------------------------------------------------------
def _why_left_out(result: dict) -> str:
    if "error" in result:
        return result["error"]
    return f"outputs differ from the first backend's by {result.get('difference', 0.0):.3g}"


def choose(results: dict[str, dict], tolerance: float = 2e-2) -> tuple[str | None, str]:
    """The fastest backend among those that ran and agree with the first one that ran, and the reason."""
    ok = {n: r for n, r in results.items() if "seconds" in r and r.get("difference", 0.0) <= tolerance}
    left_out = [f"{n} ({_why_left_out(r)})" for n, r in results.items() if n not in ok]
    if not ok:
        return None, "no backend ran on the recorded shapes: " + "; ".join(left_out)
    ranked = sorted(ok, key=lambda n: ok[n]["seconds"])
    timings = ", ".join(f"{n} {ok[n]['seconds'] * 1e3:.2f} ms" for n in ranked)
    return ranked[0], f"measured forward + backward: {timings}" + (f"; left out: {'; '.join(left_out)}" if left_out else "")


def measure_in_child(calls: list[AttentionCall], device: torch.device, work: Path) -> dict[str, dict]:
    """Run the measurement in a child process; a backend that crashes it is recorded as crashed."""
    work.mkdir(parents=True, exist_ok=True)
    calls_file = work / "attention-calls.json"
    calls_file.write_text(json.dumps([asdict(c) for c in calls]))
    done = subprocess.run([sys.executable, "-m", "toolkit.train.attention", str(calls_file), str(device)],
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    results: dict[str, dict] = {}
    running = None
    for line in done.stdout.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        running = record["backend"]
        if "started" not in record:
            results[running] = record
            running = None
    if running is not None:
        tail = (done.stderr.strip().splitlines() or ["no message"])[-1][:200]
        results[running] = {"backend": running, "crashed": True, "error": f"crashed the process: {tail}"}
    return results


def cache_key(calls: list[AttentionCall], device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    versions = (torch.__version__, str(torch.backends.cudnn.version()), str(torch.version.hip))
    return json.dumps([name, versions, [asdict(c) for c in calls]])


def probe(calls: list[AttentionCall], device: torch.device, cache_file: Path) -> tuple[str | None, str]:
    """The backend for `calls` (the MAX_SHAPES most expensive), from the cache or measured now."""
    calls = calls[:MAX_SHAPES]
    key = cache_key(calls, device)
    cached = {}
    if cache_file.is_file():
        try:
            cached = json.loads(cache_file.read_text())
        except ValueError:
            cached = {}
    if key in cached:
        best, why = cached[key]
        return best, f"{why} (measured before, from {cache_file})"
    best, why = choose(measure_in_child(calls, device, cache_file.parent))
    cached[key] = [best, why]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_text(json.dumps(cached))
    return best, why


def priority(first: str) -> list[SDPBackend]:
    """PyTorch's priority order with `first` ahead of the others (all stay enabled)."""
    return [BACKENDS[first]] + [b for n, b in BACKENDS.items() if n != first]


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])


def choose_for_run(setting: str, device: torch.device, forward: Callable[[], object], is_main: bool,
                   from_main: Callable, cache_file: Path, log: Callable[[str], None]):
    """device.sdpa_backend for a run: (the context that puts the chosen backend first or None for PyTorch's order,
    the backend chosen or None, why).

    `forward()` runs one forward pass on a batch (every process runs it: a sharded model needs them all); the
    main process measures and every process gets its choice."""
    if setting != "auto":
        best, why = setting, "set in the config"
    elif device.type != "cuda":
        why = f"PyTorch's own SDPA choice on {device.type} (device.sdpa_backend=auto measures on GPUs)"
        log(f"attention: {why}")
        return None, None, why
    else:
        calls = record_attention_calls(forward)
        best, why = None, "the model made no scaled_dot_product_attention calls"
        if is_main and calls:
            best, why = probe(calls, device, cache_file)
        best, why = from_main((best, why))
    if best is None:
        log(f"attention: PyTorch's own SDPA choice ({why})")
        return None, None, f"PyTorch's own SDPA choice ({why})"
    from torch.nn.attention import sdpa_kernel

    log(f"attention: SDPA {best} first, the others as fallback (device.sdpa_backend={setting}: {why})")
    # (the trainer holds gradient_in_output_layout() for the whole run on a GPU, whichever backend goes first)
    return sdpa_kernel(priority(best), set_priority=True), best, why


# -- cuDNN's backward and the gradient's memory layout ----------------------------------------------------------
def _hand_gradient_in_layout(out: torch.Tensor) -> None:
    """Hook `out` so that its gradient reaches the attention's backward in `out`'s own memory layout (a copy only
    where the layouts differ). A tensor hook, not an autograd function, so later in-place ops on `out` stay legal."""
    strides = out.stride()

    def same_layout(grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == strides:
            return grad
        return torch.empty_strided(grad.shape, strides, dtype=grad.dtype, device=grad.device).copy_(grad)

    out.register_hook(same_layout)


@contextmanager
def gradient_in_output_layout():
    """While inside, every eager scaled_dot_product_attention output that needs a gradient gets it in the output's
    own layout. cuDNN's SDPA backward (cuDNN 9.19, torch 2.11) failed with an illegal memory access when calls of
    one shape got their gradients in different layouts: Flux's double blocks pass a dense gradient, its single
    blocks a slice of their attention + MLP concatenation. A double and a single block in sequence crashed on an
    H100, each alone ran, and flash ran both (bench/cudnn_layouts.py). A copy costs one
    gradient's worth of memory traffic, and only where the layouts differ. Compiled graphs are left alone: the
    compiler lays out the gradients itself, and compiled Flux trained with cuDNN first."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def scaled_dot_product_attention(*args, **kwargs):
        out = original(*args, **kwargs)
        if not torch.compiler.is_compiling() and out.requires_grad and _dense(out):
            _hand_gradient_in_layout(out)
        return out

    functional.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def _dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its storage without gaps or overlaps (some order of its dimensions is contiguous)."""
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d]))
    expected = 1
    for d in order:
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True
