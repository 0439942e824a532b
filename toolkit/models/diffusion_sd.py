"""The `sd` (Stable Diffusion 1.x/2.x, eps or v-prediction) and `sdxl` families: PEFT LoRA on the UNet
(and optionally the text encoders), saved with kohya keys, which `pipe.load_lora_weights`, ComfyUI and sd-scripts read.

Loading, caches, the loss, samples and LoRA files come from DiffusionAdapter and the DDPM objective
(toolkit/models/objectives.py); this file holds the text encoding and the UNet forward.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from toolkit.models.diffusion_base import Denoiser, DiffusionAdapter
from toolkit.models.lora import target_modules
from toolkit.models.lora_export import Factors, kohya_keys
from toolkit.models.objectives import DDPMObjective, Noised

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
UNET_ALL_LINEAR = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                   "time_emb_proj", "linear_1", "linear_2"]


TIME_ID_KEYS = ("original_size", "crop_top_left", "target_size")


def sdxl_time_ids(batch: Mapping[str, Any]) -> torch.Tensor:
    """SDXL's size and crop micro-conditioning, (B, 6) float32: original (h, w), crop (top, left), target (h, w),
    the order of diffusers' StableDiffusionXLPipeline._get_add_time_ids."""
    return torch.cat([batch[k] for k in TIME_ID_KEYS], dim=1).float()


def unet_blocks(unet: torch.nn.Module) -> list[torch.nn.Module]:
    """The UNet's repeated blocks in forward order: its resnets and the transformer blocks inside its attentions
    (diffusers' ResnetBlock2D, BasicTransformerBlock), the outermost ones."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D

    found = [m for m in unet.modules() if isinstance(m, (ResnetBlock2D, BasicTransformerBlock))]
    inner = {id(m) for block in found for m in block.modules() if m is not block}
    return [b for b in found if id(b) not in inner]


class UNetFamily:
    """What sd and sdxl share, mixed in beside DiffusionAdapter: the UNet, its LoRA targets and blocks, the DDPM
    objective, kohya's key style, the text tokenizers and the DDIM samples."""

    denoiser_names = ("unet",)
    kohya_te_prefixes: dict[str, str] = {}

    def lora_target_modules(self) -> list[str]:
        return target_modules(self.cfg.network.target_modules, UNET_TARGETS, UNET_ALL_LINEAR)

    def lora_key_style(self, factors: dict[str, Factors]) -> dict[str, torch.Tensor]:
        """kohya keys with an alpha per module: read by diffusers, ComfyUI and sd-scripts alike."""
        encoders = {name: factors[name] for name in self.text_encoder_names if name in factors}
        return kohya_keys(factors["unet"], encoders, self.kohya_te_prefixes)

    def block_regions(self, checkpointed: bool) -> dict[str, list[torch.nn.Module]]:
        """Checkpointed: the UNet's down blocks, mid block and up blocks, each recomputed on its own. Otherwise, as
        train.compile_regions says: the UNet whole (one graph; compiled whole it trained SD1.5 far faster than its
        down, mid and up blocks compiled one by one), or its transformer and resnet blocks, each compiled (once per
        shape) and replayed on its own."""
        unet = self.component("unet")
        if checkpointed:
            return {"unet": [*unet.down_blocks, unet.mid_block, *unet.up_blocks]}
        if self.cfg.train.compile_regions == "blocks":
            return {"unet": unet_blocks(unet)}
        return {"unet": [unet]}

    def setup_training(self) -> None:
        self.objective = DDPMObjective(self.pipe.scheduler.config, self.cfg.train, self.cfg.model.name_or_path)

    def tokenize(self, name: str, captions: list[str]) -> torch.Tensor:
        tokenizer = getattr(self.pipe, name.replace("text_encoder", "tokenizer"))
        return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids.to(self.runtime.device)

    # -- loss ------------------------------------------------------------------------------
    def unet_kwargs(self, cond: dict[str, torch.Tensor], batch: dict[str, Any], dtype: torch.dtype) -> dict:
        """Conditioning beyond the text states (SDXL: pooled embeddings and size/crop micro-conditioning)."""
        return {}

    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        dtype = denoiser.dtype
        return denoiser.forward(noised.noisy.to(dtype), noised.t, cond["prompt_embeds"].to(dtype),
                                **self.unet_kwargs(cond, batch, dtype)).sample.float()

    @torch.no_grad()
    def generate(self, prompt: str, seed: int) -> list:
        from diffusers import DDIMScheduler

        s, pipe = self.cfg.sample, self.pipe
        scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        runner = type(pipe)(**{**pipe.components, "scheduler": scheduler})
        runner.set_progress_bar_config(disable=True)
        generator = torch.Generator("cpu").manual_seed(seed)
        width, height = self.sample_size()
        return runner(prompt, negative_prompt=s.negative_prompt or None, num_inference_steps=s.num_inference_steps,
                      guidance_scale=s.guidance_scale, width=width, height=height, generator=generator).images


