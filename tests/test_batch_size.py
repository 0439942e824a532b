"""train.batch_size=auto (train/batch_size.py): the search over measured peaks, the global batch's accumulation, and
runs through the real entry point on the CPU with the one device-bound function (the peak of one try) replaced by
a memory model a x size + c: the size chosen, what it costs the run (nothing: the same LoRA as the same batch set
by hand), the cache that skips the probe, a resume that keeps the checkpoint's size, the CPU's preset table. The
probe on a real GPU is the `gpu` test at the end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import REPO
from helpers import read_metrics
from toolkit.train import batch_size as bs
from toolkit.train import checkpointing_probe

GiB = 2**30
SD = REPO / "configs/examples/quickstart_sd.yaml"
SHORT = ("train.steps=1", "save.every=1", "sample.prompts=[]", "log.every=1", "log.tensorboard=false")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> str:
    """data.path of 8 images in 2 buckets (64x64 and 128x64 at resolution 96), for the tiny sd runs."""
    from toolkit.tiny.fixtures import write_shapes_dataset

    path = tmp_path_factory.mktemp("shapes")
    write_shapes_dataset(path, sizes=((64, 64), (128, 64)), count=4)
    return f"data.path={path}"


def linear(a: float, c: float, oom_from: int | None = None):
    """measure(size) = a x size + c bytes (None, out of memory, from `oom_from` on), and the sizes it was asked."""
    asked: list[int] = []

    def measure(size: int) -> int | None:
        asked.append(size)
        return None if oom_from is not None and size >= oom_from else int(a * size + c)

    return measure, asked


@pytest.mark.parametrize("limit, cap, oom_from, chosen, asked", [
    (20 * GiB, 64, None, 18, [1, 2, 4, 8, 16, 32, 18, 19]),     # doubling, then the line's point, then one above
    (100 * GiB, 64, None, 64, [1, 2, 4, 8, 16, 32, 64]),        # everything fits: the cap
    (100 * GiB, 24, None, 24, [1, 2, 4, 8, 16, 24]),            # a cap between powers of two is tried
    (40 * GiB, 64, 12, 11, [1, 2, 4, 8, 16, 15, 11, 14, 12]),   # out of memory from 12: halving after a failure
    (int(2.5 * GiB), 64, None, 1, [1]),                         # not even 1 fits: 1, and the line says so
])
def test_search_finds_the_largest_size_within_the_limit(limit, cap, oom_from, chosen, asked):
    measure, seen = linear(1 * GiB, 2 * GiB, oom_from)
    size, peaks = bs.search(measure, cap, limit)
    assert size == chosen and seen == asked and list(peaks) == asked
    line = bs.describe(size, peaks, bs.Budget(limit, "limit"), f"{cap}")
    assert line.startswith(f"forward + backward on the data's largest batch peaked at 1: 3.00 GiB")
    assert (": out of memory" in line) == (oom_from is not None)
    assert ("even batch 1 goes over the limit" in line) == (chosen == 1)


def test_budget_and_cap():
    budget = bs.probe_budget(10.0, 0.9, trainable=50_000_000, ema=True, processes=2)
    state = 50_000_000 * 4 * 4  # Adam's two moments, the EMA, DDP's bucket: fp32 each
    assert budget.limit == int((10 * GiB * 0.9 - state) * 0.9)
    assert budget.why == ("limit 7.43 GiB = device.memory_fraction 0.9 of 10 GiB, less 0.75 GiB for the optimizer "
                          "state and 10% for fragmentation")
    assert bs.probe_cap(1000, 1, None) == (64, "64 (the probe's cap)")
    assert bs.probe_cap(24, 2, None) == (12, "12 (the training items per process)")
    assert bs.probe_cap(1000, 2, 20) == (10, "10 (train.global_batch_size per process)")


def test_grad_accum_follows_the_global_batch():
    # auto: the batch is trimmed to the least that reaches the global batch with that accumulation
    assert bs.accumulate_to(24, 7, 1, trim=True, requested_accum=1)[:2] == (6, 4)
    assert bs.accumulate_to(32, 24, 1, trim=True, requested_accum=1)[:2] == (16, 2)
    assert bs.accumulate_to(64, 16, 2, trim=True, requested_accum=1)[:2] == (16, 2)
    # a batch size set by hand stays; the step then takes the least whole number of micro-batches above
    size, accum, note = bs.accumulate_to(24, 7, 1, trim=False, requested_accum=1)
    assert (size, accum) == (7, 4)
    assert note == ("train.global_batch_size=24: 7 per process x 1 process x grad_accum 4 = 28, the least at or "
                    "above 24 with this batch size")
    assert bs.accumulate_to(24, 7, 1, trim=False, requested_accum=4)[:2] == (7, 4)  # given and consistent
    with pytest.raises(bs.UserError, match=r"train.grad_accum=3 does not fit train.global_batch_size=24 with 7 per "
                                           r"process x 1 process, which takes grad_accum 4"):
        bs.accumulate_to(24, 7, 1, trim=False, requested_accum=3)


def test_text_probe_batches_are_the_widest():
    from toolkit.data.packing import PackedTextDataset
    from toolkit.data.samples import TokenizedSample
    from toolkit.data.text import TextDataset

    samples = [TokenizedSample(list(range(n)), list(range(n))) for n in (5, 9, 3, 7)]
    text = TextDataset(samples, pad_token_id=0)
    assert text.largest_batch(3) == [1, 1, 2]  # the longest twice, the shortest last: padded, with a mask
    batch = text.collate(text.largest_batch(3))
    assert batch["input_ids"].shape == (3, 9) and batch["attention_mask"].sum().item() == 9 + 9 + 3
    assert text.largest_batch(1) == [1]
    packed = PackedTextDataset(samples, max_seq_len=12)   # packs [5, 3] (8 tokens), [9], [7]
    assert packed.largest_batch(2) == [1, 1] and packed.collate(packed.largest_batch(2))["input_ids"].shape == (1, 18)


# -- runs through the entry point -----------------------------------------------------------------------------
@pytest.fixture
def measuring_device(monkeypatch):
    """The trainer measures on the CPU as it would on a GPU, of a 10 GiB 'device' (limit 8.10 GiB)."""
    from toolkit.device.detect import DeviceInfo

    monkeypatch.setattr("toolkit.train.memory_plan.measures_on", lambda device: True)
    monkeypatch.setattr("toolkit.plan.run.detect_device",
                        lambda force_cpu=False: DeviceInfo("cpu", "cpu", "CPU", 10.0, bf16=False))


@pytest.fixture
def keeps_measured(monkeypatch):
    """sd as if measured faster keeping attention (FamilySpec.keeps_auto), and torch.compile a no-op: auto keeps
    attention in compiled blocks only, and the decision is the subject here, not inductor."""
    import dataclasses

    import toolkit.config.families as families

    monkeypatch.setitem(families.FAMILY_SPECS, "sd", dataclasses.replace(families.FAMILY_SPECS["sd"],
                                                                         keeps_auto="modelled"))
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)


@pytest.fixture
def probe(monkeypatch, measuring_device):
    """The probe on the CPU of a 10 GiB 'device' (limit 8.10 GiB): each try runs the real forward + backward on
    the data's largest batch, its peak modelled as 0.5 GiB x size + 0.5 GiB; from size 3 on, the adapter's loss
    runs out of memory (raises torch.OutOfMemoryError) before it computes anything. `probe.sizes` lists the batch
    sizes the loss was called with, probe and training alike; `probe.items` the items the probe's batches held."""
    from toolkit.data.images import DiffusionDataset
    from toolkit.models.diffusion_base import DiffusionAdapter

    class Probe:
        sizes: list[int] = []
        items: set[int] = set()
        dataset = None
        trying = False

    largest, loss = DiffusionDataset.largest_batch, DiffusionAdapter.loss

    def largest_batch(dataset, size):
        Probe.dataset = dataset
        indices = largest(dataset, size)
        Probe.items.update(indices)
        return indices

    def loss_of(adapter, batch, modules):
        Probe.sizes.append(len(batch["latents"]))
        if Probe.trying and Probe.sizes[-1] >= 3:
            raise torch.OutOfMemoryError("modelled")
        return loss(adapter, batch, modules)

    def peak(run, device):
        Probe.trying = True
        try:
            run()
        except torch.OutOfMemoryError:
            return None
        finally:
            Probe.trying = False
        return int((0.5 * Probe.sizes[-1] + 0.5) * GiB)

    monkeypatch.setattr(DiffusionDataset, "largest_batch", largest_batch)
    monkeypatch.setattr(DiffusionAdapter, "loss", loss_of)
    monkeypatch.setattr(bs, "peak_bytes", peak)
    Probe.sizes = []
    return Probe


