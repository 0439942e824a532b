"""The input embeddings looked up in the processes' shards (device.distributed=fsdp), never gathered whole.

FSDP2 shards the frozen embedding table by rows, as it does the output head (kernels/sharded_cross_entropy.py):
process r holds rows [r * S, (r + 1) * S), S = ceil(vocab / N). Run as an FSDP unit, the table is all-gathered
whole for its forward: for Mistral-Nemo-12B (131k x 5120, bf16) 1.25 GiB on every GPU, and for a moment twice that
(the all-gather's output, then the table copied out of it), at the start of the step, beside the first decoder
layer prefetched. Here the token ids travel instead of the table:
- the processes' token counts are exchanged on the host (a gloo group: no wait for the GPU), and each process's ids,
  padded to the largest count with -1 (no row), are all-gathered;
- each process looks up the ids whose rows it holds (zeros for the others) for every process;
- a reduce-scatter (a sum: every id has one owner) gives each process its own tokens' rows.
Exact: the sums add zeros. tokens x hidden values cross the links, not the table: for 1 x 1024 tokens of a 5120-wide
model on 2 processes, 20 MiB instead of 1.25 GiB. Where the processes' tokens together outnumber the table's rows,
the exchange would be the larger: the unit then gathers the table as FSDP2 does (every process takes that branch,
the counts being the same everywhere).

The table is frozen (LoRA does not train it), so no gradient flows into it, and the lookup of integer ids has none
to give back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class ShardedEmbedding(torch.nn.Module):
    """Stands in for the model's input embeddings (an FSDP2 unit of a plain, frozen nn.Embedding), keeping that unit
    as its child so that the model's parameters stay where they were sharded."""

    def __init__(self, unit: torch.nn.Module, counts_group):
        super().__init__()
        self.unit, self.counts_group = unit, counts_group
        weight = unit.weight
        self.mesh = weight.device_mesh
        self.world = self.mesh.size()
        self.rows = -(-weight.shape[0] // self.world)   # S (FSDP2's dim-0 chunks; the last ones may be short)
        # hooks others put on the embeddings' output (transformers' enable_input_require_grads) follow it here;
        # FSDP2's own (its unshard and reshard) are what this module replaces
        for hook in unit._forward_hooks.values():
            if "fsdp" not in type(getattr(hook, "__self__", None)).__module__:
                self.register_forward_hook(hook)

    @property
    def weight(self) -> torch.Tensor:
        """The sharded table (a DTensor), as the embedding's `weight` (get_input_embeddings().weight readers)."""
        return self.unit.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local, group = self.unit.weight.to_local(), self.mesh.get_group()
        # nn.Embedding refuses an id outside the table; the shards would give it zeros (no process holds it). On a
        # GPU the check runs there, without the host waiting for it (a device-side assert, as the embedding's own)
        torch._assert_async(((ids >= 0) & (ids < self.unit.weight.shape[0])).all(),
                            "input embeddings: a token id is outside the vocabulary (index out of range)")
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(counts, torch.tensor([ids.numel()]), group=self.counts_group)
        most = max(int(c) for c in counts)
        if self.world * most >= self.unit.weight.shape[0]:  # more ids than the table has rows (long sequences on
            return self.unit(ids)                           # many processes): gathering the table is the smaller
        mine = F.pad(ids.reshape(-1), (0, most - ids.numel()), value=-1)
        every = mine.new_empty(self.world * most)
        dist.all_gather_into_tensor(every, mine, group=group)
        within = every - self.mesh.get_local_rank() * self.rows
        held = (within >= 0) & (within < local.shape[0])
        if local.shape[0]:
            rows = F.embedding(torch.where(held, within, 0), local) * held.unsqueeze(-1).to(local.dtype)
        else:  # more processes than the table has chunks: this one holds none
            rows = local.new_zeros(self.world * most, local.shape[1])
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: the sum everywhere, this share kept
            dist.all_reduce(rows, group=group)
            out = rows[self.mesh.get_local_rank() * most:][:most]
        else:
            out = rows.new_empty(most, rows.shape[1])
            dist.reduce_scatter_tensor(out, rows, group=group)
        return out[:ids.numel()].reshape(*ids.shape, rows.shape[1])


def shardable(module: torch.nn.Module) -> bool:
    """Whether `module` (an input embedding, before fully_shard) can be looked up shard by shard: a frozen
    nn.Embedding as torch defines it (a subclass may scale or change its forward), without max_norm."""
    return (isinstance(module, torch.nn.Embedding) and type(module).forward is torch.nn.Embedding.forward
            and module.max_norm is None and not module.weight.requires_grad)
