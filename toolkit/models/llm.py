"""The `llm` family: PEFT LoRA on any transformers causal LM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from toolkit.data.text import TextDataset, build_text_dataset
from toolkit.errors import UserError
from toolkit.models.base import Runtime, load_trainable_state_dict, trainable_state_dict
from toolkit.models.tiny import resolve_model_path


def peft_lora_config(network: DictConfig, target_modules: Any):
    from peft import LoraConfig

    return LoraConfig(r=network.rank, lora_alpha=network.alpha, lora_dropout=network.dropout,
                      target_modules=target_modules, use_dora=network.type == "dora",
                      use_rslora=network.rslora, task_type="CAUSAL_LM")


def resolve_target_modules(value: Any) -> Any:
    """auto and all-linear adapt every linear layer but the output head; a list names modules."""
    if value in ("auto", "all-linear"):
        return "all-linear"
    if OmegaConf.is_list(value) or isinstance(value, list):
        names = list(value)
        if names and all(isinstance(n, str) for n in names):
            return names
    raise UserError(f"network.target_modules: expected auto, all-linear or a list of module names, got {value!r}")


class LLMAdapter:
    family = "llm"

    def __init__(self, cfg: DictConfig, runtime: Runtime):
        self.cfg = cfg
        self.runtime = runtime
        self.network: torch.nn.Module | None = None
        self.tokenizer = None
        self.model_path = resolve_model_path(cfg.model.name_or_path)

    # -- loading ---------------------------------------------------------------------------
    def load(self) -> None:
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.cfg.model
        common = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, **common)
            model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=self.runtime.base_dtype, attn_implementation=cfg.attention, **common)
        except OSError as err:
            raise UserError(f"model.name_or_path: cannot load '{cfg.name_or_path}': {str(err).splitlines()[0]}\n"
                            "  fix: give a local folder with config.json, or a Hub id you can reach") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model.requires_grad_(False)
        # Move first, then train: on HIP large host-to-device copies of a cast model can fail.
        model.to(self.runtime.device)
        if self.cfg.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        lora = peft_lora_config(self.cfg.network, resolve_target_modules(self.cfg.network.target_modules))
        # autocast_adapter_dtype keeps the LoRA weights in fp32 over a bf16/fp16 base.
        self.network = get_peft_model(model, lora, autocast_adapter_dtype=True)
        self.network.to(self.runtime.device)

    def lora_targets(self) -> list[str]:
        return sorted({name.rsplit(".lora_A", 1)[0] for name, _ in self.network.named_parameters() if ".lora_A" in name})

    # -- data and loss ---------------------------------------------------------------------
    def dataset(self) -> TextDataset:
        return build_text_dataset(self.cfg.data, self.tokenizer)

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        batch = {k: v.to(self.runtime.device, non_blocking=True) for k, v in batch.items()}
        return self.network(**batch).loss

    def eval_loss(self) -> float | None:
        return None

    # -- sampling --------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, out_dir: Path) -> list[Path]:
        prompts = list(self.cfg.sample.prompts)
        if not prompts:
            return []
        model = self.network
        was_training = model.training
        model.eval()
        results = []
        generator_seed = self.cfg.sample.seed
        for prompt in prompts:
            torch.manual_seed(generator_seed)
            inputs = self.tokenizer(prompt, return_tensors="pt").to(self.runtime.device)
            greedy = self.cfg.sample.temperature == 0
            output = model.generate(**inputs, max_new_tokens=self.cfg.sample.max_new_tokens, do_sample=not greedy,
                                    temperature=None if greedy else self.cfg.sample.temperature,
                                    top_p=None, top_k=None, pad_token_id=self.tokenizer.pad_token_id,
                                    use_cache=True)
            completion = self.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            results.append({"prompt": prompt, "completion": completion})
        if was_training:
            model.train()
        out_dir.mkdir(parents=True, exist_ok=True)
        jsonl = out_dir / "samples.jsonl"
        jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results), encoding="utf-8")
        text = out_dir / "samples.txt"
        text.write_text("".join(f"### {r['prompt']}\n{r['completion']}\n\n" for r in results), encoding="utf-8")
        return [jsonl, text]

    # -- LoRA weights ----------------------------------------------------------------------
    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        return trainable_state_dict(self.network)

    def load_lora_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_trainable_state_dict(self.network, state)

    def save_lora(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """PEFT format: adapter_model.safetensors + adapter_config.json (PeftModel.from_pretrained loads it)."""
        fmt = self.cfg.save.format
        if fmt not in ("auto", "peft"):
            raise UserError(f"save.format: {fmt} is not available for the llm family; use peft (or auto)")
        state = {k: v.detach().to(dtype) for k, v in self.network.state_dict().items() if "lora_" in k}
        self.network.save_pretrained(out_dir, state_dict=state)
        # Record the base the adapter belongs to, as a Hub id or local folder the user gave.
        config_path = out_dir / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = self.model_path
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        return [out_dir / "adapter_model.safetensors", config_path]

    def load_lora(self, path: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(self.network, load_file(str(Path(path) / "adapter_model.safetensors")))
