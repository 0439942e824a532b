"""Video folders for Wan: frame counts, (width, height, frames) buckets, evenly spaced frames, sample videos.

Every synthetic clip has frame i painted in a background colour that encodes i (red = 20 * i), with a white square
moving along the top, so a loaded tensor tells which frames were taken.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image, ImageDraw

from toolkit.config.data_schemas import VideoDataSection
from toolkit.data.video import (H264_ENCODERS, check_num_frames, clip_frames, frame_indices, load_clip, scan_clips,
                                write_video)
from toolkit.errors import UserError

STEP = 20  # red value per frame index


def _data(path, **kw):
    cfg = OmegaConf.structured(VideoDataSection(path=str(path), resolution=96, bucket_step=32, num_frames=9))
    for k, v in kw.items():
        cfg[k] = v
    return cfg


def _frames(n, size):
    frames = []
    for i in range(n):
        image = Image.new("RGB", size, (STEP * i, 128, 255 - STEP * i))
        ImageDraw.Draw(image).rectangle((2 * i, 0, 2 * i + 11, 11), fill=(255, 255, 255))
        frames.append(image)
    return frames


def _h264():
    """An H.264 encoder PyAV offers here, or None."""
    av = pytest.importorskip("av", reason="PyAV is not installed")
    for name in H264_ENCODERS:
        try:
            av.codec.Codec(name, "w")
            return name
        except ValueError:
            continue
    return None


def _write_mp4(path, frames, fps=16):
    import av

    codec = _h264()
    if codec is None:
        pytest.skip(f"PyAV {av.__version__} offers none of the H.264 encoders {H264_ENCODERS}")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = *frames[0].size, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(frame)))
        container.mux(stream.encode())


def _save_animated(path, frames, **kw):
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=62, loop=0, **kw)


def _taken(pixels):
    """Frame indices read back from the background colour (bottom-right 6x6 corner) of each loaded frame."""
    red = (pixels[0, :, -6:, -6:].mean(dim=(1, 2)) + 1) * 127.5
    return [round(v / STEP) for v in red.tolist()]


def test_frame_rules():
    assert [clip_frames(n, 17) for n in (1, 4, 5, 8, 9, 16, 17, 100)] == [1, 1, 5, 5, 9, 13, 17, 17]
    assert frame_indices(13, 5) == [0, 3, 6, 9, 12]
    assert frame_indices(11, 9) == [0, 1, 2, 4, 5, 6, 8, 9, 10]  # round half to even: symmetric about the middle
    assert frame_indices(7, 1) == [0]
    for n in (1, 5, 9, 17, 81):
        check_num_frames(n)


def test_num_frames_not_4k_plus_1_is_a_user_error(tmp_path):
    with pytest.raises(UserError) as err:
        scan_clips(_data(tmp_path, num_frames=6), print)
    assert str(err.value) == "data.num_frames: 6 is not 4k+1 (the VAE compresses time by 4); use 5 or 9"


@pytest.mark.parametrize("config, frames, factor, fix", [
    ("quickstart_wan21.yaml", 6, 4, "use 5 or 9"),
    ("quickstart_hunyuan15.yaml", 2, 4, "use 1 or 5"),
    ("quickstart_ltx2.yaml", 13, 8, "use 9 or 17"),
    ("quickstart_ltx2.yaml", 5, 8, "use 1 or 9"),     # 4k+1, which the scan of the Wan families would take
])
def test_validate_and_the_clip_scan_refuse_a_frame_count_in_the_same_words(config, frames, factor, fix, tmp_path,
                                                                           run_cli, capsys):
    """One rule (data/video.py's frame_count_problem) behind the preflight and the clip scan: the same message for
    data.num_frames and data.target_frames, at the family's time compression."""
    said = f"{frames} is not {factor}k+1 (the VAE compresses time by {factor}); {fix}"
    for key, override in (("data.num_frames", f"data.num_frames={frames}"),
                          ("data.target_frames", f"data.target_frames=[{factor + 1},{frames}]")):
        assert run_cli("validate", f"configs/examples/{config}", "data.frame_extraction=head", override) == 2
        err = capsys.readouterr().err
        assert f"'{key}' in command line: {said}" in err and "Traceback" not in err
    with pytest.raises(UserError) as err:
        scan_clips(_data(tmp_path, num_frames=frames), print, time_compression=factor)
    assert str(err.value) == f"data.num_frames: {said}"
    with pytest.raises(UserError) as err:
        scan_clips(_data(tmp_path, frame_extraction="head", target_frames=[factor + 1, frames]), print,
                   time_compression=factor)
    assert str(err.value) == f"data.target_frames: {said}"


def test_gif_webp_still_and_a_corrupt_file(tmp_path):
    pytest.importorskip("av", reason="PyAV is not installed (reads the corrupt .mp4)")
    _save_animated(tmp_path / "anim.gif", _frames(11, (96, 64)))
    _save_animated(tmp_path / "tall.webp", _frames(6, (64, 128)), lossless=True)
    _frames(1, (128, 64))[0].save(tmp_path / "still.png")
    (tmp_path / "broken.mp4").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    (tmp_path / "anim.txt").write_text("a [trigger] square")
    (tmp_path / "still.txt").write_text("a still square")
    logs = []
    items = scan_clips(_data(tmp_path, trigger_word="sks", default_caption="a clip"), logs.append)

    by_name = {it.path.name: it for it in items}
    assert sorted(by_name) == ["anim.gif", "still.png", "tall.webp"]
    assert [m for m in logs if m.startswith("warning")] == [
        f"warning: skipped 1 unreadable clip(s) in {tmp_path}: broken.mp4 (Invalid data found when processing input)"]
    assert logs[-1] == ("buckets (data.bucket_step=32):\n"
                        "     64 x 128   (ratio 0.50) x   5 frames: 1 clip\n"
                        "     96 x 64    (ratio 1.50) x   9 frames: 1 clip\n"
                        "    128 x 64    (ratio 2.00) x   1 frame : 1 clip")
    gif, webp, still = by_name["anim.gif"], by_name["tall.webp"], by_name["still.png"]
    assert (gif.size, gif.frame_count, gif.bucket, gif.caption) == ((96, 64), 11, (96, 64, 9), "a sks square")
    assert (webp.size, webp.frame_count, webp.bucket, webp.caption) == ((64, 128), 6, (64, 128, 5), "sks, a clip")
    assert (still.size, still.frame_count, still.bucket) == ((128, 64), 1, (128, 64, 1))
    assert len(gif.content_hash) == 32 and gif.content_hash != webp.content_hash

    pixels = load_clip(gif)  # 96x64 is in no table bucket that fits: its own size, never upscaled
    assert pixels.shape == (3, 9, 64, 96) and pixels.dtype == torch.float32
    assert pixels.min() >= -1 and pixels.max() <= 1 and pixels.max() == 1  # the white square
    assert _taken(pixels) == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    pixels = load_clip(webp)
    assert pixels.shape == (3, 5, 128, 64) and _taken(pixels) == [0, 1, 2, 4, 5]
    pixels = load_clip(still)
    assert pixels.shape == (3, 1, 64, 128) and _taken(pixels) == [0]


def test_mp4_frames_bucket_and_evenly_spaced_frames(tmp_path):
    _write_mp4(tmp_path / "clip.mp4", _frames(13, (128, 64)))
    (tmp_path / "clip.txt").write_text("a moving square")
    logs = []
    (item,) = scan_clips(_data(tmp_path), logs.append)
    assert (item.size, item.frame_count, item.bucket, item.caption) == ((128, 64), 13, (128, 64, 9), "a moving square")
    assert logs == [f"data: 1 clip in {tmp_path}, 1 with a caption (.txt files), 0 without",
                    "buckets (data.bucket_step=32):\n    128 x 64    (ratio 2.00) x   9 frames: 1 clip"]
    pixels = load_clip(item)
    assert pixels.shape == (3, 9, 64, 128) and pixels.min() >= -1 and pixels.max() <= 1
    assert _taken(pixels) == frame_indices(13, 9) == [0, 2, 3, 4, 6, 8, 9, 10, 12]

    item.bucket = (64, 64, 5)  # cover 64x64: resized to 128x64 -> crop the middle 64 columns
    pixels = load_clip(item)
    assert pixels.shape == (3, 5, 64, 64) and _taken(pixels) == [0, 3, 6, 9, 12]


def test_webm_without_a_frame_count_in_its_header_is_counted_by_decoding(tmp_path):
    av = pytest.importorskip("av", reason="PyAV is not installed")
    try:
        av.codec.Codec("libvpx", "w")
    except ValueError:
        pytest.skip(f"PyAV {av.__version__} has no libvpx (VP8) encoder")
    with av.open(str(tmp_path / "clip.webm"), "w") as container:
        stream = container.add_stream("libvpx", rate=16)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for frame in _frames(7, (64, 64)):
            container.mux(stream.encode(av.VideoFrame.from_image(frame)))
        container.mux(stream.encode())
    with av.open(str(tmp_path / "clip.webm")) as container:
        assert container.streams.video[0].frames == 0
    (item,) = scan_clips(_data(tmp_path), lambda m: None)
    assert (item.frame_count, item.bucket) == (7, (64, 64, 5))
    assert _taken(load_clip(item)) == [0, 2, 3, 4, 6]


def test_a_clip_shorter_than_its_header_says_is_a_user_error(tmp_path):
    _write_mp4(tmp_path / "clip.mp4", _frames(5, (64, 64)))
    (item,) = scan_clips(_data(tmp_path), lambda m: None)
    item.frame_count = 9  # as if the header had overcounted
    with pytest.raises(UserError, match=r"clip.mp4: the file said it has 9 frames, but decoding ended before frame 6\n  fix: re-encode"):
        load_clip(item)


def test_mp4_display_rotation_is_applied(tmp_path):
    """A phone clip: landscape pixels with a -90 degree display matrix in tkhd show as portrait, turned clockwise."""
    frames = [Image.new("RGB", (128, 64), (0, 0, 0)) for _ in range(5)]
    for frame in frames:
        frame.paste((255, 255, 255), (0, 0, 16, 16))  # top-left marker: after turning clockwise it is top-right
    _write_mp4(tmp_path / "phone.mp4", frames)
    raw = bytearray((tmp_path / "phone.mp4").read_bytes())
    matrix = raw.find(b"tkhd") + 4 + 4 + 4 * 5 + 8 + 8  # version 0 tkhd: flags, times, ids, layer/volume, matrix
    raw[matrix:matrix + 36] = struct.pack(">9i", 0, 1 << 16, 0, -(1 << 16), 0, 0, 64 << 16, 0, 1 << 30)
    (tmp_path / "phone.mp4").write_bytes(bytes(raw))
    (item,) = scan_clips(_data(tmp_path, num_frames=5), lambda m: None)
    assert (item.size, item.bucket) == ((64, 128), (64, 128, 5))
    pixels = load_clip(item)
    assert pixels.shape == (3, 5, 128, 64)
    assert pixels[:, :, :8, -8:].min() > 0.9 and pixels[:, :, :8, :8].max() < -0.9


def test_metadata_jsonl_and_no_usable_clip(tmp_path):
    _save_animated(tmp_path / "a.gif", _frames(5, (64, 64)))
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "a.gif", "text": "X"}) + "\n"
                                             + json.dumps({"file_name": "missing.webm", "text": "Y"}) + "\n")
    logs = []
    items = scan_clips(_data(tmp_path), logs.append)
    assert [(it.path.name, it.caption, it.bucket) for it in items] == [("a.gif", "X", (64, 64, 5))]
    assert logs[0] == f"data: 1 clip in {tmp_path}, 1 with a caption (metadata.jsonl), 0 without"
    assert logs[1].startswith("warning: skipped 1 unreadable clip(s)") and "missing.webm" in logs[1]

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "broken.gif").write_bytes(b"GIF89a not really")
    with pytest.raises(UserError) as err:
        scan_clips(_data(empty), lambda m: None)
    assert f"data.path: no usable videos or images in {empty}" in str(err.value) and "fix:" in str(err.value)


