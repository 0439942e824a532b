"""The `sd` (Stable Diffusion 1.x/2.x, eps or v-prediction) and `sdxl` families: PEFT LoRA on the UNet
(and optionally the text encoders), saved in the diffusers format that `pipe.load_lora_weights` reads.

Loading, caches, samples and LoRA files come from DiffusionAdapter; this file holds the DDPM objective:
noise -> timestep -> UNet -> MSE against epsilon or the velocity, with noise offset and Min-SNR weighting.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from toolkit.errors import UserError
from toolkit.models.diffusion_base import DiffusionAdapter, target_module_list

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
UNET_ALL_LINEAR = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                   "time_emb_proj", "linear_1", "linear_2"]


def sample_timesteps(kind: str, batch: int, num_train_timesteps: int, device: torch.device) -> torch.Tensor:
    """uniform over [0, T); logit_normal: sigmoid of a standard normal, which favours the middle timesteps."""
    if kind == "uniform":
        return torch.randint(0, num_train_timesteps, (batch,), device=device)
    if kind == "logit_normal":
        u = torch.sigmoid(torch.randn(batch, device=device))
        return (u * num_train_timesteps).long().clamp(max=num_train_timesteps - 1)
    raise UserError(f"train.timestep_sampling: unknown '{kind}'; available: uniform, logit_normal")


def min_snr_weights(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023): min(SNR, gamma)/SNR for eps, /(SNR+1) for v."""
    alpha = alphas_cumprod.to(timesteps.device)[timesteps].float()
    snr = alpha / (1 - alpha)
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr


class StableDiffusionAdapter(DiffusionAdapter):
    family = "sd"
    xl = False
    denoiser_names = ("unet",)
    text_encoder_names = ("text_encoder",)
    text_encoder_lora = True

    def pipeline_class(self):
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline

    def pipeline_kwargs(self) -> dict:
        return {"safety_checker": None, "requires_safety_checker": False}

    def lora_target_modules(self) -> list[str]:
        return target_module_list(self.cfg.network.target_modules, UNET_TARGETS, UNET_ALL_LINEAR)

    @property
    def tokenizers(self) -> list:
        return [self.pipe.tokenizer, self.pipe.tokenizer_2] if self.xl else [self.pipe.tokenizer]

    def setup_training(self) -> None:
        from diffusers import DDPMScheduler

        self.noise_scheduler = DDPMScheduler.from_config(self.pipe.scheduler.config)
        self.prediction_type = self.noise_scheduler.config.prediction_type

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """prompt_embeds (SD: last hidden state; SDXL: both encoders' penultimate states concatenated) and,
        for SDXL, the second encoder's pooled projection."""
        states, pooled = [], None
        for tokenizer, encoder in zip(self.tokenizers, self.text_encoders):
            ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                            return_tensors="pt").input_ids.to(encoder.device)
            out = encoder(ids, output_hidden_states=self.xl)
            if self.xl:
                states.append(out.hidden_states[-2])
                if encoder is self.pipe.text_encoder_2:
                    pooled = out[0]  # CLIPTextModelWithProjection: the projected pooled output
            else:
                states.append(out[0])
        result = {"prompt_embeds": torch.cat(states, dim=-1)}
        if self.xl:
            result["pooled_prompt_embeds"] = pooled
        return result

    # -- loss ------------------------------------------------------------------------------
    def conditioning(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
        """latents, prompt_embeds and (SDXL) added_cond_kwargs of a batch, on the device."""
        latents = self.latents_of(batch)
        text = self.text_conditioning(batch, ("prompt_embeds", "pooled_prompt_embeds"))
        added = None
        if self.xl:
            added = {"text_embeds": text["pooled_prompt_embeds"], "time_ids": batch["time_ids"].to(self.runtime.device)}
        return latents, text["prompt_embeds"], added

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: torch.Tensor, added: dict | None) -> torch.Tensor:
        # note: the network is a ModuleDict, so a DDP wrapper of it (trainer.forward_module) cannot be
        # called as the UNet; multi-GPU diffusion training needs the UNet wrapped on its own (not done yet).
        unet, dtype = self.pipe.unet, self.pipe.unet.dtype
        added = {k: v.to(dtype) for k, v in added.items()} if added else None
        return unet(noisy.to(dtype), timesteps, embeds.to(dtype), added_cond_kwargs=added).sample.float()

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """What the UNet predicts: the noise (epsilon) or the velocity (v_prediction), per the scheduler config."""
        if self.prediction_type == "epsilon":
            return noise
        if self.prediction_type == "v_prediction":
            return self.noise_scheduler.get_velocity(latents, noise, timesteps)
        raise UserError(f"{self.cfg.model.name_or_path}: scheduler prediction_type '{self.prediction_type}' "
                        "is not supported; the sd/sdxl families train epsilon and v_prediction")

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        t = self.cfg.train
        latents, embeds, added = self.conditioning(batch)
        noise = torch.randn_like(latents)
        if t.noise_offset:
            noise = noise + t.noise_offset * torch.randn(latents.shape[0], latents.shape[1], 1, 1, device=latents.device)
        timesteps = sample_timesteps(self.timestep_sampling, latents.shape[0],
                                     self.noise_scheduler.config.num_train_timesteps, latents.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        pred = self.predict(noisy, timesteps, embeds, added)
        per_sample = F.mse_loss(pred, self.target(latents, noise, timesteps), reduction="none").mean(dim=(1, 2, 3))
        if t.min_snr_gamma:
            per_sample = per_sample * min_snr_weights(self.noise_scheduler.alphas_cumprod, timesteps,
                                                      t.min_snr_gamma, self.prediction_type)
        return per_sample.mean()

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


class StableDiffusionXLAdapter(StableDiffusionAdapter):
    family = "sdxl"
    xl = True
    text_encoder_names = ("text_encoder", "text_encoder_2")

    def pipeline_class(self):
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline

    def pipeline_kwargs(self) -> dict:
        return {}
