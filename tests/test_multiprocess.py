"""Several training processes on the CPU (gloo), through the real entry point (`train ... --gpus 2`): the ranks
end with the same LoRA, 2 processes x batch b train the same LoRA as 1 process x batch 2b, there is one run
folder and one log stream, and a run killed with kill -9 resumes on 2 processes bit for bit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_toolkit
from helpers import read_metrics
from toolkit.plan.decisions import RunPlan
from toolkit.train.checkpoint import find_latest_checkpoint

LLM = str(REPO / "configs/examples/quickstart_llm.yaml")
SD = str(REPO / "configs/examples/quickstart_sd.yaml")
# fp32 AdamW, no sampling: the comparisons are of the training arithmetic alone.
COMMON = ["train.optimizer=adamw", "train.lr=3e-3", "log.every=1", "log.tensorboard=false", "sample.prompts=[]",
          "save.dtype=fp32", "save.keep_last=20"]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """These runs fill latent and text caches of their own, so other tests' cache counts stay as they expect."""
    ENV["TOOLKIT_CACHE"] = str(tmp_path_factory.mktemp("multiprocess-cache"))
    yield
    del ENV["TOOLKIT_CACHE"]


def train(processes: int, config: str, out: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    launch = ["--gpus", str(processes)] if processes > 1 else []
    proc = run_toolkit("train", config, f"run.output_dir={out}", *COMMON, *extra, *launch, timeout=timeout, env=ENV)
    print(proc.stderr, file=sys.stderr)
    return proc


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (torch's launcher starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def kill_9(pid: int) -> None:
    for member in process_tree(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "adapter_model.safetensors"))


def test_two_processes_train_what_one_process_trains_with_twice_the_batch(tmp_path):
    # 32 tokens a sequence: with fsdp, 2 x 4 x 32 ids stay fewer than tiny:llm's 400 rows, so the embeddings are
    # looked up in the shards (kernels/sharded_embedding.py) rather than gathered
    short = "data.max_seq_len=32"
    one = train(1, LLM, tmp_path / "one", "train.steps=8", "train.batch_size=8", short)
    # the ddp run also groups q/k/v and gate/up (model.fuse_projections): the same numbers as PEFT's own layers
    two = train(2, LLM, tmp_path / "two", "train.steps=8", "train.batch_size=4", "model.fuse_projections=true", short)
    sharded = train(2, LLM, tmp_path / "sharded", "train.steps=8", "train.batch_size=4", "device.distributed=fsdp",
                    "model.kernels=fused", short)
    assert one.returncode == 0 and two.returncode == 0 and sharded.returncode == 0
    a, b, c = adapter(tmp_path / "one"), adapter(tmp_path / "two"), adapter(tmp_path / "sharded")
    assert a.keys() == b.keys() == c.keys() and len(a) == 28
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert max((a[k] - c[k]).abs().max().item() for k in a) <= 1e-5
    assert "device.distributed=ddp (auto: the CPU is never sharded automatically)" in two.stderr
    assert "device.distributed=fsdp (set in the config): the frozen base is sharded over 2 processes" in sharded.stderr
    assert sharded.stderr.count("processes: LoRA weights identical on all 2") == 1
    # fsdp: the untied embeddings and head of tiny:llm are units of their own, and the fused loss reads the head
    # block by block from the processes' shards (kernels/sharded_cross_entropy.py): the same LoRA as one process
    # and the embeddings are looked up in the shards (kernels/sharded_embedding.py), never gathered
    assert ("device.distributed=fsdp: sharded model: 2 blocks (LlamaDecoderLayer) + input embeddings and output "
            "head, each its own unit (the embeddings looked up in the processes' shards, never gathered whole)"
            ) in sharded.stderr
    assert ("model.kernels=fused: output head and cross-entropy in chunks, no full logits; an output head sharded as "
            "a unit of its own is read block by block from the processes' shards, never gathered whole") in sharded.stderr
    # the same mean loss at every step (the loss is the mean over every token of the global batch)
    losses_one = [r["loss"] for r in read_metrics(tmp_path / "one")]
    losses_two = [r["loss"] for r in read_metrics(tmp_path / "two")]
    assert losses_two == pytest.approx(losses_one, rel=1e-5, abs=1e-6) and len(losses_two) == 8
    # the ranks agree, one run folder, one log stream
    err = two.stderr
    assert err.count("processes: LoRA weights identical on all 2") == 1
    assert err.count("model: llm tiny:llm") == 1 and err.count("device: ") == 1
    assert "batch: 4 per process x 2 processes x 1 accumulation = 8 per optimizer step" in err
    assert err.count("model.fuse_projections: 4 groups of LoRA layers") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "sharded", "two"]
    assert [r["step"] for r in read_metrics(tmp_path / "two")] == list(range(1, 9))