def saved_train(run: Path) -> dict:
    """The train section the run used: its config.yaml (as asked) with plan.json (what auto became) in place."""
    from toolkit.plan.decisions import RunPlan

    plan = RunPlan.from_json((run / "plan.json").read_text())
    return plan.effective(yaml.safe_load((run / "config.yaml").read_text()))["train"]


def lora(run: Path) -> dict[str, torch.Tensor]:
    [file] = (run / "final").rglob("*.safetensors")
    return load_file(str(file))


def test_auto_batch_is_measured_then_remembered_and_kept_on_resume(probe, shapes, own_data_caches, tmp_path, run_cli,
                                                                    capsys):
    first = tmp_path / "first"
    auto = (shapes, *SHORT, "train.batch_size=auto", "train.global_batch_size=4")
    assert run_cli("train", SD, f"run.output_dir={first}", *auto) == 0
    err = capsys.readouterr().err
    # 1, 2 fit; 4 (the cap: the global batch) runs out of memory; the line through 1 and 2 meets the limit at 15,
    # so 3 is tried: out of memory. 2 it is, and the global batch 4 takes grad_accum 2.
    tried = [1, 2, 4, 3]
    assert probe.sizes[:len(tried)] == tried
    assert {probe.dataset.items[i].bucket for i in probe.items} == {(128, 64)}  # the larger of the two buckets
    assert ("train.batch_size=auto -> 2: measured: forward + backward on the data's largest batch peaked at "
            "1: 1.00 GiB, 2: 1.50 GiB, 4: out of memory, 3: out of memory; limit 8.10 GiB = device.memory_fraction "
            "0.9 of 10 GiB, less 0.00 GiB for the optimizer state and 10% for fragmentation; at most 4 "
            "(train.global_batch_size per process); train.global_batch_size=4: 2 per process x 1 process x "
            "grad_accum 2 = 4\n") in err
    assert "batch: 2 per process x 1 process x 2 accumulation = 4 per optimizer step (train.global_batch_size=4)" in err
    assert {k: saved_train(first)[k] for k in ("batch_size", "grad_accum", "global_batch_size")} == \
           {"batch_size": 2, "grad_accum": 2, "global_batch_size": 4}
    assert probe.sizes[len(tried):] == [2, 2]  # training: 1 step of 2 micro-batches of 2

    # The probe leaves no trace in training: the same LoRA as batch 2 x 2 set by hand.
    by_hand = tmp_path / "by_hand"
    assert run_cli("train", SD, f"run.output_dir={by_hand}", shapes, *SHORT, "train.batch_size=2",
                   "train.grad_accum=2") == 0
    assert "train.batch_size=auto" not in capsys.readouterr().err
    measured, given = lora(first), lora(by_hand)
    assert measured.keys() == given.keys() and all(torch.equal(measured[k], given[k]) for k in measured)

    # The same config again: the probe's answer comes from the cache, nothing is tried.
    probe.sizes.clear()
    assert run_cli("train", SD, f"run.output_dir={tmp_path / 'second'}", *auto) == 0
    err = capsys.readouterr().err
    assert probe.sizes == [2, 2]
    cache = own_data_caches / "batch_size.json"
    assert f"train.batch_size=auto -> 2: from cache ({cache}): forward + backward" in err

    # A resume keeps the checkpoint's batch size and measures nothing, whatever the memory says now.
    probe.sizes.clear()
    cache.unlink()
    assert run_cli("train", SD, f"run.output_dir={first}", *auto, "train.steps=2") == 0
    err = capsys.readouterr().err
    assert ("train.batch_size=auto -> 2: the checkpoint's batch size (a resumed run keeps it; nothing is measured)"
            in err)
    assert f"resumed from {first / 'checkpoints' / 'step-000001'} (step 1)" in err
    assert probe.sizes == [2, 2] and not cache.exists()
    assert saved_train(first)["batch_size"] == 2


