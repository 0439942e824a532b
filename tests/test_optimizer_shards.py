"""device.shard_optimizer (train/optimizer_shards.py): ZeRO stage 1 over gloo processes. Each process holds 1/N of
the AdamW state, every process ends each step with the same weights, those of a plain AdamW given the same
gradients, and the whole state it saves loads at another process count. Then through the real entry point: fsdp
on 2 and 4 processes trains what one process trains, and resumes across process counts."""

from __future__ import annotations

import copy
import hashlib
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from gloo import gloo_process
from test_multiprocess import LLM, adapter, train
from toolkit.train.checkpoint import find_latest_checkpoint, load_checkpoint_state
from toolkit.train.optimizer_shards import ShardedOptimizer

SIZES = [(16, 8), (8, 16), (4, 32), (32, 4), (2, 64), (64, 2), (128,), (8, 8, 2)]  # 128 elements each
TOTAL = 128 * len(SIZES)


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(size, generator=gen)) for size in SIZES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(size, generator=gen) for size in SIZES]


def _adamw(groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=True)


def _run(steps: int, params, optimizer) -> None:
    for step in range(steps):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _worker(rank: int, world: int, store: str, results, resume_from) -> None:
    with gloo_process(rank, world, store):
        params = _params()
        storage = [p.data_ptr() for p in params]
        optimizer = ShardedOptimizer(params, _adamw)
        if resume_from is not None:
            weights, state = resume_from
            with torch.no_grad():
                for p, w in zip(params, weights):
                    p.copy_(w)
            optimizer.load_state_dict(state)
        _run(3, params, optimizer)
        optimizer.gather_state()
        state = optimizer.state_dict() if rank == 0 else None
        # the weights keep their storage (a CUDA graph captured before the optimizer reads them there)
        assert [p.data_ptr() for p in params] == storage
        results[rank] = ([p.detach().clone() for p in params], optimizer.owned_elements(), state)


def _spawn(world: int, tmp_path, resume_from=None) -> dict:
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, str(tmp_path / f'store-{world}'), results, resume_from), nprocs=world)
    return dict(results)


def _digest(tensors) -> str:
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in tensors)).hexdigest()


