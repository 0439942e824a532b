"""The video families `wan21` (Wan 2.1 T2V and I2V) and `wan22` (Wan 2.2: A14B with two experts, T2V or I2V, or
TI2V-5B). Image-to-video (model.task, the start-image condition) is in wan_i2v.py.

Clips (toolkit.data.video) are encoded by the Wan VAE (time / 4, space / 8 or / 16) and normalised with its
per-channel latent statistics; the transformer predicts the flow velocity at timestep 1000 * sigma.

Wan 2.2 A14B splits the denoising between a high-noise expert (`transformer`, timesteps at or above
boundary_ratio * 1000) and a low-noise expert (`transformer_2`). `train.experts` picks which get a LoRA;
with both, training alternates every `train.expert_switch_every` steps, each expert seeing only sigmas of
its own range. With `model.expert_offload` the idle expert's frozen weights wait in CPU memory; LoRA
weights (and so their optimizer state) never leave the device. With `model.block_swap` too, the resident
expert streams its swapped blocks in (models/block_swap.py) and the idle one gives its GPU slots back. Each expert's LoRA is saved on its own.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from toolkit.data.augment import View
from toolkit.errors import UserError
from toolkit.models.diffusion_base import Denoiser, DiffusionAdapter
from toolkit.models.diffusion_files import lora_file_in
from toolkit.models.diffusion_flow import FlowMatching
from toolkit.models.lora import target_modules
from toolkit.models.lora_export import wan_native_keys
from toolkit.models.objectives import Noised
from toolkit.models.wan_i2v import StartImages, resolve_task, sample_image, sample_images, start_images_for

WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
WAN_ALL_LINEAR = WAN_TARGETS + ["add_k_proj", "add_v_proj", "time_embedder.linear_1", "time_embedder.linear_2",
                                "time_proj", "text_embedder.linear_1", "text_embedder.linear_2"]
EXPERT_FOLDERS = {"transformer": "high_noise", "transformer_2": "low_noise"}


class Wan(FlowMatching):
    """What the Wan families share, mixed in beside DiffusionAdapter (with FlowMatching): the task (text- or
    image-to-video), clips and their latents, the text encoder, the transformer's forward and the samples."""

    transformer_key_style = staticmethod(wan_native_keys)
    text_encoder_names = ("text_encoder",)
    max_text_tokens = 512
    task = "t2v"                              # model.task, resolved in load()
    start_images: StartImages | None = None   # image-to-video: the start-image condition (wan_i2v.py)

    def load(self, shard_base: bool = False) -> None:
        self.task, why = resolve_task(self.cfg.model.task, self.model_path, self.cfg.model.revision)
        self.log(f"model.task: {self.task} ({why})")
        super().load(shard_base)

    def pipeline_class(self):
        from diffusers import WanImageToVideoPipeline, WanPipeline

        return WanImageToVideoPipeline if self.task == "i2v" else WanPipeline

    def sample_multiple(self) -> int:
        """The VAE's spatial downscale times the patch: 16 for Wan 2.1 and 2.2 A14B, 32 for Wan 2.2 TI2V-5B (its VAE
        downscales 16x), as the pipeline rounds a size."""
        name = next(n for n in ("transformer", "transformer_2") if getattr(self.pipe, n, None) is not None)
        _, p_h, p_w = self.component(name).config.patch_size
        return max(self.spec.sample_multiple, self.pipe.vae_scale_factor_spatial * max(p_h, p_w))

    def lora_target_modules(self) -> list[str]:
        return target_modules(self.cfg.network.target_modules, WAN_TARGETS, WAN_ALL_LINEAR)

    def setup_training(self) -> None:
        super().setup_training()
        self.shift = self.configured_shift(self.pipe.scheduler.config.get("flow_shift", None) or 1.0)
        self.expand_timesteps = bool(self.pipe.config.get("expand_timesteps", False))
        self.log(f"flow matching: {self.timestep_sampling} sigmas shifted by {self.shift:g}"
                 + (" (train.flow_shift)" if self.cfg.train.flow_shift != "auto" else " (the scheduler's flow_shift)"))
        name = self.cfg.model.name_or_path
        self.start_images = start_images_for(self.pipe, self.task, name, self.runtime.device, self.log)
        self.sample_starts = sample_images(list(self.cfg.sample.images), self.sample_prompts(), self.task, name)
        if self.start_images is not None:
            self.objective = self.start_images.objective(self.objective)
            self.log(f"image-to-video: {self.start_images.describe()}")

    # -- data ------------------------------------------------------------------------------
    def scan(self, data, log) -> list:
        from toolkit.data.video import scan_clips

        return scan_clips(data, log, self.start_images.items if self.start_images else None)

    def load_item(self, item, view: View) -> dict[str, torch.Tensor]:
        from toolkit.data.video import load_clip

        loaded = {"pixels": load_clip(item, view), "crop": torch.tensor(view.top_left)}
        return self.start_images.load(item, view, loaded) if self.start_images else loaded

    def encode_view(self, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().encode_view(loaded)
        if self.start_images:  # the start image's condition, cached with the clip's latents
            out.update({k: v[0] for k, v in self.start_images.encode(loaded["image"][None],
                                                                     loaded["pixels"].shape[1]).items()})
        return out

    def latent_key_parts(self, item) -> tuple:
        return self.start_images.key_parts(item) if self.start_images else ()

    def _prepare_data(self):
        if not self.start_images:
            return super()._prepare_data()
        with self.start_images.image_encoder_on_device(keep=not self.cfg.data.cache_latents):
            return super()._prepare_data()

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.pipe.vae.config
        mean = torch.tensor(config.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
        return (latents - mean) / std

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(captions, do_classifier_free_guidance=False, device=self.runtime.device,
                                            max_sequence_length=self.max_text_tokens)
        return {"prompt_embeds": embeds}

    # -- loss ------------------------------------------------------------------------------
    def conditioning(self, batch: dict[str, Any], modules) -> dict[str, torch.Tensor]:
        cond = super().conditioning(batch, modules)
        return {**cond, **self.start_images.conditioning(batch)} if self.start_images else cond

    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        dtype = denoiser.dtype
        hidden, timestep, extra = noised.noisy, noised.t * 1000, {}
        _, p_h, p_w = denoiser.config.patch_size
        tokens_per_frame = (hidden.shape[3] // p_h) * (hidden.shape[4] // p_w)
        if self.expand_timesteps:  # Wan 2.2 TI2V-5B takes a timestep per latent patch
            timestep = timestep[:, None].expand(-1, hidden.shape[2] * tokens_per_frame)
        if self.start_images:
            hidden, timestep, extra = self.start_images.model_inputs(hidden, timestep, cond, tokens_per_frame)
        return denoiser.forward(hidden_states=hidden.to(dtype), timestep=timestep.to(dtype),
                                encoder_hidden_states=cond["prompt_embeds"].to(dtype),
                                **{k: v.to(dtype) for k, v in extra.items()}, return_dict=False)[0]

    # -- sampling --------------------------------------------------------------------------
    def generate(self, prompt: str, seed: int) -> list:
        text, negative = self.embeddings_for(prompt), self.embeddings_for(self.cfg.sample.negative_prompt)
        frames = self.cfg.sample.num_frames or self.cfg.data.num_frames
        start, placed = {}, nullcontext()
        if self.sample_starts:  # sample i starts from image i (pipeline seeds go sample.seed + i), or the only one
            index = (seed - self.cfg.sample.seed) if len(self.sample_starts) > 1 else 0
            start["image"] = sample_image(self.sample_starts[index], self.sample_size())
            placed = self.start_images.image_encoder_on_device()
        with placed:
            out = self.pipeline_call(seed, prompt_embeds=text["prompt_embeds"],
                                     negative_prompt_embeds=negative["prompt_embeds"], num_frames=frames,
                                     output_type="pil", **start)
        return list(out.frames[0])


class WanAdapter(Wan, DiffusionAdapter):
    """Wan 2.1: one transformer."""


class Wan22Adapter(Wan, DiffusionAdapter):
    """A14B (two experts: `transformer` for high noise, `transformer_2` for low) or TI2V-5B (one transformer);
    which one is resolved once, from the pipeline, in setup_training. Its eval loss scores each fixed level with
    the expert that owns the level's sigma (eval_experts), whichever experts train."""

    def setup_training(self) -> None:
        self.experts = [n for n in ("transformer", "transformer_2") if getattr(self.pipe, n, None) is not None]
        self.two_experts = len(self.experts) == 2
        experts = self.cfg.train.experts
        if not self.two_experts:
            if experts != "both":
                raise UserError(f"train.experts={experts}: {self.cfg.model.name_or_path} has one transformer "
                                "(Wan 2.2 TI2V-5B); only A14B has high- and low-noise experts\n"
                                "  fix: leave train.experts=both")
            self.trained = ["transformer"]
        else:
            self.trained = {"both": ["transformer", "transformer_2"], "high_noise": ["transformer"],
                            "low_noise": ["transformer_2"]}[experts]
        self.boundary = float(self.pipe.config.get("boundary_ratio") or 0.0)
        self.active = self.trained[0]
        self.resident = None  # the expert on the device, with model.expert_offload (place_experts)
        super().setup_training()
        if self.two_experts:
            every = self.cfg.train.expert_switch_every
            plan = (f"alternating every {every} steps, high-noise first" if len(self.trained) == 2 else "only")
            self.log(f"wan22 experts: boundary sigma {self.boundary:g}; training {' and '.join(self.trained)} ({plan})")

    def expert_offload_setting(self) -> bool | str:
        return self.cfg.model.expert_offload

    @property
    def denoiser_names(self) -> tuple[str, ...]:
        return tuple(self.experts)

    def denoiser_names_in(self, index: dict) -> list[str]:
        return [n for n in ("transformer", "transformer_2") if (index.get(n) or [None])[0] is not None]

    def lora_denoiser_names(self) -> list[str]:
        return list(self.trained)

    def begin_step(self, step: int) -> None:
        """The expert for optimizer step `step` (1-based): derived from the step, so a resumed run agrees."""
        active = self.trained[((step - 1) // self.cfg.train.expert_switch_every) % len(self.trained)]
        if active != self.active:
            self.active = active
            if self.memory.offload:
                self.place_experts(active)

    def active_denoiser(self) -> str:
        return self.active

    def noise_range(self) -> tuple[float, float]:
        """The active expert's sigmas: at or above the boundary for the high-noise expert, below for the low."""
        if not self.two_experts:
            return 0.0, 1.0
        return (self.boundary, 1.0) if self.active == "transformer" else (0.0, self.boundary)

    def eval_experts(self, levels: int) -> list[tuple[str, list[int]]]:
        """A14B: the high-noise expert scores the levels whose sigma is at or above the boundary, the low-noise
        expert the others (the pipeline's own split at boundary_ratio, and training's); the resident expert first."""
        if not self.two_experts:
            return super().eval_experts(levels)
        sampler = self.sampler_for(None)  # Wan's shift is fixed: a level's sigma does not depend on the latents
        owned: dict[str, list[int]] = {"transformer": [], "transformer_2": []}
        for level in range(levels):
            sigma = float(sampler.shifted(torch.tensor((level + 0.5) / levels)))
            owned["transformer" if sigma >= self.boundary else "transformer_2"].append(level)
        order = sorted(owned, key=lambda name: name != self.resident)
        return [(name, owned[name]) for name in order if owned[name]]

    def place_for_training(self) -> None:
        self.place_experts(self.active)

    def place_experts(self, resident: str) -> None:
        """Every expert on the device, or with offload only `resident` (models/flow_memory.py FlowMemory.place)."""
        self.memory.place(resident)
        self.resident = resident

    @contextmanager
    def denoisers_on_demand(self):
        """While sampling or evaluating with offload, each expert comes to the device when it is called; the
        trained one is placed back after."""
        if not self.memory.offload:
            yield
            return
        hooks = [self.component(name).register_forward_pre_hook(lambda module, args, name=name: self._bring(name))
                 for name in self.denoiser_names]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            self.place_experts(self.active)

    def _bring(self, name: str) -> None:
        if name != self.resident:
            self.place_experts(name)

    def generate(self, prompt: str, seed: int) -> list:
        with self.denoisers_on_demand():
            return super().generate(prompt, seed)

    # -- LoRA files ------------------------------------------------------------------------
    def save_lora(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """A14B: one file per trained expert, in high_noise/ and low_noise/ (load the second with
        `pipe.load_lora_weights(..., load_into_transformer_2=True)`); TI2V-5B: one file, like wan21."""
        if not self.two_experts:
            return super().save_lora(out_dir, dtype)
        files = []
        for name in self.trained:
            folder = out_dir / EXPERT_FOLDERS[name]
            folder.mkdir(parents=True, exist_ok=True)
            files += self.write_lora_file(folder, [name], dtype, out_dir / f"{self.cfg.run.name}_{EXPERT_FOLDERS[name]}")
        return files

    def file_prefix(self, name: str) -> str:
        return "transformer"  # each expert's file holds one transformer, loaded into transformer_2 on request

    def load_lora(self, path: Path, partial: bool = False, label: str | None = None) -> None:
        if not self.two_experts:
            return super().load_lora(path, partial, label)
        for name in self.trained:
            into_second = {"load_into_transformer_2": True} if name == "transformer_2" else {}
            file = lora_file_in(path, EXPERT_FOLDERS[name], label)
            named = f"{label} ({EXPERT_FOLDERS[name]})" if label else str(file)
            self.load_lora_file(file, [name], partial, named, **into_second)
