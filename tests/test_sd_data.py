"""Image folders: captions from .txt files or metadata.jsonl, buckets, corrupt files skipped, user errors."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from toolkit.config.data_schemas import ImageDataSection
from toolkit.data.images import DiffusionDataset, caption_rules, load_pixels, scan_images
from toolkit.errors import UserError
from toolkit.models.diffusion_sd import sdxl_time_ids
from toolkit.tiny.fixtures import write_shapes_dataset


def _data(path, **kw):
    cfg = OmegaConf.structured(ImageDataSection)
    cfg.path = str(path)
    cfg.resolution = 96
    for k, v in kw.items():
        cfg[k] = v
    return cfg


def test_folder_with_captions_buckets_and_a_corrupt_file(tmp_path):
    write_shapes_dataset(tmp_path, sizes=((64, 64), (128, 64), (96, 64)), count=2)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (tmp_path / "red_circle_64x64.txt").write_text("a [trigger] red circle")
    (tmp_path / "red_square_64x64.txt").unlink()
    logs = []
    items = scan_images(_data(tmp_path, trigger_word="sks", default_caption="a shape", bucket_step=64), logs.append)
    assert len(items) == 6
    assert any("skipped 1 unreadable image(s)" in m and "broken.png" in m for m in logs)
    assert any(m.startswith("buckets (data.bucket_step=64):") and "128 x 64" in m for m in logs)
    by_name = {it.path.name: it for it in items}
    assert by_name["red_circle_64x64.png"].caption == "a sks red circle"
    assert by_name["red_square_64x64.png"].caption == "sks, a shape"
    assert by_name["red_circle_128x64.png"].caption == "sks, a red circle on a white background"
    assert by_name["red_circle_128x64.png"].bucket == (128, 64)
    assert by_name["red_circle_96x64.png"].bucket == (64, 64)  # never upscaled into 128x64

    pixels, crop = load_pixels(by_name["red_circle_96x64.png"])
    assert pixels.shape == (3, 64, 64) and crop == (0, 16)
    assert pixels.min() >= -1 and pixels.max() <= 1
    dataset = DiffusionDataset(items, caption_rules(_data(tmp_path)))
    assert sorted(set(dataset.groups)) == [0, 1]
    index = items.index(by_name["red_circle_96x64.png"])
    batch = dataset.collate([index])
    assert batch["pixels"].shape == (1, 3, 64, 64)
    # SDXL micro-conditioning: original (h, w), crop (top, left), target (h, w)
    assert sdxl_time_ids(batch).tolist() == [[64.0, 96.0, 0.0, 16.0, 64.0, 64.0]]
    assert batch["captions"] == ["sks, a red circle on a white background"]  # no shuffle or dropout: as scanned


def test_metadata_jsonl(tmp_path):
    write_shapes_dataset(tmp_path, sizes=((64, 64),), count=2)
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "red_square_64x64.png", "text": "X"}) + "\n")
    items = scan_images(_data(tmp_path), lambda m: None)
    assert [(it.path.name, it.caption) for it in items] == [("red_square_64x64.png", "X")]


def test_user_errors_name_the_folder_and_the_fix(tmp_path):
    with pytest.raises(UserError, match="is not a folder"):
        scan_images(_data(tmp_path / "missing"), lambda m: None)
    (tmp_path / "notes.txt").write_text("no images here")
    with pytest.raises(UserError, match=f"no usable images in {tmp_path}"):
        scan_images(_data(tmp_path), lambda m: None)
    (tmp_path / "metadata.jsonl").write_text("{broken\n")
    with pytest.raises(UserError, match="metadata.jsonl:1: expected a JSON object"):
        scan_images(_data(tmp_path), lambda m: None)


def test_images_all_smaller_than_the_resolution_and_a_bucket_are_named_with_the_fix(tmp_path, run_cli, capsys):
    """Every image under one bucket step: the message says they are too small for data.resolution and the buckets,
    names them, and gives the fix (larger images, or a bucket step they fit), through `train`."""
    from conftest import REPO

    data = tmp_path / "small"
    write_shapes_dataset(data, sizes=((40, 40), (48, 20)), count=1)
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    out = tmp_path / "run"
    assert run_cli("train", REPO / "configs/examples/quickstart_sd.yaml", f"data.path={data}",
                   f"run.output_dir={out}", "data.bucket_step=64") == 2  # (auto at 96 px: 16, where they fit)
    err = capsys.readouterr().err
    assert (f"error: data.path: every image in {data} is smaller than data.resolution (96 px) and than the smallest "
            "bucket side (data.bucket_step: 64 px), so none can train: red_circle_40x40.png (40x40), "
            "red_circle_48x20.png (48x20); 1 more could not be read\n"
            "  fix: use larger images (at least 64 px a side, about 96 px to train at data.resolution), or let them "
            "train in smaller buckets: data.bucket_step=32\n") in err
    assert "add .png/.jpg/.webp images" not in err and "Traceback" not in err
    (data / "broken.png").unlink()
    (data / "red_circle_40x40.png").unlink()
    with pytest.raises(UserError, match=r"so none can train: red_circle_48x20.png \(48x20\)\n  fix: use larger images \(at least 64 px a side, about 96 px to "
                                        r"train at data.resolution\), or let them train in smaller buckets: "
                                        r"data.bucket_step=16$"):
        scan_images(_data(data, bucket_step=64), lambda m: None)  # 48x20: its short side fits 16 px buckets
    assert [item.bucket for item in scan_images(_data(data, bucket_step=16), lambda m: None)] == [(48, 16)]


def test_kohyas_repeat_subfolders_are_named_with_the_datasets_that_replace_them(tmp_path, run_cli, capsys):
    from conftest import REPO

    write_shapes_dataset(tmp_path / "kohya" / "10_sks shape", sizes=((64, 64),), count=1)
    assert run_cli("train", REPO / "configs/examples/quickstart_sd.yaml", f"data.path={tmp_path / 'kohya'}",
                   f"run.output_dir={tmp_path / 'run'}") == 2
    err = capsys.readouterr().err
    assert (f"error: data.path: no usable images in {tmp_path / 'kohya'}\n  fix: this toolkit reads the images of one "
            "folder per dataset, with repeats set in the config, not kohya's N_name subfolders (10_sks shape): set "
            "data.path to the subfolder and data.repeats to its N") in err
