"""Compute kernels the toolkit writes itself: plain PyTorch, fused by torch.compile where it runs on a GPU
(inductor emits Triton for CUDA and ROCm from the same source), run eagerly on the CPU."""