def test_a_flat_all_reduce_trains_what_ddp_trains(tmp_path):
    """device.gradient_sync=allreduce (the modules unwrapped, one all-reduce of the LoRA gradients after backward,
    as a compiled denoiser and its CUDA graph need) against DDP's buckets, on 2 and 4 processes of the SD quickstart:
    the same LoRA (the processes draw the same noise either way) and every rank agrees."""
    common = ("train.steps=3", "sample.prompts=[]", "train.gradient_checkpointing=false", "save.every=0")
    for n in (2, 4):
        runs = {sync: train(n, SD, tmp_path / f"{sync}-{n}", *common, f"train.batch_size={4 // n}",
                            f"device.gradient_sync={sync}") for sync in ("ddp", "allreduce")}
        assert all(proc.returncode == 0 for proc in runs.values())
        weights = {sync: load_file(str(tmp_path / f"{sync}-{n}" / "final" / "pytorch_lora_weights.safetensors"))
                   for sync in runs}
        assert weights["ddp"].keys() == weights["allreduce"].keys()
        assert max((weights["ddp"][k] - weights["allreduce"][k]).abs().max().item() for k in weights["ddp"]) <= 1e-6
        for sync, proc in runs.items():
            assert proc.stderr.count(f"processes: LoRA weights identical on all {n}") == 1
            assert f"batch: {4 // n} per process x {n} processes x 1 accumulation = 4 per optimizer step" in proc.stderr
        plan = RunPlan.from_json((tmp_path / f"ddp-{n}" / "plan.json").read_text())
        assert plan.value("device.distributed") == "ddp" and "device.gradient_sync" not in plan  # as set


def test_output_preservation_on_two_processes(tmp_path):
    """train.dop_class / dop_weight under DDP (3 forwards through the wrapper before one backward: the step's, and the
    class caption's with the adapter off, without gradients, and on): every rank ends with the same LoRA; 2 processes
    x batch 2 train what 1 process x batch 4 trains (each sample draws its noise and noise level from its own
    generator, models/sample_draws.py: the same losses, the LoRA within rounding); at weight 0 the run trains bit for
    bit what it trains without DOP; DDP's buckets give the LoRA that one flat all-reduce of the unwrapped modules'
    gradients gives (device.gradient_sync=allreduce)."""
    from toolkit.tiny.fixtures import write_shapes_dataset

    data = tmp_path / "data"
    write_shapes_dataset(data, sizes=((64, 64),), count=4)
    common = (f"data.path={data}", "train.steps=3", "save.every=0", "train.gradient_checkpointing=false")
    dop = ("train.dop_class=shape", "train.dop_weight=1")
    runs = {"plain": train(2, SD, tmp_path / "plain", *common, "train.batch_size=2"),
            "dop0": train(2, SD, tmp_path / "dop0", *common, "train.batch_size=2", "train.dop_class=shape",
                          "train.dop_weight=0"),
            "dop": train(2, SD, tmp_path / "dop", *common, "train.batch_size=2", *dop),
            "dop-allreduce": train(2, SD, tmp_path / "dop-allreduce", *common, "train.batch_size=2", *dop,
                                   "device.gradient_sync=allreduce"),
            "dop-one": train(1, SD, tmp_path / "dop-one", *common, "train.batch_size=4", *dop)}
    weights, losses = {}, {}
    for name, proc in runs.items():
        assert proc.returncode == 0, proc.stderr
        assert "4 per optimizer step" in proc.stderr
        if name != "dop-one":
            assert proc.stderr.count("processes: LoRA weights identical on all 2") == 1
        if name != "plain":
            weight = "0" if name == "dop0" else "1"
            assert proc.stderr.count("output preservation: 4 of 4 items with a class caption (their trigger word -> "
                                     f"'shape'; train.dop_weight={weight})") == 1
        weights[name] = load_file(str(tmp_path / name / "final" / "pytorch_lora_weights.safetensors"))
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / name)]
    plain = weights["plain"]
    assert len(plain) > 0 and all(w.keys() == plain.keys() for w in weights.values())

    def largest_difference(a: str, b: str) -> float:
        return max((weights[a][k] - weights[b][k]).abs().max().item() for k in plain)

    assert all(torch.equal(plain[k], weights["dop0"][k]) for k in plain) and losses["dop0"] == losses["plain"]
    dop_effect = largest_difference("dop", "plain")
    assert dop_effect > 1e-3
    assert losses["dop-one"] == pytest.approx(losses["dop"], rel=1e-6) and len(losses["dop"]) == 3
    assert largest_difference("dop", "dop-one") <= 5e-5 < dop_effect / 20
    assert largest_difference("dop", "dop-allreduce") <= 1e-6


