"""One frozen linear layer's forward + input gradient: bf16 nn.Linear against the toolkit's fp8 layer
(toolkit/kernels/fp8_linear.py), eager and compiled, on the shapes of the models the toolkit trains. CUDA events,
median of the timed repeats; the error of the fp8 output and input gradient against bf16.

    python bench/fp8_linear.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.device.detect import detect_device  # noqa: E402
from toolkit.kernels.fp8_linear import Float8Linear, fp8_format, fp8_matmul_supported  # noqa: E402

SHAPES = {  # tokens, in, out
    "flux qkv": (4608, 3072, 3 * 3072), "flux mlp up": (4608, 3072, 12288), "flux mlp down": (4608, 12288, 3072),
    "llama-1b up": (8192, 2048, 8192), "llama-1b down": (8192, 8192, 2048), "llama-1b q": (8192, 2048, 2048),
}


def timed(fn, repeats: int) -> float:
    """ms per call: `repeats` calls queued back to back between two events (the host runs ahead, as in training)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    info = detect_device()
    torch._dynamo.config.cache_size_limit = 64  # one compiled graph per layer and shape
    print(f"device: {torch.cuda.get_device_name()}; fp8 matmuls: {fp8_matmul_supported(info)}; torch {torch.__version__}")
    print(f"{'shape':<15} {'bf16 ms':>8} {'bf16 c':>8} {'fp8 ms':>8} {'fp8 c':>8} {'c ratio':>8} {'err y':>7} {'err gx':>7} "
          f"{'eager gx':>8}   (c: compiled; errors against bf16 eager)")
    for name, (m, k, n) in SHAPES.items():
        torch.manual_seed(0)
        base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        fp8 = Float8Linear(base, fp8_format(info), fp8_matmul_supported(info), torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        results, errors = {}, {}
        x16 = x.detach().clone().requires_grad_()
        y16 = base(x16)
        y16.backward(grad)
        for label, module in (("bf16", base), ("fp8", fp8)):
            for compiled in (False, True):
                run = torch.compile(module) if compiled else module
                leaf = x.detach().clone().requires_grad_()
                y = run(leaf)
                y.backward(grad)
                errors[label, compiled] = (rel(y, y16), rel(leaf.grad, x16.grad))

                def step():
                    leaf.grad = None
                    run(leaf).backward(grad)
                results[label, compiled] = timed(step, args.repeats)
        print(f"{name:<15} {results['bf16', False]:>8.3f} {results['bf16', True]:>8.3f} {results['fp8', False]:>8.3f} "
              f"{results['fp8', True]:>8.3f} {results['bf16', True] / results['fp8', True]:>8.2f} "
              f"{errors['fp8', True][0]:>7.3f} {errors['fp8', True][1]:>7.3f} {errors['fp8', False][1]:>7.3f}", flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


if __name__ == "__main__":
    main()
