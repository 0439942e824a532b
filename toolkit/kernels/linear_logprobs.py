"""Per-token log-probs of given tokens through the output head, in chunks of tokens: what the preference and RL
objectives need (a sequence's log-prob is the sum of its tokens'), without the tokens x vocabulary logits ever
existing whole.

Forward makes each chunk's logits (fp32, with the model's scale and soft-cap), takes log_softmax at the target
and d(log p)/d(hidden) = (onehot - softmax) @ W at once, and drops the logits; backward scales each token's
saved row by that token's incoming gradient (the objectives weigh tokens differently, so unlike the cross-entropy
in linear_cross_entropy.py the gradient is kept per token, not summed). The head's weight is frozen here (LoRA
does not adapt the output head); a trained head is refused.
"""

from __future__ import annotations

import torch

from toolkit.kernels.linear_cross_entropy import CHUNK_ELEMENTS, HeadMath, chunk_rows


def chunk_logps_and_grad(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, math_: HeadMath) -> tuple[torch.Tensor, torch.Tensor]:
    """For one chunk of rows: (log p(target) per row in fp32, d(log p)/d(logits) in the hidden states' dtype)."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if math_.scale != 1.0:
        logits = logits * math_.scale
    if math_.softcap is not None:
        capped = torch.tanh(logits / math_.softcap)
        logits = capped * math_.softcap
    logp_all = torch.log_softmax(logits, dim=1)
    logp = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1)
    grad = torch.zeros_like(logp_all).scatter_(1, targets.unsqueeze(1), 1.0) - torch.exp(logp_all)
    if math_.softcap is not None:
        grad = grad * (1.0 - capped * capped)
    if math_.scale != 1.0:
        grad = grad * math_.scale
    return logp, grad.to(hidden.dtype)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, math_, chunk):
        logps = torch.empty(hidden.shape[0], dtype=torch.promote_types(weight.dtype, torch.float32),
                            device=hidden.device)
        grad_h = torch.empty_like(hidden) if hidden.requires_grad else None
        h = hidden.to(weight.dtype)
        for first in range(0, h.shape[0], chunk):
            part = slice(first, first + chunk)
            logps[part], grad_logits = chunk_logps_and_grad(h[part], weight, bias, targets[part], math_)
            if grad_h is not None:
                grad_h[part] = (grad_logits @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad_h)
        return logps

    @staticmethod
    def backward(ctx, grad_output):
        (grad_h,) = ctx.saved_tensors
        grad_hidden = None if grad_h is None else grad_h * grad_output.unsqueeze(1).to(grad_h.dtype)
        return grad_hidden, None, None, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    bias: torch.Tensor | None = None, math_: HeadMath = HeadMath(),
                    chunk: int | None = None) -> torch.Tensor:
    """log_softmax(head(hidden))[target] per row, in fp32 (fp64 inputs: fp64).

    hidden: (rows, hidden_size), the rows whose next token is scored; targets: (rows,) those tokens."""
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("linear_logprobs: the output head must be frozen (LoRA does not adapt it)")
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearLogprobs.apply(hidden, weight, bias, targets, math_,
                                     chunk or chunk_rows(weight.shape[0], CHUNK_ELEMENTS))
