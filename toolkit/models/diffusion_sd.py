"""The `sd` (Stable Diffusion 1.x/2.x, eps or v-prediction) and `sdxl` families: PEFT LoRA on the UNet
(and optionally the text encoders), saved in the diffusers format that `pipe.load_lora_weights` reads.

The pattern later diffusion families follow: load the pipeline, freeze it, add LoRA with `add_adapter`,
cache latents / text embeddings (latent_cache), then `loss` is noise -> timestep -> UNet -> weighted MSE.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from toolkit.data.captions import apply_trigger
from toolkit.data.images import DiffusionDataset, caption_rules, load_pixels, scan_images
from toolkit.data.latent_cache import TensorCache, cache_key
from toolkit.errors import UserError
from toolkit.models.base import Runtime, load_trainable_state_dict, trainable_state_dict
from toolkit.models.tiny import cache_root, resolve_model_path

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
LORA_FILE = "pytorch_lora_weights.safetensors"


def unet_target_modules(value: Any) -> Any:
    """auto: the attention projections; all-linear: every linear and conv layer PEFT supports; or a list."""
    if value == "auto":
        return list(UNET_TARGETS)
    if value == "all-linear":
        return ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                "time_emb_proj", "linear_1", "linear_2"]
    if OmegaConf.is_list(value) or isinstance(value, list):
        names = list(value)
        if names and all(isinstance(n, str) for n in names):
            return names
    raise UserError(f"network.target_modules: expected auto, all-linear or a list of module names, got {value!r}")


def sample_timesteps(kind: str, batch: int, num_train_timesteps: int, device: torch.device) -> torch.Tensor:
    """uniform over [0, T); logit_normal: sigmoid of a standard normal, which favours the middle timesteps."""
    if kind == "uniform":
        return torch.randint(0, num_train_timesteps, (batch,), device=device)
    if kind == "logit_normal":
        u = torch.sigmoid(torch.randn(batch, device=device))
        return (u * num_train_timesteps).long().clamp(max=num_train_timesteps - 1)
    raise UserError(f"train.timestep_sampling: unknown '{kind}'; available: uniform, logit_normal")


def min_snr_weights(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023): min(SNR, gamma)/SNR for eps, /(SNR+1) for v."""
    alpha = alphas_cumprod.to(timesteps.device)[timesteps].float()
    snr = alpha / (1 - alpha)
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr


