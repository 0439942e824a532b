"""Several datasets (repeats, weights, regularisation images), several resolutions, and the config forms: the
`data:` list, data.datasets entries checked key by key, the data order's counts through the entry point."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from helpers import adapter_for, diffusion_train_args
from toolkit.data.datasets import EpochMix
from toolkit.data.images import DiffusionDataset
from toolkit.errors import ConfigError
from toolkit.tiny.fixtures import write_shapes_dataset

pytestmark = pytest.mark.usefixtures("own_data_caches")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """Two folders of 2 images each (64x64), one bucket: `a` the subject, `b` regularisation images."""
    root = tmp_path_factory.mktemp("datasets")
    write_shapes_dataset(root / "a", sizes=((64, 64),), count=2)
    write_shapes_dataset(root / "b", sizes=((64, 64),), count=2)
    return root / "a", root / "b"


def _config_with_data(tmp_path: Path, data) -> Path:
    config = yaml.safe_load((REPO / "configs/examples/quickstart_sd.yaml").read_text())
    config["data"] = data
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_data_list_is_data_path_and_data_datasets_and_each_entry_is_checked(tmp_path, folders, run_cli, capsys):
    from toolkit.plan.run import load_run

    a, b = folders
    listed = _config_with_data(tmp_path, [{"path": str(a), "resolution": 96, "trigger_word": "sks", "repeats": 2},
                                          {"path": str(b), "is_regularization": True, "weight": 0.5}])
    run = load_run([listed], [f"run.output_dir={tmp_path / 'out'}"])
    assert (run.cfg.data.path, run.cfg.data.repeats, len(run.cfg.data.datasets)) == (str(a), 2, 1)
    entry = run.cfg.data.datasets[0]
    assert (entry.path, entry.is_regularization, entry.weight, entry.resolution) == (str(b), True, 0.5, None)
    bad = _config_with_data(tmp_path, [{"path": str(a)}, {"path": str(tmp_path / "none"), "repeat": 2},
                                       {"repeats": 0, "weight": -1}])
    with pytest.raises(ConfigError) as err:
        load_run([bad], [f"run.output_dir={tmp_path / 'out'}"])
    text = str(err.value)
    assert "unknown key 'data.datasets[0].repeat'" in text and "did you mean 'data.datasets[0].repeats'" in text
    assert "'data.datasets[1].repeats' in" in text and "0 is below the minimum 1" in text
    assert "'data.datasets[1].weight' in" in text and "-1.0 is below the minimum 0.0" in text
    assert "'data.datasets[1].path' in" in text and "is required" in text
    missing = _config_with_data(tmp_path, [{"path": str(a)}, {"path": str(tmp_path / "none")}])
    assert run_cli("validate", str(missing), f"run.output_dir={tmp_path / 'out'}") == 2
    said = capsys.readouterr()
    assert f"'data.datasets[0].path' in {missing}: the data folder {tmp_path / 'none'} does not exist" in said.err + said.out


def test_repeats_and_weights_set_each_epoch_s_counts():
    # items 0, 1 in dataset 0; 2, 3, 4 in dataset 1
    mix = EpochMix((0, 0, 1, 1, 1), repeats=(1, 3), weights=(0.0, 0.0), seed=5)
    entries = list(mix.entries(0))
    assert Counter(e % 5 for e in entries) == {0: 1, 1: 1, 2: 3, 3: 3, 4: 3}
    assert len(set(entries)) == len(entries) == mix.size() == 11   # each repeat its own entry (own draws)
    assert list(EpochMix((0, 0, 1), (1, 1), (0.0, 0.0)).entries(3)) == [0, 1, 2]  # no repeats: the items
    # weights 3:1 over an epoch of 11: round(11 * 3/4) = 8 from dataset 0 (2 items: 4 passes), 3 from dataset 1
    weighted = EpochMix((0, 0, 1, 1, 1), repeats=(1, 3), weights=(3.0, 1.0), seed=5)
    assert weighted.counts() == [8, 3]
    for epoch in range(4):
        counts = Counter(e % 5 for e in weighted.entries(epoch))
        assert counts == {0: 4, 1: 4, 2: 1, 3: 1, 4: 1}
    assert weighted.entries(1) == weighted.entries(1) and weighted.entries(1) != weighted.entries(2)
    # a dataset left at 0 weighs 1 when another sets a weight: 4 x 3/4 and 4 x 1/4
    assert EpochMix((0, 0, 0, 1), (1, 1), (3.0, 0.0)).counts() == [3, 1]


def test_two_datasets_train_with_their_repeats_and_the_prior_weight(tmp_path, folders, run_cli, capsys, monkeypatch):
    a, b = folders
    drawn: list[list[int]] = []
    collate = DiffusionDataset.collate
    monkeypatch.setattr(DiffusionDataset, "collate",
                        lambda self, entries, epoch=0: drawn.append(list(entries)) or collate(self, entries, epoch))
    out = tmp_path / "run"
    rc = run_cli(*diffusion_train_args("quickstart_sd.yaml", out, f"data.path={a}", "train.batch_size=1",
                                       "train.steps=9", f"data.datasets=[{{path: {b}, repeats: 3, "
                                       "is_regularization: true}]", "train.prior_loss_weight=0.5",
                                       "data.balance_regularization=false"))
    log = capsys.readouterr().err
    assert rc == 0, log
    assert f"dataset 0 (data.path = {a}): 2 items at 96 px, repeats 1: 2 of 8 samples an epoch" in log
    assert (f"dataset 1 (data.datasets[0].path = {b}): 2 items at 96 px, repeats 3: 6 of 8 samples an epoch, "
            "regularisation (train.prior_loss_weight)") in log
    assert f"data: 2 images in {a}" in log and f"data: 2 images in {b}" in log  # the report covers each dataset
    assert len(drawn) == 9 and all(len(batch) == 1 for batch in drawn)
    first_epoch = Counter(batch[0] % 4 for batch in drawn[:8])
    assert first_epoch == {0: 1, 1: 1, 2: 3, 3: 3}   # items 0, 1 from a; 2, 3 from b (3 repeats each)
    assert len({batch[0] for batch in drawn[:8]}) == 8  # every repeat its own entry


def test_regularisation_balanced_as_kohya_does_it():
    # dataset 0: 5 training items x 2 repeats = 10; dataset 1: 2 regularisation items x 1, cycled up to 10
    cycled = EpochMix((0, 0, 0, 0, 0, 1, 1), (2, 1), (0.0, 0.0), 0, (False, True), balance=True)
    assert cycled.item_repeats() == [2, 2, 2, 2, 2, 5, 5] and cycled.counts() == [10, 10]
    assert Counter(e % 7 for e in cycled.entries(0)) == {0: 2, 1: 2, 2: 2, 3: 2, 4: 2, 5: 5, 6: 5}
    # 3 regularisation items x 2 repeats for 3 training samples: the first two (kohya's overshoot), the third unused
    trimmed = EpochMix((0, 0, 0, 1, 1, 1), (1, 2), (0.0, 0.0), 0, (False, True), balance=True)
    assert trimmed.item_repeats() == [1, 1, 1, 2, 2, 0] and trimmed.counts() == [3, 4]
    # an odd count: one more repeat each, in order, stopping as soon as the count is reached
    assert EpochMix((0,) * 7 + (1, 1, 1), (1, 1), (0.0, 0.0), 0, (False, True), True).item_repeats()[7:] == [3, 2, 2]
    # off, or weights set: each dataset by its own repeats / share
    assert EpochMix((0, 0, 0, 1), (1, 1), (0.0, 0.0), 0, (False, True), balance=False).counts() == [3, 1]
    assert EpochMix((0, 0, 0, 1), (1, 1), (1.0, 1.0), 0, (False, True), balance=True).counts() == [2, 2]
    # no regularisation dataset: nothing to balance
    assert EpochMix((0, 0, 1), (1, 3), (0.0, 0.0), 0, (False, False), balance=True).counts() == [2, 3]


def test_regularisation_images_balanced_through_the_entry_point(tmp_path, run_cli, capsys, monkeypatch):
    """data.balance_regularization (on by default): 2 training images x 3 repeats against 4 regularisation images
    (repeats 1) trains each epoch 6 training samples and 6 regularisation samples, the first two regularisation
    images twice (kohya's cycling); and 2 training images x 1 against the same 4 use only the first two of them."""
    subject, reg = tmp_path / "subject", tmp_path / "reg"
    write_shapes_dataset(subject, sizes=((64, 64),), count=2)
    write_shapes_dataset(reg, sizes=((64, 64),), count=4)
    drawn: list[list[int]] = []
    collate = DiffusionDataset.collate
    monkeypatch.setattr(DiffusionDataset, "collate",
                        lambda self, entries, epoch=0: drawn.append(list(entries)) or collate(self, entries, epoch))
    rc = run_cli(*diffusion_train_args("quickstart_sd.yaml", tmp_path / "run", f"data.path={subject}",
                                       "data.repeats=3", "train.batch_size=2", "train.steps=12",
                                       f"data.datasets=[{{path: {reg}, is_regularization: true}}]"))
    log = capsys.readouterr().err
    assert rc == 0, log
    assert f"dataset 0 (data.path = {subject}): 2 items at 96 px, repeats 3: 6 of 12 samples an epoch" in log
    assert (f"dataset 1 (data.datasets[0].path = {reg}): 4 items at 96 px, repeats 1, balanced with the training "
            "images (data.balance_regularization): 6 of 12 samples an epoch, regularisation "
            "(train.prior_loss_weight)") in log
    assert len(drawn) == 12 and all(len(batch) == 2 for batch in drawn)
    for epoch in (drawn[:6], drawn[6:]):  # two epochs of 6 batches of 2
        counts = Counter(entry % 6 for batch in epoch for entry in batch)
        assert counts == {0: 3, 1: 3, 2: 2, 3: 2, 4: 1, 5: 1}  # items 0, 1: subject; 2-5: reg in scan order

    drawn.clear()
    rc = run_cli(*diffusion_train_args("quickstart_sd.yaml", tmp_path / "trimmed", f"data.path={subject}",
                                       "train.batch_size=1", "train.steps=8", f"data.datasets=[{{path: {reg}, "
                                       "is_regularization: true}]"))
    log = capsys.readouterr().err
    assert rc == 0, log
    assert ("repeats 1, balanced with the training images (data.balance_regularization): 2 of 4 samples an epoch, "
            "regularisation (train.prior_loss_weight); 2 of its 4 items unused (more than the training images)") in log
    assert Counter(batch[0] % 6 for batch in drawn) == {0: 2, 1: 2, 2: 2, 3: 2}  # 2 epochs; reg items 4, 5 unused


def test_prior_loss_weight_scales_the_regularisation_images_loss(tmp_path, folders):
    import torch

    a, b = folders
    adapter, dataset = adapter_for("quickstart_sd.yaml", tmp_path, f"data.path={a}", "train.prior_loss_weight=0.25",
                                   f"data.datasets=[{{path: {b}, is_regularization: true}}]")
    assert dataset.prior_weights == [1.0, 1.0, 0.25, 0.25]
    batch = dataset.collate([0, 2])
    assert batch["loss_weight"].tolist() == [1.0, 0.25]
    per_sample = []
    objective_loss = adapter.objective.loss
    adapter.objective.loss = lambda *args: per_sample.append(objective_loss(*args)) or per_sample[-1]
    total = adapter.loss(batch, adapter.trainable_modules())
    assert per_sample[0].shape == (2,) and per_sample[0].min() > 0
    torch.testing.assert_close(total, per_sample[0][0] + 0.25 * per_sample[0][1], rtol=0, atol=0)


def test_several_resolutions_give_each_image_a_bucket_at_each(tmp_path):
    data = tmp_path / "data"
    write_shapes_dataset(data, sizes=((128, 128),), count=2)
    adapter, dataset = adapter_for("quickstart_sd.yaml", tmp_path, f"data.path={data}", "data.resolutions=[64,96,128]",
                                   "data.bucket_step=32")
    buckets = Counter(item.bucket for item in dataset.items)
    assert buckets == {(64, 64): 2, (96, 96): 2, (128, 128): 2}
    sides = sorted(e[0]["latents"].shape[-1] for e in dataset.encoded)
    assert len(sides) == 6 and sides[0] * 2 == sides[-1] and sides[2] * 4 == sides[0] * 6   # 64 : 96 : 128


def test_kill_9_and_resume_with_several_datasets_is_bit_identical(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from safetensors.torch import load_file

    from conftest import run_toolkit
    from test_resume import SINGLE_THREAD, assert_bit_identical, kill_9_after_checkpoint

    data, reg, other = tmp_path / "data", tmp_path / "reg", tmp_path / "other"
    write_shapes_dataset(data, sizes=((64, 64), (96, 64)), count=2)
    write_shapes_dataset(reg, sizes=((64, 64),), count=3)
    write_shapes_dataset(other, sizes=((128, 128),), count=2)
    args = ["train", str(REPO / "configs/examples/quickstart_sd.yaml"), "train.steps=8", "save.every=2",
            "save.dtype=fp32", "save.keep_last=10", "sample.prompts=[]", "log.every=1", "log.tensorboard=false",
            "train.batch_size=2", "data.random_flip=true", "data.crop_variants=2", f"data.path={data}",
            "data.weight=2", "train.prior_loss_weight=0.5", "train.dop_class=shape",
            f"data.datasets=[{{path: {reg}, is_regularization: true, weight: 1}}, "
            f"{{path: {other}, repeats: 2, resolutions: [64, 96]}}]"]
    env = {**SINGLE_THREAD, "TOOLKIT_CACHE": str(tmp_path / "cache")}
    ref, out = tmp_path / "reference", tmp_path / "run"
    proc = run_toolkit(*args, f"run.output_dir={ref}", env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"dataset 0 (data.path = {data}): 4 items at 96 px, weight 2: 8 of 16 samples an epoch" in proc.stderr
    assert f"dataset 2 (data.datasets[1].path = {other}): 4 items at 64/96 px, weight 1: 4 of 16" in proc.stderr
    killed = subprocess.Popen([sys.executable, "-m", "toolkit", *args, f"run.output_dir={out}"], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    kill_9_after_checkpoint(killed, out, 4)
    assert killed.returncode == -signal.SIGKILL and not (out / "final").exists()
    proc = run_toolkit(*args, f"run.output_dir={out}", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stderr
    name = "pytorch_lora_weights.safetensors"
    assert_bit_identical(load_file(str(out / "final" / name)), load_file(str(ref / "final" / name)))


def test_a_regularisation_entry_takes_no_inherited_trigger_and_an_entrys_resolution_beats_inherited_resolutions():
    from omegaconf import OmegaConf

    from toolkit.config.data_schemas import ImageDataSection
    from toolkit.data.datasets import dataset_settings

    data = OmegaConf.merge(OmegaConf.structured(ImageDataSection), {
        "path": "subject", "trigger_word": "zxq", "resolutions": [768, 1024],
        "datasets": [{"path": "people", "is_regularization": True, "resolution": 1024},
                     {"path": "own", "is_regularization": True, "trigger_word": "person"},
                     {"path": "more", "repeats": 2}]})
    subject, people, own, more = dataset_settings(data)
    assert [s.section.trigger_word for s in (subject, people, own, more)] == ["zxq", None, "person", "zxq"]
    assert [s.resolutions for s in (subject, people, own, more)] == [(768, 1024), (1024,), (768, 1024), (768, 1024)]
