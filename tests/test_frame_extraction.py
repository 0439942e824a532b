"""Clips cut from longer videos (data.frame_extraction, musubi-tuner's head / chunk / slide / uniform / full with
target_frames, frame_stride, frame_sample, max_frames; spread: ai-toolkit's num_frames over the whole video) and
their buckets by frames and size, down to the frames each loaded clip holds and a training run's bucket table;
and a frame setting that no dataset's mode reads refused by `validate` and `train` (exit 2).

Frame i of a synthetic video has the background red = 8 * i, so a loaded tensor tells which frames it took.
"""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf
from PIL import Image, ImageDraw

from helpers import REPO, diffusion_train_args, read_metrics
from toolkit.config.data_schemas import VideoDataSection
from toolkit.data.video import H264_ENCODERS, clip_spans, load_clip, scan_clips
from toolkit.errors import UserError

STEP = 8  # red value per frame index: 30 frames stay under 255
LONG = 30


def _data(path, **kw):
    cfg = OmegaConf.structured(VideoDataSection(path=str(path), resolution=64, bucket_step=16, num_frames=9))
    for k, v in kw.items():
        cfg[k] = v
    return cfg


def _frames(n, size):
    frames = []
    for i in range(n):
        image = Image.new("RGB", size, (STEP * i, 128, 255 - STEP * i))
        ImageDraw.Draw(image).rectangle((i, 0, i + 7, 7), fill=(255, 255, 255))
        frames.append(image)
    return frames


def _write_mp4(path, frames, fps=16):
    """An H.264 mp4 written with PyAV (skipped where this FFmpeg build has no H.264 encoder)."""
    av = pytest.importorskip("av", reason="PyAV is not installed")
    for codec in H264_ENCODERS:
        try:
            av.codec.Codec(codec, "w")
            break
        except ValueError:
            continue
    else:
        pytest.skip(f"PyAV {av.__version__} offers none of the H.264 encoders {H264_ENCODERS}")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = *frames[0].size, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(frame)))
        container.mux(stream.encode())


def _webp(path, frames):
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=62, loop=0, lossless=True)


def _taken(pixels):
    red = (pixels[0, :, -6:, -6:].mean(dim=(1, 2)) + 1) * 127.5
    return [round(v / STEP) for v in red.tolist()]


# The documented clips of a 30-frame video, (first frame, frames), for target_frames [9, 17]:
EXPECTED = {
    "head": [(0, 9), (0, 17)],
    "chunk": [(0, 9), (9, 9), (18, 9), (0, 17)],                       # back to back; the tail 27..29 is dropped
    "slide": [(0, 9), (5, 9), (10, 9), (15, 9), (20, 9), (0, 17), (5, 17), (10, 17)],   # frame_stride 5
    "uniform": [(0, 9), (10, 9), (21, 9), (0, 17), (6, 17), (13, 17)],  # frame_sample 3: starts over 0..30-F
    "full": [(0, 29)],                                                  # every frame, rounded down to 4k+1
}
SETTINGS = dict(target_frames=[9, 17], frame_stride=5, frame_sample=3)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_clip_spans_are_musubi_tuners(mode):
    assert clip_spans(LONG, _data(".", frame_extraction=mode, **SETTINGS)) == EXPECTED[mode]


