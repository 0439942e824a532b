"""The `vlm` family: PEFT LoRA on a vision-language model loaded with transformers' AutoModelForImageTextToText
(Qwen2.5-VL, Qwen3-VL), trained on image + text chats (data/vision_chat.py).

The LoRA goes on the language model's linear layers, and with network.vision_layers also on the vision tower's
(its blocks and the patch merger), as unsloth's finetune_language_layers / finetune_vision_layers do. The
adapter is PEFT's own folder: PeftModel.from_pretrained over AutoModelForImageTextToText loads it.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from toolkit.data.vision_chat import VisionChatEncoder, build_vision_chat_data
from toolkit.errors import UserError
from toolkit.models.base import ModelAdapter, ModelMemory, Runtime, eval_mode
from toolkit.models.generation import generating
from toolkit.models.lora import lora_config
from toolkit.models.lora_loading import load_peft_folder
from toolkit.models.token_loss import label_tokens, mean_token_loss
from toolkit.tiny import resolve_model_path


def linear_pattern(model: torch.nn.Module, roots: list[torch.nn.Module], names: list[str] | None) -> str:
    """PEFT's target_modules as one regular expression: the nn.Linear layers under `roots` (those whose name ends
    in one of `names`, when given), block numbers generalised (`layers.\\d+.`) so the adapter_config stays short."""
    where = {id(module): name for name, module in model.named_modules()}
    found = set()
    for root in roots:
        prefix = where[id(root)]
        for name, module in root.named_modules():
            if not isinstance(module, torch.nn.Linear) or not name:
                continue
            if names is not None and not any(name == n or name.endswith("." + n) for n in names):
                continue
            found.add(r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in f"{prefix}.{name}".split(".")))
    return "|".join(sorted(found))


class VLMAdapter(ModelAdapter):
    """PEFT LoRA on a transformers vision-language model; the loss is the sum of the assistant tokens' losses."""

    def __init__(self, cfg: DictConfig, runtime: Runtime):
        super().__init__(cfg, runtime)
        self.model_path = resolve_model_path(cfg.model.name_or_path)
        self.tokenizer = self.encoder = self.data = None
        self.memory = VLMMemory(self)

    # -- model -----------------------------------------------------------------------------
    def load(self, shard_base: bool = False) -> None:
        from peft import get_peft_model
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        if shard_base:
            raise UserError("device.distributed=fsdp: the vlm family does not shard its base\n  fix: set "
                            "device.distributed=ddp (each process holds the whole model)")
        common = {"revision": self.cfg.model.revision}
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, **common)
            image_processor = AutoImageProcessor.from_pretrained(self.model_path, **common)
            model = AutoModelForImageTextToText.from_pretrained(self.model_path, dtype=self.runtime.base_dtype,
                                                                **common)
        except (OSError, ValueError) as err:
            raise UserError(f"model.name_or_path: cannot load '{self.cfg.model.name_or_path}' as an image-text-to-text "
                            f"model: {str(err).splitlines()[0]}\n  fix: give a Qwen2.5-VL or Qwen3-VL folder (config.json, "
                            "preprocessor_config.json, tokenizer) or a Hub id you can reach") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.encoder = VisionChatEncoder(self.tokenizer, image_processor, model.config.image_token_id, self.cfg.data)
        # transformers 5 computes the multimodal rotary positions from each token's modality (processors return it)
        self.takes_token_types = "mm_token_type_ids" in inspect.signature(type(model).forward).parameters
        model.requires_grad_(False)
        model.to(self.runtime.device)
        if self.cfg.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        pattern = linear_pattern(model, self._lora_roots(model), self._target_names())
        if not pattern:
            raise UserError(f"network.target_modules: {OmegaConf.to_container(self.cfg.network.target_modules)} names "
                            "no linear layer of the model\n  fix: use auto, or names such as q_proj, v_proj")
        self.network = get_peft_model(model, lora_config(self.cfg.network, pattern, task_type="CAUSAL_LM"),
                                      autocast_adapter_dtype=True)
        self.network.to(self.runtime.device)
        self.log(f"model: {type(model).__name__}, LoRA on {len(self._lora_layers())} linear layers "
                 f"({'language model and vision tower' if self.cfg.network.vision_layers else 'language model'})")

    def _lora_roots(self, model) -> list[torch.nn.Module]:
        """The language model, and with network.vision_layers the vision tower."""
        roots = [model.get_decoder()]
        if self.cfg.network.vision_layers:
            vision = getattr(model.model, "visual", None)
            if vision is None:
                raise UserError(f"network.vision_layers: {type(model).__name__} has no vision tower under "
                                "model.visual\n  fix: set network.vision_layers=false")
            roots.append(vision)
        return roots

    def _target_names(self) -> list[str] | None:
        value = self.cfg.network.target_modules
        if value in ("auto", "all-linear"):
            return None
        if OmegaConf.is_list(value) and all(isinstance(n, str) for n in value) and len(value):
            return list(value)
        raise UserError(f"network.target_modules: expected auto, all-linear or a list of module names, got {value!r}")

    def _lora_layers(self) -> list[str]:
        return sorted({n.rsplit(".lora_A", 1)[0] for n, _ in self.network.named_parameters() if ".lora_A" in n})

    # -- data and loss ---------------------------------------------------------------------
    def prepare_data(self):
        self.data = build_vision_chat_data(self.cfg.data, self.encoder, self.tokenizer.pad_token_id, self.cfg.run.seed)
        return self.data.train

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        return {"model": self.network}

    def batch_units(self, batch: dict[str, Any]) -> tuple[int, int]:
        return label_tokens(batch["labels"]), batch["input_ids"].numel()

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """`batch` on the device, with mm_token_type_ids (1 on image tokens, 0 elsewhere) where the model takes
        them, as transformers' processors return them."""
        inputs = {k: v.to(self.runtime.device, non_blocking=True) for k, v in batch.items()}
        if self.takes_token_types:
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.encoder.image_token_id).int()
        return inputs

    def loss(self, batch: dict[str, Any], modules: Mapping[str, torch.nn.Module]) -> torch.Tensor:
        batch = self.model_inputs(batch)
        # num_items_in_batch=1: transformers' causal-LM loss sums the token losses (the trainer divides by the step's)
        return modules["model"](**batch, use_cache=False, num_items_in_batch=1).loss

    @torch.no_grad()
    def eval_loss(self, batch_size: int) -> float | None:
        """Mean token loss over the held-out chats."""
        if self.data is None or self.data.eval is None:
            return None
        return mean_token_loss(self.data.eval, batch_size, lambda batch: self.loss(batch, self.trainable_modules()),
                               self.network, self.runtime)

    # -- sampling --------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, out_dir: Path) -> list[Path]:
        """Each prompt as a user turn, with its sample.images entry (one per prompt, or one for all) when given."""
        prompts, images = list(self.cfg.sample.prompts), [Path(p) for p in self.cfg.sample.images]
        if not prompts:
            return []
        results = []
        greedy = self.cfg.sample.temperature == 0
        for index, prompt in enumerate(prompts):
            image = images[index] if len(images) == len(prompts) else (images[0] if images else None)
            inputs = self.model_inputs(self.encoder.prompt(prompt, image))
            torch.manual_seed(self.cfg.sample.seed)
            with eval_mode(self.network), generating():  # eager, no cuDNN attention
                output = self.network.generate(**inputs, max_new_tokens=self.cfg.sample.max_new_tokens,
                                               do_sample=not greedy,
                                               temperature=None if greedy else self.cfg.sample.temperature,
                                               top_p=None, top_k=None, pad_token_id=self.tokenizer.pad_token_id,
                                               use_cache=True)
            completion = self.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            results.append({"prompt": prompt, "image": str(image) if image else None, "completion": completion})
        out_dir.mkdir(parents=True, exist_ok=True)
        jsonl = out_dir / "samples.jsonl"
        jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results), encoding="utf-8")
        text = out_dir / "samples.txt"
        text.write_text("".join(f"### {r['prompt']}" + (f" [{r['image']}]" if r["image"] else "") +
                                f"\n{r['completion']}\n\n" for r in results), encoding="utf-8")
        return [jsonl, text]

    # -- LoRA files ------------------------------------------------------------------------
    def save_lora(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """PEFT's folder: adapter_model.safetensors + adapter_config.json (PeftModel.from_pretrained over
        AutoModelForImageTextToText loads it)."""
        state = {k: v.detach().to(dtype) for k, v in self.network.state_dict().items() if "lora_" in k}
        self.network.save_pretrained(out_dir, state_dict=state)
        config_path = out_dir / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = self.model_path
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        return [out_dir / "adapter_model.safetensors", config_path]

    def load_lora(self, path: Path, partial: bool = False, label: str | None = None) -> None:
        """A PEFT adapter folder (a run's final/ or checkpoint folder; a run folder means its final/)."""
        load_peft_folder(self.network, Path(path), partial, label, f"vlm ({self.cfg.model.name_or_path})", self.log)


class VLMMemory(ModelMemory):
    """The vlm family's memory: its size counted without loading; checkpointing through transformers."""

    def __init__(self, adapter: VLMAdapter):
        self.adapter = adapter

    def base_parameters(self) -> int:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForImageTextToText

        a = self.adapter
        with init_empty_weights():
            model = AutoModelForImageTextToText.from_config(
                AutoConfig.from_pretrained(a.model_path, revision=a.cfg.model.revision))
        return sum(p.numel() for p in model.parameters())

    def enable_checkpointing(self) -> None:
        self.adapter.network.get_base_model().gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})

    def fixes(self) -> list[str]:
        return ["data.max_pixels lower (fewer image tokens a sample)"]
