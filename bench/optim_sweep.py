"""Kernel variants of the toolkit's 8-bit AdamW on one GPU: correctness against the reference, then time.

    python bench/optim_sweep.py [--baseline path/to/triton_kernels.py] [--tensors 16] [--size 4096]

For each variant (quantize search, dequantize method, blocks per program, warps) and param dtype: one fused
step against the pure-torch reference on a few tensors (codes that differ, largest param error), then the
step times over --tensors parameters of --size x --size, timed as bench/optim.py times them. --baseline times an
older copy of toolkit/optim/triton_kernels.py in the same run, for a before/after from one machine (one whose
fused_step takes the step counts from the states, as since the step count moved to the device).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.optim import AdamW8bit, triton_kernels  # noqa: E402
from toolkit.optim.reference import adamw_8bit_update_  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_optim", Path(__file__).with_name("optim.py"))
BENCH = importlib.util.module_from_spec(_spec)  # bench/optim.py: the same timing as the comparison table
_spec.loader.exec_module(BENCH)

# (quant_search, dequant, blocks, num_warps); the midpoint check on every step (not only the first) as a probe
VARIANTS = [(1, 1, 1, 1), (1, 1, 1, 2), (1, 1, 2, 2), (1, 1, 4, 4), (1, 0, 1, 1), (0, 1, 1, 1)]
PROBES = [{"quant_search": 1, "dequant": 1, "blocks": 1, "num_warps": 1, "exact_ties": True}]


def check_one_step(fused_step, config: dict, dtype: torch.dtype) -> str:
    """One fused step against adamw_8bit_update_ from identical states: code differences, param error."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(512, 1024), (4099,), (33, 257)]
    params = [(torch.randn(s, device="cuda", generator=gen) * 0.1).to(dtype) for s in shapes]
    grads = [(torch.randn(s, device="cuda", generator=gen) * 1e-2).to(dtype) for s in shapes]
    warm = AdamW8bit([torch.nn.Parameter(p.clone()) for p in params], lr=1e-3, weight_decay=0.05, impl="torch")
    for p in warm.param_groups[0]["params"]:  # two reference steps give realistic moments
        p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(dtype) * 1e-2
    warm.step()
    warm.step()
    states = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in warm.state[p].items()}
              for p in warm.param_groups[0]["params"]]
    for st in states:
        st["step"] += 1
    ref_states = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()} for st in states]
    ref_params = [p.clone() for p in params]
    fused_step("adamw", params, grads, states, triton_kernels._LaunchTables(), lr=1e-3, beta1=0.9, beta2=0.999,
               eps=1e-8, weight_decay=0.05, config=config)
    for p, g, st in zip(ref_params, grads, ref_states):
        adamw_8bit_update_(p, g, st, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
    diffs = max_diff = 0
    for st, ref in zip(states, ref_states):
        for key in ("state1", "state2"):
            d = (st[key].int() - ref[key].int()).abs()
            diffs += int((d > 0).sum())
            max_diff = max(max_diff, int(d.max()))
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(params, ref_params))
    n = sum(p.numel() for p in params)
    return f"codes differing {diffs}/{2 * n} (max {max_diff}), param max err {err:.1e}"


def time_step(fused_step, config: dict, dtype: torch.dtype, tensors: int, size: int, steps: int) -> tuple:
    """bench/optim.py's (synced ms, back-to-back ms, host ms) of AdamW8bit.step() with this kernel config."""
    saved = triton_kernels.fused_step
    triton_kernels.fused_step = lambda *a, **k: fused_step(*a, **{**k, "config": config})
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(size, size, device="cuda", dtype=dtype, generator=gen))
                  for _ in range(tensors)]
        grad_sets = [[torch.randn(size, size, device="cuda", dtype=dtype, generator=gen) * 1e-3
                      for _ in range(tensors)] for _ in range(3)]
        opt = AdamW8bit(params, lr=1e-4, weight_decay=0.01, impl="triton")
        return BENCH.time_steps(opt, params, grad_sets, steps)
    finally:
        triton_kernels.fused_step = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="an older triton_kernels.py to time beside the current one")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    runs = []
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_kernels", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
        runs.append(("baseline", baseline.fused_step, lambda dt: baseline.DEFAULT_CONFIGS[dt]))
    runs.append(("defaults", triton_kernels.fused_step, lambda dt: triton_kernels.DEFAULT_CONFIGS[dt]))
    for q, d, b, w in VARIANTS:
        config = {"quant_search": q, "dequant": d, "blocks": b, "num_warps": w}
        runs.append((f"q{q} d{d} {b}x256/w{w}", triton_kernels.fused_step, lambda dt, c=config: c))
    for config in PROBES:
        name = f"q1 d1 {config['blocks']}x256/w{config['num_warps']} exact"
        runs.append((name, triton_kernels.fused_step, lambda dt, c=config: c))
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name, fused_step, config_for in runs:
            config = config_for(dtype)
            try:
                check = check_one_step(fused_step, config, dtype)
                synced, back_to_back, host = time_step(fused_step, config, dtype, args.tensors, args.size, args.steps)
            except Exception as exc:  # a variant that fails to compile is reported, the sweep goes on
                print(f"  {dtype_name:9s} {name:24s} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            rows.append((dtype_name, name, synced, back_to_back))
            print(f"  {dtype_name:9s} {name:24s} {synced:7.3f} ms synced {back_to_back:7.3f} ms back-to-back "
                  f"{host:6.3f} ms host; {check}", flush=True)
            torch.cuda.empty_cache()
    param_bytes = {"float32": 4, "bfloat16": 2}
    print(f"\n{'dtype':9s} {'variant':24s} {'synced':>7s} {'b2b':>7s} {'TB/s':>5s}")
    for dtype_name, name, synced, b2b in rows:
        moved = args.tensors * args.size**2 * (3 * param_bytes[dtype_name] + 4)
        print(f"{dtype_name:9s} {name:24s} {synced:7.3f} {b2b:7.3f} {moved / b2b / 1e9:5.2f}")


if __name__ == "__main__":
    main()
