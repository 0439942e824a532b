"""Loading a diffusion family's pipeline and adding its LoRA. Mixed into DiffusionAdapter, which provides `cfg`,
`runtime`, `family`, `spec`, `model_path`, the family's `pipeline_class`, `pipeline_kwargs`, `denoiser_names`,
`text_encoder_names`, `lora_target_modules`, `setup_training`, `place_denoisers`, `lora_denoiser_names` and
`trains_text_encoders`, and `check_lycoris_names`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.errors import UserError
from toolkit.models.lora import lora_config

TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


class DiffusersLoading:
    """The pipeline (`pipe`) loaded, its components frozen, LoRA added to the denoisers (and text encoders when
    trained) as `network`; the base size read from the folder before it is loaded."""

    def component(self, name: str):
        return getattr(self.pipe, name)

    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        return [m for m in (getattr(self.pipe, n, None) for n in self.text_encoder_names) if m is not None]

    def load(self, shard_base: bool = False) -> None:
        from diffusers.utils import logging as diffusers_logging

        self.shard_base = shard_base
        diffusers_logging.disable_progress_bar()  # "Loading pipeline components" says nothing a user can act on
        try:
            self.pipe = self.pipeline_class().from_pretrained(self.model_path, dtype=self.runtime.base_dtype,
                                                              revision=self.cfg.model.revision, **self.pipeline_kwargs())
        except (OSError, ValueError) as err:
            raise UserError(f"model.name_or_path: cannot load '{self.cfg.model.name_or_path}' as a {self.family} "
                            f"pipeline: {str(err).splitlines()[0]}\n  fix: give a local diffusers folder "
                            "(model_index.json) or a Hub id you can reach") from None
        except ImportError as err:  # a component class that needs a library the toolkit does not install
            raise UserError(f"model.name_or_path: loading '{self.cfg.model.name_or_path}' as a {self.family} pipeline "
                            f"needs a library that is not installed: {str(err).strip().splitlines()[0]}\n  fix: "
                            "install the library it names into the toolkit's environment (.venv/bin/pip install ...)"
                            ) from None
        self.pipe.set_progress_bar_config(disable=True)
        for module in self.pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False)
        self.setup_training()
        self.place_denoisers()
        net, train = self.cfg.network, self.cfg.train
        modules = {}
        for name in self.lora_denoiser_names():
            denoiser = self.component(name)
            denoiser.add_adapter(lora_config(net, self.lora_target_modules()))
            modules[name] = denoiser  # checkpointing, compile and block swap: per block, by train/blocks.py
        if self.trains_text_encoders:
            for name in self.text_encoder_names:
                encoder = self.component(name)
                encoder.to(self.runtime.device)
                encoder.add_adapter(lora_config(net, TEXT_ENCODER_TARGETS))
                modules[name] = encoder
        self.network = torch.nn.ModuleDict(modules)
        self.check_lycoris_names()
        for p in self.network.parameters():  # LoRA weights train in fp32 over a bf16/fp16 base
            if p.requires_grad:
                p.data = p.data.float()

    def count_base_parameters(self) -> int | None:
        """The denoisers' parameters, from model_index.json and their configs on the meta device."""
        import diffusers
        from accelerate import init_empty_weights

        index_file = Path(self.model_path) / "model_index.json"
        if not index_file.is_file():
            return None  # a Hub id: its size is known only once it is downloaded
        index = json.loads(index_file.read_text(encoding="utf-8"))
        total = 0
        for name in self.denoiser_names_in(index):
            model_cls = getattr(diffusers, index[name][1])
            with init_empty_weights():
                model = model_cls.from_config(model_cls.load_config(self.model_path, subfolder=name))
            total += sum(p.numel() for p in model.parameters())
        return total

    def denoiser_names_in(self, index: dict) -> list[str]:
        """The denoisers a pipeline folder has (model_index.json), before it is loaded."""
        return [n for n in self.denoiser_names if (index.get(n) or [None])[0] is not None]
