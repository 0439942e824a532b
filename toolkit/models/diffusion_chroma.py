"""The `chroma` family (Chroma1-HD, diffusers ChromaPipeline): PEFT LoRA on Chroma's Flux-derived transformer.

What differs from Flux (diffusion_flow.FluxAdapter):
- Text: T5 alone (no CLIP, no pooled projection), encoded by the pipeline's own encode_prompt, which runs T5 with
  the tokenizer's attention mask and returns the mask Chroma's transformer attends with: each prompt's tokens and
  its first padding token, the rest masked (lodestones' "masking T5 padding tokens"). Both are cached at
  `max_text_tokens`; predict cuts the padding no cached text attends to before the forward, at one length for the
  whole run (the longest caption or sample prompt), so compiled blocks see one text shape. Exact: the cut tokens
  are masked keys and queries whose outputs are dropped, and the text's RoPE ids are all zero.
- The mask reaches the transformer as a boolean mask, in training and in samples alike. ChromaPipeline, given a
  prompt string, builds it in the text encoder's float dtype, and diffusers' attention then adds it to the
  scores as a bias (+1 where both tokens are kept) instead of masking; Chroma's reference code and ComfyUI (which
  does not pad at all) mask the padding out. The toolkit's samples pass the boolean mask to the pipeline
  (prompt_attention_mask), so they are what training saw.
- No guidance embedding: the distilled guidance approximator turns the timestep (guidance fixed at 0) into every
  block's modulation, so there is no train.guidance; samples use true classifier-free guidance with
  sample.negative_prompt (sample.guidance_scale, the pipeline's guidance_scale).
- LoRA targets: Flux's attention and feed-forward projections of the double and single blocks (Chroma's blocks
  have no modulation layers); all-linear adds the input embedders and the output projection. The approximator
  (distilled_guidance_layer) is left out: ComfyUI's Chroma names its layers otherwise (layers.N.in_layer) and
  its diffusers-name map has no entry for them, so a LoRA there would load in diffusers only.
- The LoRA file has Flux's keys (`transformer.<diffusers module>` with `.alpha`): ComfyUI's Chroma is a Flux model
  to its LoRA loader (comfy.utils.flux_to_diffusers), and ChromaPipeline reads them with Flux's reader.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.models.diffusion_base import Denoiser, DiffusionAdapter
from toolkit.models.diffusion_flow import FLUX_TARGETS, FlowMatching, unpack_flux
from toolkit.models.lora import target_modules
from toolkit.models.lora_export import chroma_keys
from toolkit.models.objectives import Noised

CHROMA_ALL_LINEAR = "(x_embedder|context_embedder|proj_out|" + FLUX_TARGETS + ")"


class ChromaAdapter(FlowMatching, DiffusionAdapter):
    text_encoder_names = ("text_encoder",)
    text_keys = ("prompt_embeds", "prompt_attention_mask")
    max_text_tokens = 512  # the pipeline's default and its maximum
    transformer_key_style = staticmethod(chroma_keys)
    text_length = 0  # the text tokens every forward keeps: the longest cached text's (prepare_data); 0: per batch

    def pipeline_class(self):
        from diffusers import ChromaPipeline

        return ChromaPipeline

    def lora_target_modules(self) -> list[str] | str:
        return target_modules(self.cfg.network.target_modules, FLUX_TARGETS, CHROMA_ALL_LINEAR)

    def setup_training(self) -> None:
        super().setup_training()
        self.scheduler_shift()  # Flux's resolution-dependent shift, as the pipeline computes mu

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """prompt_embeds [B, max_text_tokens, 4096] (T5 run with the padding masked) and prompt_attention_mask
        [B, max_text_tokens] (1 = attended: the prompt's tokens and its first padding token)."""
        n = self.max_text_tokens
        embeds, _, mask, *_ = self.pipe.encode_prompt(captions, device=self.runtime.device,
                                                      do_classifier_free_guidance=False, max_sequence_length=n)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask.long()}

    def prepare_data(self):
        dataset = super().prepare_data()
        if dataset.text is not None:  # captions cached: no batch is longer than the longest cached text
            masks = [text["prompt_attention_mask"] for text in self.prompt_cache.values()]  # with the sample texts
            self.text_length = max(int(m.nonzero().max()) + 1 for m in masks)
        return dataset

    def cut_text(self, embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The text cut to the run's text_length, its mask as booleans; see the module docstring. Without cached
        captions (encoded every step) each batch is cut to its own longest, which reads the mask on the host."""
        n = self.text_length or int(mask.bool().any(dim=0).nonzero().max()) + 1
        return embeds[:, :n], mask[:, :n].bool()

    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        """The transformer on 2x2-packed latent patches at timestep sigma (the pipeline's t / 1000), the text
        cut to the run's text_length and masked as the pipeline's _prepare_attention_mask extends it over the
        image tokens; the velocity comes back unpacked."""
        from diffusers import ChromaPipeline

        b, c, h, w = noised.noisy.shape
        dtype, device = denoiser.dtype, noised.noisy.device
        embeds, mask = self.cut_text(cond["prompt_embeds"], cond["prompt_attention_mask"])
        packed = ChromaPipeline._pack_latents(noised.noisy.to(dtype), b, c, h, w)
        mask = torch.cat([mask, torch.ones(b, packed.shape[1], dtype=torch.bool, device=device)], dim=1)
        pred = denoiser.forward(
            hidden_states=packed, timestep=noised.t.to(dtype), encoder_hidden_states=embeds.to(dtype),
            txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
            img_ids=self.constant(("img_ids", h, w, dtype),
                                  lambda: ChromaPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", dtype)),
            attention_mask=mask, return_dict=False)[0]
        return unpack_flux(pred, b, c, h, w)

    def generate(self, prompt: str, seed: int) -> list:
        kwargs = self.pipeline_text(self.embeddings_for(prompt))
        if self.cfg.sample.guidance_scale > 1:
            negative = self.pipeline_text(self.embeddings_for(self.cfg.sample.negative_prompt))
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"],
                          negative_prompt_attention_mask=negative["prompt_attention_mask"])
        return self.pipeline_call(seed, **kwargs).images

    def pipeline_text(self, text: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A cached prompt as the pipeline takes it: cut as in training, with its mask as booleans."""
        embeds, mask = self.cut_text(text["prompt_embeds"], text["prompt_attention_mask"])
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}