def test_cpu_auto_keeps_the_preset_table(shapes, own_data_caches, tmp_path, run_cli, capsys, monkeypatch):
    def never(run, device):
        raise AssertionError("the probe ran on the CPU")

    monkeypatch.setattr(bs, "peak_bytes", never)
    assert run_cli("train", SD, f"run.output_dir={tmp_path}", shapes, "train.steps=1", "save.every=0",
                   "sample.prompts=[]", "train.batch_size=auto") == 0
    err = capsys.readouterr().err
    assert re.search(r"\n  train\.batch_size=1: preset cpu: \d+ GB of device memory \(>= 0 GB\) -> batch size 1; "
                     r"on the CPU auto keeps the preset's table \(the batch probe measures on GPUs\)\n", err)
    assert "train.batch_size=auto ->" not in err
    assert "batch: 1 per process x 1 process x 1 accumulation = 1 per optimizer step" in err
    assert saved_train(tmp_path)["batch_size"] == 1


def test_global_batch_with_a_batch_size_set_by_hand_and_its_mistakes(shapes, own_data_caches, tmp_path, run_cli,
                                                                      capsys):
    # 5 samples per step in batches of 2: grad_accum 3, 6 per step, the least at or above 5
    assert run_cli("train", SD, f"run.output_dir={tmp_path / 'run'}", shapes, *SHORT, "save.every=0",
                   "train.batch_size=2", "train.global_batch_size=5") == 0
    assert ("batch: 2 per process x 1 process x 3 accumulation = 6 per optimizer step (train.global_batch_size=5: "
            "the least at or above it with this batch size)") in capsys.readouterr().err
    assert saved_train(tmp_path / "run")["grad_accum"] == 3
    assert run_cli("train", SD, f"run.output_dir={tmp_path / 'refused'}", "train.batch_size=2", "train.global_batch_size=0") == 2
    assert "'train.global_batch_size' in command line: 0 is below the minimum 1" in capsys.readouterr().err
    assert run_cli("train", SD, f"run.output_dir={tmp_path / 'refused'}", "train.global_batch_size=many") == 2
    err = capsys.readouterr().err
    assert "'train.global_batch_size' in command line: expected an integer or null, got 'many'" in err
    assert run_cli("train", SD, f"run.output_dir={tmp_path / 'refused'}", "train.batch_size=2", "train.grad_accum=3",
                   "train.global_batch_size=8") == 2
    err = capsys.readouterr().err
    assert ("train.grad_accum=3 does not fit train.global_batch_size=8 with 2 per process x 1 process, which takes "
            "grad_accum 4\n  fix: remove train.grad_accum") in err
    assert "Traceback" not in err


