"""Rectified-flow training helpers shared by the flux, sd3 and wan families.

A clean latent x0 and noise n are mixed at sigma in (0, 1): x = (1 - sigma) * x0 + sigma * n, and the
model predicts the velocity n - x0. Sigma is drawn as u (uniform, or logit-normal: the sigmoid of a normal),
then shifted towards the noisy end: by a fixed shift s (SD3: 3, Wan: the scheduler's flow_shift), or by
Flux's resolution-dependent shift whose exponent mu grows with the number of image tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from toolkit.errors import UserError


@dataclass(frozen=True)
class SigmaSampler:
    """Draws training sigmas: u from `distribution`, shifted by `shift` (or Flux's exp(mu) when `mu` is set)."""

    distribution: str = "logit_normal"   # uniform | logit_normal
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    mu: float | None = None              # resolution-dependent (Flux): replaces shift by exp(mu)

    @property
    def factor(self) -> float:
        return math.exp(self.mu) if self.mu is not None else self.shift

    def shifted(self, u: torch.Tensor) -> torch.Tensor:
        """sigma = s*u / (1 + (s-1)*u); the same as Flux's exp(mu) / (exp(mu) + 1/u - 1) with s = exp(mu)."""
        s = self.factor
        return s * u / (1 + (s - 1) * u)

    def unshifted(self, sigma: float) -> float:
        """The u that shifts to `sigma` (the inverse of `shifted`)."""
        s = self.factor
        return sigma / (s - (s - 1) * sigma)

    def sample(self, n: int, device: torch.device, low: float = 0.0, high: float = 1.0,
               p: torch.Tensor | None = None) -> torch.Tensor:
        """n sigmas from the shifted distribution restricted to [low, high) (a Wan 2.2 expert's range), by inverse
        transform of `p` (n uniform values; unset: drawn from torch's global stream)."""
        u_low, u_high = self.unshifted(low), self.unshifted(high)
        if p is None:
            p = torch.rand(n, device=device, dtype=torch.float32)
        if self.distribution == "uniform":
            u = u_low + (u_high - u_low) * p
        elif self.distribution == "logit_normal":
            # inverse-CDF sampling of the normal truncated to the logits of [u_low, u_high]; stays on the device
            cdf_low = _normal_cdf((_logit(u_low) - self.logit_mean) / self.logit_std) if u_low > 0 else 0.0
            cdf_high = _normal_cdf((_logit(u_high) - self.logit_mean) / self.logit_std) if u_high < 1 else 1.0
            q = (cdf_low + (cdf_high - cdf_low) * p).clamp(1e-7, 1 - 1e-7)
            u = torch.sigmoid(self.logit_mean + self.logit_std * torch.special.ndtri(q))
        else:
            raise UserError(f"train.timestep_sampling: '{self.distribution}' is not available for flow matching; "
                            "use uniform or logit_normal")
        # [low, high): the boundary itself belongs to the expert above it
        return self.shifted(u).clamp(max(low, 1e-5), high if high >= 1.0 else high - 1e-6)


def _logit(u: float) -> float:
    return math.log(u / (1 - u))


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def flux_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
            max_shift: float = 1.15) -> float:
    """Flux's shift exponent: linear in the number of image tokens, base_shift at base_seq_len."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + base_shift - slope * base_seq_len


def noisy_latents(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """(1 - sigma) * x0 + sigma * noise, with sigma broadcast over all but the batch dimension."""
    s = sigmas.view(-1, *([1] * (latents.dim() - 1))).to(latents.dtype)
    return (1 - s) * latents + s * noise