def test_full_stops_at_max_frames_and_short_videos_give_no_clip():
    assert clip_spans(LONG, _data(".", frame_extraction="full", max_frames=15)) == [(0, 13)]
    assert clip_spans(12, _data(".", frame_extraction="head", target_frames=[9, 17])) == [(0, 9)]
    assert clip_spans(8, _data(".", frame_extraction="chunk", target_frames=[9])) == []


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_a_long_mp4_gives_the_documented_clips_at_their_frames(tmp_path, mode):
    _write_mp4(tmp_path / "long.mp4", _frames(LONG, (64, 64)))
    (tmp_path / "long.txt").write_text("a moving square")
    logs = []
    items = scan_clips(_data(tmp_path, frame_extraction=mode, **SETTINGS), logs.append)
    assert [(it.frames[0], len(it.frames)) for it in items] == EXPECTED[mode]
    assert [it.bucket for it in items] == [(64, 64, n) for _, n in EXPECTED[mode]]
    assert len({it.content_hash for it in items}) == len(items)  # each clip its own latent cache entry
    assert f"frame extraction ({mode}): {len(items)} clips from 1 files" in logs
    for item, (first, frames) in zip(items, EXPECTED[mode]):
        assert _taken(load_clip(item)) == list(range(first, first + frames))


def test_spread_takes_num_frames_over_the_whole_video(tmp_path):
    _webp(tmp_path / "long.webp", _frames(LONG, (64, 64)))
    (item,) = scan_clips(_data(tmp_path, num_frames=9), print)
    assert item.frames == () and item.bucket == (64, 64, 9)
    assert _taken(load_clip(item)) == [0, 4, 7, 11, 14, 18, 22, 25, 29]


def test_target_frames_not_4k_plus_1_and_no_video_long_enough(tmp_path):
    _webp(tmp_path / "short.webp", _frames(6, (64, 64)))
    with pytest.raises(UserError, match=r"data.target_frames: 8 is not 4k\+1"):
        scan_clips(_data(tmp_path, frame_extraction="head", target_frames=[9, 8]), print)
    with pytest.raises(UserError, match="no video in .* is as long as 9 frames"):
        scan_clips(_data(tmp_path, frame_extraction="head", target_frames=[9]), print)


def _mixed_folder(root):
    """Clips of different lengths and sizes: 2 wide of 30 frames, 1 tall of 13, 1 wide of 6, a still image."""
    root.mkdir()
    for name, n, size in (("wide_a", LONG, (128, 64)), ("wide_b", LONG, (128, 64)), ("tall", 13, (64, 128)),
                          ("short", 6, (128, 64))):
        _webp(root / f"{name}.webp", _frames(n, size))
        (root / f"{name}.txt").write_text(f"a {name} square")
    _frames(1, (64, 64))[0].save(root / "still.png")
    (root / "still.txt").write_text("a still square")


def test_clips_of_different_lengths_and_sizes_bucket_by_frames_and_size(tmp_path):
    _mixed_folder(tmp_path / "clips")
    logs = []
    items = scan_clips(_data(tmp_path / "clips", frame_extraction="chunk", target_frames=[5, 9]), logs.append)
    counts = {}
    for item in items:
        counts[item.bucket] = counts.get(item.bucket, 0) + 1
    # wide (30 frames): 6 chunks of 5 + 3 of 9 each; tall (13): 2 of 5 + 1 of 9; short (6): 1 of 5; still: 1 frame
    # (each size: the aspect bucket of about data.resolution squared, 64 x 64 here)
    assert counts == {(80, 48, 5): 13, (80, 48, 9): 6, (48, 80, 5): 2, (48, 80, 9): 1, (64, 64, 1): 1}
    assert logs[-1] == ("buckets (data.bucket_step=16):\n"
                        "     48 x 80    (ratio 0.60) x   5 frames: 2 clips\n"
                        "     48 x 80    (ratio 0.60) x   9 frames: 1 clip\n"
                        "     64 x 64    (ratio 1.00) x   1 frame : 1 clip\n"
                        "     80 x 48    (ratio 1.67) x   5 frames: 13 clips\n"
                        "     80 x 48    (ratio 1.67) x   9 frames: 6 clips")


