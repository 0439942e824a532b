"""The `flux_kontext` family (FLUX.1 Kontext [dev], diffusers FluxKontextPipeline): Flux's LoRA (diffusion_flow.py)
trained on targets with one reference image each (docs/edit.md), conditioned as the pipeline conditions it:

- The reference's VAE latents (Flux's shift and scale) are 2x2-packed and follow the image's tokens along the
  sequence, with position ids whose first coordinate is 1 (the image's are 0); the loss is on the image's tokens.
- The reference keeps its aspect ratio at about data.resolution squared, sides multiples of 16 (the pipeline picks
  the nearest of its preferred ~1024 x 1024 resolutions at FLUX.1's 1024 px). Its latents are cached with the
  target's (or encoded each step with data.cache_latents off). The text is Flux's and cached as Flux's.
- Samples: sample.references gives each prompt its reference, passed as the pipeline's `image`.
- The LoRA file is Flux's (diffusers names with alphas), which FluxKontextPipeline.load_lora_weights and
  ComfyUI read as they read a Flux LoRA.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.config.families import family_spec
from toolkit.data.references import ReferenceSizing, open_image, sample_references
from toolkit.models.diffusion_base import DiffusionAdapter
from toolkit.models.diffusion_flow import Flux
from toolkit.models.references import References, ReferencedTargets


class FluxKontextAdapter(ReferencedTargets, Flux, DiffusionAdapter):
    def pipeline_class(self):
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline

    def setup_training(self) -> None:
        super().setup_training()
        fewest, most = family_spec(self.cfg.model.family).references
        self.references = References(ReferenceSizing(multiple=16, max_references=most), self.encode_pixels,
                                     self.to_device, required=fewest > 0, data=self.cfg.data)
        self.sample_refs = sample_references([list(r) for r in self.cfg.sample.references], self.sample_prompts(),
                                             required=fewest > 0)

    # -- references for predict ------------------------------------------------------------
    def reference_latents(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        return self.references.latents(batch)

    # -- samples ---------------------------------------------------------------------------
    def generate(self, prompt: str, seed: int) -> list:
        """The Kontext pipeline on the prompt's cached embeddings and its reference (sample.references), resized
        by the pipeline to its preferred resolution."""
        text = self.embeddings_for(prompt)
        (image,) = [open_image(path) for path in self.sample_refs[seed - self.cfg.sample.seed][:1]]
        return self.pipeline_call(seed, prompt_embeds=text["prompt_embeds"], image=image,
                                  pooled_prompt_embeds=text["pooled_prompt_embeds"]).images
