"""The preference and RL losses of the llm objectives, per sequence, on log-probs (TRL's formulas; the tests
check them against TRL's trainers).

Each returns per-unit losses (a pair, an example, a completion); the adapter sums them and the trainer divides
by the step's units, so a step's loss is the mean over every unit of the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))) per pair, and the reward margin
    beta * (...) (TRL's rewards/margins)."""
    margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    return -F.logsigmoid(margin), margin.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends."""
    return torch.where(x > -0.693147, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_losses(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, beta: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO per pair: the chosen completion's NLL (its mean token loss) minus beta * log sigmoid(log odds ratio),
    on mean token log-probs as TRL takes them; and the log odds ratio."""
    chosen_mean, rejected_mean = chosen_mean.float(), rejected_mean.float()
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    return -chosen_mean - beta * F.logsigmoid(log_odds), log_odds.detach()


def kto_losses(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float,
               desirable_weight: float, undesirable_weight: float) -> torch.Tensor:
    """KTO per example: w_d * (1 - sigmoid(beta * (ratio - kl))) for desirable completions, w_u * (1 - sigmoid(
    beta * (kl - ratio))) for undesirable ones; `kl` the batch's (detached, at least 0) KL estimate."""
    ratio = logps - ref_logps
    good = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(desirable.to(ratio.device), good, bad)


def kto_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point: the mean log-ratio of mismatched (prompt, completion) pairs, at least 0, detached."""
    return (logps - ref_logps).mean().clamp(min=0).detach()


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's standard deviation + 1e-4 (TRL's
    scale_rewards='group'); rewards are grouped by consecutive runs of `group`."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(1, keepdim=True)
    std = grouped.std(1, keepdim=True)
    return ((grouped - mean) / (std + 1e-4)).reshape(-1)


def grpo_token_losses(logps: torch.Tensor, advantages: torch.Tensor, ref_logps: torch.Tensor | None,
                      kl_coef: float) -> torch.Tensor:
    """GRPO per token, one policy update per generation (the old policy is the current one, so the ratio is 1 with
    the policy's gradient): -exp(logp - logp.detach()) * A, plus kl_coef * the k3 KL estimate against the
    reference, exp(ref - logp) - (ref - logp) - 1. `advantages` per token."""
    loss = -torch.exp(logps - logps.detach()) * advantages
    if ref_logps is not None and kl_coef > 0:
        delta = ref_logps - logps
        loss = loss + kl_coef * (torch.exp(delta) - delta - 1)
    return loss