def test_a_run_trains_on_extracted_clips_one_bucket_a_batch(tmp_path, run_cli, capsys, own_data_caches,
                                                             monkeypatch):
    """Through the entry point (hunyuan_video15, batch 2): the clips cut from the folder, their bucket table, the
    latents of every clip encoded once, the steps that train on them, and every batch the run collates holding
    clips of one bucket (the folder has 5 buckets); the run's config.yaml, every frame setting in it, validates."""
    from toolkit.data.images import DiffusionDataset

    collate, batches = DiffusionDataset.collate, []

    def recorded(dataset, entries, epoch=0):
        batches.append([dataset.items[e % len(dataset.items)].bucket for e in entries])
        return collate(dataset, entries, epoch)

    monkeypatch.setattr(DiffusionDataset, "collate", recorded)
    _mixed_folder(tmp_path / "clips")
    out = tmp_path / "run"
    args = diffusion_train_args("quickstart_hunyuan15.yaml", out, f"data.path={tmp_path / 'clips'}",
                                "data.frame_extraction=chunk", "data.target_frames=[5,9]", "train.steps=4")
    assert run_cli(*args) == 0
    log = capsys.readouterr().err
    assert "frame extraction (chunk): 23 clips from 5 files" in log
    assert "     80 x 48    (ratio 1.67) x   5 frames: 13 clips" in log
    assert "latents: 0 cached, 23 encoded" in log
    assert len(read_metrics(out)) == 4
    assert re.search(r"model: hunyuan_video15 .*; 23 training samples", log)
    assert len(batches) >= 4 and all(len(set(buckets)) == 1 for buckets in batches), batches
    assert sum(len(buckets) == 2 for buckets in batches) >= 3  # batch 2: most batches are pairs of one bucket
    assert len({buckets[0] for buckets in batches}) >= 2       # and the steps visit several buckets
    config = OmegaConf.load(out / "config.yaml")
    assert (config.data.frame_stride, config.data.frame_sample, config.data.max_frames) == (1, 1, 129)
    assert run_cli("validate", out / "config.yaml", f"run.output_dir={tmp_path / 'again'}") == 0


def test_ai_toolkits_and_musubis_names_suggest_the_keys(run_cli, capsys):
    from helpers import REPO

    assert run_cli("validate", REPO / "configs/examples/quickstart_hunyuan15.yaml", "data.shrink_video_to_frames=false",
                   "data.video_directory=clips") == 2
    err = capsys.readouterr().err
    assert ("unknown key 'data.shrink_video_to_frames' in command line; did you mean 'data.frame_extraction'? "
            "(shrink_video_to_frames: the name in ai-toolkit; true is data.frame_extraction: spread (the default); "
            "false: head)") in err
    assert "unknown key 'data.video_directory' in command line; did you mean 'data.path'?" in err


def test_each_dataset_entry_cuts_its_own_clips_in_one_run(tmp_path, run_cli, capsys, own_data_caches):
    """data.datasets entries with their own frame_extraction (musubi-tuner's per-dataset keys) over the same
    30-frame video: each entry's documented clips at their frames, data.path's the run-wide spread, in one run."""
    from helpers import adapter_for

    _write_mp4(tmp_path / "long.mp4", _frames(LONG, (64, 64)))
    (tmp_path / "long.txt").write_text("a moving square")
    entries = ("data.datasets=[{path: %s, frame_extraction: head, target_frames: [9, 17]}, "
               "{path: %s, frame_extraction: uniform, target_frames: [9, 17], frame_sample: 3}]" % (tmp_path, tmp_path))
    overrides = (f"data.path={tmp_path}", entries)
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_hunyuan15.yaml", out, *overrides, "train.steps=2")) == 0
    log = capsys.readouterr().err
    assert "frame extraction (head): 2 clips from 1 files" in log
    assert "frame extraction (uniform): 6 clips from 1 files" in log
    assert "dataset 1 (data.datasets[0].path = %s): 2 items at 64 px" % tmp_path in log
    assert "dataset 2 (data.datasets[1].path = %s): 6 items at 64 px" % tmp_path in log
    assert "latents: 0 cached, 9 encoded" in log and "; 9 training samples" in log  # each clip its own entry
    assert len(read_metrics(out)) == 2

    adapter, dataset = adapter_for("quickstart_hunyuan15.yaml", tmp_path / "again", *overrides)
    spans = {d: [(it.frames[0], len(it.frames)) if it.frames else ("spread", it.bucket[2])
                 for it in dataset.items if it.dataset == d] for d in range(3)}
    assert spans == {0: [("spread", 9)], 1: EXPECTED["head"], 2: EXPECTED["uniform"]}
    for item in dataset.items:
        if item.frames:
            assert _taken(load_clip(item)) == list(range(item.frames[0], item.frames[0] + len(item.frames)))


