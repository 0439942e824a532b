"""The output head and the cross-entropy in one pass over chunks of tokens: the tokens x vocabulary logits
never exist whole (at 4 x 2048 tokens and a 128k vocabulary they are 2 GiB in bf16 and 4 GiB more in fp32).

Each chunk's logits are made, turned into the chunk's loss and into the gradient of its hidden states (and of
the head's weight where that is trained) at once, and dropped; backward then only scales what forward kept.
The same arithmetic as transformers' causal-LM loss: logits upcast to fp32, optional scale (Cohere, Granite)
and tanh soft-capping (Gemma 2/3), log-sum-exp, labels equal to IGNORE_INDEX left out, a sum over tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from toolkit.data.samples import IGNORE_INDEX

CHUNK_ELEMENTS = 2**26   # fp32 logits per chunk: 256 MiB, whatever the vocabulary
# Compiled, a chunk's fp32 logits are never held (the softmax and one-hot are one kernel over the matmul's bf16
# output), so its chunks are twice as long: 1,024 tokens at a 128k vocabulary, 0.37 GiB more at the peak
# (two bf16 tensors of chunk x vocabulary) and 0.6 ms less a step on one H100 (Llama-3.2-1B shape, 4 x 2048:
# 98.3 against 98.9 and 98.5 ms; 256 tokens took 102.4). bench/results/session-note-2026-11-26i.md.
COMPILED_CHUNK_ELEMENTS = 2**27


@dataclass(frozen=True)
class HeadMath:
    """What the model does to the head's output before its loss: logits * scale, then cap * tanh(logits / cap)."""

    scale: float = 1.0
    softcap: float | None = None


def chunk_rows(vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk: a power of two, so the compiled chunk sees few distinct shapes."""
    return max(16, 2 ** int(math.log2(max(1, elements // vocab))))


def chunk_loss_and_grad(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                        math_: HeadMath) -> tuple[torch.Tensor, torch.Tensor]:
    """For one chunk of rows: (sum of token losses in fp32, d(sum)/d(logits) in the hidden states' dtype)."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 for bf16/fp16, fp64 stays
    if math_.scale != 1.0:
        logits = logits * math_.scale
    if math_.softcap is not None:
        capped = torch.tanh(logits / math_.softcap)
        logits = capped * math_.softcap
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0).unsqueeze(1)
    lse = torch.logsumexp(logits, dim=1)
    loss = torch.where(valid, lse - logits.gather(1, target).squeeze(1), 0.0).sum()
    grad = torch.exp(logits - lse.unsqueeze(1))                       # softmax
    grad = grad - torch.zeros_like(grad).scatter_(1, target, 1.0)    # minus the one-hot target
    grad = grad * valid.unsqueeze(1)
    if math_.softcap is not None:
        grad = grad * (1.0 - capped * capped)
    if math_.scale != 1.0:
        grad = grad * math_.scale
    return loss, grad.to(hidden.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows, math_, chunk, step):
        if rows is None:  # only tokens with a label cost anything (found here: a wait for the device)
            rows = torch.nonzero(labels != IGNORE_INDEX).squeeze(1)
        h = hidden.index_select(0, rows).to(weight.dtype)
        y = labels.index_select(0, rows)
        total = torch.zeros((), dtype=torch.promote_types(weight.dtype, torch.float32), device=hidden.device)
        grad_h = torch.empty_like(h)
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros_like(weight, dtype=accumulate) if weight.requires_grad else None
        grad_b = torch.zeros_like(bias, dtype=accumulate) if bias is not None and bias.requires_grad else None
        for first in range(0, h.shape[0], chunk):
            part = slice(first, first + chunk)
            loss, grad_logits = step(h[part], weight, bias, y[part], math_)
            total += loss
            grad_h[part] = grad_logits @ weight
            if grad_w is not None:
                grad_w.addmm_(grad_logits.t().to(accumulate), h[part].to(accumulate))
            if grad_b is not None:
                grad_b += grad_logits.to(accumulate).sum(0)
        grad_hidden = None
        if hidden.requires_grad:
            grad_hidden = torch.zeros_like(hidden)
            grad_hidden.index_copy_(0, rows, grad_h.to(hidden.dtype))
        ctx.save_for_backward(grad_hidden, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_w, grad_b = ctx.saved_tensors
        scale = lambda g, dtype=None: None if g is None else (g * grad_output).to(dtype or g.dtype)  # noqa: E731
        return (scale(grad_hidden), scale(grad_w, ctx.dtypes[0]), scale(grad_b, ctx.dtypes[1]),
                None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         bias: torch.Tensor | None = None, math_: HeadMath = HeadMath(),
                         step: Callable = chunk_loss_and_grad, chunk: int | None = None,
                         rows: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over tokens of cross_entropy(head(hidden), labels), IGNORE_INDEX left out, in fp32 (fp64 inputs: fp64).

    hidden: (tokens, hidden_size); labels: (tokens,), already aligned (a causal LM shifts them first).
    `step` is chunk_loss_and_grad or its compiled form (compiled_step). `rows`: the indices of the tokens whose
    label is not IGNORE_INDEX, when the caller knows them without asking the device (from host labels)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, bias, labels, rows, math_,
                                         chunk or chunk_rows(weight.shape[0]), step)


def compiled_step() -> Callable:
    """chunk_loss_and_grad through torch.compile: the softmax, one-hot and capping become one fused kernel
    around the two matrix products (chunks of COMPILED_CHUNK_ELEMENTS). Shapes: a fixed chunk and the last,
    smaller one (marked dynamic after the first change, so it compiles twice at most)."""
    return torch.compile(chunk_loss_and_grad)
