"""Image-to-video training for the Wan families: Wan 2.1 I2V, Wan 2.2 I2V-A14B and TI2V-5B, each conditioned on a
clip's start image (toolkit/data/start_images.py) exactly as WanImageToVideoPipeline conditions it at inference.

The task (model.task) is read from the model folder under auto: a WanImageToVideoPipeline (model_index.json) is
image-to-video, any other Wan pipeline text-to-video. TI2V-5B is published as a WanPipeline and does both: it
trains on start images with model.task=i2v. The loaded transformer then says how it takes the condition:

- channels (Wan 2.1 I2V, Wan 2.2 I2V-A14B: in_channels = 2 x latent channels + 4): the VAE latents of the start
  image followed by F-1 black frames, behind a 4-channel mask that marks the first latent frame as given, are
  concatenated to the noisy latents. Wan 2.1 I2V (transformer image_dim set) also cross-attends to the CLIP image
  encoder's penultimate hidden states of the start image. Both come from the pipeline's own `prepare_latents`
  and `encode_image`, and are cached with the clip's latents (a second VAE encoding of F frames per view).
- first frame (TI2V-5B, expand_timesteps): the start image's latent replaces the first noisy latent frame, whose
  tokens get timestep 0, and the loss leaves that frame out: the pipeline overwrites the model's prediction there
  (DiffSynth-Studio trains TI2V-5B the same way).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from toolkit.errors import UserError
from toolkit.models.objectives import Noised

I2V_PIPELINE = "WanImageToVideoPipeline"


def resolve_task(setting: str, model_path: str, revision: str | None,
                 i2v_pipeline: str = I2V_PIPELINE) -> tuple[str, str]:
    """model.task as t2v or i2v, and why: as set, or under auto the pipeline class of the model folder (a
    `i2v_pipeline` is image-to-video)."""
    if setting != "auto":
        return setting, "model.task"
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.load_config(model_path, revision=revision).get("_class_name")
    task = "i2v" if pipeline == i2v_pipeline else "t2v"
    return task, f"auto: the model folder holds a {pipeline}"


def check_task(pipe, task: str, name: str) -> str | None:
    """The way `pipe`'s transformer takes a start image ("channels" or "first_frame"), None for t2v; a UserError
    when the model cannot train `task`."""
    transformer = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
    channels, latent = transformer.config.in_channels, pipe.vae.config.z_dim
    takes_channels = channels == 2 * latent + 4
    if task == "t2v":
        if takes_channels:
            raise UserError(f"model.task=t2v: {name} is an image-to-video model (its transformer takes {channels} "
                            f"input channels: latents, mask and start-frame condition)\n  fix: set model.task=i2v "
                            "(or auto), or use a text-to-video model")
        return None
    if pipe.config.get("expand_timesteps", False) and channels == latent:
        return "first_frame"
    if not takes_channels:
        raise UserError(f"model.task=i2v: {name} is a text-to-video model (its transformer takes {channels} input "
                        "channels, its latents only)\n  fix: use an image-to-video model (Wan2.1-I2V-14B-480P/720P, "
                        "Wan2.2-I2V-A14B, Wan2.2-TI2V-5B), or set model.task=t2v")
    if transformer.config.image_dim is not None and getattr(pipe, "image_encoder", None) is None:
        raise UserError(f"{name}: its transformer cross-attends to image embeddings, and the folder has no "
                        "image_encoder\n  fix: use the full Diffusers folder (Wan2.1-I2V-14B-480P-Diffusers)")
    return "channels"


def to_pil(image: torch.Tensor):
    """A CHW image in [-1, 1] as the 8-bit PIL image it was read from."""
    from PIL import Image

    array = ((image.float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(np.ascontiguousarray(array))


class FirstFrameGiven:
    """TI2V-5B image-to-video: the objective of `inner` with the loss over every latent frame but the first,
    which the model is given, not asked for."""

    def __init__(self, inner):
        self.inner = inner

    def noise(self, latents: torch.Tensor, low: float = 0.0, high: float = 1.0, draws=None) -> Noised:
        return self.inner.noise(latents, low, high, draws)

    def noise_at(self, latents: torch.Tensor, noise: torch.Tensor, level: float) -> Noised:
        return self.inner.noise_at(latents, noise, level)

    def loss(self, pred: torch.Tensor, noised: Noised, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.loss(pred[:, :, 1:], Noised(noised.noisy, noised.t, noised.target[:, :, 1:]), weight)


class StartImages:
    """A Wan image-to-video model's start-image condition: the clips' start images (data), what the latent cache
    keeps beside each view, and the transformer's inputs; built by the pipeline's own methods."""

    def __init__(self, pipe, mode: str, device: torch.device, log: Callable[[str], None]):
        self.pipe, self.mode, self.device, self.log = pipe, mode, device, log
        transformer = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
        self.image_embeds = mode == "channels" and transformer.config.image_dim is not None

    def describe(self) -> str:
        if self.mode == "first_frame":
            return ("the start image's latent is the first latent frame (timestep 0 there, left out of the loss), "
                    "as TI2V-5B")
        return ("mask and start-frame latents concatenated to the noisy latents"
                + (", CLIP image embeddings cross-attended" if self.image_embeds else ""))

    def objective(self, inner):
        return FirstFrameGiven(inner) if self.mode == "first_frame" else inner

    # -- data ------------------------------------------------------------------------------
    def items(self, items: list) -> list:
        from toolkit.data.start_images import pair_start_images

        return pair_start_images(items, self.log)

    def load(self, item, view, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A loaded clip view with its start image (`image`, the view's cut of it), the image beside the clip
        or its first frame."""
        from toolkit.data.start_images import load_start_image

        image = load_start_image(item, view) if item.start_image is not None else loaded["pixels"][:, 0]
        return {**loaded, "image": image}

    def key_parts(self, item) -> tuple:
        """What a cached view depends on beyond the clip: the condition kind and the start image."""
        return ("start-image", self.mode, self.image_embeds, item.start_hash or "first-frame")

    @contextmanager
    def image_encoder_on_device(self, keep: bool = False):
        """The CLIP image encoder (Wan 2.1) on the device inside (filling the cache, sampling); afterwards back
        where it was, unless `keep` (latents not cached: every step encodes start images)."""
        encoder = self.pipe.image_encoder if self.image_embeds else None
        before = encoder.device if encoder is not None else None
        if encoder is not None:
            encoder.to(self.device)
        try:
            yield
        finally:
            if encoder is not None and not keep:
                encoder.to(before)

    # -- condition -------------------------------------------------------------------------
    def encode(self, images: torch.Tensor, frames: int) -> dict[str, torch.Tensor]:
        """The condition of a batch of start images (B, 3, H, W in [-1, 1]) for clips of `frames` frames:
        `condition` (mask + latents, or the first-frame latent) and, for Wan 2.1, `image_embeds`."""
        pipe, device = self.pipe, self.device
        b, _, height, width = images.shape
        latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
        shape = (1, pipe.vae.config.z_dim, latent_frames, height // pipe.vae_scale_factor_spatial,
                 width // pipe.vae_scale_factor_spatial)
        with torch.no_grad():
            # `latents` given, so the pipeline draws no noise: only the condition is wanted.
            out = {"condition": torch.cat([
                pipe.prepare_latents(image[None].to(device, torch.float32), 1, shape[1], height, width, frames,
                                     torch.float32, device, latents=torch.zeros(shape, device=device))[1]
                for image in images])}
            if self.image_embeds:
                out["image_embeds"] = torch.cat([pipe.encode_image(to_pil(image), device).float() for image in images])
        return out

    def conditioning(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The batch's condition on the device: cached with its latents, or encoded now from its start images."""
        if "condition" in batch:
            # non_blocking: the trainer pins batches, so the copy does not wait for the GPU
            return {k: batch[k].to(self.device, non_blocking=True) for k in ("condition", "image_embeds") if k in batch}
        return self.encode(batch["image"], batch["pixels"].shape[2])

    def model_inputs(self, noisy: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor],
                     tokens_per_frame: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The transformer's hidden states, timesteps and extra arguments for `noisy` latents at `timestep`
        (per token with expand_timesteps, `tokens_per_frame` of them per latent frame)."""
        condition = cond["condition"].to(noisy.device, noisy.dtype)
        if self.mode == "first_frame":
            hidden = torch.cat([condition, noisy[:, :, 1:]], dim=2)
            given = torch.zeros_like(timestep[:, :tokens_per_frame])
            return hidden, torch.cat([given, timestep[:, tokens_per_frame:]], dim=1), {}
        extra = {"encoder_hidden_states_image": cond["image_embeds"]} if self.image_embeds else {}
        return torch.cat([noisy, condition], dim=1), timestep, extra


def start_images_for(pipe, task: str, name: str, device: torch.device,
                     log: Callable[[str], None]) -> StartImages | None:
    """The start-image condition of an image-to-video run (None for text-to-video); a UserError when the model
    cannot train `task`."""
    mode = check_task(pipe, task, name)
    return None if mode is None else StartImages(pipe, mode, device, log)


def sample_images(paths: list[str], prompts: list[str], task: str, name: str) -> list[Path]:
    """sample.images checked against the task and the prompts: one per prompt, or one for all."""
    if task == "t2v":
        if paths:
            raise UserError(f"sample.images: {name} trains text-to-video, whose samples take no start image\n"
                            "  fix: remove sample.images, or train an image-to-video model (model.task=i2v)")
        return []
    if prompts and not paths:
        raise UserError("sample.images: image-to-video samples start from an image, and none is set\n"
                        "  fix: set sample.images: [path/to/start.png] (one per prompt, or one for all), or "
                        "sample.prompts: []")
    if paths and len(paths) not in (1, len(prompts)):
        raise UserError(f"sample.images: {len(paths)} images for {len(prompts)} prompts\n"
                        "  fix: give one image per prompt, or one for all")
    return [Path(p) for p in paths]


def sample_image(path: Path, size: tuple[int, int]):
    """A start image for a sample: resized to cover (width, height) and centre-cropped, as training cuts clips."""
    from PIL import Image, ImageOps

    from toolkit.data.images import cover_and_crop

    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened).convert("RGB")
    return cover_and_crop(image, size)[0]
