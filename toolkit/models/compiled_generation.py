"""train.generation=compiled: GRPO's completions from a decode-only copy of the policy that a compiled decode step
can run fast (models/generation.py says why the eager path runs as it does).

What it changes against the eager path (the trained network itself, HF generate with a dynamic KV cache):
- the LoRA merged: a copy of each adapted layer's weight, W + the active adapters' deltas (PEFT's get_delta_weight,
  summed in fp32, cast to W's dtype), refreshed before each generate call. Every other tensor (embeddings, norms,
  the output head, the rotary buffers) is the trained model's own, shared. The trained weights are never written:
  generation reads the copy, so the LoRA and the base stay bit-for-bit what they were; the copy costs one more
  copy of the adapted base weights (all-linear on Llama-3.2-1B: 0.97B parameters, 1.8 GiB in bf16);
- a static KV cache (transformers' StaticCache, cache_implementation="static") of prompt width +
  max_completion_length, the prompts left-padded to a multiple of WIDTH_STEP tokens, so that one cache shape (and
  one compiled decode) serves every batch of prompts up to that width;
- the decode forward compiled through transformers' CompileConfig, with CUDA graphs (mode reduce-overhead) on CUDA;
  on the CPU it runs eagerly (inductor's C++ build costs more than a CPU decode saves), with the same cache and
  merged copy.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch.nn.attention import sdpa_kernel
from transformers import CompileConfig

from toolkit.errors import UserError
from toolkit.models.generation import DECODE_ATTENTION

# Prompts left-padded to a multiple of this: one static cache, one compiled decode per width. Per batch, not the
# widest seen so far: a batch's padding (and so its sampled tokens, to the last bit) must not depend on what the
# process ran before it, or a resumed run would sample otherwise than the uninterrupted one.
WIDTH_STEP = 64
# How the decode step compiles, per device type (None: not compiled). dynamic=False: one graph per cache width.
DECODE_COMPILE: dict[str, dict[str, Any] | None] = {
    "cuda": dict(fullgraph=False, dynamic=False, backend="inductor", mode="reduce-overhead"),
    "cpu": None,
}


def decode_compile_config(device_type: str) -> CompileConfig | None:
    """The CompileConfig of the decode step on `device_type`, or None where it runs eagerly."""
    settings = DECODE_COMPILE.get(device_type)
    if settings is None:
        return None
    config = CompileConfig(**settings)
    config._compile_all_devices = device_type != "cuda"  # transformers compiles on accelerators only, unless told
    return config


def padded_width(longest: int) -> int:
    """The prompt width a batch is left-padded to: `longest` rounded up to a multiple of WIDTH_STEP."""
    return -(-longest // WIDTH_STEP) * WIDTH_STEP


def trained_adapters(layer: LoraLayer) -> list[str]:
    """The active adapters `layer` holds factors for: lora_A/lora_B, or PEFT's lora_embedding_A/B on an embedding."""
    held = {*layer.lora_A, *getattr(layer, "lora_embedding_A", {})}
    return [a for a in layer.active_adapters if a in held]


class MergedDecoder:
    """The policy for generation only: the model's architecture (built on the meta device, then bound to tensors)
    with each LoRA layer its frozen layer's plain class, whose weight is a merged copy; every other tensor shared."""

    def __init__(self, network: torch.nn.Module):
        base = network.get_base_model()
        with torch.device("meta"):  # the trained model's own class: a model of remote code too, nothing imported again
            self.model = type(base)._from_config(base.config, dtype=base.dtype,
                                                 attn_implementation=base.config._attn_implementation)
        self.model.generation_config = base.generation_config
        self.merged: list[tuple[torch.Tensor, LoraLayer]] = []
        adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
        for name, module in self.model.named_modules():
            if name in adapted:
                self._bind_merged(module, adapted[name])
            elif not any(name.startswith(a + ".") for a in adapted):
                self._bind_shared(module, base.get_submodule(name))
        left = [f"{n}.{k}" if n else k for n, m in self.model.named_modules() for k, t in vars(m).items()
                if isinstance(t, torch.Tensor) and t.is_meta]
        left += [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"train.generation=compiled: no tensor of the trained model for {left[:4]}")
        self.model.eval().requires_grad_(False)

    def _bind_merged(self, module: torch.nn.Module, layer: LoraLayer) -> None:
        """`module` (the copy's, of the frozen layer's own class: nn.Linear, nn.Embedding, transformers' Conv1D)
        gets a weight of its own for W + the deltas; PEFT's get_delta_weight gives each delta in W's layout."""
        frozen = layer.get_base_layer()
        deltas = {a: tuple(layer.get_delta_weight(a).shape) for a in trained_adapters(layer)}
        if type(module) is not type(frozen) or any(shape != tuple(frozen.weight.shape) for shape in deltas.values()):
            raise UserError(f"train.generation: compiled generation cannot merge the LoRA of a {type(frozen).__name__} "
                            f"(deltas {deltas} over a weight of {tuple(frozen.weight.shape)})\n"
                            "  fix: train.generation=eager, or network.target_modules without that layer")
        module.weight = torch.nn.Parameter(torch.empty_like(frozen.weight), requires_grad=False)
        if "bias" in frozen._parameters:  # LoRA leaves the bias as it is (an embedding has none)
            module.bias = frozen.bias
        self.merged.append((module.weight, layer))

    @staticmethod
    def _bind_shared(module: torch.nn.Module, source: torch.nn.Module) -> None:
        for leaf in list(module._parameters):
            module._parameters[leaf] = source._parameters[leaf]
        for leaf in list(module._buffers):
            module._buffers[leaf] = source._buffers[leaf]
        for leaf, value in vars(source).items():  # tensors kept as plain attributes (rotary original_inv_freq)
            if isinstance(value, torch.Tensor) and isinstance(getattr(module, leaf, None), torch.Tensor):
                setattr(module, leaf, value)

    @torch.no_grad()
    def refresh(self) -> None:
        """Each merged weight := W + the sum of the active adapters' deltas (fp32 sums, cast once to W's dtype)."""
        for merged, layer in self.merged:
            total = layer.get_base_layer().weight.float()
            for adapter in trained_adapters(layer):
                total = total + layer.get_delta_weight(adapter).float()
            merged.copy_(total)

    def extra_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m, _ in self.merged)


class CompiledGeneration:
    """train.generation=compiled: merged weights, a static KV cache at padded widths, the decode step compiled."""

    def __init__(self, network: torch.nn.Module, device_type: str):
        self.decoder = MergedDecoder(network)
        self.device_type, self.compile_config = device_type, decode_compile_config(device_type)

    def width(self, longest: int) -> int:
        return padded_width(longest)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, **sampling: Any) -> torch.Tensor:
        self.decoder.refresh()
        with sdpa_kernel(DECODE_ATTENTION):  # no cuDNN attention: generation.py
            return self.decoder.model.generate(input_ids=ids, attention_mask=mask, use_cache=True,
                                               cache_implementation="static", compile_config=self.compile_config,
                                               disable_compile=self.compile_config is None, **sampling)

    def describe(self) -> str:
        settings = DECODE_COMPILE.get(self.device_type)
        compiled = (f"the decode step compiled ({', '.join(f'{k}={v}' for k, v in settings.items())})" if settings
                    else f"the decode step eager on the {self.device_type}")
        return (f"train.generation=compiled: the LoRA merged into a copy of {len(self.decoder.merged)} layers' "
                f"weights ({self.decoder.extra_bytes() / 2**20:,.1f} MiB more), a static KV cache with the prompts "
                f"padded to multiples of {WIDTH_STEP} tokens, {compiled}")
