"""Toy training data for tests and quickstarts: coloured shapes on white, with matching captions."""

from __future__ import annotations

from pathlib import Path

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")


def _draw_shape(image, shape: str, colour: str, x0: float, y0: float, side: float) -> None:
    from PIL import ImageDraw

    draw, fill = ImageDraw.Draw(image), COLOURS[colour]
    if shape == "circle":
        draw.ellipse((x0, y0, x0 + side, y0 + side), fill=fill)
    elif shape == "square":
        draw.rectangle((x0, y0, x0 + side, y0 + side), fill=fill)
    else:
        draw.polygon([(x0 + side / 2, y0), (x0, y0 + side), (x0 + side, y0 + side)], fill=fill)


def _pairs(count: int) -> list[tuple[str, str]]:
    return [(c, s) for c in COLOURS for s in SHAPES][:count]


def write_shapes_dataset(out: Path, sizes: tuple[tuple[int, int], ...] = ((64, 64), (128, 64)),
                         count: int = 12) -> list[Path]:
    """Coloured shapes on white with matching captions ("a red circle on a white background"): the first
    `count` colour/shape pairs, each at every size."""
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for colour, shape in _pairs(count):
        for w, h in sizes:
            image = Image.new("RGB", (w, h), (255, 255, 255))
            side = min(w, h) * 0.6
            _draw_shape(image, shape, colour, (w - side) / 2, (h - side) / 2, side)
            name = f"{colour}_{shape}_{w}x{h}"
            image.save(out / f"{name}.png")
            (out / f"{name}.txt").write_text(f"a {colour} {shape} on a white background\n")
            written.append(out / f"{name}.png")
    return written


def write_clips_dataset(out: Path, count: int = 6, frames: int = 9, size: tuple[int, int] = (64, 64),
                        stills: int = 2) -> list[Path]:
    """Animated webp clips of a coloured shape moving left to right on white ("a red circle moving right"),
    plus `stills` stills, each with a caption file: the toy video set in configs/examples/data/clips."""
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    w, h = size
    side = min(w, h) * 0.4
    written = []
    for n, (colour, shape) in enumerate(_pairs(count + stills)):
        still = n >= count
        images = []
        for f in range(1 if still else frames):
            image = Image.new("RGB", (w, h), (255, 255, 255))
            x0 = (w - side) / 2 if still else f * (w - side) / (frames - 1)
            _draw_shape(image, shape, colour, x0, (h - side) / 2, side)
            images.append(image)
        name = f"{colour}_{shape}"
        if still:
            path = out / f"{name}.png"
            images[0].save(path)
            caption = f"a {colour} {shape} on a white background"
        else:
            path = out / f"{name}.webp"
            images[0].save(path, save_all=True, append_images=images[1:], duration=62, loop=0, lossless=True)
            caption = f"a {colour} {shape} moving right on a white background"
        path.with_suffix(".txt").write_text(caption + "\n")
        written.append(path)
    return written


def write_i2v_clips_dataset(out: Path, count: int = 4, frames: int = 9, size: tuple[int, int] = (64, 64)) -> list[Path]:
    """The image-to-video toy set in configs/examples/data/clips_i2v: `count` clips (as write_clips_dataset, no
    stills), the last with a start image beside it: its first frame drawn at twice the size (the same aspect
    ratio), as a sharper still of the first frame would be."""
    from PIL import Image

    clips = write_clips_dataset(out, count=count, frames=frames, size=size, stills=0)
    colour, shape = clips[-1].stem.split("_")
    w, h = size[0] * 2, size[1] * 2
    side = min(w, h) * 0.4
    image = Image.new("RGB", (w, h), (255, 255, 255))
    _draw_shape(image, shape, colour, 0, (h - side) / 2, side)
    image.save(clips[-1].with_suffix(".png"))
    return clips


def write_sound_clip(path: Path, frames: int = 9, fps: int = 24, size: tuple[int, int] = (64, 64),
                     tone_hz: float | None = 440.0, sample_rate: int = 16000, colour: str = "red") -> Path:
    """An mp4 (H.264) of a `colour` circle moving right, with a mono AAC soundtrack of a sine tone at `tone_hz` as
    long as the frames (none when tone_hz is None), and its caption file."""
    import av
    import numpy as np
    from PIL import Image

    from toolkit.data.video import H264_ENCODERS

    w, h = size
    side = min(w, h) * 0.4
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        for codec in H264_ENCODERS:
            try:
                video = container.add_stream(codec, rate=fps)
                break
            except (av.FFmpegError, ValueError):
                continue
        video.width, video.height, video.pix_fmt = w, h, "yuv420p"
        audio = container.add_stream("aac", rate=sample_rate, layout="mono") if tone_hz is not None else None
        for f in range(frames):
            image = Image.new("RGB", size, (255, 255, 255))
            _draw_shape(image, "circle", colour, f * (w - side) / (frames - 1), (h - side) / 2, side)
            container.mux(video.encode(av.VideoFrame.from_image(image)))
        container.mux(video.encode())
        if audio is not None:
            t = np.arange(round(frames / fps * sample_rate) + 1024) / sample_rate  # a little past the last frame
            tone = (0.5 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)[None]
            chunk = 1024
            for start in range(0, tone.shape[1], chunk):
                frame = av.AudioFrame.from_ndarray(tone[:, start:start + chunk], format="fltp", layout="mono")
                frame.sample_rate, frame.pts = sample_rate, start
                container.mux(audio.encode(frame))
            container.mux(audio.encode())
    path.with_suffix(".txt").write_text(f"a {colour} circle moving right on a white background\n")
    return path
