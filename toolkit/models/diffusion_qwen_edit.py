"""The `qwen_image_edit` family (Qwen-Image-Edit-2509 / 2511, diffusers QwenImageEditPlusPipeline): Qwen-Image's
LoRA (diffusion_qwen.py) trained on targets with 1-3 reference images (docs/edit.md), conditioned as the pipeline
conditions them:

- Each reference's VAE latents (normalised as the target's) are 2x2-packed and follow the target's tokens along
  the sequence; img_shapes lists (1, h/2, w/2) for the target and then for each reference (their RoPE positions);
  the loss is on the target's tokens only. References keep their aspect ratio at about data.resolution squared
  (the pipeline's 1024 x 1024 area at Qwen-Image's 1024 px), sides multiples of 32.
- The Qwen2.5-VL text encoder sees the references too: the prompt is "Picture 1: <image> Picture 2: <image> ..."
  + the caption in the edit template, each reference at about 384 x 384 (the pipeline's CONDITION_IMAGE_SIZE),
  through the pipeline's own encode_prompt. These embeddings depend on the item's references, so they are cached
  with its latents, one entry per view (a flipped view flips its references), padded to 1024 tokens.
- Captions therefore stay fixed: caption dropout, tag shuffle / dropout and uncached latents or text are refused.
- eval.path's images carry their references (the same layout rules inside the eval folder), their text encoded
  with them as in training. Output preservation (train.dop_class) encodes each item's class caption with the
  item's references too, cached beside its caption's (`dop.prompt_embeds`), so the base and LoRA predictions of
  the preservation pass see the sample's references.
- Samples: sample.references gives each prompt its references; the pipeline encodes the prompt with them, so the
  text encoder is kept (in CPU memory between samples) rather than freed after caching.
- The LoRA file is Qwen-Image's (diffusers names under diffusion_model. with alphas), which the edit pipeline's
  load_lora_weights and ComfyUI's Qwen-Image-Edit read as the base model's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from toolkit.config.families import family_spec
from toolkit.data.augment import View
from toolkit.data.images import load_image_view
from toolkit.data.references import ReferenceSizing, open_image, sample_references
from toolkit.errors import UserError
from toolkit.models.diffusion_base import DiffusionAdapter
from toolkit.models.diffusion_qwen import QwenImage
from toolkit.models.references import References

CONDITION_AREA = 384 * 384  # QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE: what the text encoder sees


def condition_size(size: tuple[int, int]) -> tuple[int, int]:
    """The pipeline's calculate_dimensions(CONDITION_IMAGE_SIZE, ratio): about 384 x 384, multiples of 32."""
    ratio = size[0] / size[1]
    width = math.sqrt(CONDITION_AREA * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


def class_key(item) -> tuple:
    """A training item as its dataset holds it (an eval item of another folder is not one)."""
    return item.path, item.bucket, item.content_hash, item.dataset


class QwenImageEditAdapter(QwenImage, DiffusionAdapter):
    max_text_tokens = 1024  # the pipeline's tokenizer_max_length: the prompt holds each reference's image tokens
    samples_need_text_encoders = True

    def pipeline_class(self):
        from diffusers import QwenImageEditPlusPipeline

        return QwenImageEditPlusPipeline

    def pipeline_kwargs(self) -> dict:
        from toolkit.data.qwen_vl_processor import processor_override

        return processor_override(self.model_path, self.cfg.model.revision)

    def setup_training(self) -> None:
        super().setup_training()
        # Settings that would change a caption per step are refused before the model loads (FamilySpec.fixed_captions,
        # plan/static_checks.py): its text is encoded with the references and cached with the latents.
        self.dop_captions: list[str | None] | None = None  # train.dop_class: each training item's class caption
        self.class_caption_of: dict[tuple, str] = {}  # class_key(item) -> what its preservation pass is encoded with
        fewest, most = family_spec(self.cfg.model.family).references
        self.references = References(ReferenceSizing(multiple=32, max_references=most), self.encode_pixels,
                                     self.to_device, required=fewest > 0, data=self.cfg.data)
        self.sample_refs = sample_references([list(r) for r in self.cfg.sample.references], self.sample_prompts(),
                                             required=fewest > 0)

    # -- data ------------------------------------------------------------------------------
    def scan(self, data, log) -> list:
        return self.references.scan(data, log)

    def scan_datasets(self, settings: list) -> list:
        """The datasets' items; with train.dop_class, each one's class caption, noted now because it is encoded with
        the item's references into its latent cache entry (`dop.prompt_embeds`) as its caption is."""
        items = super().scan_datasets(settings)
        self.dop_captions = self.class_captions(items, settings)
        # a regularisation image (no class caption) keeps its own caption there; its preservation is masked off
        self.class_caption_of = {} if self.dop_captions is None else {
            class_key(item): caption if caption is not None else item.caption
            for item, caption in zip(items, self.dop_captions)}
        return items

    def load_item(self, item, view: View) -> dict[str, Any]:
        """The target's view, its references' pixels, and what the text encoder reads: the caption and each
        reference at the condition size (as PIL images, mirrored with the view)."""
        from PIL import Image

        loaded = self.references.load(item, view, load_image_view(item, view))
        images = []
        for path in item.references:
            image = open_image(path)
            image = image.resize(condition_size(image.size), Image.Resampling.LANCZOS)  # the pipeline's resample
            images.append(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if view.flip else image)
        key = class_key(item)
        classes = {"class_caption": self.class_caption_of[key]} if key in self.class_caption_of else {}
        return {**loaded, "caption": item.caption, "condition_images": images, **classes}

    def encode_view(self, loaded: dict[str, Any]) -> dict[str, torch.Tensor]:
        text = self.encode_edit_text(loaded["caption"], loaded["condition_images"])
        if "class_caption" in loaded:  # output preservation: the class caption with the same references
            dop = self.encode_edit_text(loaded["class_caption"], loaded["condition_images"])
            text.update({f"dop.{key}": value for key, value in dop.items()})
        return {**super().encode_view(loaded), **self.references.encoded(loaded), **text}

    def latent_key_parts(self, item) -> tuple:
        dop = ("dop-text", self.class_caption_of[class_key(item)]) if class_key(item) in self.class_caption_of else ()
        return self.references.key_parts(item) + ("edit-text", item.caption, self.max_text_tokens) + dop

    def encode_edit_text(self, caption: str, images: list) -> dict[str, torch.Tensor]:
        """prompt_embeds [max_text_tokens, hidden] and its mask for one caption with its references in the edit
        template (the pipeline's own encode_prompt), unbatched."""
        n = self.max_text_tokens
        with torch.no_grad():
            embeds, mask = self.pipe.encode_prompt([caption], image=images, device=self.runtime.device)
        length = embeds.shape[1]
        if length > n:
            raise UserError(f"data.path: the caption {caption[:60]!r} with its {len(images)} reference(s) is "
                            f"{length} tokens, over the pipeline's {n}\n  fix: shorten the caption")
        if mask is None:
            mask = torch.ones(1, length, dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": F.pad(embeds[0], (0, 0, 0, n - length)),
                "prompt_embeds_mask": F.pad(mask[0].long(), (0, n - length))}

    def _prepare_data(self):
        """The text encoder on the device while the latent cache is filled (the text is encoded with each view)."""
        for encoder in self.text_encoders:
            encoder.to(self.runtime.device)
        try:
            return super()._prepare_data()
        finally:
            for encoder in self.text_encoders:
                encoder.to("cpu")

    def _prepare_text(self, dataset, items, rules, root, settings) -> None:
        dataset.dop_captions = self.dop_captions
        self.log("text embeddings: encoded with each target's references and cached with its latents")

    def reference_latents(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        return self.references.latents(batch)

    # -- samples ---------------------------------------------------------------------------
    def generate(self, prompt: str, seed: int) -> list:
        """The edit pipeline on the prompt and its references (sample.references), true CFG with the negative
        prompt when sample.guidance_scale > 1."""
        index = seed - self.cfg.sample.seed
        images = [open_image(path) for path in self.sample_refs[index]]
        negative = {"negative_prompt": self.cfg.sample.negative_prompt} if self.cfg.sample.guidance_scale > 1 else {}
        return self.pipeline_call(seed, prompt=prompt, image=images, **negative).images
