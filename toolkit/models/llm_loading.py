"""Loading the llm family's base: how it is quantized (QuantPlan: model.quantize, the backend and a prequantized
checkpoint's config), bitsandbytes' config, the attention implementation's package, the parameter count without
loading, whether the model's loss sums, transformers' checkpointing of the decoder layers, and
model.fuse_projections' groups once PEFT has wrapped the model."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from toolkit.errors import UserError
from toolkit.models.checkpoint_offload import InputOffload, offloading
from toolkit.models.quantize import choose_backend
from toolkit.models.shared_input import group_shared_inputs


@dataclass
class QuantPlan:
    """How the frozen base is quantized: mode none/4bit/8bit/fp8/prequantized, and when."""

    mode: str
    after_load: bool = False   # load 16-bit weights, then replace the linear layers (HIP, torchao)
    note: str | None = None
    library: str = "bitsandbytes"


def plan_quantization(quantize: str, backend: str, checkpoint_quantization: dict | None, name: str,
                      library: str = "auto") -> QuantPlan:
    """Decide how to quantize the base from model.quantize (already resolved from auto), the backend, the
    library (model.quantize_backend) and the checkpoint's quantization_config.

    On HIP the bitsandbytes loading path of transformers is not used: prequantized checkpoints are refused
    (they hold no 16-bit weights), and model.quantize loads the 16-bit weights and quantizes them afterwards.
    """
    if checkpoint_quantization is not None:
        method = checkpoint_quantization.get("quant_method", "unknown")
        if backend == "hip":
            raise UserError(f"model.name_or_path: '{name}' is a prequantized checkpoint ({method}); on ROCm "
                            "prequantized checkpoints are not loaded and it holds no 16-bit weights\n"
                            "  fix: point model.name_or_path at the 16-bit model and set model.quantize=4bit "
                            "(it is quantized after loading)")
        if quantize not in ("none", "auto"):
            raise UserError(f"model.quantize: '{name}' is already quantized ({method}); set model.quantize=none")
        return QuantPlan("prequantized", note=f"model: prequantized checkpoint ({method}), loaded as it is")
    if quantize in ("none", "auto"):
        return QuantPlan("none")
    library, why = choose_backend(library, quantize, backend)
    if library == "toolkit":
        return QuantPlan(quantize, after_load=True, library=library,
                         note=f"model.quantize={quantize}: the linear layers quantized after loading ({why})")
    if library == "torchao":
        return QuantPlan(quantize, after_load=True, library=library,
                         note=f"model.quantize={quantize}: torchao int8 weights after loading ({why})")
    if backend == "hip":
        return QuantPlan(quantize, after_load=True,
                         note=f"model.quantize={quantize} on ROCm: loading the 16-bit weights and quantizing the "
                              "linear layers after loading (bitsandbytes load-time quantization is not used on HIP)")
    return QuantPlan(quantize, note=f"model.quantize={quantize}: frozen base quantized by bitsandbytes at load (QLoRA)")


def bnb_config(mode: str, compute_dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    if mode == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def check_attention(attention: str) -> None:
    if attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UserError("model.attention: flash_attention_2 needs the flash_attn package, which is not installed\n"
                        "  fix: pip install flash-attn (CUDA/ROCm builds), or set model.attention=sdpa")


def checkpoint_quantization_config(path: str, common: dict) -> dict | None:
    """The checkpoint's quantization_config (config.json), or None."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **common)
    value = getattr(config, "quantization_config", None)
    if value is None:
        return None
    return value if isinstance(value, dict) else value.to_dict()



def count_base_parameters(model_path: str, common: dict) -> int:
    """Parameters of the base, counted on the meta device (nothing is allocated or loaded)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path, **common))
    return sum(p.numel() for p in model.parameters())


def takes_num_items_in_batch(model: torch.nn.Module) -> bool:
    """Whether the model's loss honours num_items_in_batch: every causal LM that ships with transformers
    (4.46 and later) passes it to its loss function. Remote code may take **kwargs and drop it, which would
    silently turn a sum into a mean, so for those the adapter multiplies the mean by the token count."""
    return type(model).__module__.startswith("transformers.models.")


def checkpoint_layers(model, offload: InputOffload | None = None) -> int:
    """transformers' gradient checkpointing of every decoder layer, non-reentrant (no inputs need grad); with
    `offload` (train.checkpoint_offload), each checkpointed call's saved inputs go through it. Returns how many
    checkpointed layers it wrapped (0 without `offload`)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if offload is None:
        return 0
    from transformers import PreTrainedModel

    layers = 0
    for module in model.modules():  # the layers' own functions, and the model's (older transformers call that)
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = offloading(module._gradient_checkpointing_func, offload)
            layers += not isinstance(module, PreTrainedModel)
    return layers


def group_projections(network: torch.nn.Module, shard_base: bool, quantized: str, log: Callable[[str], None]) -> None:
    """model.fuse_projections: q/k/v and gate/up LoRA layers as groups (models/shared_input.py), where the base
    is whole on this device and in 16 bits (fsdp and the quantize mode are only known at load when auto)."""
    if shard_base:
        log("model.fuse_projections: not applied: the frozen base is sharded (device.distributed=fsdp), "
            "and a group holds its layers' weights whole")
        return
    if quantized != "none":
        log(f"model.fuse_projections: not applied: the base is {quantized} (model.quantize); groups need "
            "16-bit weights")
        return
    grouping = group_shared_inputs(network, reset_before=network.get_base_model().get_decoder())
    left = (f"; {grouping.left} sets left as PEFT's layers (not every layer of the set adapted, or not a plain "
            "LoRA over an unquantized nn.Linear)" if grouping.left else "")
    log(f"model.fuse_projections: {len(grouping.groups)} groups of LoRA layers that read one input "
        f"(q/k/v, gate/up) run as one group each (their LoRA B inside the frozen product){left}; "
        f"{len(grouping.rows)} layers (o_proj, down_proj) run their LoRA A inside the frozen product; "
        f"{grouping.mlps} gated MLPs compute down_proj's A gradient in their activation's backward")
