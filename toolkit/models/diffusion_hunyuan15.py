"""The `hunyuan_video15` family: HunyuanVideo 1.5 text-to-video and image-to-video (diffusers'
HunyuanVideo15Pipeline / HunyuanVideo15ImageToVideoPipeline), PEFT LoRA on HunyuanVideo15Transformer3DModel.

What the pipelines do, and so what training does:
- Latents: the causal 3D VAE (x16 space, x4 time, 32 channels) times its scaling_factor (the pipeline divides by
  it before decoding; no shift, no per-channel statistics). Clips take 4k+1 frames (toolkit/data/video.py).
- Text: two encoders, both cached. Qwen2.5-VL's third-last hidden state of the chat-templated prompt (the system
  prefix cut by count, padded to 1000 tokens) with its mask, and the ByT5 glyph encoder over the prompt's quoted
  text ('a sign saying "OPEN"'; all zeros and masked out when the prompt quotes nothing) with its mask; the
  pipeline's own `encode_prompt` produces both.
- The transformer's input is [noisy latents | condition latents | mask] (32 + 32 + 1 channels) and it
  cross-attends to SigLIP image tokens. Text-to-video: condition, mask and image tokens are zeros (the model
  then masks the image tokens out), as the pipeline passes them. Image-to-video (model.task: i2v): the start
  image's VAE latent (the posterior mode, as the pipeline's `_get_image_latents`) fills the first latent frame of
  the condition, the mask is 1 there, and the image tokens are SigLIP's last hidden state of the start image
  (the pipeline's `_get_image_embeds`); both are cached with the clip's latents. The loss covers every frame.
- Masked tokens are left out of the forward: the Qwen and ByT5 texts are cut to the longest cached text's
  tokens (their padding is at the end and masked; the transformer places its text tokens without positions), and
  text-to-video passes one zero image token, not the pipeline's 729 (all masked out). Exact (batches with padding
  left: one text shape a run; see below for the others); `tests/test_hunyuan15.py` checks predict against the pipeline's full-length step.
- Attention without the S x S mask: when no token of the batch is padding (`valid_lengths`: batch 1 always)
  each text is cut to its own tokens, text-to-video's image token and an all-masked ByT5 text are left out, and
  the blocks' processor (hunyuan15_attention.py) passes attn_mask None, so SDPA may pick flash. Exact (a masked
  key adds nothing); a batch with padding left keeps the run's text lengths and diffusers' masked processor.
  Compiled blocks count each cached text length pair as a batch shape (`memory.sequence_variants`).
- Timestep: 1000 * sigma, sigmas shifted by the scheduler's fixed shift (train.flow_shift to override).
- Samples: the pipeline's own call on the cached embeddings, classifier-free guidance by its guider at
  sample.guidance_scale with sample.negative_prompt. Image-to-video samples take their size from the start image
  (the pipeline picks the bucket of transformer.config.target_size closest to its aspect ratio).

The pipelines have no load_lora_weights: the LoRA file (diffusers names, the scale folded into lora_A) is read by
the transformer's own `load_lora_adapter` (diffusers' PEFT loader); save.format=comfyui writes ComfyUI's
HunyuanVideo names beside it (lora_export.hunyuan15_comfy_keys: q/k/v joined into one qkv LoRA).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from toolkit.data.augment import View
from toolkit.errors import UserError
from toolkit.models.diffusion_base import Denoiser, DiffusionAdapter
from toolkit.models.diffusion_flow import FlowMatching
from toolkit.models.hunyuan15_attention import MaskFreeAttention, install as install_attention
from toolkit.models.lora import target_modules
from toolkit.models.lora_export import Factors, diffusers_keys_scaled, hunyuan15_comfy_keys
from toolkit.models.objectives import Noised
from toolkit.models.wan_i2v import resolve_task, sample_image, sample_images, to_pil

I2V_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"
_BLOCK = r"transformer_blocks\.\d+\."
_ATTENTION_FF = (r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
                 r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2)")
# The dual-stream blocks' attention and feed-forward projections (the text refiner's blocks keep their names
# out: they have to_q ... too); all-linear adds the blocks' modulation.
HUNYUAN15_TARGETS = f"{_BLOCK}({_ATTENTION_FF})"
HUNYUAN15_ALL_LINEAR = f"{_BLOCK}({_ATTENTION_FF}|norm1\\.linear|norm1_context\\.linear)"
TEXT_KEYS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")


def valid_lengths(mask: torch.Tensor, mask_2: torch.Tensor) -> tuple[int, int] | None:
    """The Qwen and ByT5 tokens to keep when cutting leaves no padding in the batch: every text's attended tokens
    lead and the texts have as many (always so at batch 1; ByT5 may keep 0: no caption quotes text); None when
    padding remains. One read of the (B, tokens) masks a step."""
    lengths = []
    for m in (mask, mask_2):
        m = m.detach().to("cpu", torch.bool)
        n = int(m.sum(1).max())
        if not bool(m[:, :n].all()):
            return None
        lengths.append(n)
    return lengths[0], lengths[1]


def attention_note(task: str) -> str:
    """The start log line's word on the attention mask."""
    image = "the start image's SigLIP tokens kept" if task == "i2v" else "text-to-video's masked image token left out"
    return (f"no mask (SDPA free to pick flash / cuDNN) for a batch whose texts are as long (batch 1 always): texts "
            f"cut to their tokens, {image}; a batch with captions of different lengths keeps diffusers' S x S mask "
            "(exact, slower)")


