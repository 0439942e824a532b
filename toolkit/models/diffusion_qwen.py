"""The `qwen_image` family (Qwen-Image, diffusers QwenImagePipeline): PEFT LoRA on the dual-stream MMDiT.

What differs from Flux / SD3:
- Text: the last hidden state of Qwen2.5-VL over a chat template, the template's system prefix dropped; the
  pipeline returns variable-length embeddings and a mask. They are padded here to `max_text_tokens` (zeros, mask
  0), so cached items stack into a batch; predict trims the batch's common trailing padding before the forward
  (exact: padded tokens are masked keys, and RoPE positions do not depend on the sequence length).
- Latents: the causal-3D VAE takes and returns [B, C, frames, H, W]; an image is one frame. Latents are kept
  as [B, 16, H/8, W/8] (the frame axis dropped), normalised per channel: (z - latents_mean) / latents_std.
- The transformer takes 2x2-packed patches, timestep = sigma (the pipeline's t / 1000), the text mask and
  img_shapes [(1, H/16, W/16)] per sample for its RoPE; it predicts the velocity noise - x0.
- Sigma shift: the scheduler's dynamic exponential shift, mu linear in the number of patches (Flux's formula
  with Qwen-Image's max_shift 0.9 at 8192 patches), in training as at inference. shift_terminal (0.02) only
  stretches the inference schedule.
- The last block's text-stream layers get no gradient (its text output is discarded), so DDP looks for unused
  parameters.
- Samples: true classifier-free guidance (true_cfg_scale with a negative prompt); the transformer has no
  guidance embedding, so sample.guidance_scale is used as true_cfg_scale.
- The LoRA file holds the diffusers module names under `diffusion_model.` with `.alpha` keys: ComfyUI's QwenImage
  model has the diffusers module names, and diffusers' Qwen-Image reader applies the alphas (lora_export.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from toolkit.models.diffusion_base import Denoiser, DiffusionAdapter
from toolkit.models.diffusion_flow import FlowMatching
from toolkit.models.lora import target_modules
from toolkit.models.lora_export import qwen_image_keys
from toolkit.models.objectives import Noised

# Attention (image stream to_*, text stream add_*_proj / to_add_out) and the two streams' feed-forward layers.
QWEN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
# ... and each block's AdaLN modulation (the Linear of nn.Sequential(SiLU, Linear), 6 * dim outputs).
QWEN_ALL_LINEAR = QWEN_TARGETS + ["img_mod.1", "txt_mod.1"]


def trim_text(embeds: torch.Tensor, mask: torch.Tensor | None,
              keep_full_mask: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop the padding columns no sample of the batch uses. A mask with every remaining token valid becomes None
    (attention then runs unmasked, as the pipeline does), unless `keep_full_mask` (the pipeline, given embeddings
    without a mask, warns, and drops a full one itself)."""
    if mask is None:
        return embeds, None
    used = mask.bool().any(dim=0).nonzero()
    length = int(used.max()) + 1 if used.numel() else 1
    embeds, mask = embeds[:, :length], mask[:, :length]
    return embeds, (None if bool(mask.all()) and not keep_full_mask else mask)


