"""The run's optimizer: train.optimizer over the LoRA weights, or over this process's share of them with
device.shard_optimizer (train/optimizer_shards.py, ZeRO stage 1)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from omegaconf import OmegaConf

from toolkit.optim import build_optimizer, optimizer_spec


def run_optimizer(train, params: list[torch.nn.Parameter], device_type: str,
                  shard: bool) -> tuple[torch.optim.Optimizer, str]:
    """(optimizer, the reason line the log gives) for the config's train section."""
    reasons: list[str] = []

    def build(group_params):
        optimizer, reason = build_optimizer(
            train.optimizer, group_params, lr=train.lr, betas=tuple(train.betas), eps=train.eps,
            weight_decay=train.weight_decay, backend=train.optimizer_backend, device_type=device_type,
            args=OmegaConf.to_container(train.optimizer_args))
        reasons.append(reason)
        return optimizer

    if not shard:
        return build(params), reasons[0]
    from toolkit.train.optimizer_shards import ShardedOptimizer  # torch.distributed.optim: seconds to import

    sharded = ShardedOptimizer(params, build)
    owned = sum(p.numel() for group in sharded.optim.param_groups for p in group["params"])
    return sharded, (f"{reasons[0]}; device.shard_optimizer: this process steps and keeps the state of "
                     f"{owned:,} of the {sum(p.numel() for p in params):,} LoRA weights (ZeRO stage 1)")


@contextmanager
def evaluation_weights(optimizer: torch.optim.Optimizer, name: str):
    """Inside: the weights an optimizer keeps for evaluation when they differ from those it trains (schedule-free),
    as optimizer `name`'s spec says; for eval, sampling, checkpoints and the export. Others: nothing changes."""
    if not optimizer_spec(name).needs_eval_mode:
        yield
        return
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()
