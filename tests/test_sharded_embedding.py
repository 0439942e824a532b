"""The input embeddings looked up in FSDP2's row shards (kernels/sharded_embedding.py), on 2 and 3 gloo processes:
each process gets exactly the rows nn.Embedding gives for its own ids (of a length its own, the first and last
rows of a vocabulary that does not divide evenly among them), the FSDP unit's own forward (its all-gather of the
whole table) never runs unless the ids outnumber the table's rows, and hooks others put on the embeddings' output
still run."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from gloo import gloo_process

VOCAB, HIDDEN = 37, 8


def _worker(rank: int, world: int, store: str, errors) -> None:
    with gloo_process(rank, world, store, errors):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from toolkit.kernels.sharded_embedding import ShardedEmbedding, shardable

        torch.manual_seed(0)
        whole = torch.nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)   # the same table on every process
        unit = torch.nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)
        unit.load_state_dict(whole.state_dict())
        assert shardable(unit)
        hooked = []
        unit.register_forward_hook(lambda module, args, out: out.requires_grad_(True))  # as enable_input_require_grads
        fully_shard(unit, mesh=init_device_mesh("cpu", (world,)))
        unit.register_forward_pre_hook(lambda module, args: hooked.append("unit forward"))
        lookup = ShardedEmbedding(unit, None)
        for length in (5 + 3 * rank, 1 + rank, 9):                   # each process its own number of ids
            torch.manual_seed(10 * length + rank)
            ids = torch.randint(0, VOCAB, (1, length))
            ids[0, 0] = 0 if rank % 2 else VOCAB - 1
            got = lookup(ids)
            assert got.shape == (1, length, HIDDEN) and got.requires_grad
            torch.testing.assert_close(got.detach(), whole(ids), rtol=0, atol=0)
        assert hooked == []                                            # the table was never gathered
        # an id outside the table is refused, as nn.Embedding refuses it, not looked up as zeros
        for bad in (VOCAB, -1):
            with pytest.raises(RuntimeError, match="outside the vocabulary"):
                lookup(torch.tensor([[1, bad]]))
        # more ids over the processes than the table has rows: the unit gathers it (the smaller exchange), the same rows
        ids = torch.arange(VOCAB).reshape(1, VOCAB)
        torch.testing.assert_close(lookup(ids).detach(), whole(ids), rtol=0, atol=0)
        assert hooked == ["unit forward"]


@pytest.mark.parametrize("world", [2, 3])
def test_each_process_gets_its_own_ids_rows_exactly(world, tmp_path):
    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(world, str(tmp_path / "store"), errors), nprocs=world, join=True, start_method="spawn")
    assert errors.empty()


def test_only_a_plain_frozen_embedding_is_looked_up_in_shards():
    from toolkit.kernels.sharded_embedding import shardable

    class Scaled(torch.nn.Embedding):  # as Gemma 3's scaled word embeddings: a forward of its own
        def forward(self, ids):
            return super().forward(ids) * 2.0

    assert shardable(torch.nn.Embedding(4, 2).requires_grad_(False))
    assert not shardable(torch.nn.Embedding(4, 2))                              # trained: it needs its gradient
    assert not shardable(Scaled(4, 2).requires_grad_(False))
    assert not shardable(torch.nn.Embedding(4, 2, max_norm=1.0).requires_grad_(False))
    assert not shardable(torch.nn.Linear(2, 2))
