"""The `z_image` family (Z-Image / Z-Image-Turbo, diffusers ZImagePipeline): PEFT LoRA on the single-stream DiT.

What differs from Flux / Qwen-Image:
- Text: Qwen3's second-to-last hidden state over its chat template (a user turn and the generation prompt), the
  padding dropped: the pipeline hands the transformer one [tokens, hidden] tensor per prompt. They are cached padded
  to `max_text_tokens` with a mask, so cached items stack into a batch, and cut back to each prompt's own tokens
  before the forward.
- Latents: the Flux VAE (16 channels, (z - shift_factor) * scaling_factor), [B, 16, H/8, W/8]; the transformer
  takes a list of [16, 1, H/8, W/8] latents (one frame) and patchifies them 2x2 itself.
- Time runs the other way: the transformer's t is 1 - sigma (1 = clean), and it predicts x0 - noise; the pipeline
  negates that into the scheduler's velocity, and so does `predict`.
- Sigma shift: the scheduler config's: Z-Image-Turbo's is a fixed shift of 3.0 (use_dynamic_shifting false, so the
  mu the pipeline passes is ignored); a config with use_dynamic_shifting gets Flux's resolution-dependent mu.
- Samples: Turbo samples without guidance (sample.guidance_scale 0); above 0 the pipeline runs classifier-free
  guidance with sample.negative_prompt.
- The LoRA file holds the diffusers module names under `diffusion_model.` with `.alpha` keys, which ComfyUI's
  Lumina2 / Z-Image model and diffusers' Z-Image reader both map (lora_export.z_image_keys).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from toolkit.models.diffusion_base import Denoiser, DiffusionAdapter
from toolkit.models.diffusion_flow import FlowMatching
from toolkit.models.lora import target_modules
from toolkit.models.lora_export import z_image_keys
from toolkit.models.objectives import Noised

# Attention and SwiGLU feed-forward of every block (the noise and context refiners and the joint layers).
Z_IMAGE_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
# ... and each modulated block's AdaLN projection (4 * dim outputs); a regex (PEFT full-matches a string), since the
# final layer's adaLN_modulation.0 is its SiLU.
Z_IMAGE_ALL_LINEAR = (r".*(layers|noise_refiner|context_refiner)\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)"
                      r"|feed_forward\.w[123]|adaLN_modulation\.0)")


def in_z_image_blocks(name: str) -> bool:
    """Linear layers of the repeated blocks, which the memory plan quantizes (embedders and final layer stay)."""
    return name.startswith(("layers.", "noise_refiner.", "context_refiner."))


def per_prompt(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each prompt's own token embeddings ([tokens, hidden]), as the pipeline passes them to the transformer."""
    return [e[m.bool()] for e, m in zip(embeds, mask)]


class ZImageAdapter(FlowMatching, DiffusionAdapter):
    text_encoder_names = ("text_encoder",)
    text_keys = ("prompt_embeds", "prompt_embeds_mask")
    max_text_tokens = 512  # the pipeline's default max_sequence_length
    transformer_key_style = staticmethod(z_image_keys)
    quantized_layer = staticmethod(in_z_image_blocks)

    def pipeline_class(self):
        from diffusers import ZImagePipeline

        return ZImagePipeline

    def lora_target_modules(self) -> list[str] | str:
        return target_modules(self.cfg.network.target_modules, Z_IMAGE_TARGETS, Z_IMAGE_ALL_LINEAR)

    def setup_training(self) -> None:
        super().setup_training()
        self.scheduler_shift()  # the scheduler's shift (Turbo: fixed 3.0), as the pipeline samples with it

    # -- text ------------------------------------------------------------------------------
    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """prompt_embeds [B, max_text_tokens, hidden] and prompt_embeds_mask [B, max_text_tokens] (1 = token)."""
        n = self.max_text_tokens
        # encode_prompt writes the chat-templated prompts into the list it is given: hand it a copy.
        embeds, _ = self.pipe.encode_prompt(list(captions), device=self.runtime.device,
                                            do_classifier_free_guidance=False, max_sequence_length=n)
        lengths = torch.tensor([len(e) for e in embeds], device=embeds[0].device)
        mask = (torch.arange(n, device=lengths.device)[None] < lengths[:, None]).long()
        return {"prompt_embeds": torch.stack([F.pad(e, (0, 0, 0, n - len(e))) for e in embeds]),
                "prompt_embeds_mask": mask}

    # -- loss ------------------------------------------------------------------------------
    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        """The velocity (noise - x0) for `noised.noisy` [B, 16, H, W]: the transformer at t = 1 - sigma on one-frame
        latents and each prompt's own tokens, its x0 - noise prediction negated."""
        dtype = denoiser.dtype
        latents = list(noised.noisy.to(dtype).unsqueeze(2).unbind(0))  # [16, 1, H, W] each
        text = per_prompt(cond["prompt_embeds"].to(dtype), cond["prompt_embeds_mask"])
        # t stays fp32, as the pipeline passes it: the embedder computes its frequencies in fp32 from t * 1000.
        out = denoiser.forward(latents, 1 - noised.t.float(), text, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    # -- samples ---------------------------------------------------------------------------
    def generate(self, prompt: str, seed: int) -> list:
        kwargs = {"prompt_embeds": self.prompt_tokens(prompt)}
        if self.cfg.sample.guidance_scale > 0:  # the pipeline's classifier-free guidance needs the negative
            kwargs["negative_prompt_embeds"] = self.prompt_tokens(self.cfg.sample.negative_prompt)
        return self.pipeline_call(seed, **kwargs).images

    def prompt_tokens(self, prompt: str) -> list[torch.Tensor]:
        text = self.embeddings_for(prompt)
        return per_prompt(text["prompt_embeds"], text["prompt_embeds_mask"])