class QwenImage(FlowMatching):
    """What qwen_image and qwen_image_edit share, mixed in beside DiffusionAdapter (with FlowMatching): the text
    encoder, latents, shift, the transformer's forward and samples."""

    text_encoder_names = ("text_encoder",)
    text_keys = ("prompt_embeds", "prompt_embeds_mask")
    max_text_tokens = 512  # the pipeline's default max_sequence_length (it allows up to 1024)
    transformer_key_style = staticmethod(qwen_image_keys)  # diffusers names under diffusion_model., with alphas

    def pipeline_class(self):
        from diffusers import QwenImagePipeline

        return QwenImagePipeline

    def lora_target_modules(self) -> list[str]:
        return target_modules(self.cfg.network.target_modules, QWEN_TARGETS, QWEN_ALL_LINEAR)

    def setup_training(self) -> None:
        super().setup_training()
        # The pipeline's resolution-dependent shift (FlowMatching.sampler_for), kept for training as
        # FluxAdapter does, rather than diffusers' train_dreambooth_lora_qwen_image.py, which draws from the
        # scheduler's static, unshifted timesteps: the LoRA then learns most at the noise levels inference
        # spends its steps on. train.flow_shift=<number> replaces it by a fixed shift.
        self.scheduler_shift()
        if self.pipe.transformer.config.get("guidance_embeds", False):
            self.log("warning: this Qwen-Image transformer has guidance_embeds set; it is trained without guidance")

    # -- latents ---------------------------------------------------------------------------
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 16, H/8, W/8] normalised latents of images [B, 3, H, W] (one frame each for the 3D VAE)."""
        latents = super().encode_pixels(pixels.unsqueeze(2) if pixels.dim() == 4 else pixels)
        return latents[:, :, 0] if pixels.dim() == 4 else latents

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """(z - latents_mean) / latents_std per channel: the inverse of the pipeline's decode step."""
        config = self.pipe.vae.config
        shape = (1, -1) + (1,) * (latents.dim() - 2)
        mean = torch.tensor(config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(config.latents_std, device=latents.device, dtype=latents.dtype).view(shape)
        return (latents - mean) / std

    # -- text ------------------------------------------------------------------------------
    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """prompt_embeds [B, max_text_tokens, hidden] and prompt_embeds_mask [B, max_text_tokens] (1 = token)."""
        n = self.max_text_tokens
        embeds, mask = self.pipe.encode_prompt(captions, device=self.runtime.device, max_sequence_length=n)
        b, length, _ = embeds.shape
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(b, length, dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": F.pad(embeds, (0, 0, 0, n - length)),
                "prompt_embeds_mask": F.pad(mask.long(), (0, n - length))}

    # -- sigmas ----------------------------------------------------------------------------
    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        """The velocity for `noised.noisy` ([B, C, H, W], or [B, C, 1, H, W]), in its layout: the transformer on
        2x2-packed patches at timestep sigma (the pipeline's t / 1000), the batch's text trimmed to its longest."""
        noisy = noised.noisy
        frames = noisy.dim() == 5
        pred = self.transformer_forward(denoiser, noisy[:, :, 0] if frames else noisy, noised.t, cond,
                                        self.reference_latents(batch))
        return pred if frames else pred[:, :, 0]

    def reference_latents(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """The batch's reference latents, packed after the target's tokens (qwen_image_edit); none here."""
        return []

    def transformer_forward(self, denoiser: Denoiser, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor],
                            references: list[torch.Tensor]) -> torch.Tensor:
        """The transformer on the 2x2-packed patches of `x` [B, C, H, W], followed along the sequence by those of
        each reference latent (img_shapes lists one (1, h/2, w/2) each, as QwenImageEditPlusPipeline does); the
        prediction for the target's tokens, unpacked to [B, C, 1, H, W]."""
        from diffusers import QwenImagePipeline

        b, c, h, w = x.shape
        dtype = denoiser.dtype
        embeds, mask = trim_text(cond["prompt_embeds"], cond.get("prompt_embeds_mask"))
        pack = QwenImagePipeline._pack_latents
        tokens = [pack(x.to(dtype), b, c, h, w)] + [pack(r.to(dtype), b, c, r.shape[-2], r.shape[-1])
                                                     for r in references]
        shapes = [(1, h // 2, w // 2)] + [(1, r.shape[-2] // 2, r.shape[-1] // 2) for r in references]
        packed = denoiser.forward(hidden_states=torch.cat(tokens, dim=1), timestep=t.to(dtype),
                                  encoder_hidden_states=embeds.to(dtype), encoder_hidden_states_mask=mask,
                                  img_shapes=[shapes] * b, return_dict=False)[0]
        scale = self.pipe.vae_scale_factor
        return QwenImagePipeline._unpack_latents(packed[:, :tokens[0].shape[1]], h * scale, w * scale, scale)

    # True: the last block's text-stream output is discarded (only the image stream reaches norm_out and proj_out),
    # so the LoRA layers after its attention on the text side (attn.to_add_out, txt_mlp.net.0.proj, txt_mlp.net.2)
    # are not in the graph and never get a gradient (attn.add_q_proj gets an all-zero one). DDP must then look for
    # unused parameters each step; without it the second step fails.
    unused_lora_parameters = True

    # -- samples ---------------------------------------------------------------------------
    def generate(self, prompt: str, seed: int) -> list:
        text = self.embeddings_for(prompt)
        embeds, mask = trim_text(text["prompt_embeds"], text["prompt_embeds_mask"], keep_full_mask=True)
        kwargs = dict(prompt_embeds=embeds, prompt_embeds_mask=mask)
        if self.cfg.sample.guidance_scale > 1:
            negative = self.embeddings_for(self.cfg.sample.negative_prompt)
            neg_embeds, neg_mask = trim_text(negative["prompt_embeds"], negative["prompt_embeds_mask"],
                                             keep_full_mask=True)
            kwargs.update(negative_prompt_embeds=neg_embeds, negative_prompt_embeds_mask=neg_mask)
        return self.pipeline_call(seed, **kwargs).images

    def pipeline_call(self, seed: int, **kwargs) -> Any:
        """The pipeline for one sample; sample.guidance_scale is Qwen-Image's true_cfg_scale (true CFG with the
        negative prompt), since its transformer has no guidance embedding for guidance_scale."""
        s = self.cfg.sample
        width, height = self.sample_size()
        generator = torch.Generator("cpu").manual_seed(seed)
        with torch.no_grad():
            return self.pipe(num_inference_steps=s.num_inference_steps, true_cfg_scale=s.guidance_scale,
                             width=width, height=height, generator=generator,
                             max_sequence_length=self.max_text_tokens, **kwargs)


class QwenImageAdapter(QwenImage, DiffusionAdapter):
    """Qwen-Image (text-to-image)."""
