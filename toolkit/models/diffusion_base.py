"""What every diffusion family shares: a diffusers pipeline, PEFT LoRA on its denoiser(s), cached latents and
text embeddings (diffusion_data.py), the training loss (written once: latents -> objective.noise -> the family's
predict -> objective.loss), samples, and LoRA files in the diffusers format that `pipe.load_lora_weights` reads.

A family sets its pipeline class, which components carry the LoRA (`denoiser_names`), its text encoders and
the text tensors its denoiser takes (`text_keys`), its default LoRA targets, its objective (setup_training),
and implements `encode_text`, `predict` and `generate`. sd/sdxl (diffusion_sd.py) and the flow-matching
families (diffusion_flow.py, diffusion_wan.py) build on this class.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from omegaconf import DictConfig

from toolkit.data.captions import apply_trigger
from toolkit.errors import UserError
from toolkit.models.base import ModelAdapter, ModelMemory, Runtime, eval_mode, repeated_blocks
from toolkit.models.diffusion_data import DiffusionData, unbatch
from toolkit.models.diffusion_eval import DiffusionEval
from toolkit.models.sample_draws import SampleDraws
from toolkit.models.diffusion_files import DiffusersLoraFiles
from toolkit.models.diffusion_loading import DiffusersLoading
from toolkit.data.masks import loss_weights
from toolkit.models.objectives import Noised, per_sample_mse
from toolkit.tiny import resolve_model_path

@dataclass
class Denoiser:
    """What a family's predict() gets: the module to call (the trainer's wrapper, e.g. DDP, of the pipeline
    component) and the component's dtype and config, which a wrapper does not expose."""

    forward: torch.nn.Module
    dtype: torch.dtype
    config: Any


class DiffusionMemory(ModelMemory):
    """A denoiser's memory: its repeated blocks (the family's `block_regions`), what fsdp shards (the denoisers
    themselves), its size from the pipeline folder."""

    def __init__(self, adapter: "DiffusionAdapter"):
        self.adapter = adapter

    @property
    def unused_parameters(self) -> bool:
        return self.adapter.unused_lora_parameters

    def sequence_variants(self) -> int:
        return self.adapter.text_variants  # 1 unless the family keeps each batch's own text length

    def base_parameters(self) -> int | None:
        return self.adapter.count_base_parameters()

    def regions(self, checkpointed: bool) -> dict[str, list[torch.nn.Module]]:
        return self.adapter.block_regions(checkpointed)

    def shard_roots(self) -> dict[str, torch.nn.Module]:
        return self.adapter.trainable_modules()

    def fixes(self) -> list[str]:
        return ["data.resolution lower (fewer latent tokens per image)"]