def test_an_unknown_frame_extraction_in_a_dataset_entry_is_named(tmp_path, run_cli, capsys):
    from helpers import REPO

    clips = tmp_path / "clips"
    clips.mkdir()
    _webp(clips / "clip.webp", _frames(LONG, (64, 64)))
    entries = ("data.datasets=[{path: %s, frame_extraction: slide, frame_stride: 2}, "
               "{path: %s, frame_extraction: slid}]" % (clips, clips))
    code = run_cli("train", REPO / "configs/examples/quickstart_hunyuan15.yaml", f"run.output_dir={tmp_path / 'run'}",
                   entries)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.count("'data.datasets[1].frame_extraction' in command line: 'slid' is not one of spread, head, chunk, "
                     "slide, uniform, full; did you mean 'slide'?") == 1
    assert "data.datasets[0]" not in err  # its frame_stride is a valid per-entry key
    assert not (tmp_path / "run").exists()


def test_an_entrys_own_target_frames_error_names_the_entrys_key(tmp_path, run_cli, capsys, own_data_caches):
    _webp(tmp_path / "long.webp", _frames(LONG, (64, 64)))
    (tmp_path / "long.txt").write_text("a moving square")
    entries = "data.datasets=[{path: %s, frame_extraction: head, target_frames: [9, 8]}]" % tmp_path
    code = run_cli(*diffusion_train_args("quickstart_hunyuan15.yaml", tmp_path / "run", f"data.path={tmp_path}",
                                         entries))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert ("'data.datasets[0].target_frames' in command line: 8 is not 4k+1 (the VAE compresses time by 4); use 5 or 9"
            in err)


# Each frame setting only some modes read (FRAME_EXTRACTION_SETTINGS), at a value other than its default:
UNREAD = {"target_frames": ("[9,17]", "head, chunk, slide, uniform"), "frame_stride": ("5", "slide"),
          "frame_sample": ("3", "uniform"), "max_frames": ("33", "full")}
READS = {"spread": (), "head": ("target_frames",), "chunk": ("target_frames",),
         "slide": ("target_frames", "frame_stride"), "uniform": ("target_frames", "frame_sample"),
         "full": ("max_frames",)}


def _validate(run_cli, *overrides):
    return run_cli("validate", REPO / "configs/examples/quickstart_hunyuan15.yaml", *overrides)


@pytest.mark.parametrize("mode", sorted(READS))
def test_validate_refuses_each_frame_setting_the_mode_does_not_read(run_cli, capsys, mode):
    """Every frame setting given: those the mode does not read are each refused by name (exit 2), those it reads
    pass; given alone, the ones it reads are accepted."""
    assert _validate(run_cli, f"data.frame_extraction={mode}",
                     *(f"data.{key}={value}" for key, (value, _) in UNREAD.items())) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for key, (_, readers) in UNREAD.items():
        message = (f"'data.{key}' in command line has no effect with data.frame_extraction={mode}; remove it, or "
                   f"set data.frame_extraction to one that reads it: {readers}")
        assert (message in err) == (key not in READS[mode]), key
    assert err.count("has no effect") == len(UNREAD) - len(READS[mode])
    assert _validate(run_cli, f"data.frame_extraction={mode}",
                     *(f"data.{key}={UNREAD[key][0]}" for key in READS[mode])) == 0
    assert "config OK" in capsys.readouterr().err