class StableDiffusionAdapter(UNetFamily, DiffusionAdapter):
    text_encoder_names = ("text_encoder",)
    # kohya's names for the text encoders where they differ from diffusers' converter (lora_te1_, lora_te2_):
    # sd-scripts' SD 1.x network calls its one text encoder lora_te (networks/lora.py LORA_PREFIX_TEXT_ENCODER).
    kohya_te_prefixes = {"lora_te1_": "lora_te_"}

    def pipeline_class(self):
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline

    def pipeline_kwargs(self) -> dict:
        return {"safety_checker": None, "requires_safety_checker": False}

    def encode_text(self, captions: list[str], encoders: Mapping[str, torch.nn.Module] | None = None
                    ) -> dict[str, torch.Tensor]:
        """prompt_embeds: the text encoder's last hidden state. `encoders` (the trainer's modules) replace the
        pipeline's when the text encoders are trained."""
        encoder = (encoders or {}).get("text_encoder", self.pipe.text_encoder)
        return {"prompt_embeds": encoder(self.tokenize("text_encoder", captions))[0]}


class StableDiffusionXLAdapter(UNetFamily, DiffusionAdapter):
    text_encoder_names = ("text_encoder", "text_encoder_2")
    kohya_te_prefixes = {}  # lora_te1_ / lora_te2_, as sd-scripts' SDXL network names them
    text_keys = ("prompt_embeds", "pooled_prompt_embeds")

    def pipeline_class(self):
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline

    def encode_text(self, captions: list[str], encoders: Mapping[str, torch.nn.Module] | None = None
                    ) -> dict[str, torch.Tensor]:
        """prompt_embeds: both encoders' penultimate hidden states, concatenated; pooled_prompt_embeds: the
        second encoder's projected pooled output."""
        states, pooled = [], None
        for name in self.text_encoder_names:
            encoder = (encoders or {}).get(name, getattr(self.pipe, name))
            out = encoder(self.tokenize(name, captions), output_hidden_states=True)
            states.append(out.hidden_states[-2])
            if name == "text_encoder_2":
                pooled = out[0]  # CLIPTextModelWithProjection: the projected pooled output
        return {"prompt_embeds": torch.cat(states, dim=-1), "pooled_prompt_embeds": pooled}

    def unet_kwargs(self, cond: dict[str, torch.Tensor], batch: dict[str, Any], dtype: torch.dtype) -> dict:
        time_ids = sdxl_time_ids({k: self.to_device(batch[k]) for k in TIME_ID_KEYS})
        added = {"text_embeds": cond["pooled_prompt_embeds"], "time_ids": time_ids}
        return {"added_cond_kwargs": {k: v.to(dtype) for k, v in added.items()}}

    @property
    def unused_lora_parameters(self) -> bool:
        # Only the penultimate states are used: the text encoders' last layers get no gradient.
        return self.trains_text_encoders
