"""The flow-matching families `flux` (Flux.1-dev/schnell) and `sd3` (SD3 / SD3.5): PEFT LoRA on the transformer.

FlowMatchingAdapter holds what they share with Wan (diffusion_wan.py): the flow objective with each family's
sigma sampler (shift), the memory plan (quantized frozen base, text encoders freed once their outputs are
cached), and the LoRA file's keys (each family names its key style in `transformer_key_style`). Samples run the
family's own diffusers pipeline on cached prompt embeddings.
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
from toolkit.models.base import repeated_blocks
from toolkit.models.block_swap import BlockSwap, move_except_swapped, plan_block_swap
from toolkit.models.quantize import (choose_backend, plan_weights, quantize_linear_layers, weight_budget_gb,
                                     weights_gb)

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


class FlowMatchingAdapter(DiffusionAdapter):
    denoiser_names = ("transformer",)
    samples_need_text_encoders = False
    # The LoRA file's keys for the transformer's factors (lora_export.py): diffusers' module names with alphas
    transformer_key_style = staticmethod(diffusers_keys_with_alpha)
    # Which linear layers (by name inside the denoiser) the memory plan quantizes: the repeated blocks'
    quantized_layer = staticmethod(in_blocks)

    def lora_key_style(self, factors: dict[str, Factors]) -> dict[str, torch.Tensor]:
        (transformer,) = factors.values()  # one transformer per file (each Wan 2.2 expert has its own)
        return self.transformer_key_style(transformer)

    # -- memory plan -----------------------------------------------------------------------
    def setup_training(self) -> None:
        self.objective = FlowObjective(self.sampler_for)
        self.dynamic_shift = False  # scheduler_shift() turns it on for the families that shift by resolution
        model, device = self.cfg.model, self.runtime.info
        counts = {name: sum(p.numel() for p in self.component(name).parameters()) for name in self.denoiser_names}
        offload = False if self.runtime.shard_base else model.expert_offload  # fsdp: the trainer refuses true
        self.quantize, self.offload, why = plan_weights(self.quantize_setting(), offload, counts, device,
                                                        self.cfg.device.memory_fraction)
        self.swap_plans, self.swaps = {}, {}
        if model.block_swap != 0 and not self.runtime.shard_base:
            self.swap_plans, why = self.plan_block_swap(counts, offload, why)
        self.log(why)
        self.quantize_library = None
        if self.quantize != "none":
            self.quantize_library, reason = choose_backend(model.quantize_backend, self.quantize, device.backend)
            self.log(f"model.quantize_backend={self.quantize_library}: {reason}")

    def place_denoisers(self) -> None:
        """Quantized denoisers go to the device now (the libraries quantize on the move); 16-bit ones wait in
        CPU memory until the caches are filled, so the text encoders never share the device with them."""
        if self.quantize == "none":
            return
        for name in self.denoiser_names:
            count = quantize_linear_layers(self.component(name), self.quantize, self.runtime.compute_dtype,
                                           self.quantize_device(name), skip=(), backend=self.quantize_library,
                                           include=self.quantized_layer, info=self.runtime.info)
            self.log(f"model: quantized {count} linear layers of the {name} to {self.quantize} "
                     f"({self.quantize_library})")

    def quantize_device(self, name: str) -> torch.device:
        """Where denoiser `name` is quantized: the device (bitsandbytes quantizes on the move there)."""
        return self.runtime.device

    def plan_block_swap(self, counts: dict[str, int], offload, why: str) -> tuple[dict, str]:
        """model.block_swap: which blocks stay in CPU memory (models/block_swap.py). Under auto, with
        model.quantize auto too, a base whose 16-bit weights exceed the budget swaps blocks rather than being
        quantized; returns the plans by denoiser and the memory plan's reason."""
        model, device, fraction = self.cfg.model, self.runtime.info, self.cfg.device.memory_fraction
        if model.block_swap == "auto" and self.quantize_setting() == "auto" and self.quantize != "none":
            self.quantize, self.offload, _ = plan_weights("none", offload, counts, device, fraction)
            why = ("model.quantize=auto -> none" + (", model.expert_offload=true" if self.offload else "") +
                   ": 16-bit weights with blocks swapped rather than quantized (model.block_swap=auto)")
        if self.quantize != "none":
            if model.block_swap == "auto":
                return {}, why + "; model.block_swap=auto -> 0 (the base is quantized)"
            raise UserError("model.block_swap: swaps 16-bit weights; it is not combined with model.quantize\n"
                            "  fix: model.quantize=none, or model.block_swap=0")
        budget = weight_budget_gb(device, fraction)
        # With expert offload one expert is on the device at a time (Wan 2.2 A14B): each swaps within the budget.
        resident = weights_gb(max(counts.values()) if self.offload else sum(counts.values()), "none")
        plans = {}
        for name in self.lora_denoiser_names():
            plan = plan_block_swap(model.block_swap, repeated_blocks(self.component(name), outermost=True), resident,
                                   budget, device.backend, device.integrated)
            several = len(self.lora_denoiser_names()) > 1
            why += f"; {name}: {plan.reason}" if several else f"; {plan.reason}"
            if plan.swapped:
                plans[name] = plan
        return plans, why

    def block_swaps(self) -> dict:
        return self.swaps

    def quantized(self) -> str:
        return self.quantize

    def place_for_training(self) -> None:
        if self.runtime.shard_base:
            return
        self.build_swaps()
        for name in self.denoiser_names:
            self.move_denoiser(name, self.runtime.device)

    def build_swaps(self) -> None:
        """The BlockSwap of each denoiser that has a swap plan (models/block_swap.py)."""
        for name, plan in self.swap_plans.items():
            self.swaps[name] = BlockSwap(repeated_blocks(self.component(name), outermost=True), plan.swapped,
                                         self.runtime.device)

    def move_denoiser(self, name: str, target: torch.device) -> None:
        """A denoiser onto `target` (the device, or the CPU for an idle Wan 2.2 expert), its LoRA weights onto the
        device either way. Swapped blocks' frozen weights stay in pinned CPU memory; a denoiser without swap moves
        by Module.to, which quantized layers (bitsandbytes) need to carry their quantization state along."""
        module, swap, device = self.component(name), self.swaps.get(name), self.runtime.device
        if swap is not None:
            move_except_swapped(module, target, swap, trainable=device)
            return
        lora = [p for p in module.parameters() if p.requires_grad]
        module.to(target)
        for p in lora:
            p.data = p.data.to(device)

    def memory_fixes(self) -> list[str]:
        fixes = []
        if self.quantize in ("none", "8bit"):
            fixes.append(f"model.quantize={'8bit' if self.quantize == 'none' else '4bit'} (a quantized frozen base)")
        fixes.append("data.resolution lower (fewer latent tokens per image)")
        return fixes

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

    def pipeline_call(self, seed: int, **kwargs) -> Any:
        """Run the pipeline for one sample with the sample settings and a CPU generator seeded `seed`."""
        s = self.cfg.sample
        width, height = self.sample_size()
        generator = torch.Generator("cpu").manual_seed(seed)
        with torch.no_grad():
            return self.pipe(num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale,
                             width=width, height=height, generator=generator, **kwargs)


class FluxAdapter(FlowMatchingAdapter):
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

    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        """The transformer on 2x2-packed latent patches; the velocity comes back unpacked."""
        from diffusers import FluxPipeline

        b, c, h, w = noised.noisy.shape
        dtype, device = denoiser.dtype, noised.noisy.device
        embeds = cond["prompt_embeds"].to(dtype)
        guidance = torch.full((b,), float(self.cfg.train.guidance), device=device) if self.guidance_embeds else None
        pred = denoiser.forward(
            hidden_states=FluxPipeline._pack_latents(noised.noisy.to(dtype), b, c, h, w),
            timestep=noised.t.to(dtype), guidance=guidance, pooled_projections=cond["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=embeds, txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
            img_ids=self.constant(("img_ids", h, w, dtype),
                                  lambda: FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", dtype)),
            return_dict=False)[0]
        return unpack_flux(pred, b, c, h, w)

    def generate(self, prompt: str, seed: int) -> list:
        text = self.embeddings_for(prompt)
        return self.pipeline_call(seed, prompt_embeds=text["prompt_embeds"],
                                  pooled_prompt_embeds=text["pooled_prompt_embeds"]).images


class SD3Adapter(FlowMatchingAdapter):
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
