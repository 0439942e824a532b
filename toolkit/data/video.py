"""Video folders for the video families (Wan, HunyuanVideo 1.5): clips with captions, cut from each video by
data.frame_extraction, buckets in (width, height, frames), and sample videos.

The layouts are those of images.py (same-name caption files, or metadata.jsonl). Containers (.mp4 .webm .mkv .mov
.avi) are read with PyAV, animated .gif/.webp with Pillow; a still image is a one-frame clip (the video models
train on images as 1-frame videos). Their VAEs compress time by 4, so every clip trains on 4k+1 frames.

Clips from a video (`clip_spans`): `spread` (the default, ai-toolkit's num_frames with shrink_video_to_frames)
takes data.num_frames frames evenly across the whole video; the other modes are musubi-tuner's frame_extraction
and cut consecutive frames, for each length of data.target_frames: `head` the first F, `chunk` back-to-back
clips, `slide` one every frame_stride frames, `uniform` frame_sample clips whose starts are spread evenly, `full`
every frame up to max_frames. Each clip is an item of its own, bucketed by its frame count and its size (the
aspect bucket at data.resolution): a batch holds clips of one bucket.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from toolkit.data.augment import View
from toolkit.data.buckets import bucket_step
from toolkit.data.images import IMAGE_EXTS, cover_and_crop, file_hash, oriented_size, scan_folder
from toolkit.disk import is_disk_full
from toolkit.errors import UserError

if TYPE_CHECKING:
    from PIL.Image import Image

CONTAINER_EXTS = (".mp4", ".webm", ".mkv", ".mov", ".avi")
VIDEO_EXTS = CONTAINER_EXTS + (".gif", ".webp")
H264_ENCODERS = ("libx264", "libopenh264", "h264")  # tried in order; "h264" is whatever this FFmpeg build names so
TIME_COMPRESSION = 4  # Wan's VAE: latent frames = 1 + (frames - 1) / 4


@dataclass
class ClipItem:
    path: Path
    caption: str                    # after default caption and trigger word, like ImageItem
    size: tuple[int, int]           # original (width, height), after the file's rotation
    frame_count: int                # frames in the file (1 for a still image)
    bucket: tuple[int, int, int]    # training (width, height, frames)
    content_hash: str = ""
    start_image: Path | None = None  # image-to-video: the image beside the clip that stands for its first frame
    start_hash: str = ""
    dataset: int = 0                # which dataset (data/datasets.py) it came from
    mask: Path | None = None        # its loss mask (data.masked_loss)
    frames: tuple[int, ...] = ()    # the video's frames it trains on (extracted clips); (): spread over the video
    soundtrack: bool = False        # LTX-2 with data.audio on: the file has an audio stream (data/audio.py)


def frame_count_problem(frames: int, factor: int = TIME_COMPRESSION) -> str:
    """What is wrong with clips of `frames` frames for a VAE that compresses time by `factor` ('' when nothing):
    it takes factor k + 1 (4k+1; LTX-2's 8k+1). The one rule and message of the preflight and the clip scan."""
    if frames >= 1 and (frames - 1) % factor == 0:
        return ""
    below = max(1, (frames - 1) // factor * factor + 1)
    return f"{frames} is not {factor}k+1 (the VAE compresses time by {factor}); use {below} or {below + factor}"


def check_num_frames(frames: int, key: str = "data.num_frames", factor: int = TIME_COMPRESSION) -> None:
    """Raise a UserError naming `key` unless `frames` is factor k + 1 (frame_count_problem)."""
    if (problem := frame_count_problem(frames, factor)):
        raise UserError(f"{key}: {problem}")


def clip_frames(frame_count: int, num_frames: int) -> int:
    """Frames a clip trains on: num_frames, or the largest 4k+1 the clip holds when it is shorter."""
    return min(num_frames, (frame_count - 1) // TIME_COMPRESSION * TIME_COMPRESSION + 1)


def target_frames(data, factor: int = TIME_COMPRESSION) -> list[int]:
    """data.target_frames (each checked factor k + 1), or [data.num_frames] when it is empty."""
    lengths = list(data.target_frames) or [data.num_frames]
    for length in lengths:
        check_num_frames(length, "data.target_frames" if data.target_frames else "data.num_frames", factor)
    return lengths


def clip_spans(frame_count: int, data) -> list[tuple[int, int]]:
    """(first frame, frames) of each clip data.frame_extraction cuts from a video of `frame_count` frames, as
    musubi-tuner cuts them (not used for `spread`, whose one clip is spread over the whole video)."""
    mode, spans = data.frame_extraction, []
    if mode == "full":
        frames = clip_frames(min(data.max_frames, frame_count), data.max_frames)  # rounded down to 4k+1
        return [(0, frames)]
    for length in target_frames(data):
        if frame_count < length:
            continue
        if mode == "head":
            spans.append((0, length))
        elif mode == "chunk":
            spans += [(start, length) for start in range(0, frame_count - length + 1, length)]
        elif mode == "slide":
            spans += [(start, length) for start in range(0, frame_count - length + 1, data.frame_stride)]
        elif mode == "uniform":
            starts = np.linspace(0, frame_count - length, data.frame_sample, dtype=int).tolist()
            spans += [(start, length) for start in starts]
        else:  # the schema's choices hold only these
            raise ValueError(f"frame_extraction {mode!r}")
    return spans


def _clips_of(path: Path, caption: str, size: tuple[int, int], count: int, spatial: tuple[int, int],
              data) -> list[ClipItem]:
    """The items of one scanned file: its spread clip, a still image, or the clips cut from it."""
    content_hash = file_hash(path)
    if data.frame_extraction == "spread" or count == 1:
        return [ClipItem(path, caption, size, count, (*spatial, clip_frames(count, data.num_frames)), content_hash)]
    return [ClipItem(path, caption, size, count, (*spatial, frames), f"{content_hash}:{first}+{frames}",
                     frames=tuple(range(first, first + frames)))
            for first, frames in clip_spans(count, data)]


def frame_indices(frame_count: int, frames: int) -> list[int]:
    """`frames` indices spread evenly over the whole clip, first and last frame included."""
    return np.linspace(0, frame_count - 1, frames).round().astype(int).tolist()


def _import_av(path: Path):
    try:
        import av
    except ImportError:
        raise UserError(f"{path}: reading {path.suffix} videos needs PyAV\n  fix: pip install av") from None
    return av


def _probe_container(path: Path) -> tuple[tuple[int, int], int]:
    av = _import_av(path)
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            frames = container.decode(stream)
            # Decode one frame: a file FFmpeg cannot decode fails here, not in the middle of training.
            first = next(frames, None)
            if first is None:
                raise ValueError("no frames")
            count = stream.frames or 1 + sum(1 for _ in frames)  # the header's count when it has one
            w, h = first.width, first.height
            return ((h, w) if abs(first.rotation) == 90 else (w, h)), count
    except av.FFmpegError as err:
        raise ValueError(err.strerror or str(err)) from err  # strerror: the message without errno and path


def _probe_pillow(path: Path) -> tuple[tuple[int, int], int]:
    from PIL import Image

    with Image.open(path) as image:
        count = getattr(image, "n_frames", 1)
        image.load()
        return oriented_size(image), count


def _probe(path: Path) -> tuple[tuple[int, int], int]:
    """(width, height) as displayed, and the frame count."""
    return _probe_container(path) if path.suffix.lower() in CONTAINER_EXTS else _probe_pillow(path)


def scan_clips(data, log: Callable[[str], None],
               select: Callable[[list[ClipItem]], list[ClipItem]] | None = None,
               time_compression: int = TIME_COMPRESSION) -> list[ClipItem]:
    """Every readable clip or image under data.path with its caption and (width, height, frames) bucket;
    unreadable files are skipped and named. `select` narrows the list before the bucket table is printed
    (image-to-video: start images are not items); `time_compression`: the VAE's, which the clip lengths asked for
    (data.num_frames, data.target_frames) must suit."""
    check_num_frames(data.num_frames, factor=time_compression)
    if data.frame_extraction != "spread":
        target_frames(data, time_compression)  # each checked before any file is read
    root = Path(data.path)
    if not root.is_dir():
        raise UserError(f"data.path: {root} is not a folder\n  fix: point data.path at a folder of videos/images "
                        f"with same-name {data.caption_ext} captions (or a metadata.jsonl)")
    exts = tuple(dict.fromkeys(VIDEO_EXTS + IMAGE_EXTS))
    items, short = [], []
    for path, caption, size, count, spatial in scan_folder(data, log, "clip", exts, _probe, kinds="videos or images",
                                                           add="add .mp4/.webm/.gif videos or .png/.jpg images"):
        clips = _clips_of(path, caption, size, count, spatial, data)
        items += clips
        if not clips:
            short.append(f"{path.name} ({count} frames)")
    if short:
        log(f"warning: {len(short)} video(s) shorter than every data.target_frames length give no clip "
            f"(frame_extraction={data.frame_extraction}): {', '.join(short[:5])}{', ...' if len(short) > 5 else ''}")
    if not items:
        raise UserError(f"data.target_frames: no video in {root} is as long as {min(target_frames(data))} frames\n"
                        "  fix: shorter data.target_frames, or frame_extraction=spread")
    if data.frame_extraction != "spread":
        log(f"frame extraction ({data.frame_extraction}): {len(items)} clips from "
            f"{len({item.path for item in items})} files")
    if select is not None:
        items = select(items)
    log(format_clip_buckets(Counter(item.bucket for item in items), bucket_step(data.bucket_step, data.resolution)[1]))
    return items


def format_clip_buckets(counts: dict[tuple[int, int, int], int], why: str = "") -> str:
    """One line per used bucket: size, aspect ratio, frames and clip count; `why`: where the step came from."""
    lines = [f"  {w:>5} x {h:<5} (ratio {w / h:4.2f}) x {f:>3} frame{'s' if f != 1 else ' '}: "
             f"{n} clip{'s' if n != 1 else ''}"
             for (w, h, f), n in sorted(counts.items(), key=lambda kv: (kv[0][0] / kv[0][1], kv[0][2]))]
    return f"buckets{f' ({why})' if why else ''}:\n" + "\n".join(lines)


def _decode_container(path: Path, indices: list[int]) -> dict[int, "Image"]:
    av = _import_av(path)
    wanted, frames = set(indices), {}
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                image = frame.to_image()
                # Phone clips store the sensor's orientation and a display rotation (-90: turn clockwise).
                frames[i] = image.rotate(frame.rotation, expand=True) if frame.rotation else image
            if i >= indices[-1]:
                break
    return frames


def _decode_pillow(path: Path, indices: list[int]) -> dict[int, "Image"]:
    from PIL import Image, ImageOps, ImageSequence

    wanted, frames = set(indices), {}
    with Image.open(path) as image:
        if getattr(image, "n_frames", 1) == 1:
            return {0: ImageOps.exif_transpose(image).convert("RGB")}
        for i, frame in enumerate(ImageSequence.Iterator(image)):
            if i in wanted:
                frames[i] = frame.convert("RGB")
            if i >= indices[-1]:
                break
    return frames


def load_clip(item: ClipItem, view: View | None = None) -> torch.Tensor:
    """The clip's bucket frames, each resized to cover the bucket and cut to it (centred, or at the view's
    offset, mirrored when the view says so): (3, F, H, W) in [-1, 1]."""
    width, height, count = item.bucket
    indices = list(item.frames) or frame_indices(item.frame_count, count)
    decode = _decode_container if item.path.suffix.lower() in CONTAINER_EXTS else _decode_pillow
    frames = decode(item.path, indices)
    missing = [i for i in indices if i not in frames]
    if missing:
        raise UserError(f"{item.path}: the file said it has {item.frame_count} frames, but decoding ended before "
                        f"frame {missing[0]}\n  fix: re-encode it (ffmpeg -i in.mp4 -c:v libx264 out.mp4) or remove it")
    top_left = view.top_left if view else None
    array = np.stack([np.asarray(cover_and_crop(frames[i], (width, height), top_left)[0], dtype=np.float32)
                      for i in indices])
    pixels = torch.from_numpy(array / 127.5 - 1.0).permute(3, 0, 1, 2).contiguous()
    return pixels.flip(-1) if view is not None and view.flip else pixels


def write_video(frames: list["Image"], out_base: Path, fps: int = 16,
                log: Callable[[str], None] | None = None) -> list[Path]:
    """An animated .webp at out_base (always), and an H.264 .mp4 beside it when PyAV can encode one.

    An mp4 that cannot be written is left out and the reason goes to `log` (a warning without one): a sample
    never fails a run.
    """
    out_base = Path(out_base)
    out_base.parent.mkdir(parents=True, exist_ok=True)
    webp = out_base.with_suffix(".webp")
    rgb = [frame.convert("RGB") for frame in frames]
    rgb[0].save(webp, save_all=True, append_images=rgb[1:], duration=round(1000 / fps), loop=0,
                lossless=False, quality=90)
    written = [webp]
    reason = _write_mp4(rgb, out_base.with_suffix(".mp4"), fps)
    if reason is None:
        written.append(out_base.with_suffix(".mp4"))
    else:
        (log or warnings.warn)(f"{out_base.with_suffix('.mp4').name} not written ({reason}); the .webp is")
    return written


def _write_mp4(frames: list["Image"], path: Path, fps: int) -> str | None:
    """Encode H.264 yuv420p (odd sizes padded to even); None on success, else why not."""
    try:
        import av
    except ImportError:
        return "PyAV is not installed: pip install av"
    from PIL import Image

    w, h = frames[0].size
    even = (w + w % 2, h + h % 2)
    if even != (w, h):
        padded = []
        for frame in frames:
            canvas = Image.new("RGB", even)
            canvas.paste(frame, (0, 0))
            padded.append(canvas)
        frames = padded
    failures = []
    for codec in H264_ENCODERS:
        try:
            with av.open(str(path), "w") as container:
                stream = container.add_stream(codec, rate=fps)
                stream.width, stream.height, stream.pix_fmt = *even, "yuv420p"
                for frame in frames:
                    container.mux(stream.encode(av.VideoFrame.from_image(frame)))
                container.mux(stream.encode())
            return None
        except (av.FFmpegError, ValueError, OSError) as err:
            if is_disk_full(err):  # not the encoder's fault: the run stops, naming the disk (toolkit/disk.py)
                path.unlink(missing_ok=True)
                raise
            failures.append(f"{codec}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
            path.unlink(missing_ok=True)
    return "no working H.264 encoder in PyAV: " + "; ".join(failures)
