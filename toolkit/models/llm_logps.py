"""Per-token log-probs of a batch's labelled tokens, for the llm objectives beyond sft.

Where the fused loss can apply (a plain Linear head of a model type llm_loss.py has checked), the decoder runs
alone and the head's log-probs are taken in chunks (kernels/linear_logprobs.py): the tokens x vocabulary
logits never exist whole. Otherwise the model's own logits are used (log_softmax in fp32), and the log says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.data.samples import IGNORE_INDEX
from toolkit.kernels.linear_cross_entropy import HeadMath
from toolkit.kernels.linear_logprobs import linear_logprobs
from toolkit.models.llm_loss import HEAD_MATH, gathered


@dataclass
class TokenLogps:
    """The labelled tokens' log-probs (`values`, flat) and the row of each (`rows`), for `count` rows."""

    values: torch.Tensor
    rows: torch.Tensor
    count: int

    def sums(self) -> torch.Tensor:
        """Each row's sequence log-prob."""
        return torch.zeros(self.count, dtype=self.values.dtype, device=self.values.device).index_add(
            0, self.rows, self.values)

    def tokens(self) -> torch.Tensor:
        return torch.zeros(self.count, dtype=self.values.dtype, device=self.values.device).index_add(
            0, self.rows, torch.ones_like(self.values))

    def means(self) -> torch.Tensor:
        """Each row's mean token log-prob."""
        return self.sums() / self.tokens().clamp(min=1)


def head_math_for(network: torch.nn.Module) -> HeadMath | None:
    """The head's math where the chunked log-probs apply to this PEFT model, else None."""
    base = network.get_base_model()
    head = base.get_output_embeddings()
    model_type = getattr(base.config, "model_type", "?")
    if (model_type not in HEAD_MATH or type(head) is not torch.nn.Linear
            or type(head.weight) is not torch.nn.Parameter or not type(base).__module__.startswith("transformers.")):
        return None
    return HEAD_MATH[model_type](base.config)


class TokenScorer:
    """Calls a forward module (the decoder's hidden states with `math_`, else the whole model's logits) on a
    batch of rows and returns its labelled tokens' log-probs."""

    def __init__(self, network: torch.nn.Module, math_: HeadMath | None, device: torch.device):
        self.network, self.math, self.device = network, math_, device

    def __call__(self, module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> TokenLogps:
        labels = batch["labels"]
        shifted = labels[:, 1:]
        flat = torch.nonzero(shifted.reshape(-1) != IGNORE_INDEX).squeeze(1)   # on the host: no wait for the device
        rows = (flat // shifted.shape[1]).to(self.device, non_blocking=True)
        targets = shifted.reshape(-1)[flat].to(self.device, non_blocking=True)
        flat = flat.to(self.device, non_blocking=True)
        inputs = {k: batch[k].to(self.device, non_blocking=True) for k in ("input_ids", "attention_mask") if k in batch}
        if self.math is not None:
            hidden = module(**inputs)
            hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, flat)
            head = self.network.get_base_model().get_output_embeddings()
            with gathered(head):
                values = linear_logprobs(hidden, head.weight, targets, bias=head.bias, math_=self.math)
            return TokenLogps(values, rows, labels.shape[0])
        logits = module(**inputs, use_cache=False).logits[:, :-1]
        picked = logits.reshape(-1, logits.shape[-1]).index_select(0, flat).float()
        values = torch.log_softmax(picked, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        return TokenLogps(values, rows, labels.shape[0])