class StableDiffusionAdapter:
    family = "sd"
    xl = False

    def __init__(self, cfg: DictConfig, runtime: Runtime):
        self.cfg = cfg
        self.runtime = runtime
        self.model_path = resolve_model_path(cfg.model.name_or_path)
        self.network: torch.nn.Module | None = None
        self.pipe = None
        self.log = lambda msg: print(msg, file=sys.stderr, flush=True)

    # -- loading ---------------------------------------------------------------------------
    def _pipeline_class(self):
        from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

        return StableDiffusionXLPipeline if self.xl else StableDiffusionPipeline

    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        return [self.pipe.text_encoder, self.pipe.text_encoder_2] if self.xl else [self.pipe.text_encoder]

    @property
    def tokenizers(self) -> list:
        return [self.pipe.tokenizer, self.pipe.tokenizer_2] if self.xl else [self.pipe.tokenizer]

    def load(self) -> None:
        from diffusers import DDPMScheduler
        from peft import LoraConfig

        extra = {} if self.xl else {"safety_checker": None, "requires_safety_checker": False}
        try:
            self.pipe = self._pipeline_class().from_pretrained(self.model_path, dtype=self.runtime.base_dtype,
                                                               revision=self.cfg.model.revision, **extra)
        except (OSError, ValueError) as err:
            raise UserError(f"model.name_or_path: cannot load '{self.cfg.model.name_or_path}' as a {self.family} "
                            f"pipeline: {str(err).splitlines()[0]}\n  fix: give a local diffusers folder "
                            "(model_index.json) or a Hub id you can reach") from None
        self.pipe.set_progress_bar_config(disable=True)
        self.noise_scheduler = DDPMScheduler.from_config(self.pipe.scheduler.config)
        self.prediction_type = self.noise_scheduler.config.prediction_type
        unet = self.pipe.unet
        for module in [unet, self.pipe.vae, *self.text_encoders]:
            module.requires_grad_(False)
        unet.to(self.runtime.device)  # move first, then add LoRA: large cast copies can fail on HIP
        net = self.cfg.network
        lora = dict(r=net.rank, lora_alpha=net.alpha, lora_dropout=net.dropout, init_lora_weights="gaussian",
                    use_dora=net.type == "dora", use_rslora=net.rslora)
        unet.add_adapter(LoraConfig(target_modules=unet_target_modules(net.target_modules), **lora))
        modules = {"unet": unet}
        if self.cfg.train.train_text_encoder:
            for name, encoder in zip(("text_encoder", "text_encoder_2"), self.text_encoders):
                encoder.to(self.runtime.device)
                encoder.add_adapter(LoraConfig(target_modules=TEXT_TARGETS, **lora))
                modules[name] = encoder
        if self.cfg.train.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        self.network = torch.nn.ModuleDict(modules)
        for p in self.network.parameters():  # LoRA weights train in fp32 over a bf16/fp16 base
            if p.requires_grad:
                p.data = p.data.float()

    def lora_targets(self) -> list[str]:
        return sorted({n.rsplit(".lora_A", 1)[0] for n, _ in self.network.named_parameters() if ".lora_A" in n})

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
        """Scaled VAE latents (the posterior mean) of images in [-1, 1]."""
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
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return ((latents.float() - shift) * vae.config.scaling_factor)

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """prompt_embeds (SD: last hidden state; SDXL: both encoders' penultimate states concatenated) and,
        for SDXL, the second encoder's pooled projection."""
        states, pooled = [], None
        for tokenizer, encoder in zip(self.tokenizers, self.text_encoders):
            ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                            return_tensors="pt").input_ids.to(encoder.device)
            out = encoder(ids, output_hidden_states=self.xl)
            if self.xl:
                states.append(out.hidden_states[-2])
                if encoder is self.pipe.text_encoder_2:
                    pooled = out[0]  # CLIPTextModelWithProjection: the projected pooled output
            else:
                states.append(out[0])
        result = {"prompt_embeds": torch.cat(states, dim=-1)}
        if self.xl:
            result["pooled_prompt_embeds"] = pooled
        return result

    # -- data ------------------------------------------------------------------------------
    def dataset(self) -> DiffusionDataset:
        data, rules = self.cfg.data, caption_rules(self.cfg.data)
        items = scan_images(data, self.log)
        dataset = DiffusionDataset(items, rules)
        root = cache_root() / "diffusion"
        if data.cache_latents:
            self.pipe.vae.to(self.runtime.device)
            self.latent_cache = TensorCache(root, "latents")
            vae_id = (self.model_path, self.cfg.model.revision, str(self.pipe.vae.dtype), "mode")
            keys = [cache_key(it.content_hash, it.bucket, *vae_id) for it in items]
            cached = self.latent_cache.fill(keys, lambda idx: [self._encode_item(items[i]) for i in idx])
            dataset.latents = [c["latents"] for c in cached]
            dataset.crops = [(int(c["crop"][0]), int(c["crop"][1])) for c in cached]
            self.log(f"latents: {self.latent_cache.hits} cached, {self.latent_cache.misses} encoded")
            self.pipe.vae.to("cpu")  # only sampling needs it again
        else:
            self.pipe.vae.to(self.runtime.device)  # latents are encoded every step
        train_te = self.cfg.train.train_text_encoder
        if data.cache_text_embeddings and (rules.varies or train_te):
            why = "train.train_text_encoder is on" if train_te else "data.shuffle_tags / data.caption_dropout change captions"
            self.log(f"text embeddings: computed every step, not cached ({why}); the text encoders stay on the device")
        if data.cache_text_embeddings and not rules.varies and not train_te:
            for encoder in self.text_encoders:
                encoder.to(self.runtime.device)
            self.text_cache = TensorCache(root, "text")
            text_id = (self.model_path, self.cfg.model.revision, self.family, str(self.pipe.text_encoder.dtype))
            keys = [cache_key(it.caption, *text_id) for it in items]
            with torch.no_grad():
                cached = self.text_cache.fill(keys, lambda idx: self._unbatch(self.encode_text([items[i].caption for i in idx])))
            dataset.text = cached
            self.log(f"text embeddings: {self.text_cache.hits} cached, {self.text_cache.misses} encoded")
            for encoder in self.text_encoders:
                encoder.to("cpu")
        else:
            for encoder in self.text_encoders:
                encoder.to(self.runtime.device)
        return dataset

    def _encode_item(self, item) -> dict[str, torch.Tensor]:
        pixels, crop = load_pixels(item)
        return {"latents": self.encode_pixels(pixels[None])[0], "crop": torch.tensor(crop)}

    @staticmethod
    def _unbatch(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        n = next(iter(tensors.values())).shape[0]
        return [{k: v[i] for k, v in tensors.items()} for i in range(n)]

    # -- loss ------------------------------------------------------------------------------
    def conditioning(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
        """latents, prompt_embeds and (SDXL) added_cond_kwargs of a batch, on the device."""
        device = self.runtime.device
        latents = batch["latents"].to(device) if "latents" in batch else self.encode_pixels(batch["pixels"])
        if "prompt_embeds" in batch:
            text = {k: batch[k].to(device) for k in ("prompt_embeds", "pooled_prompt_embeds") if k in batch}
        else:
            with torch.set_grad_enabled(bool(self.cfg.train.train_text_encoder)):
                text = self.encode_text(batch["captions"])
        added = None
        if self.xl:
            added = {"text_embeds": text["pooled_prompt_embeds"], "time_ids": batch["time_ids"].to(device)}
        return latents, text["prompt_embeds"], added

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: torch.Tensor, added: dict | None) -> torch.Tensor:
        # note: the network is a ModuleDict, so a DDP wrapper of it (trainer.forward_module) cannot be
        # called as the UNet; multi-GPU diffusion training needs the UNet wrapped on its own (not done yet).
        unet, dtype = self.pipe.unet, self.pipe.unet.dtype
        added = {k: v.to(dtype) for k, v in added.items()} if added else None
        return unet(noisy.to(dtype), timesteps, embeds.to(dtype), added_cond_kwargs=added).sample.float()

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """What the UNet predicts: the noise (epsilon) or the velocity (v_prediction), per the scheduler config."""
        if self.prediction_type == "epsilon":
            return noise
        if self.prediction_type == "v_prediction":
            return self.noise_scheduler.get_velocity(latents, noise, timesteps)
        raise UserError(f"{self.cfg.model.name_or_path}: scheduler prediction_type '{self.prediction_type}' "
                        "is not supported; the sd/sdxl families train epsilon and v_prediction")

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        t = self.cfg.train
        latents, embeds, added = self.conditioning(batch)
        noise = torch.randn_like(latents)
        if t.noise_offset:
            noise = noise + t.noise_offset * torch.randn(latents.shape[0], latents.shape[1], 1, 1, device=latents.device)
        timesteps = sample_timesteps(t.timestep_sampling, latents.shape[0],
                                     self.noise_scheduler.config.num_train_timesteps, latents.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        pred = self.predict(noisy, timesteps, embeds, added)
        per_sample = F.mse_loss(pred, self.target(latents, noise, timesteps), reduction="none").mean(dim=(1, 2, 3))
        if t.min_snr_gamma:
            per_sample = per_sample * min_snr_weights(self.noise_scheduler.alphas_cumprod, timesteps,
                                                      t.min_snr_gamma, self.prediction_type)
        return per_sample.mean()

    def eval_loss(self) -> float | None:
        return None

    # -- sampling --------------------------------------------------------------------------
    def sample_prompts(self) -> list[str]:
        return [apply_trigger(p, self.cfg.data.trigger_word) for p in self.cfg.sample.prompts]

    @torch.no_grad()
    def generate(self, prompt: str, seed: int) -> "PIL.Image.Image":  # noqa: F821
        from diffusers import DDIMScheduler

        s, pipe = self.cfg.sample, self.pipe
        scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        runner = type(pipe)(**{**pipe.components, "scheduler": scheduler})
        runner.set_progress_bar_config(disable=True)
        generator = torch.Generator("cpu").manual_seed(seed)
        return runner(prompt, num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale,
                      width=s.width or self.cfg.data.resolution, height=s.height or self.cfg.data.resolution,
                      generator=generator).images[0]

    def sample(self, out_dir: Path) -> list[Path]:
        from toolkit.train.plots import make_grid

        prompts = self.sample_prompts()
        if not prompts:
            return []
        was_training = self.network.training
        self.network.eval()
        moved = [m for m in [self.pipe.vae, *self.text_encoders] if m.device != self.runtime.device]
        for module in moved:
            module.to(self.runtime.device)
        out_dir.mkdir(parents=True, exist_ok=True)
        files = []
        for i, prompt in enumerate(prompts):
            path = out_dir / f"{i:02d}.png"
            self.generate(prompt, self.cfg.sample.seed + i).save(path)
            files.append(path)
        (out_dir / "prompts.txt").write_text("".join(f"{i:02d}: {p}\n" for i, p in enumerate(prompts)), encoding="utf-8")
        files.append(make_grid(files, out_dir / "grid.png"))
        for module in moved:
            module.to("cpu")
        self.network.train(was_training)
        return files

    # -- LoRA weights ----------------------------------------------------------------------
    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        return trainable_state_dict(self.network)

    def load_lora_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_trainable_state_dict(self.network, state)

    def diffusers_lora_layers(self, dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
        """save_lora_weights arguments: unet_lora_layers (and text encoder layers) in diffusers key names."""
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        layers = {}
        for name, module in self.network.items():
            state = convert_state_dict_to_diffusers(get_peft_model_state_dict(module))
            layers[f"{name}_lora_layers"] = {k: v.detach().to("cpu", dtype) for k, v in state.items()}
        return layers

    def save_lora(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """diffusers format (pytorch_lora_weights.safetensors); save.format kohya adds the ComfyUI/kohya file."""
        from toolkit.models.lora_export import save_kohya

        fmt = self.cfg.save.format
        if fmt not in ("auto", "diffusers", "kohya"):
            raise UserError(f"save.format: {fmt} is not available for the {self.family} family; use diffusers "
                            "(auto) or kohya")
        self._pipeline_class().save_lora_weights(out_dir, safe_serialization=True, **self.diffusers_lora_layers(dtype))
        files = [out_dir / LORA_FILE]
        if fmt == "kohya":
            files.append(save_kohya(out_dir / LORA_FILE, out_dir / f"{self.cfg.run.name}_kohya.safetensors",
                                    self.kohya_metadata()))
        return files

    def kohya_metadata(self) -> dict[str, str]:
        return {"ss_base_model": str(self.cfg.model.name_or_path), "toolkit_family": self.family,
                "ss_network_dim": str(self.cfg.network.rank), "ss_network_alpha": str(self.cfg.network.alpha),
                "ss_steps": str(self.cfg.train.steps), "ss_trigger_word": str(self.cfg.data.trigger_word or ""),
                "ss_network_module": "networks.lora"}

    def load_lora(self, path: Path) -> None:
        """Load a diffusers-format LoRA file (or a folder holding one) into the trained modules."""
        from diffusers.utils import convert_state_dict_to_peft, convert_unet_state_dict_to_peft
        from peft import set_peft_model_state_dict

        state, _ = self._pipeline_class().lora_state_dict(str(path), weight_name=LORA_FILE if Path(path).is_dir() else None)
        for name, module in self.network.items():
            prefix = f"{name}."
            part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            part = convert_unet_state_dict_to_peft(part) if name == "unet" else convert_state_dict_to_peft(part)
            result = set_peft_model_state_dict(module, part)
            if getattr(result, "unexpected_keys", None):
                raise UserError(f"{path}: LoRA keys do not match the {name}: {result.unexpected_keys[:2]}")


class StableDiffusionXLAdapter(StableDiffusionAdapter):
    family = "sdxl"
    xl = True
