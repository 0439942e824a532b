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