class DiffusionAdapter(DiffusersLoading, DiffusionData, DiffusionEval, DiffusersLoraFiles, ModelAdapter):
    denoiser_names: tuple[str, ...] = ("unet",)      # pipeline components that carry the LoRA
    text_encoder_names: tuple[str, ...] = ("text_encoder",)
    text_keys: tuple[str, ...] = ("prompt_embeds",)   # the cached text tensors the denoiser takes
    # sd/sdxl sample from prompt strings and keep their (small) text encoders; the flow families sample
    # from cached embeddings, so their text encoders (T5-XXL, UMT5-XXL: 10+ GB) can be freed after caching.
    samples_need_text_encoders = True
    uses_negative_prompt = True                      # samples take negative embeddings (Flux-dev does not)
    unused_lora_parameters = False                   # some LoRA weights get no gradient (DDP must look for them)
    text_variants = 1                                # text lengths a forward may take (memory.sequence_variants)
    memory_class = DiffusionMemory                   # the flow families plan quantization and swap (FlowMemory)

    def __init__(self, cfg: DictConfig, runtime: Runtime):
        super().__init__(cfg, runtime)
        self.model_path = resolve_model_path(cfg.model.name_or_path)
        self.pipe = None
        self.objective = None   # DDPMObjective or FlowObjective, set by setup_training
        self.prompt_cache: dict[str, dict[str, torch.Tensor]] = {}
        self.constants: dict[tuple, torch.Tensor] = {}  # see constant()
        self.timestep_sampling = cfg.train.timestep_sampling  # resolved from auto per family (the static plan)
        self.memory = self.memory_class(self)
        self._sample_size_said = False  # a rounded sample size is said once (sample_size)

    # -- family hooks ----------------------------------------------------------------------
    def pipeline_class(self):
        raise NotImplementedError

    def pipeline_kwargs(self) -> dict:
        return {}

    def lora_target_modules(self) -> list[str] | str:
        raise NotImplementedError

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """Batched text conditioning (the `text_keys` tensors) for captions, batch first."""
        raise NotImplementedError

    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        """The denoiser's prediction for `noised`, in the latents' layout: the one forward a family writes."""
        raise NotImplementedError

    def generate(self, prompt: str, seed: int) -> list:
        """The PIL frames of one sample (one frame for image families)."""
        raise NotImplementedError

    def place_denoisers(self) -> None:
        """At load, before the LoRA is added: put the denoiser(s) on the device (the flow families quantize
        here and wait with 16-bit weights until place_for_training, after the caches are filled)."""
        if self.shard_base:
            return
        for name in self.denoiser_names:
            self.component(name).to(self.runtime.device)  # move first, then add LoRA: large cast copies fail on HIP

    def setup_training(self) -> None:
        """Family set-up between loading and LoRA: the objective (noise schedule, sigma sampler), memory plan."""

    def lora_denoiser_names(self) -> list[str]:
        """The denoisers that get a LoRA (Wan 2.2 may train one expert of two)."""
        return list(self.denoiser_names)

    @property
    def trains_text_encoders(self) -> bool:
        """train.train_text_encoder (config validation refuses it for families whose spec does not read it)."""
        return "train.train_text_encoder" in self.spec.settings and bool(self.cfg.train.train_text_encoder)

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        return dict(self.network.items())

    def block_regions(self, checkpointed: bool) -> dict[str, list[torch.nn.Module]]:
        """Each LoRA denoiser's outermost repeated blocks (its `_no_split_modules`: DiT blocks)."""
        return {name: self.denoiser_blocks(name) for name in self.lora_denoiser_names()}

    def denoiser_blocks(self, name: str) -> list[torch.nn.Module]:
        """Denoiser `name`'s repeated blocks in forward order: checkpointed, compiled and swapped one by one."""
        return repeated_blocks(self.component(name), outermost=True)

    def place_for_training(self) -> None:
        """The denoisers onto the device once the caches are filled (sd/sdxl put theirs there at load)."""

    def denoisers_on_demand(self) -> AbstractContextManager:
        """Inside: every denoiser runs on the device when called (an offloaded Wan 2.2 expert is brought in),
        and the trained one is placed back after; the others have them all there."""
        return nullcontext()

    def prepare_data(self):
        """The data with its latent and text caches filled (diffusion_data.py), then the denoisers placed."""
        dataset = self.fill_caches()
        self.place_for_training()
        return dataset

    # -- loss ------------------------------------------------------------------------------
    def active_denoiser(self) -> str:
        """The denoiser trained at this step (Wan 2.2 alternates its experts)."""
        return self.lora_denoiser_names()[0]

    def noise_range(self) -> tuple[float, float]:
        """The noise levels (fractions of the schedule) this step trains: a Wan 2.2 expert's range."""
        return 0.0, 1.0

    def conditioning(self, batch: dict[str, Any], modules: Mapping[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
        """The text tensors (and any other conditioning) the denoiser takes, on the device."""
        return self.text_conditioning(batch, self.text_keys, modules)

    def batch_units(self, batch: dict[str, Any]) -> tuple[int, int]:
        return int((batch["latents"] if "latents" in batch else batch["pixels"]).shape[0]), 0

    def loss(self, batch: dict[str, Any], modules: Mapping[str, torch.nn.Module]) -> torch.Tensor:
        """Sum over the batch of each sample's loss: noise the latents, let the family predict, weigh (a loss
        mask, a regularisation image's weight), and add output preservation (train.dop_class)."""
        latents = self.latents_of(batch)
        cond = self.conditioning(batch, modules)
        name = self.active_denoiser()
        draws = SampleDraws(batch["draw_seeds"], latents.device) if "draw_seeds" in batch else None
        noised = self.objective.noise(latents, *self.noise_range(), draws)
        component = self.component(name)
        denoiser = Denoiser(modules[name], component.dtype, component.config)
        pred = self.predict(denoiser, noised, cond, batch)
        weight = None
        if "mask" in batch:
            weight = loss_weights(self.to_device(batch["mask"]), pred.shape, self.cfg.data.mask_min)
        per_sample = self.objective.loss(pred, noised, weight)
        if "loss_weight" in batch:
            per_sample = per_sample * self.to_device(batch["loss_weight"])
        if "preserve" in batch:
            per_sample = per_sample + self.preservation_loss(batch, modules, denoiser, noised)
        return per_sample.sum()

    def preservation_loss(self, batch: dict[str, Any], modules: Mapping[str, torch.nn.Module], denoiser: Denoiser,
                          noised: Noised) -> torch.Tensor:
        """Differential output preservation (ai-toolkit's DOP), per sample: for the class captions (the trigger
        word replaced by train.dop_class), the squared distance of the LoRA's prediction from the base model's,
        both on this step's noised latents; the base prediction comes from the same model with its adapters
        switched off, without gradients. train.dop_weight times it; regularisation images get none."""
        class_batch = {**batch, **{key[len("dop."):]: value for key, value in batch.items() if key.startswith("dop.")}}
        cond = self.conditioning(class_batch, modules)
        component = self.component(self.active_denoiser())
        component.disable_adapters()
        try:
            with torch.no_grad():
                base = self.predict(denoiser, noised, cond, class_batch)
        finally:
            component.enable_adapters()
        pred = self.predict(denoiser, noised, cond, class_batch)
        keep = self.to_device(batch["preserve"]).float()
        return self.cfg.train.dop_weight * keep * per_sample_mse(pred, base)

    def loss_at(self, name: str, batch: dict[str, Any], latents: torch.Tensor, cond: dict[str, torch.Tensor],
                noise: torch.Tensor, level: float) -> torch.Tensor:
        """Each sample's loss with `noise` at the fixed noise `level` (the eval loss: diffusion_eval.py), through
        the pipeline's own denoiser `name`."""
        noised = self.objective.noise_at(latents, noise, level)
        component = self.component(name)
        pred = self.predict(Denoiser(component, component.dtype, component.config), noised, cond, batch)
        return self.objective.loss(pred, noised)

    # -- conditioning ----------------------------------------------------------------------
    @contextmanager
    def _vae_encoding(self):
        """cuDNN/MIOpen off while encoding when device.vae_encode_cudnn is false (MIOpen can be 30x slower)."""
        saved = torch.backends.cudnn.enabled
        torch.backends.cudnn.enabled = bool(self.cfg.device.vae_encode_cudnn)
        try:
            yield
        finally:
            torch.backends.cudnn.enabled = saved

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised VAE latents (the posterior mean) of images (or clips) in [-1, 1]."""
        vae = self.pipe.vae
        # The SDXL VAE overflows in fp16 (its config says force_upcast): encode in fp32, then go back, so the
        # pipeline's own upcast logic still applies when sampling.
        upcast = vae.dtype == torch.float16 and getattr(vae.config, "force_upcast", False)
        if upcast:
            vae.to(torch.float32)
        try:
            with torch.no_grad(), self._vae_encoding():
                latents = vae.encode(pixels.to(self.runtime.device, vae.dtype)).latent_dist.mode()
        finally:
            if upcast:
                vae.to(torch.float16)
        return self.normalize_latents(latents.float())

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.pipe.vae.config
        shift = getattr(config, "shift_factor", None) or 0.0
        return (latents - shift) * config.scaling_factor

    def text_conditioning(self, batch: dict[str, Any], keys: tuple[str, ...],
                          modules: Mapping[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
        """The batch's cached text tensors on the device, or the captions encoded now (through the trainer's
        modules when the text encoders carry a LoRA)."""
        device = self.runtime.device
        if keys[0] in batch:
            return {k: self.to_device(batch[k]) for k in keys if k in batch}
        if not self.trains_text_encoders:
            with torch.no_grad():
                return self.encode_text(batch["captions"])
        return self.encode_text(batch["captions"], encoders={n: modules[n] for n in self.text_encoder_names})

    def latents_of(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.to_device(batch["latents"]) if "latents" in batch else self.encode_pixels(batch["pixels"])

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A batch tensor on the device without waiting for the GPU: the trainer pins batches on CUDA, so the copy
        is queued behind the previous step's work (a blocking copy would idle the GPU while the next step launches)."""
        return tensor.to(self.runtime.device, non_blocking=True)

    def constant(self, key: tuple, make) -> torch.Tensor:
        """`make()` (a host tensor that depends only on `key`: position ids of a latent shape) on the device, built
        once per key; building it every step would copy it over each time. The copy is from pinned memory, so even the
        first one (a new aspect bucket mid-run) does not wait for the GPU."""
        if key not in self.constants:
            made = make()
            self.constants[key] = self.to_device(made.pin_memory() if self.runtime.device.type == "cuda" else made)
        return self.constants[key]

    def embeddings_for(self, prompt: str) -> dict[str, torch.Tensor]:
        """One prompt's text conditioning (batch of 1) on the device: cached, or encoded now."""
        if prompt not in self.prompt_cache:
            if not self.text_encoders:
                raise UserError(f"sample prompt {prompt!r} was not cached and the text encoders were freed")
            with torch.no_grad():
                self.prompt_cache[prompt] = unbatch(self.encode_text([prompt]))[0]
        return {k: v[None].to(self.runtime.device) for k, v in self.prompt_cache[prompt].items()}

    # -- sampling --------------------------------------------------------------------------
    def sample_prompts(self) -> list[str]:
        return [apply_trigger(p, self.cfg.data.trigger_word) for p in self.cfg.sample.prompts]

    def sample_multiple(self) -> int:
        """The multiple of pixels this model's pipeline draws samples in (the family's; Wan 2.2's differs by model)."""
        return self.spec.sample_multiple or 1

    def sample_size(self) -> tuple[int, int]:
        """(width, height) of a sample: sample.width / sample.height, 0 taking data.resolution, each rounded down to
        the pipeline's multiple (validate refuses a sample.width that is not a multiple of the family's; a pipeline
        would refuse it, or resize it without a word). A rounded size is said once."""
        s, multiple = self.cfg.sample, self.sample_multiple()
        asked = (s.width or self.cfg.data.resolution, s.height or self.cfg.data.resolution)
        drawn = tuple(max(multiple, side // multiple * multiple) for side in asked)
        if drawn != asked and not self._sample_size_said:
            self._sample_size_said = True
            self.log(f"samples are drawn at {drawn[0]}x{drawn[1]}: {asked[0]}x{asked[1]} (sample.width/height, 0 "
                     f"taking data.resolution) rounded down to a multiple of {multiple}, as this model's pipeline "
                     "draws them")
        return drawn

    def pipeline_call(self, seed: int, **kwargs) -> Any:
        """Run the pipeline for one sample with the sample settings and a CPU generator seeded `seed`."""
        s = self.cfg.sample
        width, height = self.sample_size()
        generator = torch.Generator("cpu").manual_seed(seed)
        with torch.no_grad():
            return self.pipe(num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale,
                             width=width, height=height, generator=generator, **kwargs)

    def sample(self, out_dir: Path) -> list[Path]:
        from toolkit.data.media import make_grid

        prompts = self.sample_prompts()
        if not prompts:
            return []
        modules = [self.pipe.vae, *(self.text_encoders if self.samples_need_text_encoders else [])]
        moved = [m for m in modules if m.device != self.runtime.device]
        for module in moved:
            module.to(self.runtime.device)
        out_dir.mkdir(parents=True, exist_ok=True)
        stills, files = [], []
        with eval_mode(self.network):
            generated = [self.generate(prompt, self.cfg.sample.seed + i) for i, prompt in enumerate(prompts)]
        for i, (prompt, frames) in enumerate(zip(prompts, generated)):
            still = out_dir / f"{i:02d}.png"
            frames[len(frames) // 2].save(still)  # a video's middle frame stands for it in grids and reports
            stills.append(still)
            files.append(still)
            if len(frames) > 1:
                from toolkit.data.video import write_video

                files += write_video(frames, out_dir / f"{i:02d}", fps=self.cfg.sample.fps, log=self.log)
        (out_dir / "prompts.txt").write_text("".join(f"{i:02d}: {p}\n" for i, p in enumerate(prompts)), encoding="utf-8")
        grid = make_grid(stills, out_dir / "grid.png")
        for module in moved:
            module.to("cpu")
        return stills + [grid] + [f for f in files if f not in stills]
