"""Aspect-ratio buckets: the table's sizes and the never-upscale choice."""

from __future__ import annotations

from toolkit.data.buckets import bucket_table, choose_bucket, format_bucket_table


def test_table_sides_are_multiples_of_the_step_and_area_at_most_resolution_squared():
    table = bucket_table(512, 64)
    assert (512, 512) in table and (768, 320) in table and (320, 768) in table
    assert all(w % 64 == 0 and h % 64 == 0 for w, h in table)
    assert all(w * h <= 512 * 512 for w, h in table)
    assert min(min(s) for s in table) == 64 and max(max(s) for s in table) == 1024
    assert [w / h for w, h in table] == sorted(w / h for w, h in table)


def test_choice_follows_aspect_ratio_and_never_upscales():
    table = bucket_table(512, 64)
    assert choose_bucket(1024, 1024, table) == (512, 512)
    assert choose_bucket(1536, 1024, table) == (640, 384)  # ratio 1.5 -> 1.67, the closest in the table
    assert choose_bucket(1024, 1536, table) == (384, 640)
    # 300x300 is smaller than the 512 bucket: the largest table bucket that fits inside it
    assert choose_bucket(300, 300, table) == (256, 256)
    small = bucket_table(96, 64)
    assert small == [(64, 128), (64, 64), (128, 64)]
    assert choose_bucket(128, 64, small) == (128, 64)
    assert choose_bucket(96, 64, small) == (64, 64)  # (128, 64) is closer in ratio but would upscale
    assert choose_bucket(40, 200, small) is None     # under one step: no bucket


def test_bucket_table_text_lists_each_used_bucket():
    text = format_bucket_table({(128, 64): 3, (64, 64): 1})
    assert text.splitlines() == ["buckets:", "     64 x 64    (ratio 1.00): 1 image",
                                 "    128 x 64    (ratio 2.00): 3 images"]


def test_auto_step_follows_the_resolution():
    from toolkit.data.buckets import bucket_step

    steps = {resolution: bucket_step("auto", resolution)[0] for resolution in (64, 96, 128, 255, 256, 384, 511, 512, 1024)}
    assert steps == {64: 16, 96: 16, 128: 16, 255: 16, 256: 32, 384: 32, 511: 32, 512: 64, 1024: 64}
    assert bucket_step("auto", 96)[1] == ("data.bucket_step=auto: 16 px, resolution 96 / 8 rounded down to a power of "
                                          "two, at least 16")
    assert bucket_step("auto", 1024)[1] == "data.bucket_step=auto: 64 px, as for every resolution from 512 up"
    assert bucket_step(32, 1024) == (32, "data.bucket_step=32")
    # at 96 the auto step keeps 96x96 and 128x96 images near their size, where 64 cut both to 64x64
    table = bucket_table(96, 16)
    assert choose_bucket(96, 96, table, 16) == (96, 96) and choose_bucket(128, 96, table, 16) == (112, 80)


def test_train_at_resolution_96_keeps_the_images_size_and_says_why_a_coarse_step_shrinks_them(tmp_path, run_cli, capsys,
                                                                                               own_data_caches):
    from PIL import Image

    from conftest import REPO

    data = tmp_path / "data"
    data.mkdir()
    for i, size in enumerate([(96, 96), (128, 96)]):
        Image.new("RGB", size, (200, 40 * i, 0)).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text("a red thing")
    args = ["train", REPO / "configs/examples/quickstart_sd.yaml", f"data.path={data}", "train.steps=1",
            "train.batch_size=1", "save.every=0", "sample.every=0", "sample.prompts=[]", "log.tensorboard=false"]
    assert run_cli(*args, f"run.output_dir={tmp_path / 'auto'}") == 0
    err = capsys.readouterr().err
    assert ("buckets (data.bucket_step=auto: 16 px, resolution 96 / 8 rounded down to a power of two, at least 16):\n"
            "     96 x 96    (ratio 1.00): 1 image\n"
            "    112 x 80    (ratio 1.40): 1 image\n") in err
    assert "train at under 75%" not in err

    assert run_cli(*args, f"run.output_dir={tmp_path / 'coarse'}", "data.bucket_step=64") == 0
    err = capsys.readouterr().err
    assert ("note: 2 image(s) train at under 75% of the area they could have (their own, at most data.resolution=96 "
            "squared): img0.png (96x96 -> 64x64), img1.png (128x96 -> 64x64). Buckets are never larger than the image "
            "and their sides are multiples of 64 px (data.bucket_step=64); a smaller data.bucket_step keeps more of "
            "each image\n") in err
    assert "buckets (data.bucket_step=64):\n     64 x 64    (ratio 1.00): 2 images\n" in err


def test_an_image_thinner_than_every_bucket_keeps_to_max_bucket_side_and_the_area():
    table = bucket_table(128, 32, max_side=256)
    # 40 px high: no bucket of the table fits inside it; its own bucket is cropped to the longest side allowed
    assert choose_bucket(1000, 40, table, 32) == (256, 32)
    assert choose_bucket(40, 1000, table, 32) == (32, 256)
    assert choose_bucket(100, 40, table, 32) == (96, 32)  # within both limits: its own size, floored
    wide = bucket_table(128, 32, max_side=1024)
    assert choose_bucket(2000, 40, wide, 32) == (512, 32)  # the area, 128^2, holds it first
