"""The output head and the cross-entropy where the head's rows (the vocabulary) are sharded over the processes
(device.distributed=fsdp), without ever gathering the head whole.

FSDP2 shards a weight by rows: process r holds rows [r * S, (r + 1) * S) of the head, S = ceil(vocab / N) (the
last shards may be shorter). Gathered for the loss, a Mistral-Nemo-12B head (131k x 5120, bf16) holds 1.25 GiB on
every GPU at the peak of the step. Here the vocabulary is walked in blocks instead: block k is every process's
rows [k * b, (k + 1) * b) of its shard, all-gathered into one (N * b, hidden) tensor, so that one block is a fixed
share of the head whatever N (BLOCK_ELEMENTS: 128 MiB in bf16).

- Pass 1 gathers the blocks in turn and keeps each token's running maximum and sum of exponentials (an online
  log-sum-exp, as flash attention does over keys) and its target's logit, from the block that holds it.
- Pass 2 gathers them again and adds each block's share of the hidden states' gradient:
  (softmax - one-hot) @ block, with the scale and tanh soft-cap of HeadMath applied as in linear_cross_entropy.py.

So the head crosses the links twice a step instead of once, and its matrix product runs twice: a few percent of a
12B step, for a peak without the head. The head is frozen (LoRA never trains it), so no head gradient is formed.
Each process computes the loss of its own tokens, as with the head gathered: data parallelism is unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from toolkit.kernels.linear_cross_entropy import CHUNK_ELEMENTS, HeadMath

BLOCK_ELEMENTS = 2**26   # head elements gathered at a time (all processes' rows of one block together)


def _logits(hidden: torch.Tensor, block: torch.Tensor, math_: HeadMath) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's logits in fp32 after the model's scale and soft-cap, and tanh's output for the gradient."""
    logits = (hidden @ block.t()).to(torch.promote_types(block.dtype, torch.float32))
    if math_.scale != 1.0:
        logits = logits * math_.scale
    capped = None
    if math_.softcap is not None:
        capped = torch.tanh(logits / math_.softcap)
        logits = capped * math_.softcap
    return logits, capped


class VocabBlocks:
    """Where each vocabulary row lives once the shards are walked in blocks, and the gather of one block."""

    def __init__(self, local: torch.Tensor, vocab: int, world: int, group=None, block_elements: int = BLOCK_ELEMENTS):
        self.local, self.vocab, self.world, self.group = local, vocab, world, group
        self.shard = math.ceil(vocab / self.world)        # rows per process (FSDP2's dim-0 chunks)
        rows_per_block = max(1, block_elements // max(1, local.shape[1] * self.world))
        self.count = math.ceil(self.shard / rows_per_block)
        self.rows = math.ceil(self.shard / self.count)    # b: each process's rows in one block
        offsets = torch.arange(self.world * self.rows, device=local.device)
        self.owner, self.within = offsets // self.rows, offsets % self.rows

    def gather(self, k: int) -> torch.Tensor:
        """Block k: rows [k * b, (k + 1) * b) of every process's shard, process by process (zeros past a shard's end)."""
        piece = self.local[k * self.rows:(k + 1) * self.rows]
        if piece.shape[0] < self.rows:
            piece = torch.cat([piece, piece.new_zeros(self.rows - piece.shape[0], piece.shape[1])])
        out = piece.new_empty(self.world * self.rows, piece.shape[1])
        dist.all_gather_into_tensor(out, piece.contiguous(), group=self.group)
        return out

    def valid(self, k: int) -> torch.Tensor:
        """Block k's columns that are vocabulary rows (not padding past a shard's or the vocabulary's end)."""
        row = k * self.rows + self.within
        return (row < self.shard) & (self.owner * self.shard + row < self.vocab)

    def place(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each label's block and its column in that block."""
        owner, row = labels // self.shard, labels % self.shard
        return row // self.rows, owner * self.rows + row % self.rows


class _ShardedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, local, labels, rows, vocab, math_, group, block_elements):
        blocks = VocabBlocks(local, vocab, dist.get_world_size(group), group, block_elements)
        h = hidden.index_select(0, rows).to(local.dtype)
        block_of, column = blocks.place(labels.index_select(0, rows))
        chunk = max(1, CHUNK_ELEMENTS // (blocks.world * blocks.rows))
        accumulate = torch.promote_types(local.dtype, torch.float32)
        top = torch.full((h.shape[0],), -math.inf, dtype=accumulate, device=h.device)
        total = torch.zeros_like(top)
        target = torch.zeros_like(top)
        for k in range(blocks.count):                     # pass 1: log-sum-exp and target logits
            block, valid = blocks.gather(k), blocks.valid(k)
            for first in range(0, h.shape[0], chunk):
                part = slice(first, first + chunk)
                logits, _ = _logits(h[part], block, math_)
                logits = logits.masked_fill(~valid, -math.inf)
                new_top = torch.maximum(top[part], logits.amax(1))
                total[part] = total[part] * torch.exp(top[part] - new_top) + torch.exp(
                    logits - new_top.unsqueeze(1)).sum(1)
                top[part] = new_top
                here = block_of[part] == k
                picked = logits.gather(1, torch.where(here, column[part], 0).unsqueeze(1)).squeeze(1)
                target[part] += torch.where(here, picked, 0.0)
        lse = top + torch.log(total)
        loss = (lse - target).sum()
        grad_h = torch.zeros(h.shape, dtype=accumulate, device=h.device) if hidden.requires_grad else None
        for k in range(blocks.count if grad_h is not None else 0):   # pass 2: the hidden states' gradient
            block, valid = blocks.gather(k), blocks.valid(k)
            for first in range(0, h.shape[0], chunk):
                part = slice(first, first + chunk)
                logits, capped = _logits(h[part], block, math_)
                grad = torch.exp(logits - lse[part].unsqueeze(1)) * valid
                here = block_of[part] == k
                grad.scatter_add_(1, torch.where(here, column[part], 0).unsqueeze(1), -here.to(grad.dtype).unsqueeze(1))
                if capped is not None:
                    grad = grad * (1.0 - capped * capped)
                if math_.scale != 1.0:
                    grad = grad * math_.scale
                grad_h[part] += (grad.to(block.dtype) @ block).to(accumulate)
        grad_hidden = None
        if grad_h is not None:
            grad_hidden = torch.zeros_like(hidden)
            grad_hidden.index_copy_(0, rows, grad_h.to(hidden.dtype))
        ctx.save_for_backward(grad_hidden)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        (grad_hidden,) = ctx.saved_tensors
        grad = None if grad_hidden is None else (grad_hidden * grad_output).to(grad_hidden.dtype)
        return grad, None, None, None, None, None, None, None


def sharded_linear_cross_entropy(hidden: torch.Tensor, local: torch.Tensor, vocab: int, labels: torch.Tensor,
                                 rows: torch.Tensor, group=None, math_: HeadMath = HeadMath(),
                                 block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """Sum over this process's tokens of cross_entropy(head(hidden), labels), the head given as this process's
    shard `local` of its rows (vocab rows in all). hidden: (tokens, hidden_size); labels: (tokens,), aligned;
    rows: the indices of the tokens whose label counts. Every process of `group` calls it at the same point
    (the blocks are gathered collectively), each with tokens of its own."""
    if local.requires_grad:
        raise ValueError("sharded_linear_cross_entropy: the head is frozen here (no head gradient is formed)")
    with torch.autocast(hidden.device.type, enabled=False):
        return _ShardedLinearCrossEntropy.apply(hidden, local, labels, rows, vocab, math_, group, block_elements)
