"""The `flux2` family (FLUX.2 [dev], diffusers Flux2Pipeline): PEFT LoRA on the transformer.

What differs from Flux.1:
- Text: one encoder, Mistral Small 3.1 (Mistral3ForConditionalGeneration) over a system prompt and the caption; the
  hidden states of layers 10, 20 and 30 are stacked into [B, 512, 3 x hidden] (always padded to 512 tokens, and the
  transformer attends to the padding, as the pipeline does). No pooled embedding.
- Latents: AutoencoderKLFlux2's 32 channels, patchified 2x2 into 128 and normalised by the VAE's batch-norm
  statistics ((z - running_mean) / sqrt(running_var + eps)), [B, 128, H/16, W/16]: the space the pipeline denoises
  in. The transformer takes them flattened to tokens with 4-axis (t, h, w, l) position ids.
- Timestep = sigma, the guidance embedding gets train.guidance (FLUX.2 [dev] is guidance-distilled, as Flux.1-dev).
- Sigma shift: the pipeline's own, compute_empirical_mu(tokens, steps), a fit that depends on the number of
  inference steps below 4300 tokens. Training uses it at FLUX.2's usual 50 steps (mu 2.02 at 1024x1024, ComfyUI's
  fixed Flux.2 shift), so the LoRA learns most where inference spends its steps; train.flow_shift=<number> replaces it.
- The LoRA file: `transformer.<diffusers module>` with the scale folded into lora_A (lora_export.flux2_keys);
  save.format=comfyui's file names the feed-forwards and single-block projections as ComfyUI's Flux.2 model does,
  which its diffusers-name map lacks (lora_export.flux2_comfy_keys).
- Reference images (docs/edit.md), when the dataset has them: each one's latents (normalised as the target's) are
  packed after the image's tokens with position ids whose time coordinate is 10, 20, ... (Flux2Pipeline's
  _prepare_image_ids for its `image` list); the loss is on the image's tokens. A reference keeps its size up to
  data.resolution squared (the pipeline's 1024 x 1024 cap), sides cut down to multiples of 16 as the pipeline cuts
  them. sample.references gives a prompt its reference images.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.config.families import family_spec
from toolkit.data.references import ReferenceSizing, open_image, sample_references
from toolkit.models.diffusion_base import Denoiser, DiffusionAdapter
from toolkit.models.diffusion_flow import FlowMatching
from toolkit.models.flow_matching import SigmaSampler
from toolkit.models.lora import target_modules
from toolkit.models.lora_export import Factors, flux2_comfy_keys, flux2_comfy_module, flux2_keys
from toolkit.models.objectives import Noised
from toolkit.models.references import References, ReferencedTargets

# Double-stream blocks: attention (image to_*, text add_*_proj / to_add_out) and both SwiGLU feed-forwards;
# single-stream blocks: the fused qkv + MLP input projection and the output projection. A regex (PEFT full-matches
# a string), since the single blocks' attn.to_out is a Linear and the double blocks' a ModuleList.
_FLUX2_BLOCKS = (r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj"
                 r"|to_add_out)|ff\.linear_(in|out)|ff_context\.linear_(in|out))"
                 r"|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)")
FLUX2_TARGETS = f".*({_FLUX2_BLOCKS})"
# ... and the input and output projections (every linear layer ComfyUI maps; the shared modulation layers it does not)
FLUX2_ALL_LINEAR = f"(.*({_FLUX2_BLOCKS})|x_embedder|context_embedder|proj_out)"
FLUX2_MU_STEPS = 50  # the pipeline's default num_inference_steps, FLUX.2 [dev]'s usual


def unpack_flux2(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of Flux2Pipeline._pack_latents: [B, H*W, C] tokens back to [B, C, H, W]."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], height, width)


class Flux2Adapter(ReferencedTargets, FlowMatching, DiffusionAdapter):
    uses_negative_prompt = False
    text_encoder_names = ("text_encoder",)
    text_keys = ("prompt_embeds",)
    max_text_tokens = 512  # the pipeline's max_sequence_length
    transformer_key_style = staticmethod(flux2_keys)

    def pipeline_class(self):
        from diffusers import Flux2Pipeline

        return Flux2Pipeline

    def lora_target_modules(self) -> str:
        return target_modules(self.cfg.network.target_modules, FLUX2_TARGETS, FLUX2_ALL_LINEAR)

    def setup_training(self) -> None:
        super().setup_training()
        self.scheduler_shift()  # dynamic (the config says so) unless train.flow_shift is a number
        self.guidance_embeds = bool(self.pipe.transformer.config.guidance_embeds)
        fewest, most = family_spec(self.cfg.model.family).references
        self.references = References(ReferenceSizing(multiple=16, upscale=False, floor=True,
                                                     max_references=most),
                                     self.encode_pixels, self.to_device, required=fewest > 0, data=self.cfg.data)
        self.sample_refs = sample_references([list(r) for r in self.cfg.sample.references], self.sample_prompts(),
                                             required=fewest > 0)

    # -- noise levels ----------------------------------------------------------------------
    def sampler_for(self, latents: torch.Tensor) -> SigmaSampler:
        """The pipeline's shift for this many latent tokens at FLUX2_MU_STEPS steps, or the fixed one."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        if not self.dynamic_shift:
            return self.sigma_sampler(shift=self.shift)
        return self.sigma_sampler(mu=compute_empirical_mu(latents.shape[-2] * latents.shape[-1], FLUX2_MU_STEPS))

    # -- latents ---------------------------------------------------------------------------
    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 32, h, w] VAE latents patchified to [B, 128, h/2, w/2] and normalised by the VAE's batch-norm
        statistics, as Flux2Pipeline does for reference images (and inverts before decoding)."""
        from diffusers import Flux2Pipeline

        vae = self.pipe.vae
        patches = Flux2Pipeline._patchify_latents(latents)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patches.device, patches.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).to(patches.device, patches.dtype)
                         + vae.config.batch_norm_eps)
        return (patches - mean) / std

    # -- text ------------------------------------------------------------------------------
    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """prompt_embeds [B, 512, 3 x hidden]: the stacked hidden states of the pipeline's own encode_prompt."""
        embeds, _ = self.pipe.encode_prompt(list(captions), device=self.runtime.device,
                                            max_sequence_length=self.max_text_tokens)
        return {"prompt_embeds": embeds}

    # -- loss ------------------------------------------------------------------------------
    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        """The velocity for `noised.noisy` [B, 128, h, w]: the transformer on its tokens at timestep sigma, followed
        by the batch's reference tokens (their ids Flux2Pipeline's); the image's tokens' prediction."""
        from diffusers import Flux2Pipeline

        noisy = noised.noisy
        b, _, h, w = noisy.shape
        dtype, device = denoiser.dtype, noisy.device
        embeds = cond["prompt_embeds"].to(dtype)
        guidance = torch.full((b,), float(self.cfg.train.guidance), device=device) if self.guidance_embeds else None
        refs = self.references.latents(batch)
        tokens = [Flux2Pipeline._pack_latents(x.to(dtype)) for x in [noisy, *refs]]
        ids = [self.constant(("img_ids", b, h, w), lambda: Flux2Pipeline._prepare_latent_ids(noisy))]
        if refs:
            shapes = tuple(tuple(r.shape[-2:]) for r in refs)
            ids.append(self.constant(("ref_ids", b, shapes), lambda: Flux2Pipeline._prepare_image_ids(
                [torch.empty(1, 1, *shape) for shape in shapes]).repeat(b, 1, 1)))
        pred = denoiser.forward(hidden_states=torch.cat(tokens, dim=1),
                                encoder_hidden_states=embeds, timestep=noised.t.to(dtype), guidance=guidance,
                                img_ids=torch.cat(ids, dim=1),
                                txt_ids=self.constant(("txt_ids", b, embeds.shape[1]),
                                                      lambda: Flux2Pipeline._prepare_text_ids(embeds)),
                                return_dict=False)[0]
        return unpack_flux2(pred[:, :tokens[0].shape[1]], h, w)

    # -- LoRA files ------------------------------------------------------------------------
    def lycoris_key_style(self, factors: dict[str, Factors]) -> dict[str, torch.Tensor]:
        """A LoKr / LoHa file is for ComfyUI (diffusers reads no LyCORIS keys): its modules take the names ComfyUI's
        Flux.2 model reads (flux2_comfy_keys), as the save.format=comfyui LoRA does; with diffusers' names ComfyUI
        skipped the feed-forwards and the single blocks' projections."""
        (transformer,) = factors.values()
        return flux2_comfy_keys(transformer)

    # A LoKr / LoHa file written before 2026-11-29 names those modules as diffusers does: read under today's names
    lycoris_name_today = staticmethod(flux2_comfy_module)

    def copy_state(self, fmt: str, factors: dict[str, Factors] | None) -> dict[str, torch.Tensor] | None:
        """save.format=comfyui: the LoRA in the names ComfyUI reads (flux2_comfy_keys). A LoKr / LoHa file has
        ComfyUI's names already (lycoris_key_style): its copy is the same file."""
        if fmt != "comfyui" or factors is None:
            return None
        (transformer,) = factors.values()
        return flux2_comfy_keys(transformer)

    # -- samples ---------------------------------------------------------------------------
    def generate(self, prompt: str, seed: int) -> list:
        """The pipeline on the prompt's cached embeddings, with its reference images (sample.references) if any."""
        index = seed - self.cfg.sample.seed
        refs = self.sample_refs[index] if index < len(self.sample_refs) else []
        images = {"image": [open_image(path) for path in refs]} if refs else {}
        return self.pipeline_call(seed, prompt_embeds=self.embeddings_for(prompt)["prompt_embeds"], **images).images
