"""Compute kernels the toolkit writes itself. Most are plain PyTorch, fused by torch.compile where they run on a
GPU (inductor emits Triton for CUDA and ROCm from the same source) and run eagerly on the CPU; where a fusion is
beyond the compiler (a reduction over tokens inside an elementwise backward: gated_backward.py), a Triton kernel
written here, with the same arithmetic in PyTorch for the CPU."""

import functools


@functools.cache
def triton_available() -> bool:
    """True when triton imports (checked once, lazily: CPU-only installs never need it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
