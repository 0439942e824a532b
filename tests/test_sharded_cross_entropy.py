"""The cross-entropy over a head sharded by rows (kernels/sharded_cross_entropy.py), on 2 and 3 gloo processes:
each process's loss and hidden-state gradient equal linear_cross_entropy's over the whole head, for its own
tokens, with a vocabulary that does not divide evenly, several blocks, and the scale and soft-cap heads."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from gloo import gloo_process
from toolkit.kernels.linear_cross_entropy import HeadMath, linear_cross_entropy
from toolkit.kernels.sharded_cross_entropy import VocabBlocks, sharded_linear_cross_entropy

VOCAB, HIDDEN, TOKENS = 37, 8, 11
CASES = [HeadMath(), HeadMath(scale=0.5), HeadMath(softcap=3.0)]


def _worker(rank: int, world: int, store: str, block_sizes: list[int], errors) -> None:
    with gloo_process(rank, world, store, errors):
        torch.manual_seed(0)
        weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)       # the same head on every process
        local = weight.chunk(world)[rank]                               # FSDP2's dim-0 shard
        torch.manual_seed(1 + rank)                                     # tokens of its own
        labels = torch.randint(0, VOCAB, (TOKENS,))
        labels[[2, 7]] = -100
        labels[0], labels[1] = 0, VOCAB - 1                            # the first and last row of the vocabulary
        rows = torch.nonzero(labels != -100).squeeze(1)
        for math_, block_elements in [(m, b) for m in CASES for b in block_sizes]:
            hidden = torch.randn(TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
            loss = sharded_linear_cross_entropy(hidden, local, VOCAB, labels, rows, math_=math_,
                                                block_elements=block_elements)
            loss.backward(torch.tensor(0.5, dtype=torch.float64))
            expected_hidden = hidden.detach().clone().requires_grad_()
            expected = linear_cross_entropy(expected_hidden, weight, labels, math_=math_)
            expected.backward(torch.tensor(0.5, dtype=torch.float64))
            torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(hidden.grad, expected_hidden.grad, rtol=1e-10, atol=1e-10)
            assert hidden.grad[[2, 7]].abs().sum() == 0                 # ignored tokens get no gradient


@pytest.mark.parametrize("world, block_sizes", [(2, [10**6, 3 * HIDDEN * 2]), (3, [2 * HIDDEN * 3])])
def test_each_process_gets_the_whole_head_s_loss_and_gradient_for_its_tokens(world, block_sizes, tmp_path):
    """One block (the whole head), and blocks of 3 or 2 rows per process (7 and 4 blocks, the last padded)."""
    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(world, str(tmp_path / "store"), block_sizes, errors), nprocs=world, join=True,
                       start_method="spawn")
    assert errors.empty()


def test_blocks_cover_every_vocabulary_row_once():
    """The blocks' valid columns, over every block and process, are each row of the vocabulary exactly once, and
    place() finds each label where the block gather puts it (the layout, without processes)."""
    for vocab, world, elements in [(37, 2, 48), (37, 3, 48), (64, 4, 10**6), (5, 4, 8)]:
        blocks = VocabBlocks(torch.zeros(-(-vocab // world), 8), vocab, world, block_elements=elements)
        seen = []
        for k in range(blocks.count):
            valid = blocks.valid(k)
            seen += (blocks.owner * blocks.shard + k * blocks.rows + blocks.within)[valid].tolist()
        assert sorted(seen) == list(range(vocab))
        block_of, column = blocks.place(torch.arange(vocab))
        for label in range(vocab):
            k, c = block_of[label].item(), column[label].item()
            assert blocks.valid(k)[c]
            assert blocks.owner[c] * blocks.shard + k * blocks.rows + blocks.within[c] == label
