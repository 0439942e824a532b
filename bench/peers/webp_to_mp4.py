"""The bench's clip (an animated webp beside its caption) as the mp4 ai-toolkit's video loader (OpenCV) reads:
python webp_to_mp4.py DATA OUT writes OUT/clip.mp4 and OUT/clip.txt. Runs in the peer's environment (cv2)."""

import shutil
import sys
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, ImageSequence

data, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
clip = Image.open(data / "clip.webp")
frames = [np.asarray(frame.convert("RGB"))[:, :, ::-1] for frame in ImageSequence.Iterator(clip)]
height, width = frames[0].shape[:2]
writer = cv2.VideoWriter(str(out / "clip.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 16, (width, height))
for frame in frames:
    writer.write(np.ascontiguousarray(frame))
writer.release()
shutil.copy(data / "clip.txt", out / "clip.txt")
print(f"{len(frames)} frames {width}x{height} -> {out / 'clip.mp4'}")
