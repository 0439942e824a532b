"""GRPO's eager generation with the base sharded by fsdp, when the processes' completions end at different lengths:
every forward of a sharded layer is a collective, so a process that finished early must keep running forwards until
the others finish (transformers' synced_gpus, which Processes.shard turns on by marking the root FSDP-managed), or
the processes wait on each other for ever. On 2 gloo processes each asks for its own number of new tokens; each must
get exactly the tokens the same model gives it unsharded on one process."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from gloo import gloo_process

NEW_TOKENS = (3, 11)  # rank 0 stops after 3 new tokens, rank 1 after 11


def _model(folder: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))  # a LoRA that changes the output


def _generate(network, rank: int) -> torch.Tensor:
    from toolkit.models.generation import EagerGeneration

    torch.manual_seed(100 + rank)
    ids = torch.randint(3, 50, (2, 5 + rank))
    torch.manual_seed(7)
    return EagerGeneration(network)(ids, torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                    max_new_tokens=NEW_TOKENS[rank], min_new_tokens=NEW_TOKENS[rank],
                                    pad_token_id=0, eos_token_id=None)


def _worker(rank: int, world: int, store: str, folder: str, expected: list, errors) -> None:
    with gloo_process(rank, world, store, errors):
        from datetime import timedelta

        from toolkit.train.distributed import Processes

        network = _model(folder)
        accelerator = SimpleNamespace(num_processes=world, process_index=rank, is_main_process=rank == 0,
                                      device=torch.device("cpu"))
        lines = Processes(accelerator).shard({"model": network.get_base_model()}, timedelta(seconds=60))
        assert lines and "blocks" in lines[0], lines
        got = _generate(network, rank)
        assert got.shape[1] == expected[rank].shape[1], (got.shape, expected[rank].shape)
        torch.testing.assert_close(got, expected[rank], rtol=0, atol=0)


def test_fsdp_generation_with_unequal_completion_lengths_gives_each_process_its_unsharded_tokens(tmp_path):
    from toolkit.tiny import write_tiny

    folder = str(write_tiny("llm", tmp_path / "llm"))
    expected = [_generate(_model(folder), rank) for rank in range(2)]  # one process, nothing sharded
    assert [e.shape[1] for e in expected] == [5 + NEW_TOKENS[0], 6 + NEW_TOKENS[1]]
    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(2, str(tmp_path / "store"), folder, expected, errors), nprocs=2, join=True,
                       start_method="spawn")
    assert errors.empty(), errors.get()