# -- on a GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_peak_bytes_measures_and_survives_out_of_memory_on_the_gpu():
    device = torch.device("cuda")
    before = torch.cuda.memory_allocated(device)

    def too_big():
        torch.empty(2**50, dtype=torch.uint8, device=device)  # a petabyte

    assert bs.peak_bytes(too_big, device) is None
    assert torch.cuda.memory_allocated(device) == before

    def quarter_gib():  # in place: no temporary (a sum of uint8 would make an int64 copy, 2 GiB)
        torch.ones(GiB // 4, dtype=torch.uint8, device=device).mul_(2)

    peak = bs.peak_bytes(quarter_gib, device)
    assert before + GiB // 4 <= peak < before + GiB // 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("config", ["quickstart_sd.yaml", "quickstart_llm.yaml"])
def test_auto_batch_size_on_the_gpu(config, own_data_caches, tmp_path, run_cli, capsys):
    """A tiny model fits the cap on any GPU: every size up to it is measured, peaks grow with the batch, the global
    batch gives the accumulation, the run finishes, and the next run reads the cache."""
    args = [REPO / "configs/examples" / config, *SHORT, "train.batch_size=auto", "train.global_batch_size=32",
            "train.compile=false", "train.optimizer=adamw"]
    assert run_cli("train", *args, f"run.output_dir={tmp_path / 'first'}") == 0
    err = capsys.readouterr().err
    line = re.search(r"train\.batch_size=auto -> (\d+): measured: forward \+ backward on the data's largest batch "
                     r"peaked at (.*?); limit .*?; at most (\d+) \(.*?\); train\.global_batch_size=32: (\d+) "
                     r"per process(?: \(of the \d+ that fit\))? x 1 process x grad_accum (\d+) = (\d+)", err)
    assert line, err
    size, peaks, cap, per_process, accum, total = line.groups()
    measured = {int(s): float(n) * (1024 if unit == "GiB" else 1)  # MiB
                for s, n, unit in re.findall(r"(\d+): ([\d.]+) (GiB|MiB)", peaks)}
    assert max(measured) == int(cap) and "out of memory" not in peaks and "(over)" not in peaks
    assert measured[int(cap)] > measured[1] > 0
    expected = bs.accumulate_to(32, int(cap), 1, trim=True, requested_accum=1)
    assert (int(size), int(accum)) == expected[:2] and int(per_process) == int(size) and int(total) >= 32
    assert f"batch: {size} per process x 1 process x {accum} accumulation" in err
    assert "done: 1 step in " in err and (tmp_path / "first" / "final").is_dir()
    assert saved_train(tmp_path / "first")["batch_size"] == int(size)

    assert run_cli("train", *args, f"run.output_dir={tmp_path / 'second'}") == 0
    err = capsys.readouterr().err
    assert f"train.batch_size=auto -> {size}: from cache (" in err and "done: 1 step in " in err


def test_a_probe_that_breaks_leaves_the_run_on_the_presets_table(probe, shapes, own_data_caches, tmp_path, run_cli,
                                                                 capsys, monkeypatch):
    """An error in the probe that is not running out of memory (a driver or library fault) is said on the decision
    line, and the run trains with the preset's table value instead of stopping; nothing is cached."""
    def broken(run, device):
        raise RuntimeError("CUDA driver error: unknown\nmore")

    monkeypatch.setattr(bs, "peak_bytes", broken)
    out = tmp_path / "run"
    assert run_cli("train", SD, f"run.output_dir={out}", shapes, *SHORT, "train.batch_size=auto") == 0
    err = capsys.readouterr().err
    table = saved_train(out)["batch_size"]
    assert isinstance(table, int) and table >= 1
    assert (f"train.batch_size=auto -> {table}: the preset's table: the batch probe failed (RuntimeError: CUDA driver "
            "error: unknown)\n") in err
    assert not (own_data_caches / "batch_size.json").exists()


@pytest.mark.parametrize("peak_gib, needed", [(20.0, True), (1.0, False)])
def test_auto_gradient_checkpointing_is_measured_at_the_batch_size(peak_gib, needed, shapes, own_data_caches,
                                                                   tmp_path, run_cli, capsys, monkeypatch,
                                                                   measuring_device):
    """train.gradient_checkpointing=auto with a batch size set, on a 10 GiB 'device' (limit 8.10 GiB): one real
    forward + backward at the run's batch without checkpointing, its peak modelled; within the limit leaves it
    off. Over it, a second step with every block checkpointed (the same modelled peak: still over) turns it on
    for every block. The measurement leaves no trace: the LoRA equals the one trained with the same setting given
    by hand."""
    calls = []

    def peak(run, device):
        run()
        calls.append(device)
        return int(peak_gib * GiB)

    monkeypatch.setattr(bs, "peak_bytes", peak)
    auto = tmp_path / "auto"
    common = (shapes, *SHORT, "train.batch_size=2", "train.compile=false")  # the cpu preset sets it false: auto here
    assert run_cli("train", SD, f"run.output_dir={auto}", *common, "train.gradient_checkpointing=auto") == 0
    err = capsys.readouterr().err
    relation = "over the" if needed else "within the"
    assert (f"train.gradient_checkpointing=auto -> {needed}: a step of batch 2 peaked at {peak_gib:.2f} GiB without "
            f"it, {relation} limit 8.10 GiB = device.memory_fraction 0.9 of 10 GiB") in err
    assert len(calls) == (2 if needed else 1)
    blocks = [line for line in err.splitlines() if line.startswith("blocks: unet:")]
    assert len(blocks) == 1 and (" 0 gradient-checkpointed" in blocks[0]) is (not needed)
    assert saved_train(auto)["gradient_checkpointing"] is needed

    by_hand = tmp_path / "by_hand"
    assert run_cli("train", SD, f"run.output_dir={by_hand}", *common, f"train.gradient_checkpointing={needed}") == 0
    assert "train.gradient_checkpointing=auto" not in capsys.readouterr().err and len(calls) == (2 if needed else 1)
    measured, given = lora(auto), lora(by_hand)
    assert measured.keys() == given.keys() and all(torch.equal(measured[k], given[k]) for k in measured)


def modelled_peaks(monkeypatch, peak_of) -> list:
    """Each measured step's peak becomes peak_of(blocks recomputed in its backward) GiB (None: out of memory);
    returns the list the peaks are appended to, in the order measured."""
    import toolkit.train.blocks as blocks

    recomputed, peaks, checkpoint = [0], [], blocks.checkpoint

    def counted(*args, **kwargs):
        recomputed[0] += 1
        return checkpoint(*args, **kwargs)

    def peak(run, device):
        before = recomputed[0]
        run()
        peaks.append(peak_of(recomputed[0] - before))
        return None if peaks[-1] is None else int(peaks[-1] * GiB)

    monkeypatch.setattr(blocks, "checkpoint", counted)
    monkeypatch.setattr(bs, "peak_bytes", peak)
    return peaks


def test_auto_gradient_checkpointing_checkpoints_the_blocks_a_line_between_two_peaks_gives(
        shapes, own_data_caches, tmp_path, run_cli, capsys, monkeypatch, measuring_device):
    """Over the budget without checkpointing, within it with every block checkpointed: N blocks from a straight
    line between the two peaks, kept because a step measured at N fits. Modelled: 20 GiB less 3 GiB a
    checkpointed block, limit 8.10 GiB; the tiny UNet checkpoints its down, mid and up blocks one by one (5), all
    of them peak at 5 GiB, so the line gives 4 (8 GiB), which fits. The LoRA equals train.gradient_checkpointing=4
    given by hand."""
    peaks = modelled_peaks(monkeypatch, lambda count: 20 - 3 * count)
    auto, by_hand = tmp_path / "auto", tmp_path / "by_hand"
    common = (shapes, *SHORT, "train.batch_size=2", "train.compile=false")
    assert run_cli("train", SD, f"run.output_dir={auto}", *common, "train.gradient_checkpointing=auto") == 0
    err = capsys.readouterr().err
    assert peaks == [20, 5, 8]
    assert ("train.gradient_checkpointing=auto -> 4: a step of batch 2 peaked at 20.00 GiB without it, over the limit "
            "8.10 GiB = device.memory_fraction 0.9 of 10 GiB, less 0.00 GiB for the optimizer state and 10% for "
            "fragmentation; with 4 of its 5 blocks checkpointed it peaked at 8.00 GiB (every block: 5.00 GiB)") in err
    assert [line for line in err.splitlines() if line.startswith("blocks: unet:")] == [
        "blocks: unet: 5 blocks, 4 gradient-checkpointed, 0 swapped"]
    assert saved_train(auto)["gradient_checkpointing"] == 4
    assert run_cli("train", SD, f"run.output_dir={by_hand}", *common, "train.gradient_checkpointing=4") == 0
    measured, given = lora(auto), lora(by_hand)
    assert measured.keys() == given.keys() and all(torch.equal(measured[k], given[k]) for k in measured)


def test_when_the_line_s_count_misses_a_second_line_through_its_peak_gives_one_more_count(
        shapes, own_data_caches, tmp_path, run_cli, capsys, monkeypatch, measuring_device):
    """The blocks differ in size, so the first line's count can miss by a little (on Qwen-Image-Edit, 4 of 60 blocks
    peaked 0.2 GiB over the limit, and auto checkpointed all 60 at 1.42x the step time). Modelled: 14 GiB without
    checkpointing, 2 GiB with every block, limit 8.10: the line gives 3 blocks, measured at 8.6 GiB (over); the
    line through (3, 8.6) and (5, 2) gives 4, measured at 7 GiB and kept, not every block."""
    modelled = {0: 14.0, 3: 8.6, 4: 7.0, 5: 2.0}
    peaks = modelled_peaks(monkeypatch, lambda count: modelled[count])
    out = tmp_path / "auto"
    assert run_cli("train", SD, f"run.output_dir={out}", shapes, *SHORT, "train.batch_size=2", "train.compile=false",
                   "train.gradient_checkpointing=auto") == 0
    err = capsys.readouterr().err
    assert peaks == [14.0, 2.0, 8.6, 7.0]
    assert ("train.gradient_checkpointing=auto -> 4: a step of batch 2 peaked at 14.00 GiB without it, over the limit "
            "8.10 GiB = device.memory_fraction 0.9 of 10 GiB, less 0.00 GiB for the optimizer state and 10% for "
            "fragmentation; with 3 of its 5 blocks checkpointed it peaked at 8.60 GiB, with 4 it peaked at 7.00 GiB "
            "(every block: 2.00 GiB)") in err
    assert saved_train(out)["gradient_checkpointing"] == 4

    modelled[4] = 8.2  # the second count misses too: every block, both misses said
    peaks.clear()
    again = tmp_path / "again"
    assert run_cli("train", SD, f"run.output_dir={again}", shapes, *SHORT, "train.batch_size=2",
                   "train.compile=false", "train.gradient_checkpointing=auto") == 0
    err = capsys.readouterr().err
    assert peaks == [14.0, 2.0, 8.6, 8.2]
    assert ("; with 3 of its 5 blocks checkpointed it peaked at 8.60 GiB, with 4 it peaked at 8.20 GiB, with every "
            "block 2.00 GiB") in err
    assert saved_train(again)["gradient_checkpointing"] is True

    def fault(count):  # the second count's measurement fails (a driver fault): named, not called out of memory
        if count == 4:
            raise RuntimeError("CUDA driver error: unknown")
        return modelled[count]

    modelled_peaks(monkeypatch, fault)
    third = tmp_path / "third"
    assert run_cli("train", SD, f"run.output_dir={third}", shapes, *SHORT, "train.batch_size=2",
                   "train.compile=false", "train.gradient_checkpointing=auto") == 0
    err = capsys.readouterr().err
    assert ("; with 3 of its 5 blocks checkpointed it peaked at 8.60 GiB, with 4 it failed (RuntimeError: CUDA driver "
            "error: unknown), with every block 2.00 GiB") in err
    assert saved_train(third)["gradient_checkpointing"] is True


def test_auto_keeps_attention_only_where_every_block_keeping_it_fits(shapes, own_data_caches, tmp_path, run_cli,
                                                                     capsys, monkeypatch, measuring_device,
                                                                     keeps_measured):
    """train.checkpoint_keeps=auto at attention (a family measured faster with it): when every block checkpointed
    keeping its attention is over the budget, the blocks keep nothing and are measured again. Modelled as in the
    test above, kept attention adding 4 GiB: 20 GiB without checkpointing, 9 with every block keeping attention
    (over 8.10), 5 keeping nothing, so 4 blocks (8 GiB) keeping nothing. train.compile is on (auto keeps
    attention in compiled blocks only), torch.compile a no-op here."""
    keeping, checkpointed_while = [], checkpointing_probe.checkpointed_while

    def recording(regions, setting, keeps="nothing"):
        keeping.append(keeps)
        return checkpointed_while(regions, setting, keeps)

    monkeypatch.setattr(checkpointing_probe, "checkpointed_while", recording)
    peaks = modelled_peaks(monkeypatch, lambda count: 20 - 3 * count + (4 if count and keeping[-1] == "attention"
                                                                        else 0))
    out = tmp_path / "auto"
    assert run_cli("train", SD, f"run.output_dir={out}", shapes, *SHORT, "train.batch_size=2", "train.compile=true",
                   "train.gradient_checkpointing=auto") == 0  # auto keeps attention compiled only
    err = capsys.readouterr().err
    assert peaks == [20, 9, 5, 8] and keeping == ["attention", "attention", "nothing", "nothing"]
    assert "with every block checkpointed keeping its attention it peaked at 9.00 GiB" in err
    assert "train.checkpoint_keeps=auto -> nothing: a step with every block keeping its attention did not fit" in err
    assert [line for line in err.splitlines() if line.startswith("blocks: unet:")] == [
        "blocks: unet: 5 blocks, 4 gradient-checkpointed, 0 swapped, compiled"]
    assert saved_train(out)["gradient_checkpointing"] == 4 and saved_train(out)["checkpoint_keeps"] == "nothing"


def test_auto_keeps_nothing_when_the_step_runs_out_of_memory_without_checkpointing_and_keeping_attention(
        shapes, own_data_caches, tmp_path, run_cli, capsys, monkeypatch, measuring_device, keeps_measured):
    """The same fallback where a step runs out of memory without checkpointing: every block keeping its attention
    is measured too (9 GiB, over 8.10), so the blocks keep nothing (5 GiB); with 2 or 3 of the 5 blocks
    checkpointed the step does not fit either, so all of them are checkpointed."""
    peaks = iter([None, 9 * GiB, 5 * GiB, 9 * GiB, 9 * GiB])
    monkeypatch.setattr(bs, "peak_bytes", lambda run, device: next(peaks))
    out = tmp_path / "run"
    assert run_cli("train", SD, f"run.output_dir={out}", shapes, *SHORT, "train.batch_size=2", "train.compile=true",
                   "train.gradient_checkpointing=auto") == 0
    err = capsys.readouterr().err
    assert ("train.gradient_checkpointing=auto -> True: a step of batch 2 ran out of memory without it (limit 8.10 "
            "GiB") in err
    assert ("; with every block checkpointed keeping its attention it peaked at 9.00 GiB "
            "(train.checkpoint_keeps=auto -> nothing)") in err
    assert "; with 3 of its 5 blocks checkpointed it did not fit either; every block: 5.00 GiB" in err
    assert saved_train(out)["gradient_checkpointing"] is True and saved_train(out)["checkpoint_keeps"] == "nothing"


def test_auto_checkpoints_some_blocks_when_the_step_runs_out_of_memory_without(shapes, own_data_caches, tmp_path,
                                                                                run_cli, capsys, monkeypatch,
                                                                                measuring_device):
    """Without checkpointing the step runs out of memory, so its peak is unknown: the straight line goes through
    every block checkpointed (5 GiB) and half of them (2 of 5: 6.5 GiB), 0.5 GiB a block left out; the fewest on
    it under 8.10 GiB is 1 block (a step without any ran out), measured at 7 GiB, and kept. Peaks are modelled
    from the blocks recomputed in backward, as above."""
    peaks = modelled_peaks(monkeypatch, lambda count: None if count == 0 else 5 + 0.5 * (5 - count))
    out = tmp_path / "run"
    assert run_cli("train", SD, f"run.output_dir={out}", shapes, *SHORT, "train.batch_size=2", "train.compile=false",
                   "train.gradient_checkpointing=auto") == 0
    err = capsys.readouterr().err
    assert peaks == [None, 5.0, 6.5, 7.0]
    assert ("train.gradient_checkpointing=auto -> 1: a step of batch 2 ran out of memory without it (limit 8.10 GiB "
            "= device.memory_fraction 0.9 of 10 GiB, less 0.00 GiB for the optimizer state and 10% for "
            "fragmentation); with 1 of its 5 blocks checkpointed it peaked at 7.00 GiB (every block: 5.00 GiB, 2: "
            "6.50 GiB)") in err
    assert saved_train(out)["gradient_checkpointing"] == 1


def test_a_failing_measurement_with_blocks_checkpointed_checkpoints_all_of_them(shapes, own_data_caches, tmp_path,
                                                                               run_cli, capsys, monkeypatch,
                                                                               measuring_device):
    """The step is known not to fit without checkpointing: when the measurement with blocks checkpointed fails (a
    driver fault, not running out of memory), every block is checkpointed and the line says why."""
    calls = []

    def peak(run, device):
        calls.append(device)
        if len(calls) == 2:
            raise RuntimeError("CUDA driver error: unknown")
        run()
        return 20 * GiB

    monkeypatch.setattr(bs, "peak_bytes", peak)
    out = tmp_path / "run"
    assert run_cli("train", SD, f"run.output_dir={out}", shapes, *SHORT, "train.batch_size=2", "train.compile=false",
                   "train.gradient_checkpointing=auto") == 0
    err = capsys.readouterr().err
    assert "train.gradient_checkpointing=auto -> True: a step of batch 2 peaked at 20.00 GiB without it" in err
    assert "; measuring with blocks checkpointed failed (RuntimeError: CUDA driver error: unknown)" in err
    assert len(calls) == 2 and saved_train(out)["gradient_checkpointing"] is True


def test_auto_gradient_checkpointing_on_an_llm_turns_on_transformers_checkpointing(tmp_path, run_cli, capsys,
                                                                                  monkeypatch, measuring_device):
    """The llm family checkpoints through transformers: a measured need turns it on for the loaded model, and
    the run trains the same losses as with train.gradient_checkpointing=true given by hand."""
    from toolkit.models.llm import LLMMemory

    enabled, enable = [], LLMMemory.enable_checkpointing

    def recorded(memory):
        enable(memory)
        enabled.append(memory.adapter.network.get_base_model().is_gradient_checkpointing)

    monkeypatch.setattr(LLMMemory, "enable_checkpointing", recorded)
    monkeypatch.setattr(bs, "peak_bytes", lambda run, device: (run(), None)[1])  # out of memory without it
    common = ("train.steps=2", "save.every=0", "sample.every=0", "log.every=1", "log.tensorboard=false",
              "train.batch_size=2", "train.compile=false")
    losses = {}
    for name, extra in (("auto", ("train.gradient_checkpointing=auto",)),
                        ("by_hand", ("train.gradient_checkpointing=true",))):
        out = tmp_path / name
        assert run_cli("train", REPO / "configs/examples/quickstart_llm.yaml", f"run.output_dir={out}", *common,
                       *extra) == 0
        losses[name] = [r["loss"] for r in read_metrics(out)]
    err = capsys.readouterr().err
    assert "train.gradient_checkpointing=auto -> True: a step of batch 2 ran out of memory without it" in err
    assert enabled == [True] and saved_train(tmp_path / "auto")["gradient_checkpointing"] is True
    assert len(losses["auto"]) == 2 and losses["auto"] == losses["by_hand"]