# Loaded by every process through PYTHONPATH: rank 1 takes its copy of network.init_from 3 s late (a slow disk).
SLOW_SNAPSHOT = """
import importlib.abc, importlib.machinery, os, sys, time

class SlowSnapshot(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "toolkit.train.lora_source" or os.environ.get("RANK") != "1":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            take = module.LoraSnapshot._take
            module.LoraSnapshot._take = lambda self: (time.sleep(3), take(self))[1]
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, SlowSnapshot())
"""


def test_fresh_from_a_lora_inside_the_run_folder_waits_for_every_process_s_copy(tmp_path):
    """--fresh with network.init_from inside the run folder on 2 processes: the main process moves the folder aside
    only once every process has its copy of the LoRA (rank 1 is made 3 s slow to take it)."""
    out = tmp_path / "sd"
    common = ("train.batch_size=2", "save.every=2", "train.gradient_checkpointing=false")
    assert train(2, SD, out, "train.steps=2", *common).returncode == 0
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_SNAPSHOT)
    ENV["PYTHONPATH"] = os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])
    try:
        proc = train(2, SD, out, "train.steps=1", *common, f"network.init_from={out / 'checkpoints/step-000002'}",
                     "--fresh")
    finally:
        del ENV["PYTHONPATH"]
    assert proc.returncode == 0, proc.stderr
    [old] = tmp_path.glob("sd.old-*")
    assert f"the LoRA starts from checkpoint {old / 'checkpoints/step-000002'}" in proc.stderr
    assert proc.stderr.count("processes: LoRA weights identical on all 2") == 1


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_sd_on_two_processes_keeps_every_rank_in_step_and_saves_each_ranks_rng(tmp_path, distributed):
    out = tmp_path / "sd"
    proc = train(2, SD, out, "train.steps=4", "train.batch_size=2", "save.every=2", "train.grad_accum=2",
                 f"device.distributed={distributed}", "sample.prompts=[a red circle]", "sample.every=4",
                 "sample.num_inference_steps=2", "train.gradient_checkpointing=true")
    assert proc.returncode == 0
    assert proc.stderr.count("processes: LoRA weights identical on all 2") == 1
    # the UNet's blocks are checkpointed under fsdp too
    assert "blocks: unet: 5 blocks, 5 gradient-checkpointed, 0 swapped" in proc.stderr
    # the main process filled the latent cache (or found it filled, in part when a test in another pytest worker
    # shares the cache); the other read it and printed nothing
    assert proc.stderr.count("latents: ") == 1
    cached, encoded = map(int, re.search(r"latents: (\d+) cached, (\d+) encoded", proc.stderr).groups())
    assert cached + encoded == 24
    state = torch.load(out / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["rng_ranks"]) == 2
    assert not torch.equal(state["rng_ranks"][0]["torch"], state["rng_ranks"][1]["torch"])
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()
    # samples: from the main process only (with fsdp every process runs the pipeline, only one writes)
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step-000004"]
    assert (out / "samples" / "step-000004" / "00.png").is_file()