def test_frame_settings_at_their_defaults_are_never_refused(tmp_path, run_cli, capsys):
    """Written out at the schema's values (as a run's config.yaml writes every key), in a YAML file, on the command
    line and in a dataset entry, under spread, which reads none of them."""
    yaml = tmp_path / "defaults.yaml"
    yaml.write_text("data:\n  frame_extraction: spread\n  target_frames: []\n  frame_stride: 1\n  frame_sample: 1\n"
                    "  max_frames: 129\n")
    entry = ("data.datasets=[{path: configs/examples/data/shapes, target_frames: [], frame_stride: 1, "
             "frame_sample: 1, max_frames: 129}]")
    assert run_cli("validate", REPO / "configs/examples/quickstart_hunyuan15.yaml", yaml, entry,
                   "data.frame_stride=1", "data.max_frames=129") == 0
    assert "config OK" in capsys.readouterr().err


def test_a_frame_setting_in_a_yaml_file_is_named_with_its_line(tmp_path, run_cli, capsys):
    yaml = tmp_path / "spread.yaml"
    yaml.write_text("data:\n  target_frames: [9, 17]\n")
    assert run_cli("validate", REPO / "configs/examples/quickstart_hunyuan15.yaml", yaml) == 2
    err = capsys.readouterr().err
    assert (f"'data.target_frames' in {yaml}:2 has no effect with data.frame_extraction=spread; remove it, or set "
            "data.frame_extraction to one that reads it: head, chunk, slide, uniform") in err


def test_dataset_entries_frame_settings_are_checked_with_the_mode_each_cuts_by(run_cli, capsys):
    """An entry's own key against its own mode (or data.frame_extraction, which it inherits); data.<key> is read
    when an entry that leaves the key unset cuts by a mode that reads it."""
    shapes = "configs/examples/data/shapes"
    entries = (f"data.datasets=[{{path: {shapes}, frame_sample: 3}}, "
               f"{{path: {shapes}, frame_extraction: head, max_frames: 33}}, "
               f"{{path: {shapes}, frame_extraction: uniform, frame_sample: 3}}]")
    assert _validate(run_cli, entries, "data.frame_stride=5") == 2
    err = capsys.readouterr().err
    assert ("'data.datasets[0].frame_sample' in command line has no effect with data.frame_extraction=spread; "
            "remove it, or set data.datasets[0].frame_extraction to one that reads it: uniform") in err
    assert ("'data.datasets[1].max_frames' in command line has no effect with data.datasets[1].frame_extraction=head; "
            "remove it, or set data.datasets[1].frame_extraction to one that reads it: full") in err
    assert ("'data.frame_stride' in command line has no effect with data.frame_extraction=spread, "
            "data.datasets[1].frame_extraction=head, data.datasets[2].frame_extraction=uniform; remove it, or set "
            "data.frame_extraction to one that reads it: slide") in err
    assert err.count("has no effect") == 3 and "data.datasets[2].frame_sample" not in err
    # data.frame_stride read by an entry that slides and leaves it unset; data.target_frames by one that takes heads
    assert _validate(run_cli, f"data.datasets=[{{path: {shapes}, frame_extraction: slide}}, "
                     f"{{path: {shapes}, frame_extraction: head}}]", "data.frame_stride=5",
                     "data.target_frames=[9]") == 0


def test_train_refuses_an_unread_frame_setting_before_anything_loads(tmp_path, run_cli, capsys):
    code = run_cli("train", REPO / "configs/examples/quickstart_hunyuan15.yaml", f"run.output_dir={tmp_path / 'run'}",
                   "data.target_frames=[9,17]")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert ("'data.target_frames' in command line has no effect with data.frame_extraction=spread; remove it, or set "
            "data.frame_extraction to one that reads it: head, chunk, slide, uniform") in err
    assert not (tmp_path / "run").exists()
