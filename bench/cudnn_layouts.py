"""Which cuDNN SDPA calls crash on Flux.1's attention shape (1 x 24 heads x 4608 tokens x 128), each variant
in a child process of its own (a crash poisons the CUDA context). GPU only.

    python bench/cudnn_layouts.py [VARIANT ...]

Variants: contig, bshd, bshd-gradt, gradslice (bare SDPA calls: contiguous, transposed inputs, a transposed
gradient, a gradient sliced out of a concatenation); block (a Flux double block), single (a single block), both
(a double block, then a single one), each with -ckpt (checkpointed), -flash (flash instead of cuDNN) or -guard
(inside toolkit.train.attention.gradient_in_output_layout). On an H100 with cuDNN 9.19 and torch 2.11 only
"both" and "both-ckpt" crashed (an illegal memory access); "both-guard" and "both-flash" ran
(bench/results/cudnn-flux-diag-h100-2026-11-26c.txt).
"""
import subprocess
import sys
from pathlib import Path

import torch

ALL = ("contig", "bshd", "bshd-gradt", "gradslice", "block", "single", "both", "both-ckpt", "both-flash",
       "both-guard", "both-ckpt-guard")

def variant(name):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dev, dt = "cuda", torch.bfloat16
    B, H, S, D = 1, 24, 4608, 128
    torch.manual_seed(0)
    backend = SDPBackend.FLASH_ATTENTION if name.endswith("-flash") else SDPBackend.CUDNN_ATTENTION
    name = name.removesuffix("-flash")
    import contextlib
    guard = contextlib.nullcontext()
    if name.endswith("-guard"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from toolkit.train.attention import gradient_in_output_layout
        guard, name = gradient_in_output_layout(), name.removesuffix("-guard")
    with sdpa_kernel([backend]), guard:
        if name == "gradslice":
            leaves = [torch.randn(B, S, H, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3)]
            q, k, v = (x.transpose(1, 2) for x in leaves)
            for _ in range(3):
                out = F.scaled_dot_product_attention(q, k, v)
                mlp = torch.randn(B, S, 4 * H * D, device=dev, dtype=dt)
                y = torch.cat([out.transpose(1, 2).flatten(2), mlp], dim=2)
                (y.float() * torch.randn_like(y.float())).sum().backward()
        elif name in ("contig", "bshd", "bshd-gradt"):
            if name == "contig":
                q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
                leaves = (q, k, v)
            else:
                leaves = [torch.randn(B, S, H, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3)]
                q, k, v = (x.transpose(1, 2) for x in leaves)
            for _ in range(3):
                out = F.scaled_dot_product_attention(q, k, v)
                if name == "bshd-gradt":
                    y = out.transpose(1, 2).flatten(2)
                    (y.float() * torch.randn_like(y.float())).sum().backward()
                else:
                    out.backward(torch.randn_like(out))
        else:
            from diffusers.models.transformers.transformer_flux import (FluxPosEmbed, FluxSingleTransformerBlock,
                                                                        FluxTransformerBlock)
            double = FluxTransformerBlock(3072, 24, 128).to(dev, dt)
            single = FluxSingleTransformerBlock(3072, 24, 128).to(dev, dt)
            if name.startswith("single"):
                block = single
            elif name.startswith("both"):
                def block(h, e, t, r):
                    e, h = double(h, e, t, r)
                    return single(h, e, t, r)
            else:
                block = double
            hs = torch.randn(1, 4096, 3072, device=dev, dtype=dt, requires_grad=True)
            enc = torch.randn(1, 512, 3072, device=dev, dtype=dt, requires_grad=True)
            temb = torch.randn(1, 3072, device=dev, dtype=dt)
            ids = torch.zeros(4608, 3, device=dev)
            ids[512:, 1] = torch.arange(64, device=dev).repeat_interleave(64).float()
            ids[512:, 2] = torch.arange(64, device=dev).repeat(64).float()
            rope = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids)
            for _ in range(3):
                if name.endswith("ckpt"):
                    from torch.utils.checkpoint import checkpoint
                    e, h = checkpoint(block, hs, enc, temb, rope, use_reentrant=False)
                else:
                    e, h = block(hs, enc, temb, rope)
                (h.float().square().mean() + e.float().square().mean()).backward()
    torch.cuda.synchronize()
    print("ok")

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        variant(sys.argv[2])
        sys.exit(0)
    print("cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    for name in sys.argv[1:] or ALL:
        r = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True, timeout=120)
        lines = [l for l in (r.stdout + r.stderr).splitlines() if "Error" in l or l == "ok"]
        print(f"{name:<12} rc={r.returncode} {lines[:2]}", flush=True)
