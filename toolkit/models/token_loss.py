"""The token counts and held-out loss of the causal-LM families (llm, vlm): their losses are sums over label tokens,
which the trainer divides by the step's count."""

from __future__ import annotations

from typing import Any, Callable

import torch

from toolkit.data.samples import IGNORE_INDEX
from toolkit.models.base import Runtime, eval_mode


def label_tokens(labels: torch.Tensor) -> int:
    """Tokens a causal-LM loss counts: labels after the one-token shift that are not IGNORE_INDEX."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


@torch.no_grad()
def mean_token_loss(eval_set: Any, batch_size: int, loss: Callable[[dict], torch.Tensor], network: torch.nn.Module,
                    runtime: Runtime) -> float | None:
    """The mean token loss over a held-out set (its `collate` gives batches with labels): the sum of `loss(batch)`
    (a sum over the batch's label tokens) over their count, with the network in eval mode; None without tokens."""
    total, count = 0.0, 0
    with eval_mode(network):
        for first in range(0, len(eval_set), batch_size):
            batch = eval_set.collate(range(first, min(first + batch_size, len(eval_set))))
            with torch.autocast(runtime.device.type, dtype=runtime.compute_dtype,
                                enabled=runtime.compute_dtype != torch.float32):
                total += float(loss(batch))
            count += label_tokens(batch["labels"])
    return total / count if count else None
