"""`merge`: fold a trained PEFT LoRA into its base model and save a full model with its tokenizer.

    python -m toolkit merge outputs/my_run merged/ [--dtype bf16]
    python -m toolkit merge outputs/my_run/final merged/
    python -m toolkit merge outputs/my_run/checkpoints/step-000200 merged/
    python -m toolkit merge outputs/my_run merged/ --step 200

The result loads with AutoModelForCausalLM.from_pretrained like any other model (a vision-language base, the vlm
family: AutoModelForImageTextToText, with its image processor beside the tokenizer).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from toolkit.disk import disk_full_named
from toolkit.errors import UserError
from toolkit.train.checkpoint import list_checkpoints, step_dir_name

MERGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def find_adapter_dir(path: str | Path, step: int | None = None) -> Path:
    """The folder with adapter_config.json: `path` itself (final/, a checkpoint), a run folder's final/ adapter,
    or with `step` the run folder's checkpoint of that step."""
    path = Path(path)
    if step is not None:
        path = path / "checkpoints" / step_dir_name(step)
        if not path.is_dir():
            steps = [s for s, _ in list_checkpoints(path.parent)]
            raise UserError(f"merge --step {step}: {path} does not exist\n  fix: use one of the run's checkpoint "
                            f"steps: {', '.join(map(str, sorted(steps))) or 'none (give the run folder for final/)'}")
    for candidate in (path, path / "final"):
        if (candidate / "adapter_config.json").is_file() and (candidate / "adapter_model.safetensors").is_file():
            return candidate
    if not path.exists():
        raise UserError(f"merge: {path} does not exist\n  fix: give a run folder (outputs/<run>), its final/ folder "
                        "or a checkpoint folder")
    if (path / "lora.safetensors").is_file():
        raise UserError(f"merge: {path} is a checkpoint from before checkpoints held the adapter files (only "
                        "lora.safetensors, the trainer's own tensors)\n  fix: merge the run's final/, or a checkpoint "
                        "written since")
    raise UserError(f"merge: {path} holds no PEFT adapter (adapter_config.json + adapter_model.safetensors), "
                    f"nor does {path / 'final'}\n  fix: give a run folder, its final/ folder or a checkpoint folder "
                    "of an LLM run (diffusion LoRAs are loaded with pipe.load_lora_weights, not merged here)")


def model_class_of(base: str) -> tuple[type, bool]:
    """(the transformers auto class that loads `base`, whether it is a vision-language model): a model type that
    only AutoModelForImageTextToText maps (Qwen2.5-VL, Qwen3-VL: the vlm family) takes that class; every other,
    AutoModelForCausalLM (the llm family)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    model_type = AutoConfig.from_pretrained(base).model_type
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForImageTextToText, True
    return AutoModelForCausalLM, False


def merge_lora(adapter: str | Path, out_dir: str | Path, dtype: str = "auto", log=print, step: int | None = None) -> Path:
    """Merge the adapter (with `step`: the run's checkpoint of that step) into its base (in fp32), cast to
    `dtype` and save model + tokenizer into out_dir."""
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoTokenizer

    adapter_dir = find_adapter_dir(adapter, step)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"merge: output folder {out_dir} exists and is not empty\n  fix: choose a new folder")
    if dtype != "auto" and dtype not in MERGE_DTYPES:
        raise UserError(f"merge --dtype: {dtype!r}; use auto, {', '.join(MERGE_DTYPES)}")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise UserError(f"merge: {adapter_dir / 'adapter_config.json'} has no base_model_name_or_path")
    try:
        auto_class, vision = model_class_of(base)
        # Merge in fp32 so the folded weights carry no extra rounding; cast once at the end.
        model = auto_class.from_pretrained(base, dtype=torch.float32)
    except OSError as err:
        raise UserError(f"merge: cannot load the base model '{base}' named in {adapter_dir / 'adapter_config.json'}: "
                        f"{str(err).splitlines()[0]}") from None
    if getattr(model.config, "quantization_config", None) is not None:
        raise UserError(f"merge: the base '{base}' is a quantized checkpoint; merge into its 16-bit original instead")
    source_dtype = getattr(model.config, "dtype", None)
    target = MERGE_DTYPES[dtype] if dtype != "auto" else (source_dtype if isinstance(source_dtype, torch.dtype) else torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.to(target)
    tokenizer_source = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    needed = sum(p.numel() * p.element_size() for p in merged.parameters())
    try:
        with disk_full_named("the merged model", out_dir.parent, needed, fix="free space on that disk, or give an "
                             "OUT_DIR on another disk, then run the same command"):
            merged.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if vision:
                AutoImageProcessor.from_pretrained(base).save_pretrained(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"merge: wrote {out_dir} ({str(target).removeprefix('torch.')}): the base model {base} with the LoRA of "
        f"{adapter_dir} folded in; the base model's own files are unchanged")
    return out_dir