def test_each_process_keeps_one_nth_of_the_state_and_all_end_with_the_plain_optimizers_weights(tmp_path):
    plain_params = _params()
    plain = _adamw(plain_params)
    _run(3, plain_params, plain)
    _run(3, plain_params, plain)  # the resumed halves below continue to 6 steps
    two = _spawn(2, tmp_path)
    # two moments per weight, each process those of its half of the tensors
    assert sorted(owned for _, owned, _ in two.values()) == [TOTAL, TOTAL]  # 2 x TOTAL / 2
    assert _digest(two[0][0]) == _digest(two[1][0])
    saved = two[0][2]
    assert sorted(saved["state"]) == list(range(len(SIZES)))
    assert saved["param_groups"][0]["fused"] is True and saved["param_groups"][0]["lr"] == 1e-2
    # the whole state loads at 4 processes (a quarter each) and into a plain AdamW: 6 steps as one process's
    # (a copy: spawn hands tensors over in shared memory, and the optimizers step the loaded state in place)
    four = _spawn(4, tmp_path, resume_from=(two[0][0], copy.deepcopy(saved)))
    assert [four[r][1] for r in range(4)] == [TOTAL // 2] * 4
    assert len({_digest(four[r][0]) for r in range(4)}) == 1
    for got, want in zip(four[0][0], plain_params):
        assert torch.equal(got, want.detach())
    for index, want in enumerate(plain.state_dict()["state"].values()):
        assert torch.equal(four[0][2]["state"][index]["exp_avg_sq"], want["exp_avg_sq"])
    reloaded_params = [torch.nn.Parameter(w.clone()) for w in two[0][0]]
    reloaded = _adamw(reloaded_params)
    reloaded.load_state_dict(saved)
    _run(3, reloaded_params, reloaded)
    assert _digest([p.detach() for p in reloaded_params]) == _digest(four[0][0])


@pytest.mark.slow
def test_fsdp_on_two_then_four_processes_trains_what_one_process_trains(tmp_path):
    """fsdp with the optimizer sharded: 2 processes, resumed bit for bit on 2 and, from the same checkpoint, on 4
    (global batch 8 throughout), against one process with batch 8."""
    common = ["data.max_seq_len=32", "save.every=4", "device.distributed=fsdp", "device.shard_optimizer=true"]
    one = train(1, LLM, tmp_path / "one", "train.steps=8", "train.batch_size=8", *common)
    whole = train(2, LLM, tmp_path / "whole", "train.steps=8", "train.batch_size=4", *common)
    first = train(2, LLM, tmp_path / "two", "train.steps=4", "train.batch_size=4", *common)
    assert one.returncode == 0 and whole.returncode == 0 and first.returncode == 0, first.stderr
    assert "shard_optimizer: true" in (tmp_path / "two" / "config.yaml").read_text()  # as set
    assert "this process steps and keeps the state of 16,384 of the 32,768 LoRA weights" in first.stderr
    # the checkpoint holds the whole AdamW state, in the plain optimizer's format
    saved = load_checkpoint_state(find_latest_checkpoint(tmp_path / "two" / "checkpoints").path / "optimizer.pt")
    assert len(saved["state"]) == 28 and sum(s["exp_avg"].numel() for s in saved["state"].values()) == 32_768
    shutil.copytree(tmp_path / "two", tmp_path / "four")
    again = train(2, LLM, tmp_path / "two", "train.steps=8", "train.batch_size=4", *common)
    four = train(4, LLM, tmp_path / "four", "train.steps=8", "train.batch_size=2", *common)
    assert again.returncode == 0 and four.returncode == 0, four.stderr
    assert "this process steps and keeps the state of 8,192 of the 32,768 LoRA weights" in four.stderr
    assert four.stderr.count("processes: LoRA weights identical on all 4") == 1
    a, w, b, c = (adapter(tmp_path / name) for name in ("one", "whole", "two", "four"))
    assert all(torch.equal(w[k], b[k]) for k in w)  # resumed on 2: bit for bit
    assert max((a[k] - c[k]).abs().max().item() for k in a) <= 1e-5
    assert max((a[k] - w[k]).abs().max().item() for k in a) <= 1e-5


class _Facts:
    """What the loaded-stage rule reads: the two settings as asked, the process count, whether fsdp sharded."""

    def __init__(self, setting, optimizer: str, processes: int, sharded: bool):
        self.settings = {"device.shard_optimizer": setting, "train.optimizer": optimizer}
        self.extra = {"processes": processes, "sharded": sharded}

    def asked(self, key: str):
        return self.settings[key]


@pytest.mark.parametrize("setting, optimizer, processes, sharded, value", [
    ("auto", "adamw", 2, True, True),        # fsdp: on, measured: 0.21 GiB per GPU, no step-rate cost beyond noise
    ("auto", "adamw8bit", 4, True, True),
    ("auto", "adamw", 2, False, False),      # ddp: off
    ("auto", "prodigy", 2, True, False),     # one step size from every tensor
    (True, "adamw", 1, False, False),        # one process: nothing to share
    (True, "adamw", 2, False, None),         # as set (ddp too)
    (False, "adamw", 2, True, None),
])
def test_shard_optimizer_rule(setting, optimizer, processes, sharded, value):
    from toolkit.plan.loaded_rules import shard_optimizer

    decision = shard_optimizer(_Facts(setting, optimizer, processes, sharded))
    assert (None if decision is None else decision.value) is value


def test_shard_optimizer_true_with_prodigy_is_a_config_error(run_cli, capsys, tmp_path):
    code = run_cli("validate", LLM, f"run.output_dir={tmp_path / 'run'}", "train.optimizer=prodigy",
                   "device.shard_optimizer=true")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "'device.shard_optimizer' is true, but train.optimizer=prodigy steps every LoRA tensor together" in err
    assert "fix: set device.shard_optimizer to auto or false" in err


def _skip_worker(rank: int, world: int, store: str, results) -> None:
    with gloo_process(rank, world, store):
        params = _params()
        optimizer = ShardedOptimizer(params, _adamw)
        _run(1, params, optimizer)
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, _grads(1)):
            p.grad = g
        optimizer.found_inf = torch.ones(())  # what the trainer sets for a non-finite loss (train/step.py)
        optimizer.step()
        skipped = all(torch.equal(a, p.detach()) for a, p in zip(before, params))
        optimizer.found_inf = torch.zeros(())
        optimizer.step()
        results[rank] = (optimizer._step_supports_amp_scaling, skipped,
                         not any(torch.equal(a, p.detach()) for a, p in zip(before, params)))


def test_a_non_finite_step_is_skipped_on_every_process_without_a_wait(tmp_path):
    """fused AdamW's found_inf reaches each process's local optimizer: the step is skipped on the device, and a
    finite one then moves every tensor, owned or not."""
    results = mp.Manager().dict()
    mp.spawn(_skip_worker, args=(2, str(tmp_path / 'store'), results), nprocs=2)
    assert dict(results) == {0: (True, True, True), 1: (True, True, True)}
