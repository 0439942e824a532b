"""The flow-matching families `flux` (Flux.1-dev/schnell) and `sd3` (SD3 / SD3.5): PEFT LoRA on the transformer.

FlowMatching holds what they share with the other flow families (Wan, Qwen-Image, Z-Image, FLUX.2): the flow
objective with each family's sigma sampler (shift), the memory plan (models/flow_memory.py), and the LoRA file's
keys (each family names its key style in `transformer_key_style`). Samples run the family's own diffusers pipeline
on cached prompt embeddings.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.errors import UserError
from toolkit.models.diffusion_base import Denoiser, DiffusionAdapter
from toolkit.models.flow_matching import SigmaSampler, flux_mu
from toolkit.models.lora import target_modules
from toolkit.models.lora_export import Factors, diffusers_keys_scaled, diffusers_keys_with_alpha
from toolkit.models.objectives import FlowObjective, Noised
from toolkit.models.flow_memory import FlowMemory

# Attention and feed-forward projections of the MMDiT blocks (Flux double/single blocks, SD3 joint blocks).
MMDIT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                 "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
# Flux adds single blocks, whose output projection shares its name with the model's final proj_out: a regex
# (PEFT full-matches a string) keeps that one out.
_FLUX_DOUBLE = (r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
                r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2)EXTRA)")
_FLUX_SINGLE = r"single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_outEXTRA)"
FLUX_TARGETS = ".*(" + _FLUX_DOUBLE.replace("EXTRA", "") + "|" + _FLUX_SINGLE.replace("EXTRA", "") + ")"
FLUX_ALL_LINEAR = (".*(" + _FLUX_DOUBLE.replace("EXTRA", r"|norm1\.linear|norm1_context\.linear") + "|"
                   + _FLUX_SINGLE.replace("EXTRA", r"|norm\.linear") + ")")


def unpack_flux(packed: torch.Tensor, b: int, c: int, h: int, w: int) -> torch.Tensor:
    """The inverse of FluxPipeline._pack_latents: (b, h/2 * w/2, c*4) patches back to (b, c, h, w)."""
    return packed.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def in_blocks(name: str) -> bool:
    """Linear layers inside the repeated transformer blocks: what the memory plan quantizes (embedders,
    modulation of the final layer and the output head stay in 16 bits)."""
    return ".blocks." in f".{name}" or "transformer_blocks." in name


class FlowMatching:
    """What the flow-matching families share, mixed in beside DiffusionAdapter: the flow objective with each
    family's sigma sampler (shift), the memory plan (models/flow_memory.py: a quantized frozen base, expert offload,
    block swap; text encoders freed once their outputs are cached), and the LoRA file's keys in the family's
    `transformer_key_style`."""

    denoiser_names = ("transformer",)
    samples_need_text_encoders = False
    memory_class = FlowMemory
    # The LoRA file's keys for the transformer's factors (lora_export.py): diffusers' module names with alphas
    transformer_key_style = staticmethod(diffusers_keys_with_alpha)
    # Which linear layers (by name inside the denoiser) the memory plan quantizes: the repeated blocks'
    quantized_layer = staticmethod(in_blocks)

    def lora_key_style(self, factors: dict[str, Factors]) -> dict[str, torch.Tensor]:
        (transformer,) = factors.values()  # one transformer per file (each Wan 2.2 expert has its own)
        return self.transformer_key_style(transformer)

    def expert_offload_setting(self) -> bool | str:
        """model.expert_offload: a setting of the families with experts (Wan 2.2); none for the others."""
        return False

    def setup_training(self) -> None:
        self.objective = FlowObjective(self.sampler_for)
        self.dynamic_shift = False  # scheduler_shift() turns it on for the families that shift by resolution
        self.memory.plan()

    def place_denoisers(self) -> None:
        """Quantized denoisers go to the device now (the libraries quantize on the move); 16-bit ones wait in
        CPU memory until the caches are filled, so the text encoders never share the device with them."""
        self.memory.place_quantized()

    def place_for_training(self) -> None:
        self.memory.place(self.active_denoiser())

    # -- sigmas ----------------------------------------------------------------------------
    def sigma_sampler(self, shift: float | None = None, mu: float | None = None) -> SigmaSampler:
        t = self.cfg.train
        return SigmaSampler(self.timestep_sampling, t.logit_mean, t.logit_std, shift=shift or 1.0, mu=mu)

    def configured_shift(self, default: float) -> float:
        """train.flow_shift, or `default` (the model's scheduler config) when auto."""
        shift = self.cfg.train.flow_shift
        if shift == "auto":
            return float(default)
        try:
            return float(shift)
        except (TypeError, ValueError):
            raise UserError(f"train.flow_shift: expected a number or auto, got {shift!r}") from None

    def scheduler_shift(self) -> None:
        """Flux and Qwen-Image: the shift of the scheduler config, resolution-dependent when it says
        use_dynamic_shifting (and train.flow_shift is auto)."""
        config = self.pipe.scheduler.config
        self.dynamic_shift = self.cfg.train.flow_shift == "auto" and config.get("use_dynamic_shifting", False)
        self.shift = self.configured_shift(config.get("shift", 1.0))

    def sampler_for(self, latents: torch.Tensor) -> SigmaSampler:
        """The sigma sampler for a batch of latents: the family's fixed shift, or with a dynamic shift the
        pipeline's: mu from the number of 2x2 latent patches, applied as exp(mu) (or as mu, for a scheduler
        whose time_shift_type is linear)."""
        if not self.dynamic_shift:
            return self.sigma_sampler(shift=self.shift)
        config = self.pipe.scheduler.config
        tokens = (latents.shape[-2] // 2) * (latents.shape[-1] // 2)
        mu = flux_mu(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                     config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        if config.get("time_shift_type", "exponential") == "linear":
            return self.sigma_sampler(shift=mu)
        return self.sigma_sampler(mu=mu)


class Flux(FlowMatching):
    """What flux and flux_kontext share, mixed in beside DiffusionAdapter (with FlowMatching): the CLIP + T5 text,
    the shift, the transformer's forward on packed latents (with any reference tokens after them) and samples."""

    uses_negative_prompt = False
    text_encoder_names = ("text_encoder", "text_encoder_2")
    text_keys = ("prompt_embeds", "pooled_prompt_embeds")
    max_text_tokens = 512

    def pipeline_class(self):
        from diffusers import FluxPipeline

        return FluxPipeline

    def lora_target_modules(self) -> list[str] | str:
        return target_modules(self.cfg.network.target_modules, FLUX_TARGETS, FLUX_ALL_LINEAR)

    def setup_training(self) -> None:
        super().setup_training()
        self.scheduler_shift()
        self.guidance_embeds = bool(self.pipe.transformer.config.guidance_embeds)

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(captions, prompt_2=None, device=self.runtime.device,
                                                    max_sequence_length=self.max_text_tokens)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def reference_latents(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """Reference latents whose packed tokens follow the image's (flux_kontext); none here."""
        return []

    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        """The transformer on 2x2-packed latent patches, followed by each reference's packed patches with position
        ids whose first coordinate is 1 (FluxKontextPipeline's); the velocity of the image's tokens, unpacked."""
        from diffusers import FluxPipeline

        b, c, h, w = noised.noisy.shape
        dtype, device = denoiser.dtype, noised.noisy.device
        embeds = cond["prompt_embeds"].to(dtype)
        guidance = torch.full((b,), float(self.cfg.train.guidance), device=device) if self.guidance_embeds else None
        refs = self.reference_latents(batch)
        tokens = [FluxPipeline._pack_latents(x.to(dtype), b, c, x.shape[-2], x.shape[-1]) for x in [noised.noisy, *refs]]
        ids = [self.constant(("img_ids", x.shape[-2], x.shape[-1], dtype, int(i > 0)),
                             lambda x=x, i=i: latent_ids(x.shape[-2], x.shape[-1], dtype, int(i > 0)))
               for i, x in enumerate([noised.noisy, *refs])]
        pred = denoiser.forward(
            hidden_states=torch.cat(tokens, dim=1), timestep=noised.t.to(dtype), guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(dtype), encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype), img_ids=torch.cat(ids, dim=0),
            return_dict=False)[0]
        return unpack_flux(pred[:, :tokens[0].shape[1]], b, c, h, w)

    def generate(self, prompt: str, seed: int) -> list:
        text = self.embeddings_for(prompt)
        return self.pipeline_call(seed, prompt_embeds=text["prompt_embeds"],
                                  pooled_prompt_embeds=text["pooled_prompt_embeds"]).images


def latent_ids(h: int, w: int, dtype: torch.dtype, first: int = 0) -> torch.Tensor:
    """FluxPipeline's position ids of an (h, w) latent's 2x2 patches, their first coordinate `first` (1 for a
    FLUX.1 Kontext reference)."""
    from diffusers import FluxPipeline

    ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", dtype)
    ids[..., 0] = first
    return ids


class FluxAdapter(Flux, DiffusionAdapter):
    """Flux.1 dev / schnell (text-to-image)."""


class SD3Adapter(FlowMatching, DiffusionAdapter):
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    transformer_key_style = staticmethod(diffusers_keys_scaled)  # diffusers' SD3 reader refuses `.alpha` keys
    text_keys = ("prompt_embeds", "pooled_prompt_embeds")
    max_text_tokens = 256

    def pipeline_class(self):
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline

    def lora_target_modules(self) -> list[str]:
        return target_modules(self.cfg.network.target_modules, MMDIT_TARGETS,
                                  MMDIT_TARGETS + ["norm1.linear", "norm1_context.linear"])

    def setup_training(self) -> None:
        super().setup_training()
        self.shift = self.configured_shift(self.pipe.scheduler.config.get("shift", 1.0))

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.pipe.encode_prompt(captions, prompt_2=None, prompt_3=None, device=self.runtime.device,
                                                       do_classifier_free_guidance=False,
                                                       max_sequence_length=self.max_text_tokens)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        dtype = denoiser.dtype
        return denoiser.forward(hidden_states=noised.noisy.to(dtype), timestep=(noised.t * 1000).to(dtype),
                                encoder_hidden_states=cond["prompt_embeds"].to(dtype),
                                pooled_projections=cond["pooled_prompt_embeds"].to(dtype), return_dict=False)[0]

    def generate(self, prompt: str, seed: int) -> list:
        text, negative = self.embeddings_for(prompt), self.embeddings_for(self.cfg.sample.negative_prompt)
        return self.pipeline_call(seed, prompt_embeds=text["prompt_embeds"],
                                  pooled_prompt_embeds=text["pooled_prompt_embeds"],
                                  negative_prompt_embeds=negative["prompt_embeds"],
                                  negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"]).images
