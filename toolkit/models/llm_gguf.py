"""save.format=gguf (llm): the trained LoRA as a llama.cpp adapter (`llama-cli --lora FILE`), written with the `gguf`
package's GGUFWriter in the layout llama.cpp's own convert_lora_to_gguf.py writes:

- metadata: general.architecture (llama.cpp's name of the base's architecture), general.type=adapter,
  adapter.type=lora, adapter.lora.alpha, general.file_type and general.quantization_version;
- tensors: `<llama.cpp tensor name>.lora_a` (rank x in) and `.lora_b` (out x rank) for each adapted layer, the
  names mapped by gguf's TensorNameMap (`model.layers.3.self_attn.q_proj` -> `blk.3.attn_q.weight`);
- for the llama architecture, the rows of q_proj's and k_proj's lora_b permuted as the converter permutes the base
  weights (llama.cpp's rotary layout; the converter's LlamaModel.permute).

llama.cpp applies scale = alpha / rank; the alpha written is PEFT's own scaling times the rank (lora_export.py), so
rsLoRA adapters load at the scale they trained at (the converter reads lora_alpha from adapter_config.json and
would not).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolkit.errors import UserError
from toolkit.models.lora_export import Factors


@dataclass(frozen=True)
class GgufArch:
    name: str                 # llama.cpp's architecture name (gguf.MODEL_ARCH_NAMES)
    rotary_permuted: bool     # the converter permutes q/k rows (LlamaModel.permute)


# transformers architectures -> llama.cpp's, as convert_hf_to_gguf.py registers them (ModelBase.register).
GGUF_ARCHS: dict[str, GgufArch] = {
    "LlamaForCausalLM": GgufArch("llama", True),
    "MistralForCausalLM": GgufArch("llama", True),
    "Qwen2ForCausalLM": GgufArch("qwen2", False),
    "Qwen3ForCausalLM": GgufArch("qwen3", False),
    "Gemma2ForCausalLM": GgufArch("gemma2", False),
    "Gemma3ForCausalLM": GgufArch("gemma3", False),
}

FILE_TYPES = {torch.float32: "ALL_F32", torch.float16: "MOSTLY_F16", torch.bfloat16: "MOSTLY_BF16"}
TENSOR_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


GGUF_MISSING = "save.format=gguf needs the gguf package (llama.cpp's GGUF writer), which is not installed"
GGUF_FIX = "pip install gguf (or pip install -e '.[gguf]' in the toolkit's .venv), or set save.format=peft"


def import_gguf() -> Any:
    """The gguf package, or a UserError saying how to install it (it is only needed for this format)."""
    try:
        import gguf
    except ImportError:
        raise UserError(f"{GGUF_MISSING}\n  fix: {GGUF_FIX}") from None
    return gguf


def gguf_arch(model_config: Any) -> GgufArch:
    """llama.cpp's architecture for the base model, or a UserError naming the ones this format writes."""
    names = list(getattr(model_config, "architectures", None) or [])
    for name in names:
        if name in GGUF_ARCHS:
            return GGUF_ARCHS[name]
    raise UserError(f"save.format=gguf: the base model's architecture ({', '.join(names) or 'none in config.json'}) "
                    f"has no llama.cpp adapter mapping here; supported: {', '.join(GGUF_ARCHS)}\n"
                    "  fix: set save.format=peft and convert with llama.cpp's convert_lora_to_gguf.py")


def check_gguf_export(model_config: Any) -> None:
    """Before training: the package is there and the architecture has a mapping."""
    import_gguf()
    gguf_arch(model_config)


def rotary_permute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order of a q/k projection (convert_hf_to_gguf LlamaModel.permute, n_head being the kv heads
    for k): each head's two rotary halves interleaved."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_tensors(factors: Factors, model_config: Any, arch: GgufArch) -> tuple[float, dict[str, torch.Tensor]]:
    """(alpha, {gguf name: tensor}) for `factors` keyed by PEFT module path (base_model.model.model.layers...)."""
    gguf = import_gguf()
    names = gguf.get_tensor_name_map(_arch_enum(gguf, arch.name), model_config.num_hidden_layers)
    alpha = factors[min(factors)].alpha   # one alpha per file: the first module's in name order
    n_head = model_config.num_attention_heads
    n_kv = getattr(model_config, "num_key_value_heads", None) or n_head
    tensors = {}
    for module, factor in sorted(factors.items()):
        hf_name = module.removeprefix("base_model.model.") + ".weight"
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if name is None:
            raise UserError(f"save.format=gguf: {hf_name} has no llama.cpp tensor name for the {arch.name} "
                            "architecture\n  fix: leave it out of network.target_modules, or set save.format=peft")
        # a module trained at another scale has the ratio folded into its lora_b
        up = factor.up * (factor.alpha / alpha) if factor.alpha != alpha else factor.up
        if arch.rotary_permuted and hf_name.endswith("q_proj.weight"):
            up = rotary_permute(up, n_head)
        elif arch.rotary_permuted and hf_name.endswith("k_proj.weight"):
            up = rotary_permute(up, n_kv)
        tensors[name + ".lora_a"] = factor.down
        tensors[name + ".lora_b"] = up
    return alpha, tensors


def write_gguf_adapter(path: Path, factors: Factors, model_config: Any, dtype: torch.dtype, name: str) -> Path:
    """Write the llama.cpp LoRA adapter file at `path` (tensors in `dtype`: F32, F16 or BF16)."""
    gguf = import_gguf()
    arch = gguf_arch(model_config)
    alpha, tensors = gguf_tensors(factors, model_config, arch)
    writer = gguf.GGUFWriter(str(path), arch.name)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    writer.add_name(name)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[dtype]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    kind = getattr(gguf.GGMLQuantizationType, TENSOR_TYPES[dtype])
    for tensor_name, tensor in tensors.items():
        data = tensor.to(torch.float32).contiguous().numpy()
        if dtype == torch.float16:
            data = data.astype("float16")
        elif dtype == torch.bfloat16:
            data = gguf.quants.quantize(data, kind)
        writer.add_tensor(tensor_name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _arch_enum(gguf: Any, name: str) -> Any:
    return next(arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items() if arch_name == name)
