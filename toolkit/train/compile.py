"""Regional compilation: each repeated block of the trained model (a decoder layer, a DiT block, a UNet
down/up block) goes through torch.compile on its own, so one compilation serves every block of the same
shape and the compile time stays a fraction of compiling the whole model. The blocks are the model's own
`_no_split_modules` classes (transformers and diffusers list them for device maps), the outermost ones.

Triton and inductor serve CUDA and ROCm from the same source; on the CPU inductor writes C++.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from toolkit.models.base import is_sharded, repeated_blocks
from toolkit.paths import compiled_code_folders


def keep_compiled_code(log: Callable[[str], None]) -> None:
    """Compiled code kept (compiled_code_folders), so that a second run of the same model (the same shapes,
    settings and versions) loads it instead of compiling again."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    compiled_code_folders()
    inductor_config.fx_graph_cache = True
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = True
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    log(f"train.compile: compiled code is kept in {cache_dir()} (a later run of the same shapes and settings loads "
        "it)")


def without_ddp_graph_splitting() -> None:
    """Blocks compiled one by one run inside DistributedDataParallel's forward with several processes, where dynamo
    by default hands every graph it compiles to its DDPOptimizer, which splits graphs at gradient-bucket borders so
    that communication overlaps a model compiled whole. A block's own backward already ends where its gradients
    are ready, and DDP's reducer overlaps the all-reduce with the blocks before it. Measured on 2 H200s
    (bench/scaling.py, Llama-3.2-1B shape, 4 x 2048 tokens per GPU, one command): with the splitting 150.2k
    tokens/s and 14.9 GiB per GPU, without it 153.8k and 13.0 GiB (one process: 80.1k, 12.9 GiB)."""
    import torch._dynamo

    torch._dynamo.config.optimize_ddp = False


def recompute_elementwise(on: bool) -> None:
    """train.compile_recompute: with `on` (pointwise), the partitioner that splits each compiled block into its
    forward and backward recomputes every cheap elementwise op (norms, activations, casts; its allowlist) in the
    backward rather than keeping its output, even far from its use or where the backward needs it materialised:
    what a block keeps is then what matmuls and attention produced. Its three bans are what stood in the way
    (torch._functorch.config); no matmul is ever recomputed, unlike a memory budget below 1, which may. For a
    Llama decoder layer it drops the SwiGLU product and most normalised hidden states (a LoRA-wrapped layer of
    hidden size 384, 400 tokens, partitioned on the CPU under bf16 autocast, kept 8.86 MiB instead of 12.95;
    tests/test_compile_recompute.py checks the SwiGLU product on a smaller one, in fp32 and on a GPU in bf16).
    Process-wide: it applies to the graphs compiled after it, which are the toolkit's compiled blocks."""
    import torch._functorch.config as functorch_config

    for ban in ("ban_recompute_used_far_apart", "ban_recompute_long_fusible_chains",
                "ban_recompute_materialized_backward"):
        setattr(functorch_config, ban, not on)


def compile_blocks(roots: Mapping[str, torch.nn.Module], log: Callable[[str], None]) -> int:
    """Compile the outermost repeated blocks of every root in place; returns how many. A block that dynamo
    cannot compile runs eagerly (dynamo prints why) instead of stopping the run."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    without_ddp_graph_splitting()
    keep_compiled_code(log)
    count, kinds = 0, set()
    for name, root in roots.items():
        blocks = repeated_blocks(root, outermost=True)
        if not blocks:
            log(f"train.compile: the {name} ({type(root).__name__}) names no repeated blocks; it runs uncompiled")
        for block in blocks:
            if is_sharded(block):  # fsdp: its gather/free hooks stay outside the graph, the forward is compiled
                block.forward = torch.compile(block.forward)
            else:
                block.compile()
            kinds.add(type(block).__name__.removeprefix("FSDP"))
        count += len(blocks)
    if count:
        log(f"train.compile: {count} blocks ({', '.join(sorted(kinds))}) compiled one by one; the first steps "
            "include the compilation")
    return count