def test_write_video_webp_and_mp4(tmp_path):
    frames = _frames(7, (33, 17))  # odd sizes: the mp4 is padded to 34x18
    written = write_video(frames, tmp_path / "samples" / "step-000010", fps=8)
    webp = tmp_path / "samples" / "step-000010.webp"
    assert written[0] == webp
    with Image.open(webp) as image:
        assert (image.n_frames, image.size, image.info["loop"]) == (7, (33, 17), 0)
        image.seek(3)
        image.load()
        assert (image.info["timestamp"], image.info["duration"]) == (375, 125)  # 8 fps
    if _h264() is None:
        assert written == [webp]
        return
    import av

    assert written == [webp, tmp_path / "samples" / "step-000010.mp4"]
    with av.open(str(written[1])) as container:
        stream = container.streams.video[0]
        decoded = list(container.decode(stream))
        assert (stream.codec_context.name, stream.average_rate) == ("h264", 8)
    assert [(f.width, f.height, f.format.name) for f in decoded] == [(34, 18, "yuv420p")] * 7


def test_write_video_without_an_encoder_writes_only_the_webp(tmp_path, monkeypatch):
    monkeypatch.setattr("toolkit.data.video.H264_ENCODERS", ("no_such_encoder",))
    logs = []
    written = write_video(_frames(3, (32, 32)), tmp_path / "s", log=logs.append)
    assert written == [tmp_path / "s.webp"] and not (tmp_path / "s.mp4").exists()
    assert len(logs) == 1 and logs[0].startswith("s.mp4 not written (")
