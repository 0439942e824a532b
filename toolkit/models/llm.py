"""The `llm` family: PEFT LoRA on any transformers causal LM (what loading its base decides: llm_loading.py;
its samples: llm_sampling.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from omegaconf import DictConfig

from toolkit.data.preference import ExampleData, build_example_data
from toolkit.data.records import read_records
from toolkit.data.text import TextData, build_text_data, detect_format, render_chat
from toolkit.errors import UserError
from toolkit.models.base import ModelAdapter, ModelMemory, Runtime, eval_mode
from toolkit.models.checkpoint_offload import InputOffload
from toolkit.models.compiled_generation import CompiledGeneration
from toolkit.models.generation import EagerGeneration
from toolkit.models.llm_gguf import check_gguf_export, write_gguf_adapter
from toolkit.models.llm_loading import (bnb_config, check_attention, checkpoint_layers, checkpoint_quantization_config,
                                        count_base_parameters, group_projections, plan_quantization,
                                        takes_num_items_in_batch)
from toolkit.models.llm_logps import TokenScorer, head_math_for
from toolkit.models.llm_loss import CAUSAL_DECODERS, DecoderHiddenStates, fused_loss_for, no_packed_sequence_search
from toolkit.models.llm_objectives import Generator, Objective, StatsFile, build_objective
from toolkit.models.llm_sampling import objective_prompts, sample_completions, write_samples
from toolkit.models.lora import lora_config, target_modules
from toolkit.models.lora_export import peft_factors
from toolkit.models.lora_loading import load_peft_folder
from toolkit.models.quantize import choose_quantize, quantize_linear_layers
from toolkit.models.token_loss import label_tokens, mean_token_loss
from toolkit.tiny import resolve_model_path


class LLMAdapter(ModelAdapter):
    """PEFT LoRA on a transformers causal LM; the loss is the sum of token losses (mean over every token of a
    step, whatever the micro-batch and process it is in)."""

    def __init__(self, cfg: DictConfig, runtime: Runtime):
        super().__init__(cfg, runtime)
        self.tokenizer = None
        self.model_path = resolve_model_path(cfg.model.name_or_path)
        self.data: TextData | None = None
        self.fused_loss = None   # set by load(): the fused output head + cross-entropy, where it applies
        self.drops_padding_mask = False  # set by load()
        self.objective: Objective | None = None   # train.objective beyond sft (set by prepare_data)
        self.scorer: TokenScorer | None = None      # its per-token log-probs (set by load)
        self.examples: ExampleData | None = None
        self.memory = LLMMemory(self)

    # -- loading ---------------------------------------------------------------------------
    def load(self, shard_base: bool = False) -> None:
        from peft import get_peft_model, prepare_model_for_kbit_training
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.shard_base = shard_base
        cfg = self.cfg.model
        common = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
        check_attention(cfg.attention)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, **common)
            quantize, why = choose_quantize(self.quantize_setting(),
                                            lambda: count_base_parameters(self.model_path, common),
                                            self.runtime.info, self.cfg.device.memory_fraction)
            if cfg.quantize == "auto" and self.runtime.info.backend != "cpu":
                self.log(why)
            plan = plan_quantization(quantize, self.runtime.info.backend,
                                     checkpoint_quantization_config(self.model_path, common), cfg.name_or_path,
                                     cfg.quantize_backend)
            if plan.note:
                self.log(plan.note)
            kwargs = {}
            if plan.mode in ("4bit", "8bit") and not plan.after_load:
                kwargs = {"quantization_config": bnb_config(plan.mode, self.runtime.compute_dtype),
                          "device_map": {"": self.runtime.device}}
            model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=self.runtime.base_dtype, attn_implementation=cfg.attention, **kwargs, **common)
        except OSError as err:
            raise UserError(f"model.name_or_path: cannot load '{cfg.name_or_path}': {str(err).splitlines()[0]}\n"
                            "  fix: give a local folder with config.json, or a Hub id you can reach") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model.requires_grad_(False)
        self._note_context(model.config)
        if self.cfg.save.format == "gguf":  # the package and the architecture's mapping, before any step
            check_gguf_export(model.config)
        if plan.after_load:
            count = quantize_linear_layers(model, plan.mode, self.runtime.compute_dtype, self.runtime.device,
                                           backend=plan.library, info=self.runtime.info)
            self.log(f"model: quantized {count} linear layers to {plan.mode} after loading")
            model.to(self.runtime.device)
        if plan.mode in ("4bit", "8bit") and plan.library == "bitsandbytes":
            # Casts norms/embeddings to fp32 and makes the inputs require grad for checkpointing.
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=bool(self.cfg.train.gradient_checkpointing),
                                                    gradient_checkpointing_kwargs={"use_reentrant": False})
        elif not self.shard_base:
            # Move first, then train: on HIP large host-to-device copies of a cast model can fail.
            model.to(self.runtime.device)
        if self.cfg.train.gradient_checkpointing:
            self._checkpoint_layers(model)
        model.config.use_cache = False
        # auto and all-linear adapt every linear layer but the output head; a list names modules.
        targets = target_modules(self.cfg.network.target_modules, "all-linear", "all-linear")
        lora = lora_config(self.cfg.network, targets, task_type="CAUSAL_LM")
        # autocast_adapter_dtype keeps the LoRA weights in fp32 over a bf16/fp16 base.
        self.network = get_peft_model(model, lora, autocast_adapter_dtype=True)
        self.sums_loss = takes_num_items_in_batch(model)
        # Batches are right-padded (data/text.py): for a causal decoder the padding mask changes nothing the loss
        # counts. Left out, attention takes SDPA's is_causal path (flash kernels) and transformers does not read
        # the mask on the host to decide whether it may (a wait for the GPU every step).
        self.drops_padding_mask = self.sums_loss and getattr(model.config, "model_type", "") in CAUSAL_DECODERS
        if not self.shard_base:
            self.network.to(self.runtime.device)
        if cfg.fuse_projections is True:
            group_projections(self.network, self.shard_base, plan.mode, self.log)
        if self.cfg.train.objective != "sft":
            self._score_tokens()
            return
        self.fused_loss, why = fused_loss_for(self.network, cfg.kernels, bool(self.cfg.train.compile),
                                              self.sums_loss, bool(self.cfg.train.gradient_checkpointing),
                                              sharded=self.shard_base)
        # With the fused loss the trainer runs the decoder alone (hidden states, no logits); with fsdp, the whole
        # model, so that its sharded weights are gathered (DecoderHiddenStates).
        self.forward_module = (DecoderHiddenStates(self.network, through_model=self.shard_base)
                               if self.fused_loss else self.network)
        if why:
            self.log(why)

    def _score_tokens(self) -> None:
        """train.objective beyond sft: per-token log-probs through the decoder and the chunked head where that
        applies (whatever model.kernels says: a sequence's log-prob needs no logits held), else the model's own."""
        math_ = head_math_for(self.network)
        self.forward_module = (DecoderHiddenStates(self.network, through_model=self.shard_base)
                               if math_ is not None else self.network)
        self.scorer = TokenScorer(self.network, math_, self.runtime.device)
        self.log(f"train.objective={self.cfg.train.objective}: " + (
            "per-token log-probs from the output head in chunks, no full logits" if math_ is not None else
            "the model's own logits (its output head is not one the chunked log-probs cover)"))

    def _checkpoint_layers(self, model) -> None:
        if not self.cfg.train.checkpoint_offload:
            checkpoint_layers(model)
            return
        count = checkpoint_layers(model, InputOffload(self.runtime.device))
        if self.runtime.device.type == "cuda":
            self.log(f"train.checkpoint_offload: the inputs of {count} checkpointed layers wait in pinned CPU "
                     "memory between forward and backward")
        else:
            self.log(f"train.checkpoint_offload: on the {self.runtime.device.type} the inputs of {count} "
                     "checkpointed layers stay where they are (no device memory to free)")

    # -- data and loss ---------------------------------------------------------------------
    def prepare_data(self):
        """The text data, tokenized (the model is on the device since load())."""
        if self.cfg.train.objective != "sft":
            return self._prepare_examples()
        self.data = build_text_data(self.cfg.data, self.tokenizer, self.cfg.run.seed)
        return self.data.train

    def _prepare_examples(self):
        """Preference, unpaired or prompt data for the objective; the reference log-probs precomputed if asked."""
        train = self.cfg.train
        self.examples = build_example_data(self.cfg.data, self.cfg.data.format, self.tokenizer, self.cfg.run.seed)
        stats = StatsFile(self.runtime.run_dir / "objective.jsonl" if self.runtime.is_main else None)
        self.objective = build_objective(train.objective, self.scorer, self.network, self.forward_module, train,
                                         stats, self.tokenizer, self.examples.conversational, self._scoring_width(),
                                         self._generator())
        uses_reference = train.objective in ("dpo", "kto") or (train.objective == "grpo" and train.kl_coef > 0)
        if uses_reference and self.cfg.network.init_from:
            self.log(f"train.objective={train.objective}: the reference is the base model (the LoRA disabled), not "
                     "the LoRA network.init_from starts from (TRL would load that one as its reference)")
        if train.objective in ("dpo", "kto") and train.reference_logps == "precompute":
            from toolkit.models.reference_cache import precompute_reference

            batch = train.batch_size if isinstance(train.batch_size, int) else 4
            with self.runtime.main_process_first():  # the main process writes the file, the others read it
                precompute_reference(self.examples.train, lambda b: self.objective.reference(b).sums(), batch,
                                     self.runtime.run_dir, self.model_path, self.log, write=self.runtime.is_main)
        return self.examples.train

    def _generator(self) -> Generator | None:
        """grpo: what samples the completions (train.generation, settled by the plan)."""
        if self.cfg.train.objective != "grpo":
            return None
        mode = self.runtime.settled("train.generation") or self.cfg.train.generation  # the loaded stage may change it
        generator = (CompiledGeneration(self.network, self.runtime.device.type)
                     if mode == "compiled" else EagerGeneration(self.network))
        self.log(generator.describe())
        return generator

    def _scoring_width(self) -> int | None:
        """grpo with compiled layers: its scored rows all as wide as the longest prompt and completion can make
        them, so that the layers compile once instead of again for each step's width (each new width a graph per
        grad mode and input kind: dynamo's recompile limit reached within a few steps, the rest run eagerly)."""
        train = self.cfg.train
        if train.objective != "grpo" or train.compile is not True:
            return None
        return max(len(e.prompt) for e in self.examples.train.examples) + train.max_completion_length

    def begin_step(self, step: int) -> None:
        if self.objective is not None:
            self.objective.stats.step = step

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        return {"model": self.forward_module}

    def batch_units(self, batch: dict[str, Any]) -> tuple[int, int]:
        if self.objective is not None:
            return self.objective.units(batch)
        return label_tokens(batch["labels"]), batch["input_ids"].numel()

    def loss(self, batch: dict[str, Any], modules: Mapping[str, torch.nn.Module]) -> torch.Tensor:
        if self.objective is not None:
            return self.objective.loss(batch, modules["model"])
        if self.drops_padding_mask and "position_ids" not in batch:  # right-padded, not packed
            with no_packed_sequence_search():
                return self._loss({k: v for k, v in batch.items() if k != "attention_mask"}, modules)
        return self._loss(batch, modules)

    def _loss(self, batch: dict[str, Any], modules: Mapping[str, torch.nn.Module]) -> torch.Tensor:
        if self.fused_loss is not None:  # it takes the labels from the host (see FusedCausalLMLoss)
            inputs = {k: v.to(self.runtime.device, non_blocking=True) for k, v in batch.items() if k != "labels"}
            return self.fused_loss(modules["model"](**inputs), batch["labels"])
        batch = {k: v.to(self.runtime.device, non_blocking=True) for k, v in batch.items()}
        # use_cache=False: with a KV cache transformers ignores packed position_ids when building the mask.
        if self.sums_loss:  # transformers' causal-LM loss sums the token losses and divides by num_items_in_batch
            return modules["model"](**batch, use_cache=False, num_items_in_batch=1).loss
        # remote code: its mean loss times the tokens it averaged (NaN for a micro-batch without loss tokens,
        # which the trainer then skips with a warning)
        return modules["model"](**batch, use_cache=False).loss * label_tokens(batch["labels"])

    @torch.no_grad()
    def eval_loss(self, batch_size: int) -> float | None:
        """Mean token loss over the held-out set (sum of token losses / token count); beyond sft, the objective's
        mean loss per pair or example (grpo: none)."""
        if self.examples is not None:
            return self._eval_objective(batch_size)
        if self.data is None or self.data.eval is None:
            return None
        return mean_token_loss(self.data.eval, batch_size, lambda batch: self.loss(batch, self.trainable_modules()),
                               self.network, self.runtime)

    def _eval_objective(self, batch_size: int) -> float | None:
        eval_set = self.examples.eval
        if eval_set is None:
            return None
        total, count = 0.0, 0
        with eval_mode(self.network):
            for first in range(0, len(eval_set), batch_size):
                batch = eval_set.collate(range(first, min(first + batch_size, len(eval_set))))
                with torch.autocast(self.runtime.device.type, dtype=self.runtime.compute_dtype,
                                    enabled=self.runtime.compute_dtype != torch.float32):
                    total += float(self.objective.loss(batch, self.forward_module))
                count += self.objective.units(batch)[0]
        return total / count if count else None

    def _note_context(self, config) -> None:
        """Say so when data.max_seq_len is past the positions the model was trained on: it trains (rope runs on),
        but the model has not learned those positions, and a length past them is most often a typo."""
        context = getattr(getattr(config, "text_config", config), "max_position_embeddings", None)
        if isinstance(context, int) and self.cfg.data.max_seq_len > context:
            self.log(f"note: data.max_seq_len={self.cfg.data.max_seq_len} is past the model's context of {context} "
                     f"tokens (max_position_embeddings in its config.json): sequences longer than {context} train on "
                     f"positions the model never saw; set data.max_seq_len={context} unless you extend its context "
                     "on purpose (with rope_scaling in the model's config)")

    # -- sampling --------------------------------------------------------------------------
    def data_format(self) -> str:
        """The training data's format (read from data.path when dataset() has not run, e.g. for `sample`)."""
        if self.data is not None:
            return self.data.format
        if getattr(self, "moved_data_format", None) is not None:
            return self.moved_data_format
        if self.cfg.train.objective != "sft":  # conversational prompts sample through the chat template
            try:
                prompt = read_records(self.cfg.data.path)[0].get("prompt")
            except UserError as err:  # the data moved since the run trained: the tokenizer says how it chats
                chat = self.tokenizer.chat_template is not None
                self.log(f"sample: {str(err).splitlines()[0]}; the prompts go "
                         f"{'through the tokenizer' + chr(39) + 's chat template' if chat else 'as plain text'} "
                         "(whether the training prompts were conversations is read from that file)")
                self.moved_data_format = "chat" if chat else self.cfg.data.format  # said once, not per prompt
                return self.moved_data_format
            return "chat" if isinstance(prompt, list) else self.cfg.data.format
        data = self.cfg.data
        if data.format != "auto":
            return data.format
        return detect_format(read_records(data.path)[0], "auto", data.text_field, data.path)

    @classmethod
    def training_prompts(cls, cfg: DictConfig, count: int) -> tuple[list[str], str]:
        """The first `count` distinct prompts of an objective's data (llm_sampling.objective_prompts)."""
        return objective_prompts(cfg, count)

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids of a sample prompt: through the chat template (add_generation_prompt) for chat data."""
        if self.data_format() == "chat" and self.tokenizer.chat_template is not None:
            text = render_chat(self.tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    @torch.no_grad()
    def sample(self, out_dir: Path) -> list[Path]:
        prompts = list(self.cfg.sample.prompts)
        if not prompts:
            return []
        results = sample_completions(self.network, self.tokenizer, prompts, self.prompt_ids, self.cfg.sample,
                                     self.runtime.device)
        return write_samples(out_dir, results)

    # -- LoRA files ------------------------------------------------------------------------
    def save_lora(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """PEFT format: adapter_model.safetensors + adapter_config.json (PeftModel.from_pretrained loads it); with
        save.format=gguf also <run.name>.gguf, llama.cpp's LoRA adapter (models/llm_gguf.py)."""
        state = {k: v.detach().to(dtype) for k, v in self.network.state_dict().items() if "lora_" in k}
        self.network.save_pretrained(out_dir, state_dict=state)
        # Record the base the adapter belongs to, as a Hub id or local folder the user gave.
        config_path = out_dir / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = self.model_path
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        written = [out_dir / "adapter_model.safetensors", config_path]
        if self.cfg.save.format == "gguf":  # llama.cpp's adapter beside the PEFT folder (which resume and merge read)
            gguf = write_gguf_adapter(out_dir / f"{self.cfg.run.name}.gguf", peft_factors(self.network, dtype),
                                      self.network.get_base_model().config, dtype, self.cfg.run.name)
            written.append(gguf)
        return written

    def load_lora(self, path: Path, partial: bool = False, label: str | None = None) -> None:
        """Load a PEFT adapter folder (a run's final/ or checkpoint folder, or any adapter saved by PEFT; a run
        folder means its final/) with PEFT's own load_adapter, then copy its update into the trained adapter
        (toolkit/models/lora_loading.py; `partial`: modules it does not cover keep their weights; `label`: how
        messages name it, else its path)."""
        load_peft_folder(self.network, Path(path), partial, label, f"llm ({self.cfg.model.name_or_path})", self.log)


class LLMMemory(ModelMemory):
    """The llm family's memory: its decoder layers compile and checkpoint whole (through transformers), the
    model under PEFT is what fsdp shards, and a quantized base is the family's own remedy."""

    def __init__(self, adapter: LLMAdapter):
        self.adapter = adapter

    def base_parameters(self) -> int:
        a = self.adapter
        return count_base_parameters(a.model_path, {"revision": a.cfg.model.revision,
                                                    "trust_remote_code": a.cfg.model.trust_remote_code})

    def attention_without_sdpa(self) -> str | None:
        a = self.adapter
        used = getattr(a.network.config, "_attn_implementation", None)
        # transformers' sdpa and sdpa_paged call it; eager, flash_attention_2/3, flex_attention and hub kernels do not
        if used and "sdpa" not in used:
            return f"the model's attention is {used} (model.attention={a.cfg.model.attention})"
        return None

    def shard_roots(self) -> dict[str, torch.nn.Module]:
        # The transformers model under PEFT: generate() calls its forward directly.
        return {"model": self.adapter.network.get_base_model()}

    def enable_checkpointing(self) -> None:
        a = self.adapter
        a._checkpoint_layers(a.network.get_base_model())
        if a.fused_loss is not None:
            a.fused_loss.save_memory()

    def fixes(self) -> list[str]:
        quantize = self.adapter.cfg.model.quantize
        return ["model.quantize=8bit (a quantized frozen base)"] if quantize in ("none", "auto") else []