def test_fsdp_refuses_what_it_cannot_shard_before_training(tmp_path):
    proc = train(2, LLM, tmp_path / "run", "device.distributed=fsdp", "model.quantize=4bit")
    assert proc.returncode == 2
    assert "device.distributed=fsdp cannot run this config" in proc.stderr
    assert "model.quantize=4bit: quantized weights are not sharded" in proc.stderr


def test_kill_9_mid_run_then_resume_on_two_processes_is_bit_identical(tmp_path):
    steps = ["train.steps=40", "save.every=4", "train.batch_size=4", "data.max_seq_len=32"]
    reference = tmp_path / "reference"
    assert train(2, LLM, reference, *steps).returncode == 0

    out = tmp_path / "run"
    args = [sys.executable, "-m", "toolkit", "train", LLM, f"run.output_dir={out}", *COMMON, *steps, "--gpus", "2"]
    assert "TOOLKIT_CACHE" in ENV
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV})
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "step-000008" / "meta.json").is_file():
            assert proc.poll() is None, f"training ended before it was killed:\n{proc.communicate()[1]}"
            assert time.monotonic() < deadline, "timed out waiting for a checkpoint"
            time.sleep(0.005)
        kill_9(proc.pid)   # the launcher and both workers at once, as a crash would
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            kill_9(proc.pid)
    assert not (out / "final").exists()
    latest = find_latest_checkpoint(out / "checkpoints", warn=lambda _: None)
    assert latest is not None and 8 <= latest.step < 40

    resumed = train(2, LLM, out, *steps)
    assert resumed.returncode == 0 and f"resumed from {latest.path} (step {latest.step})" in resumed.stderr
    a, b = adapter(reference), adapter(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_on_another_number_of_processes_with_the_same_global_batch(tmp_path):
    """2 processes, then 1, then 4: each resume keeps the data order of the global batch of 8."""
    out = tmp_path / "run"
    assert train(2, LLM, out, "train.steps=4", "save.every=2", "train.batch_size=4").returncode == 0
    more = train(1, LLM, out, "train.steps=6", "save.every=2", "train.batch_size=8")
    assert more.returncode == 0, more.stderr
    assert "was written by 2 process(es), this run has 1" in more.stderr
    assert "train.batch_size: 4 -> 8 (2 -> 1 processes, global batch 8 unchanged)" in more.stderr
    four = train(4, LLM, out, "train.steps=8", "save.every=2", "train.batch_size=2")
    assert four.returncode == 0, four.stderr
    assert "train.batch_size: 8 -> 2 (1 -> 4 processes, global batch 8 unchanged)" in four.stderr
    assert four.stderr.count("processes: LoRA weights identical on all 4") == 1
    assert [r["step"] for r in read_metrics(out)][-4:] == [5, 6, 7, 8]


@pytest.mark.parametrize("sync", ["ddp", "allreduce"])
def test_four_processes_train_what_one_process_trains_with_four_times_the_batch(tmp_path, sync):
    one = train(1, LLM, tmp_path / "one", "train.steps=4", "train.batch_size=8", "data.max_seq_len=32")
    four = train(4, LLM, tmp_path / "four", "train.steps=4", "train.batch_size=2", "data.max_seq_len=32",
                 f"device.gradient_sync={sync}")
    assert one.returncode == 0 and four.returncode == 0
    a, b = adapter(tmp_path / "one"), adapter(tmp_path / "four")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert four.stderr.count("processes: LoRA weights identical on all 4") == 1
    assert [r["loss"] for r in read_metrics(tmp_path / "four")] == pytest.approx(
        [r["loss"] for r in read_metrics(tmp_path / "one")], rel=1e-5, abs=1e-6)


def test_every_process_runs_its_exit_handlers(tmp_path):
    """The processes other than the main one leave with os._exit after a good run (torch's C++ teardown once
    aborted there); what they registered to run at exit runs first: here a sitecustomize hook that writes a file
    per rank (what bench/scaling.py's memory report does)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import atexit, os\n"
        "def _report():\n"
        "    folder = os.environ.get('EXIT_REPORT')\n"
        "    if folder and os.environ.get('RANK') is not None:\n"
        "        open(os.path.join(folder, 'rank-' + os.environ['RANK']), 'w').write('ran')\n"
        "atexit.register(_report)\n")
    reports = tmp_path / "reports"
    reports.mkdir()
    env = {**ENV, "EXIT_REPORT": str(reports), "PYTHONPATH": os.pathsep.join(
        [str(hook), os.environ.get("PYTHONPATH", "")])}
    proc = run_toolkit("train", LLM, f"run.output_dir={tmp_path / 'run'}", *COMMON, "train.steps=2",
                       "train.batch_size=2", "data.max_seq_len=32", "--gpus", "2", timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in reports.iterdir()) == ["rank-0", "rank-1"]


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_shards_untied_embeddings_and_head_as_units_of_their_own(tied):
    """Untied: the input embeddings and the output head each become an FSDP unit (else FSDP2 keeps the root's
    weights gathered for the whole step); tied: one parameter cannot be in two units, both stay in the root."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.train.distributed import edge_modules

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    edges = edge_modules(model)
    assert edges == ([] if tied else [model.model.embed_tokens, model.lm_head])
    assert edge_modules(torch.nn.Linear(2, 2)) == []  # not a transformers model: nothing of the kind
    # fully_shard swaps each unit's class for an FSDP subclass (FSDPLlamaDecoderLayer): still a block to compile
    from toolkit.models.base import repeated_blocks

    layer = model.model.layers[0]
    layer.__class__ = type("FSDP" + type(layer).__name__, (type(layer),), {})
    assert repeated_blocks(model, outermost=True) == [layer]


def test_fsdp_embeddings_gathered_trains_what_the_lookup_in_shards_trains(tmp_path):
    """device.fsdp_embeddings: the lookup in the shards (the default) and FSDP2's gather of the whole table give the
    same LoRA; the log says which ran, and auto shards the optimizer state under fsdp (bench/results/evidence.json,
    fsdp-shard-optimizer)."""
    common = ("train.steps=4", "train.batch_size=2", "data.max_seq_len=32", "device.distributed=fsdp")
    shards = train(2, LLM, tmp_path / "shards", *common)
    gathered = train(2, LLM, tmp_path / "gathered", *common, "device.fsdp_embeddings=gathered")
    assert shards.returncode == 0 and gathered.returncode == 0, gathered.stderr
    looked_up = "(the embeddings looked up in the processes' shards, never gathered whole)"
    assert looked_up in shards.stderr and looked_up not in gathered.stderr
    assert "input embeddings and output head, each its own unit" in gathered.stderr
    for proc in (shards, gathered):
        assert "device.shard_optimizer=auto -> true: auto: on under fsdp" in proc.stderr
        assert "this process steps and keeps the state of" in proc.stderr
    a, b = adapter(tmp_path / "shards"), adapter(tmp_path / "gathered")
    assert a.keys() == b.keys() and len(a) == 28
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_grpo_under_fsdp_trains_what_it_trains_under_ddp(tmp_path):
    """GRPO on 2 processes: generation under fsdp (the root marked FSDP-managed, so generate keeps the processes'
    forwards paired) samples the same completions as under ddp, and the LoRA comes out the same."""
    grpo = str(REPO / "configs/examples/quickstart_llm_grpo.yaml")
    runs = {mode: train(2, grpo, tmp_path / mode, "train.steps=3", "save.every=0", f"device.distributed={mode}")
            for mode in ("ddp", "fsdp")}
    assert all(proc.returncode == 0 for proc in runs.values()), runs["fsdp"].stderr
    assert "device.distributed=fsdp: sharded model: 2 blocks" in runs["fsdp"].stderr
    logged = {mode: (tmp_path / mode / "objective.jsonl").read_text() for mode in runs}
    assert logged["ddp"] == logged["fsdp"] and logged["ddp"].count("\n") == 3   # the same rewards, step by step
    a, b = adapter(tmp_path / "ddp"), adapter(tmp_path / "fsdp")
    assert len(a) == 28 and max(v.abs().max().item() for v in a.values()) > 0.01  # trained
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