def kept_tokens(mask: torch.Tensor) -> int:
    """The tokens a cached text keeps when cut: its attended ones when they lead (padding at the end), else all."""
    n = int(mask.sum())
    return n if bool(mask[:n].all()) else mask.shape[-1]


class HunyuanVideo15Adapter(FlowMatching, DiffusionAdapter):
    text_encoder_names = ("text_encoder", "text_encoder_2")
    text_keys = TEXT_KEYS
    transformer_key_style = staticmethod(diffusers_keys_scaled)  # the transformer's PEFT loader takes no `.alpha`
    task = "t2v"
    text_lengths: tuple[int, int] | None = None  # the Qwen and ByT5 tokens a forward keeps (prepare_data); None: all
    attention: MaskFreeAttention | None = None  # the blocks' processor (setup_training)
    # the text lengths a forward may take (memory.sequence_variants; prepare_data counts the cached texts' and the
    # padded one: a batch whose tokens are all valid keeps its own lengths for mask-free attention); uncached: many
    text_variants = 1_000

    def load(self, shard_base: bool = False) -> None:
        self.task, why = resolve_task(self.cfg.model.task, self.model_path, self.cfg.model.revision, I2V_PIPELINE)
        self.log(f"model.task: {self.task} ({why})")
        if self.task == "i2v":
            self.check_image_encoder()
        super().load(shard_base)

    def check_image_encoder(self) -> None:
        """Image-to-video needs the folder's SigLIP image encoder: a UserError before the pipeline loads."""
        from diffusers import DiffusionPipeline

        index = DiffusionPipeline.load_config(self.model_path, revision=self.cfg.model.revision)
        if not (index.get("image_encoder") or [None])[0]:
            raise UserError(f"model.task=i2v: {self.cfg.model.name_or_path} has no image_encoder (SigLIP)\n"
                            "  fix: use an image-to-video folder (hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v), "
                            "or model.task=t2v")

    def pipeline_class(self):
        from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

        return HunyuanVideo15ImageToVideoPipeline if self.task == "i2v" else HunyuanVideo15Pipeline

    def lora_target_modules(self) -> str:
        return target_modules(self.cfg.network.target_modules, HUNYUAN15_TARGETS, HUNYUAN15_ALL_LINEAR)

    def denoiser_blocks(self, name: str) -> list[torch.nn.Module]:
        """The dual-stream blocks (the patch embedder and text refiner, also in _no_split_modules, run once)."""
        return list(self.component(name).transformer_blocks)

    def setup_training(self) -> None:
        super().setup_training()
        transformer = self.pipe.transformer
        if self.task == "t2v" and transformer.config.get("task_type") == "i2v":
            self.log(f"note: {self.cfg.model.name_or_path}'s transformer was trained for image-to-video "
                     "(task_type i2v); training it text-to-video")
        self.shift = self.configured_shift(self.pipe.scheduler.config.get("shift", 1.0))
        self.log(f"flow matching: {self.timestep_sampling} sigmas shifted by {self.shift:g}"
                 + (" (train.flow_shift)" if self.cfg.train.flow_shift != "auto" else " (the scheduler's shift)"))
        self.image_tokens = (self.pipe.vision_num_semantic_tokens, transformer.config.image_embed_dim)
        self.attention = install_attention(transformer)
        self.sample_starts = sample_images(list(self.cfg.sample.images), self.sample_prompts(), self.task,
                                           self.cfg.model.name_or_path)
        if self.task == "i2v":
            self.log("image-to-video: the start image's latent as the first condition frame (mask 1 there), "
                     "its SigLIP tokens cross-attended")

    # -- data ------------------------------------------------------------------------------
    def scan(self, data, log) -> list:
        from toolkit.data.start_images import pair_start_images
        from toolkit.data.video import scan_clips

        return scan_clips(data, log, (lambda items: pair_start_images(items, log)) if self.task == "i2v" else None)

    def load_item(self, item, view: View) -> dict[str, torch.Tensor]:
        from toolkit.data.start_images import load_start_image
        from toolkit.data.video import load_clip

        loaded = {"pixels": load_clip(item, view), "crop": torch.tensor(view.top_left)}
        if self.task == "i2v":
            start = load_start_image(item, view) if item.start_image is not None else loaded["pixels"][:, 0]
            loaded["image"] = start
        return loaded

    def encode_view(self, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().encode_view(loaded)
        if self.task == "i2v":  # the start image's condition, cached with the clip's latents
            out.update({k: v[0] for k, v in self.encode_start(loaded["image"][None]).items()})
        return out

    def latent_key_parts(self, item) -> tuple:
        return ("start-image", item.start_hash or "first-frame") if self.task == "i2v" else ()

    def _prepare_data(self):
        if self.task != "i2v":
            return super()._prepare_data()
        encoder = self.pipe.image_encoder
        encoder.to(self.runtime.device)
        try:
            return super()._prepare_data()
        finally:
            if self.cfg.data.cache_latents:
                encoder.to("cpu")

    def encode_start(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Start images (B, 3, H, W in [-1, 1]) as `start_latent` (B, 32, 1, h, w: the VAE's mode times its
        scaling factor) and `image_embeds` (SigLIP's last hidden state), as the pipeline computes them."""
        pipe, device = self.pipe, self.runtime.device
        with torch.no_grad():
            latent = self.encode_pixels(images[:, :, None])
            embeds = torch.cat([pipe._get_image_embeds(pipe.image_encoder, pipe.feature_extractor, to_pil(image),
                                                       device).float() for image in images])
        return {"start_latent": latent, "image_embeds": embeds}

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask, embeds_2, mask_2 = self.pipe.encode_prompt(captions, device=self.runtime.device,
                                                                 dtype=torch.float32, batch_size=len(captions))
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask.long(), "prompt_embeds_2": embeds_2,
                "prompt_embeds_mask_2": mask_2.long()}

    def prepare_data(self):
        dataset = super().prepare_data()
        if dataset.text is not None:  # captions cached: no batch has more text tokens than the cached texts
            texts = list(self.prompt_cache.values())  # the captions and the sample prompts
            self.text_variants = 1 + len({tuple(kept_tokens(t[key]) for key in ("prompt_embeds_mask",
                                                                                  "prompt_embeds_mask_2"))
                                          for t in texts})  # each text's own lengths (mask-free), the padded ones
            self.text_lengths = tuple(max(max(kept_tokens(t[key]) for t in texts), 1)
                                      for key in ("prompt_embeds_mask", "prompt_embeds_mask_2"))
            self.log(f"text: {self.text_lengths[0]} Qwen2.5-VL and {self.text_lengths[1]} ByT5 tokens a forward "
                     "(the longest cached text's; the rest is masked padding)")
        self.log("attention: " + attention_note(self.task))
        return dataset

    # -- loss ------------------------------------------------------------------------------
    def conditioning(self, batch: dict[str, Any], modules) -> dict[str, torch.Tensor]:
        cond = super().conditioning(batch, modules)
        if self.task != "i2v":
            return cond
        if "start_latent" in batch:
            return {**cond, "start_latent": self.to_device(batch["start_latent"]),
                    "image_embeds": self.to_device(batch["image_embeds"])}
        return {**cond, **self.encode_start(batch["image"])}

    def model_inputs(self, noisy: torch.Tensor, cond: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """[noisy | condition | mask] and the image tokens: zeros for text-to-video; for image-to-video the start
        latent in the first frame of the condition, the mask 1 there (the pipeline's prepare_cond_latents_and_mask)."""
        b, c, f, h, w = noisy.shape
        condition = torch.zeros_like(noisy)
        mask = torch.zeros(b, 1, f, h, w, dtype=noisy.dtype, device=noisy.device)
        if "start_latent" in cond:
            condition[:, :, :1] = cond["start_latent"].to(noisy.dtype)
            mask[:, :, 0] = 1.0
            image_embeds = cond["image_embeds"]
        else:  # one zero token: the model masks text-to-video's image tokens out, however many
            image_embeds = self.constant(("image_embeds", b, noisy.dtype),
                                         lambda: torch.zeros(b, 1, self.image_tokens[1], dtype=noisy.dtype))
        return torch.cat([noisy, condition, mask], dim=1), image_embeds

    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        """The flow velocity at timestep 1000 * sigma, as the pipeline's transformer call."""
        dtype = denoiser.dtype
        hidden, image_embeds = self.model_inputs(noised.noisy.to(dtype), cond)
        lengths = valid_lengths(cond["prompt_embeds_mask"], cond["prompt_embeds_mask_2"])
        if lengths is None:  # padding left: the run's text lengths, the image token masked (the S x S mask)
            n, n_2 = self.text_lengths or (cond["prompt_embeds"].shape[1], cond["prompt_embeds_2"].shape[1])
        else:  # every token valid: the batch's texts cut to their tokens, text-to-video's masked token left out
            n, n_2 = lengths
            image_embeds = image_embeds if "start_latent" in cond else image_embeds[:, :0]
        if self.attention is not None:
            self.attention.valid_tokens = None if lengths is None else n + n_2 + image_embeds.shape[1]
        return denoiser.forward(hidden_states=hidden, timestep=(noised.t * 1000).to(dtype),
                                encoder_hidden_states=cond["prompt_embeds"][:, :n].to(dtype),
                                encoder_attention_mask=cond["prompt_embeds_mask"][:, :n],
                                encoder_hidden_states_2=cond["prompt_embeds_2"][:, :n_2].to(dtype),
                                encoder_attention_mask_2=cond["prompt_embeds_mask_2"][:, :n_2],
                                image_embeds=image_embeds.to(dtype), return_dict=False)[0]

    # -- sampling --------------------------------------------------------------------------
    def generate(self, prompt: str, seed: int) -> list:
        s = self.cfg.sample
        text, negative = self.embeddings_for(prompt), self.embeddings_for(s.negative_prompt)
        kwargs = {k: v for k, v in text.items()}
        kwargs.update({f"negative_{k}": v for k, v in negative.items()})
        frames = s.num_frames or self.cfg.data.num_frames
        if self.sample_starts:  # sample i starts from image i (pipeline seeds go sample.seed + i), or the only one
            index = (seed - s.seed) if len(self.sample_starts) > 1 else 0
            kwargs["image"] = sample_image(self.sample_starts[index], self.sample_size())
        else:
            kwargs["width"], kwargs["height"] = self.sample_size()
        self.pipe.guider.guidance_scale = s.guidance_scale
        if self.attention is not None:  # the pipeline's padded call: diffusers' masked attention
            self.attention.valid_tokens = None
        encoder = getattr(self.pipe, "image_encoder", None)
        if encoder is not None:
            encoder.to(self.runtime.device)
        try:
            with torch.no_grad():
                out = self.pipe(num_inference_steps=s.num_inference_steps, num_frames=frames, output_type="pil",
                                generator=torch.Generator("cpu").manual_seed(seed), **kwargs)
        finally:
            if encoder is not None and self.cfg.data.cache_latents:
                encoder.to("cpu")
        return list(out.frames[0])

    # -- LoRA files ------------------------------------------------------------------------
    def copy_state(self, fmt: str, factors: dict[str, Factors] | None) -> dict[str, torch.Tensor] | None:
        """save.format=comfyui: ComfyUI's HunyuanVideo names (hunyuan15_comfy_keys: q, k and v fused). A LoKr / LoHa
        has no ComfyUI-named writer here, and ComfyUI maps no diffusers names for HunyuanVideo 1.5 (a ValueError)."""
        if fmt != "comfyui":
            return None
        if factors is None:
            raise ValueError(f"ComfyUI maps no diffusers names for HunyuanVideo 1.5, and network.type="
                             f"{self.cfg.network.type} has no ComfyUI-named writer here")
        (transformer,) = factors.values()
        return hunyuan15_comfy_keys(transformer)

    def write_diffusers_layout(self, folder: Path, names: list[str], dtype: torch.dtype) -> None:
        """What the key style cannot hold (DoRA's magnitudes): PEFT's own keys under `transformer.`, each scale
        folded into lora_A, which load_lora_adapter reads at scale 1 (the pipelines have no save_lora_weights)."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        from toolkit.models.diffusion_files import LORA_FILE

        (name,) = names
        model = self.network[name]
        state = {}
        for key, tensor in get_peft_model_state_dict(model).items():
            tensor = tensor.detach().to("cpu", torch.float32)
            if key.endswith(".lora_A.weight"):
                tensor = tensor * model.get_submodule(key[:-len(".lora_A.weight")]).scaling["default"]
            state[f"transformer.{key}"] = tensor.to(dtype).contiguous()
        save_file(state, str(folder / LORA_FILE), metadata=self.lora_metadata())

    def _load_lora_file(self, file: Path, names: list[str], partial: bool, label: str, model: str,
                        load_kwargs: dict) -> None:
        """The transformer's own load_lora_adapter reads the file (the pipelines have no load_lora_weights)."""
        from safetensors.torch import load_file

        from toolkit.models.lora_loading import (DEFAULT, LOADED, copy_loaded_adapter, has_loaded, reading_lora,
                                                 refuse_unplaced, unplaced_lora_keys)

        transformer = self.component("transformer")
        state = load_file(str(file))
        if not any(key.startswith("transformer.") for key in state):
            raise UserError(f"{label}: none of its weights is a LoRA of the {model} (no transformer.* keys)\n"
                            "  fix: give a LoRA trained for this model (pytorch_lora_weights.safetensors)")
        try:
            with unplaced_lora_keys() as unplaced, reading_lora(label, model):
                transformer.load_lora_adapter(state, prefix="transformer", adapter_name=LOADED)
            refuse_unplaced(label, unplaced, model)
            copy_loaded_adapter(transformer, label, "transformer", partial, self.log)
        finally:
            if has_loaded(transformer):
                transformer.delete_adapters(LOADED)
            transformer.set_adapter(DEFAULT)

