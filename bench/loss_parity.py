"""Loss parity with the diffusion trainers users switch from (issue 39 part 3): the toolkit and a peer train the same
tiny model on the same 8 images with the same hyperparameters, and one scorer measures what each LoRA learned.

    python bench/loss_parity.py [--kinds sd15,flux,wan] [--peers kohya,musubi] [--seeds 0,1,2] [--steps 400]
                                [--lr 1e-4] [--rank 16] [--alpha 16] [--out result.json] [--tiny-cpu]

Pairs: sd15 and flux against kohya sd-scripts, wan (2.1) against musubi-tuner. Models: bench/diffusion_models.py's
tiny pipelines (random weights, the real diffusers layout). Data: 8 images of 64 px, each a background and two
coloured blocks whose colours and corners the caption names ("a red block top left and a blue block bottom right
on a grey background"), so the LoRA has something to learn that the caption predicts; wan trains them as 1-frame
videos. Every trainer: LoRA rank/alpha, torch AdamW (weight decay 0.01), constant lr, no warm-up, batch 1, no noise
offset, no caption dropout, gradient norm clipped to 1.0, the seed of the row; timestep sampling as the peer does it
(TOOLKIT_SETTINGS says how the toolkit matches each peer; the peer module's notes say what it runs).

For every LoRA file, from the trainer's own output: `held_out` is the denoising loss of the pipeline with the LoRA
loaded by diffusers' `load_lora_weights` (diffusers converts kohya and musubi files itself) over the 8 training
images, at 8 fixed noise levels spread over the schedule ((i + 0.5) / 8), 2 fixed noise draws each (a generator
seeded 1234), each family's own target (epsilon for sd15, the flow velocity noise - x0 for flux and wan) and no loss
weighting; `base` is the same without the LoRA. `last100` is the mean of the trainer's own per-step losses over its
last 100 steps (its timestep distribution, so compare it between trainers of one kind only).

--tiny-cpu: 20 steps, seed 0, on the CPU (the toolkit and the scorer; a peer only where .whl-peers/NAME exists),
to check the bench."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

PEERS = {"sd15": "kohya", "flux": "kohya", "wan": "musubi"}  # the peer each kind is compared with (issue 39)
FAMILIES = {"sd15": "sd", "flux": "flux", "wan": "wan21"}
# The toolkit's settings that match each peer's timestep sampling (real config keys; the peer module's notes say
# what the peer runs):
#   sd15: kohya draws timesteps uniformly over 0..999 with epsilon prediction, no loss weighting;
#   flux: kohya --timestep_sampling flux_shift (sigmoid of a unit normal, shifted by Flux's resolution-dependent
#         exp(mu)) with --model_prediction_type raw and --guidance_scale 1.0: the toolkit's logit_normal sigmas with
#         flow_shift auto (the scheduler's dynamic shift) and train.guidance 1.0;
#   wan:  musubi --timestep_sampling shift --discrete_flow_shift 3.0 (sigmoid of a unit normal, shifted by 3): the
#         toolkit's logit_normal sigmas with flow_shift 3.0.
TOOLKIT_SETTINGS = {
    "sd15": ["train.timestep_sampling=uniform", "train.min_snr_gamma=0"],
    "flux": ["train.timestep_sampling=logit_normal", "train.logit_mean=0", "train.logit_std=1", "train.flow_shift=auto",
             "train.guidance=1.0"],
    "wan": ["train.timestep_sampling=logit_normal", "train.logit_mean=0", "train.logit_std=1", "train.flow_shift=3.0",
            "data.num_frames=1"],
}
SAVE_FORMAT = {"sd15": "kohya", "flux": "comfyui", "wan": "comfyui"}  # the toolkit's second file, besides diffusers'
RESOLUTION = 64
IMAGES = 8
LEVELS, DRAWS, SCORE_SEED = 8, 2, 1234
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
           "white": (245, 245, 245), "black": (15, 15, 15), "grey": (128, 128, 128), "purple": (140, 50, 170)}
CORNERS = {"top left": (0, 0), "top right": (0, 1), "bottom left": (1, 0), "bottom right": (1, 1)}


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# -- data ----------------------------------------------------------------------------------------------------------
def write_block_images(folder: Path, count: int = IMAGES, size: int = RESOLUTION) -> None:
    """`count` images of a background and two half-size blocks in named corners, with the caption that names them."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    names, corners = list(COLOURS), list(CORNERS)
    for i in range(count):
        background = names[(3 * i + 6) % len(names)]
        first, second = names[i % len(names)], names[(i + 3) % len(names)]
        where = corners[i % 4], corners[(i + 1 + i // 4) % 4]
        image = Image.new("RGB", (size, size), COLOURS[background])
        draw = ImageDraw.Draw(image)
        half = size // 2
        for colour, corner in zip((first, second), where):
            row, col = CORNERS[corner]
            draw.rectangle([col * half, row * half, col * half + half - 1, row * half + half - 1], fill=COLOURS[colour])
        image.save(folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text(
            f"a {first} block {where[0]} and a {second} block {where[1]} on a {background} background\n")


# -- the toolkit ---------------------------------------------------------------------------------------------------
def toolkit_parity(kind: str, folder: Path, data: Path, work: Path, seed: int, steps: int, lr: float, rank: int,
                   alpha: float, resolution: int, timeout: float) -> tuple[dict[str, Path], list[float]]:
    """Train through `python -m toolkit train` in a process of its own; ({"diffusers": file, FORMAT: file}, the
    per-step losses from logs/metrics.jsonl)."""
    name = f"toolkit-{kind}-s{seed}"
    precision = "bf16" if device() == "cuda" else "fp32"
    config = work / f"{name}.yaml"
    config.write_text(
        f"run: {{name: {name}, output_dir: {work / name}, seed: {seed}}}\n"
        f"model: {{family: {FAMILIES[kind]}, name_or_path: {folder}}}\n"
        f"network: {{rank: {rank}, alpha: {alpha}}}\n"
        f"data: {{path: {data}, resolution: {resolution}}}\n"
        f"train: {{steps: {steps}, batch_size: 1, grad_accum: 1, lr: {lr}, lr_scheduler: constant, warmup_steps: 0,\n"
        f"        optimizer: adamw, weight_decay: 0.01, noise_offset: 0.0, max_grad_norm: 1.0, precision: {precision},\n"
        f"        gradient_checkpointing: false, compile: false}}\n"
        f"save: {{every: 0, dtype: fp32, format: {SAVE_FORMAT[kind]}}}\n"
        "sample: {prompts: []}\n"
        "log: {every: 1, tensorboard: false}\n")
    log = work / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as handle:
        done = subprocess.run([sys.executable, "-m", "toolkit", "train", str(config), *TOOLKIT_SETTINGS[kind]],
                              cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"toolkit train exit {done.returncode}: {' | '.join(tail)} (whole output: {log})")
    run = work / name
    records = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}
    final = run / "final"
    files = {"diffusers": final / "pytorch_lora_weights.safetensors"}
    files.update({SAVE_FORMAT[kind]: p for p in final.glob(f"*_{SAVE_FORMAT[kind]}.safetensors")})
    return files, [losses[s] for s in sorted(losses)]


# -- the scorer: one function for every LoRA file ---------------------------------------------------------------------
def held_out_loss(kind: str, folder: Path, data: Path, lora: Path | None = None, scale: float = 1.0) -> float:
    """The denoising loss of the pipeline in `folder` with `lora` loaded by diffusers (at `scale`; none: the base)
    over the images in `data` with their captions: LEVELS noise levels (i + 0.5) / LEVELS of the schedule, DRAWS
    noise draws each from a generator seeded SCORE_SEED, the family's own target, unweighted, in fp32."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32).to(device())
    if lora is not None:
        pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="scored")
        pipe.set_adapters(["scored"], [scale])
    generator = torch.Generator().manual_seed(SCORE_SEED)
    levels = [(i + 0.5) / LEVELS for i in range(LEVELS)]
    losses = []
    with torch.no_grad():
        for image in sorted(data.glob("*.png")):
            latents, predict = PREDICTORS[kind](pipe, pixels(image), image.with_suffix(".txt").read_text().strip())
            for level in levels:
                for _ in range(DRAWS):
                    noise = torch.randn(latents.shape, generator=generator).to(latents.device)
                    prediction, target = predict(latents, noise, level)
                    losses.append(torch.nn.functional.mse_loss(prediction.float(), target.float()).item())
    return sum(losses) / len(losses)


def pixels(image: Path) -> torch.Tensor:
    """The image as a (1, 3, H, W) tensor in [-1, 1] on the device."""
    import numpy as np
    from PIL import Image

    array = np.asarray(Image.open(image).convert("RGB"), dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1)[None].to(device())


def sd_predictor(pipe, image: torch.Tensor, caption: str):
    """Epsilon prediction at the DDPM timestep `level` of the way through the schedule."""
    latents = pipe.vae.encode(image).latent_dist.mode() * pipe.vae.config.scaling_factor
    text = pipe.encode_prompt(caption, device(), 1, False)[0]
    steps = pipe.scheduler.config.num_train_timesteps

    def predict(latents, noise, level):
        t = torch.tensor([min(int(level * steps), steps - 1)], device=latents.device)
        noisy = pipe.scheduler.add_noise(latents, noise, t)
        return pipe.unet(noisy, t, encoder_hidden_states=text).sample, noise

    return latents, predict


def flux_predictor(pipe, image: torch.Tensor, caption: str):
    """The flow velocity noise - x0 at sigma `level`, on the packed latents, guidance 1.0 (as every trainer here)."""
    vae = pipe.vae
    latents = (vae.encode(image).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    b, c, h, w = latents.shape
    packed = pipe._pack_latents(latents, b, c, h, w)
    image_ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)
    text, pooled, text_ids = pipe.encode_prompt(prompt=caption, prompt_2=None, device=device())
    guidance = torch.ones(b, device=latents.device)

    def predict(latents, noise, level):
        noisy = (1 - level) * latents + level * noise
        sigma = torch.full((b,), level, device=latents.device)
        out = pipe.transformer(hidden_states=noisy, timestep=sigma, guidance=guidance, pooled_projections=pooled,
                               encoder_hidden_states=text, txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]
        return out, noise - latents

    return packed, predict


def wan_predictor(pipe, image: torch.Tensor, caption: str):
    """The flow velocity noise - x0 at sigma `level`; the image is a 1-frame video, its latents normalised as
    WanPipeline does."""
    vae = pipe.vae
    latents = vae.encode(image[:, :, None]).latent_dist.mode()
    view = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(view)
    std = torch.tensor(vae.config.latents_std, device=latents.device).view(view)
    latents = (latents - mean) / std
    text = pipe.encode_prompt(caption, do_classifier_free_guidance=False, device=device())[0]

    def predict(latents, noise, level):
        noisy = (1 - level) * latents + level * noise
        t = torch.full((latents.shape[0],), level * 1000, device=latents.device)
        out = pipe.transformer(hidden_states=noisy, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        return out, noise - latents

    return latents, predict


PREDICTORS = {"sd15": sd_predictor, "flux": flux_predictor, "wan": wan_predictor}
