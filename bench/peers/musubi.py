"""musubi-tuner (kohya-ss/musubi-tuner, pinned in musubi.sh) beside the toolkit in bench/diffusion.py: rows `musubi`
(its documented settings for speed) and `musubi-24g` (its 24 GB settings) for wan, wan22 and qwen_image, and its
Wan 2.1 run for the loss parity.

musubi runs in three steps, each a process of its own: the latents cache (wan_cache_latents.py), the text-encoder
cache (wan_cache_text_encoder_outputs.py), then the trainer (wan_train_network.py), one process (no accelerate
launch). Its dataset is a toml (docs/dataset_config.md): the clip as a video whose frames are a folder (musubi reads a
folder named like a video with PIL, frame_extraction head, target_frames the workload's), or the image folder.
Its model files are single files in the original Wan names, converted from the bench's pipeline folder
(musubi_files.py); bench/peers/musubi_launch.py sets musubi's fixed model shapes to theirs.

Settings, from docs/wan.md and the trainer's options: --sdpa (no flash-attn, sage or xformers on the machine),
--mixed_precision bf16 with the bf16 DiT, --gradient_checkpointing (its documented command), --optimizer_type adamw
(torch's AdamW; the docs' example uses adamw8bit, bitsandbytes is not on the machine), networks.lora_wan rank 16
alpha 16 on its default targets (every Linear of the blocks), --timestep_sampling shift --discrete_flow_shift 3.0
(the docs' example), cached latents and text-encoder outputs on disk, 2 persistent data-loader workers, lr 1e-4
constant, seed 0. wan22 trains the high-noise expert alone as docs/wan.md says for one expert: --dit the expert,
--min_timestep 875 --max_timestep 1000 --preserve_distribution_shape, --discrete_flow_shift 12.0 (the official T2V
inference shift the docs point to). qwen_image (docs/qwen_image.md): qwen_image_train_network.py --model_version
original, networks.lora_qwen_image, --timestep_sampling shift --discrete_flow_shift 2.2 --weighting_scheme none.
24g: --fp8_base --fp8_scaled, and --blocks_to_swap for wan22 (20 of 40: docs/wan.md gives no count, the bench's
choice) and qwen_image (16 of 60: docs/qwen_image.md's 24 GB figure)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch

from .common import (STANDINS, PeerFailed, install, peak_gib, peer_env, run_logged, tensorboard_losses,
                     timed_run)

STEPS = re.compile(r"steps:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+) \[")  # its training bar, not the loading bars (fp8)
KINDS = {"wan": "wan_train_network.py --task t2v-1.3B",
         "wan22": "wan_train_network.py --task t2v-A14B (high-noise expert)",
         "qwen_image": "qwen_image_train_network.py --model_version original"}
SCRIPTS = {  # family: (latents cache, text-encoder cache, trainer, text-encoder option, its file)
    "wan": ("wan_cache_latents.py", "wan_cache_text_encoder_outputs.py", "wan_train_network.py", "--t5", "t5"),
    "qwen_image": ("qwen_image_cache_latents.py", "qwen_image_cache_text_encoder_outputs.py",
                   "qwen_image_train_network.py", "--text_encoder", "text_encoder"),
}
HERE = Path(__file__).resolve().parent
FLOW_SHIFT = {"wan": "3.0", "wan22": "12.0", "qwen_image": "2.2"}  # the docs' commands (wan22: the T2V inference shift)
# --blocks_to_swap as a share of the blocks: wan22 20 of A14B's 40 (14B in fp8 is ~14 GB; half resident leaves room
# for activations), qwen_image 16 of 60 (docs/qwen_image.md: 24 GB with fp8 and 16 blocks swapped)
SWAPPED = {"wan22": 0.5, "qwen_image": 16 / 60}


def row(kind: str, variant: str, folder: Path, data: Path, work: Path, w: dict, steps: int, warmup: int,
        timeout: float) -> dict:
    if kind not in KINDS:
        raise PeerFailed(f"musubi-tuner does not train {kind} here (its rows: {', '.join(KINDS)})")
    run = prepare(kind, folder, data, work, w, timeout)
    args = speed_args(kind, variant, run["shapes"])
    notes = [f"musubi-tuner {KINDS[kind]}: " + " ".join(args)]
    result = train(run, args + ["--max_train_steps", str(steps + warmup), "--seed", "0"], warmup, timeout)
    result.update(peak_gib=peak_gib(run["work"]), caching_s=run["caching_s"], notes=notes)
    return result


def parity(kind: str, folder: Path, data: Path, work: Path, seed: int, steps: int, lr: float, rank: int, alpha: float,
           resolution: int, timeout: float) -> tuple[Path, list[float]]:
    """Wan 2.1: LoRA rank/alpha, torch AdamW (weight decay 0.01), constant lr, batch 1, timestep sampling `shift`:
    sigmoid(N(0, 1)) shifted by the pipeline's flow_shift, which is the toolkit's Wan default (logit_normal 0/1
    shifted by the scheduler's flow_shift); no noise offset, no caption dropout, the images of `data` (one frame)."""
    if kind != "wan":
        raise PeerFailed(f"musubi-tuner parity: wan only, not {kind}")
    shift = json.loads((folder / "scheduler" / "scheduler_config.json").read_text()).get("flow_shift", 3.0)
    w = {"batch": 1, "size": resolution}
    run = prepare(kind, folder, data, work, w, timeout)
    args = common_args(kind, run["shapes"]) + [
        "--learning_rate", str(lr), "--network_dim", str(rank), "--network_alpha", f"{alpha:g}",
        "--optimizer_args", "weight_decay=0.01", "--timestep_sampling", "shift", "--discrete_flow_shift", f"{shift:g}",
        "--sigmoid_scale", "1.0", "--weighting_scheme", "none", "--max_train_steps", str(steps), "--seed", str(seed)]
    result = train(run, args, warmup=0, timeout=timeout, timed=False)
    return run["out"] / "lora.safetensors", result["losses"]


# -- steps ---------------------------------------------------------------------------------------------------------
def prepare(kind: str, folder: Path, data: Path, work: Path, w: dict, timeout: float) -> dict:
    """Model files, dataset toml and both caches; the pieces train() needs."""
    from .musubi_files import write_qwen_image, write_wan

    work = work / f"musubi-{kind}"
    work.mkdir(parents=True, exist_ok=True)
    family = "qwen_image" if kind == "qwen_image" else "wan"
    writer = write_qwen_image if family == "qwen_image" else write_wan
    shapes = writer(folder, work / "files", torch.bfloat16 if _cuda() or family == "qwen_image" else torch.float32)
    latents_script, text_script, trainer, text_option, text_file = SCRIPTS[family]
    shapes_file = work / "files" / "shapes.json"
    src, env = musubi_env(shapes, work)
    toml = write_dataset(data, work, w)
    device = "cuda" if _cuda() else "cpu"
    launch = [sys.executable, str(HERE / "musubi_launch.py"), str(shapes_file)]
    script = lambda name: str(src / "src" / "musubi_tuner" / name)  # noqa: E731
    log = work / "musubi.log"
    caching = run_logged(launch + [script(latents_script), "--dataset_config", str(toml), "--vae",
                                   shapes["files"]["vae"], "--device", device, "--num_workers", "2"],
                         src, env, log, timeout)
    caching += run_logged(launch + [script(text_script), "--dataset_config", str(toml), text_option,
                                    shapes["files"][text_file], "--device", device, "--batch_size", "16",
                                    "--num_workers", "2"], src, env, log, timeout)
    return {"work": work, "shapes": shapes, "env": env, "toml": toml, "launch": launch, "src": src, "log": log,
            "trainer": script(trainer), "caching_s": caching, "out": work / "out"}


def musubi_env(shapes: dict, work: Path) -> tuple[Path, dict]:
    """(musubi's source folder, the environment of its processes) for the files of `shapes`: its pinned packages,
    its package, the tokenizer under the hub name musubi asks for."""
    src, site = install("musubi")
    env = peer_env(site, src, work)
    env["HF_HOME"] = shapes["hf_home"]
    paths = [str(src / "src")] + [os.environ.get("BENCH_PEER_EXTRA_PATH", ""),  # the package; a CPU check's opencv
                                  str(STANDINS)]  # last: PyAV's import-only stand-in (the clip is a folder of frames)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *filter(None, paths)])
    return src, env


def common_args(kind: str, shapes: dict) -> list[str]:
    # CPU (--tiny check): musubi's Wan time embedding asks autocast for float32, which CPU autocast ignores; the Wan
    # DiT is then float32 (musubi_files) without mixed precision. Its Qwen-Image trainer keeps the DiT in bf16.
    precision = "bf16" if _cuda() or kind == "qwen_image" else "no"
    files = shapes["files"]
    if kind == "qwen_image":
        model = ["--dit", files["dit"], "--vae", files["vae"], "--text_encoder", files["text_encoder"],
                 "--model_version", "original", "--network_module", "networks.lora_qwen_image"]
    else:
        model = ["--task", "t2v-A14B" if kind == "wan22" else "t2v-1.3B", "--dit", files["dit"],
                 "--network_module", "networks.lora_wan"]
    args = model + ["--sdpa", "--mixed_precision", precision, "--optimizer_type", "adamw", "--lr_scheduler",
                    "constant", "--gradient_checkpointing", "--max_data_loader_n_workers", "2",
                    "--persistent_data_loader_workers"]
    if kind == "wan22":  # one expert: docs/wan.md's timestep range for the T2V high-noise model
        args += ["--min_timestep", "875", "--max_timestep", "1000", "--preserve_distribution_shape"]
    return args


def speed_args(kind: str, variant: str, shapes: dict) -> list[str]:
    args = common_args(kind, shapes) + ["--learning_rate", "1e-4", "--network_dim", "16", "--network_alpha", "16",
                                        "--timestep_sampling", "shift", "--weighting_scheme", "none",
                                        "--discrete_flow_shift", FLOW_SHIFT[kind]]
    if variant == "24g":
        args += ["--fp8_base", "--fp8_scaled"]
        swapped = int(shapes["dit"]["num_layers"] * SWAPPED.get(kind, 0))
        if swapped:
            args += ["--blocks_to_swap", str(swapped)]
    elif variant:
        raise PeerFailed(f"musubi-tuner: no variant {variant!r} (\"\" or \"24g\")")
    return args


def train(run: dict, args: list[str], warmup: int, timeout: float, timed: bool = True) -> dict:
    """The trainer's run: timed from its progress bar (timed) or only run (the parity needs its losses and LoRA)."""
    logs = run["work"] / "tensorboard"
    cmd = run["launch"] + [run["trainer"], "--dataset_config", str(run["toml"]), "--output_dir", str(run["out"]),
                           "--output_name", "lora", "--logging_dir", str(logs), "--log_with", "tensorboard", *args]
    if timed:
        result = timed_run(cmd, run["src"], run["env"], run["log"], warmup, timeout, progress=STEPS)
    else:
        result = {"wall_s": run_logged(cmd, run["src"], run["env"], run["log"], timeout)}
    try:
        result["losses"] = [round(x, 5) for x in tensorboard_losses(logs, "loss/current")]
    except PeerFailed:  # the row's step time stands without them
        result["losses"] = []
    return result


def write_dataset(data: Path, work: Path, w: dict) -> Path:
    """musubi's dataset toml: the clip (as a folder of frames named clip.mp4, which musubi reads with PIL) or the
    images, their .txt captions, cached under work/."""
    from PIL import Image

    cache = work / "cache"
    if "frames" in w:
        video = work / "video"
        frames = video / "clip.mp4"  # a folder: musubi's load_video reads the images in it
        frames.mkdir(parents=True, exist_ok=True)
        with Image.open(data / "clip.webp") as clip:
            for i in range(w["frames"]):
                clip.seek(i)
                clip.convert("RGB").save(frames / f"{i:04d}.png")
        (video / "clip.txt").write_text((data / "clip.txt").read_text())
        size = (w["width"], w["height"])
        source = (f'video_directory = "{video}"\ntarget_frames = [{w["frames"]}]\nframe_extraction = "head"\n')
    else:
        size = (w["size"], w["size"])
        source = f'image_directory = "{data}"\n'
    toml = work / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [{size[0]}, {size[1]}]\ncaption_extension = ".txt"\n'
                    f'batch_size = {w["batch"]}\nenable_bucket = false\n\n[[datasets]]\n{source}'
                    f'cache_directory = "{cache}"\nnum_repeats = 1\n')
    return toml


def _cuda() -> bool:
    return torch.cuda.is_available()


