"""The diffusion training objectives, written once: noise the clean latents, say what the denoiser must
predict, and weight the per-sample losses. A family writes only its denoiser forward (`predict`).

- DDPMObjective (sd, sdxl): timesteps from the DDPM schedule, epsilon or v-prediction target, noise offset,
  Min-SNR-gamma weighting.
- FlowObjective (flux, sd3, wan, ...): rectified flow, x = (1 - sigma) x0 + sigma n, target n - x0, sigmas from
  the family's shifted sampler (toolkit/models/flow_matching.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from toolkit.errors import UserError
from toolkit.models.flow_matching import SigmaSampler, noisy_latents
from toolkit.models.sample_draws import SampleDraws


@dataclass
class Noised:
    """One noised batch: the denoiser's input, its noise level and what it must predict."""

    noisy: torch.Tensor
    t: torch.Tensor          # DDPM: integer timesteps; flow: sigmas in (0, 1)
    target: torch.Tensor


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error of each sample, in fp32; `weight` (broadcast over the error: a loss mask) multiplies
    each value first."""
    error = (pred.float() - target.float()).pow(2)
    if weight is not None:
        error = error * weight
    return error.flatten(1).mean(dim=1)


def sample_timesteps(kind: str, batch: int, num_train_timesteps: int, device: torch.device,
                     logit_mean: float = 0.0, logit_std: float = 1.0, draws: SampleDraws | None = None) -> torch.Tensor:
    """uniform over [0, T); logit_normal: the sigmoid of a normal(logit_mean, logit_std), which favours the
    middle timesteps. `draws`: each sample's own generator (sample_draws.py), else torch's global stream."""
    if kind == "uniform":
        if draws is not None:
            return (draws.uniform() * num_train_timesteps).long().clamp(max=num_train_timesteps - 1)
        return torch.randint(0, num_train_timesteps, (batch,), device=device)
    if kind == "logit_normal":
        normal = draws.normal(()) if draws is not None else torch.randn(batch, device=device)
        u = torch.sigmoid(logit_mean + logit_std * normal)
        return (u * num_train_timesteps).long().clamp(max=num_train_timesteps - 1)
    raise UserError(f"train.timestep_sampling: unknown '{kind}'; available: uniform, logit_normal")


def min_snr_weights(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023): min(SNR, gamma)/SNR for eps, /(SNR+1) for v."""
    alpha = alphas_cumprod.to(timesteps.device)[timesteps].float()
    snr = alpha / (1 - alpha)
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr


class DDPMObjective:
    """Epsilon or v-prediction over a DDPM noise schedule (the model's scheduler config)."""

    PREDICTION_TYPES = ("epsilon", "v_prediction")

    def __init__(self, scheduler_config, train_cfg, model_name: str):
        from diffusers import DDPMScheduler

        self.scheduler = DDPMScheduler.from_config(scheduler_config)
        self.prediction_type = self.scheduler.config.prediction_type
        if self.prediction_type not in self.PREDICTION_TYPES:
            raise UserError(f"{model_name}: scheduler prediction_type '{self.prediction_type}' is not supported; "
                            "the sd/sdxl families train epsilon and v_prediction")
        self.sampling = train_cfg.timestep_sampling
        self.logit_mean, self.logit_std = train_cfg.logit_mean, train_cfg.logit_std
        self.noise_offset = train_cfg.noise_offset
        self.min_snr_gamma = train_cfg.min_snr_gamma

    def noise(self, latents: torch.Tensor, low: float = 0.0, high: float = 1.0,
              draws: SampleDraws | None = None) -> Noised:
        """The latents noised at random timesteps; `draws`: each sample's own generator, else the global stream."""
        noise = draws.normal(latents.shape[1:], latents.dtype) if draws is not None else torch.randn_like(latents)
        if self.noise_offset:
            offset = (draws.normal((latents.shape[1], 1, 1)) if draws is not None else
                      torch.randn(latents.shape[0], latents.shape[1], 1, 1, device=latents.device))
            noise = noise + self.noise_offset * offset
        timesteps = sample_timesteps(self.sampling, latents.shape[0], self.scheduler.config.num_train_timesteps,
                                     latents.device, self.logit_mean, self.logit_std, draws)
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        target = noise if self.prediction_type == "epsilon" else self.scheduler.get_velocity(latents, noise, timesteps)
        return Noised(noisy, timesteps, target)

    def noise_at(self, latents: torch.Tensor, noise: torch.Tensor, level: float) -> Noised:
        """`latents` noised with `noise` at the timestep `level` of the way through the schedule (the eval loss's
        fixed levels; no noise offset)."""
        steps = self.scheduler.config.num_train_timesteps
        timesteps = torch.full((latents.shape[0],), min(int(level * steps), steps - 1), device=latents.device)
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        target = noise if self.prediction_type == "epsilon" else self.scheduler.get_velocity(latents, noise, timesteps)
        return Noised(noisy, timesteps, target)

    def loss(self, pred: torch.Tensor, noised: Noised, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample losses (Min-SNR weighted when train.min_snr_gamma is set; `weight`: a loss mask)."""
        error = F.mse_loss(pred.float(), noised.target.float(), reduction="none")
        if weight is not None:
            error = error * weight
        per_sample = error.mean(dim=tuple(range(1, pred.dim())))
        if self.min_snr_gamma:
            per_sample = per_sample * min_snr_weights(self.scheduler.alphas_cumprod, noised.t, self.min_snr_gamma,
                                                      self.prediction_type)
        return per_sample


class FlowObjective:
    """Rectified flow: the velocity n - x0 at sigmas from the family's sampler (which may depend on the
    latents' size, as Flux's resolution-dependent shift does), restricted to [low, high)."""

    def __init__(self, sampler_for: Callable[[torch.Tensor], SigmaSampler]):
        self.sampler_for = sampler_for

    def noise(self, latents: torch.Tensor, low: float = 0.0, high: float = 1.0,
              draws: SampleDraws | None = None) -> Noised:
        """The latents noised at random sigmas; `draws`: each sample's own generator, else the global stream."""
        noise = draws.normal(latents.shape[1:], latents.dtype) if draws is not None else torch.randn_like(latents)
        sigmas = self.sampler_for(latents).sample(latents.shape[0], latents.device, low, high,
                                                  draws.uniform() if draws is not None else None)
        return Noised(noisy_latents(latents, noise, sigmas), sigmas, noise - latents)

    def noise_at(self, latents: torch.Tensor, noise: torch.Tensor, level: float) -> Noised:
        """`latents` noised with `noise` at the sigma the family's shift maps `level` to (the eval loss's fixed
        levels)."""
        u = torch.full((latents.shape[0],), level, device=latents.device, dtype=torch.float32)
        sigmas = self.sampler_for(latents).shifted(u).clamp(1e-5, 1.0)
        return Noised(noisy_latents(latents, noise, sigmas), sigmas, noise - latents)

    def loss(self, pred: torch.Tensor, noised: Noised, weight: torch.Tensor | None = None) -> torch.Tensor:
        return per_sample_mse(pred, noised.target, weight)
