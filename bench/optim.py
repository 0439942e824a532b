"""Step time and state size of 8-bit AdamW implementations on one GPU, side by side in one run.

    python bench/optim.py [--tensors 16] [--size 4096] [--steps 50]

Times each optimizer's step() with CUDA events on --tensors parameters of --size x --size, for fp32 and
bf16 params, each step with the next of --grad-sets gradient sets: after 5 warm-up steps, the median of
--steps synchronized single steps, then the mean of --steps back-to-back steps and the host time to issue
them. Prints ms/step, bytes of state per parameter and speed relative to bitsandbytes AdamW8bit (TB/s
counts the bytes an 8-bit step must move). Optimizers whose package is missing are listed as such.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.optim import AdamW8bit  # noqa: E402
from toolkit.optim import triton_kernels  # noqa: E402


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of per-parameter optimizer state (step counters and maps shared by all blocks excluded)."""
    total = 0
    for state in opt.state.values():
        for key, value in state.items():
            if not torch.is_tensor(value) or key in ("step", "qmap1", "qmap2"):
                continue
            if hasattr(value, "__tensor_flatten__"):  # torchao's quantized state subclass
                names, _ = value.__tensor_flatten__()
                total += sum(getattr(value, n).nbytes for n in names if n != "qmap")
            else:
                total += value.nbytes
    return total


def time_steps(opt, params, grad_sets, steps: int, warmup: int = 5) -> tuple[float, float, float]:
    """(median ms of single steps, each synchronized; mean ms of back-to-back steps; host ms per step).

    Each step takes the next of `grad_sets`, as training brings new gradients: one fixed gradient would let
    the moments settle on values that a data-dependent kernel handles unlike real training. A synchronized
    step also counts the Python and launch time of step() before the GPU starts; back-to-back steps
    overlap it with the previous step's GPU work."""
    def step(i):
        for p, g in zip(params, grad_sets[i % len(grad_sets)]):
            p.grad = g
        opt.step()

    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    times = []
    for i in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for i in range(steps):
        step(i)
    end.record()
    host = (time.perf_counter() - host) * 1e3 / steps
    end.synchronize()
    return statistics.median(times), start.elapsed_time(end) / steps, host


LAST_KERNEL = []


def _record_kernel(fused_step):
    def wrapper(*args, **kwargs):
        kernel = fused_step(*args, **kwargs)
        LAST_KERNEL[:] = [kernel]
        return kernel
    return wrapper


triton_kernels.fused_step = _record_kernel(triton_kernels.fused_step)


def package_versions() -> str:
    """torch, triton, bitsandbytes and torchao versions as installed ('missing' where not)."""
    from importlib import metadata

    versions = []
    for name in ("torch", "triton", "bitsandbytes", "torchao"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} missing")
    return ", ".join(versions)


def make_optimizers():
    """name -> constructor(params); a constructor raising ImportError marks the package missing."""

    def toolkit(config):
        def build(params):
            triton_kernels.CONFIG_OVERRIDE = config
            return AdamW8bit(params, lr=1e-4, weight_decay=0.01, impl="triton")
        return build

    def bnb(params):
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=1e-4, weight_decay=0.01)

    def torchao(params):
        from torchao.optim import AdamW8bit as AoAdamW8bit

        return AoAdamW8bit(params, lr=1e-4, weight_decay=0.01)

    def fused(params):
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)

    builders = {}
    builders["toolkit AdamW8bit (Triton)"] = toolkit(None)  # bench/optim_sweep.py times other kernel configs
    builders["bitsandbytes AdamW8bit"] = bnb
    builders["torchao AdamW8bit"] = torchao
    builders["torch AdamW fused"] = fused
    return builders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--grad-sets", type=int, default=3, help="gradient sets the steps rotate through")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    print(f"device: {device}; {package_versions()}", flush=True)
    print(f"{args.tensors} x {args.size}x{args.size} params "
          f"({args.tensors * args.size**2 / 1e6:.0f}M); median of {args.steps} steps after 5 warm-up", flush=True)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator(device="cuda").manual_seed(0)
        grad_sets = [[torch.randn(args.size, args.size, device="cuda", dtype=dtype, generator=gen) * 1e-3
                      for _ in range(args.tensors)] for _ in range(args.grad_sets)]
        for name, build in make_optimizers().items():
            params = [torch.nn.Parameter(torch.randn(args.size, args.size, device="cuda", dtype=dtype, generator=gen))
                      for _ in range(args.tensors)]
            try:
                opt = build(params)
                ms, b2b, host = time_steps(opt, params, grad_sets, args.steps)
                bpp = state_bytes(opt) / sum(p.numel() for p in params)
                rows.append((dtype_name, name, ms, b2b, host, bpp))
                compiled = ""
                if name.startswith("toolkit") and LAST_KERNEL:
                    k = LAST_KERNEL[0]
                    compiled = f"  regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')}"
                print(f"  {dtype_name:9s} {name:34s} {ms:8.3f} ms synced {b2b:8.3f} ms back-to-back {host:6.3f} ms "
                      f"host  {bpp:5.3f} B/param{compiled}", flush=True)
            except ImportError as exc:
                print(f"  {dtype_name:9s} {name:34s} not installed ({exc})", flush=True)
            except Exception:
                print(f"  {dtype_name:9s} {name:34s} FAILED\n{traceback.format_exc()}", flush=True)
            finally:
                opt = None
                del params
                torch.cuda.empty_cache()
    param_bytes = {"float32": 4, "bfloat16": 2}
    print(f"\n{'dtype':9s} {'optimizer':30s} {'synced':>7s} {'vs bnb':>7s} {'b2b':>7s} {'vs bnb':>7s} {'host':>6s} "
          f"{'B/param':>7s} {'TB/s':>5s}")
    for dtype_name, name, ms, b2b, host, bpp in rows:
        bnb = next((r for r in rows if r[0] == dtype_name and r[1] == "bitsandbytes AdamW8bit"), None)
        ratios = [f"{bnb[i] / t:6.2f}x" if bnb else "   n/a" for i, t in ((2, ms), (3, b2b))]
        # bytes an 8-bit step must move: read p, g, both codes; write p, both codes (absmax ~1%)
        moved = args.tensors * args.size**2 * (3 * param_bytes[dtype_name] + 4)
        print(f"{dtype_name:9s} {name:30s} {ms:7.3f} {ratios[0]} {b2b:7.3f} {ratios[1]} {host:6.3f} {bpp:7.3f} "
              f"{moved / b2b / 1e9:5.2f}")


if __name__ == "__main__":
    main()
