"""Loss parity with the diffusion trainers users switch from (issue 39 part 3): the toolkit and a peer train the same
tiny model on the same 8 images with the same hyperparameters, and one scorer measures what each LoRA learned.

    python bench/loss_parity.py [--kinds sd15,flux,wan] [--peers kohya,musubi] [--seeds 0,1,2] [--steps 400]
                                [--lr 1e-4] [--rank 16] [--alpha 16] [--out result.json] [--tiny-cpu]

Pairs: sd15 and flux against kohya sd-scripts, wan (2.1) against musubi-tuner. Models: bench/diffusion_models.py's
tiny pipelines (random weights, the real diffusers layout); sd15 beside kohya on a GPU is SD1.5 at its real shape
(random weights), the only UNet sd-scripts builds; kohya and musubi build their Flux and Wan models at the tiny
pipeline's shapes (bench/peers/kohya_launch.py, musubi_launch.py) from the pipeline's own weights, every tensor.
Data: 8 images of 64 px, each a background and two coloured blocks whose colours and corners the caption names
("a red block top left and a blue block bottom right on a grey background"), so the LoRA has something to learn that
the caption predicts; wan trains them as 1-frame videos. Every trainer: LoRA rank/alpha, torch AdamW (weight decay
0.01), constant lr, no warm-up, batch 1, no noise offset, no caption dropout, gradient norm clipped to 1.0, the seed
of the row; timestep sampling as the peer does it (TOOLKIT_SETTINGS says how the toolkit matches each peer; the peer
module's notes say what it runs).

For every LoRA file, from the trainer's own output: `held_out` is the denoising loss of the pipeline with the LoRA
loaded by diffusers' `load_lora_weights` (diffusers converts kohya and musubi files itself; of a kohya Flux file on
another width than Flux.1's, the fused linear1 is split by peers/kohya_files.py: diffusers splits it at Flux.1's only)
over the 8 training images, at 8 fixed noise levels spread over the schedule ((i + 0.5) / 8), 2 fixed noise draws
each (a generator seeded 1234), each family's own target (epsilon for sd15, the flow velocity noise - x0 for flux
and wan) and no loss weighting; `base` is the same without the LoRA. A file of which diffusers adapts fewer layers
than it holds LoRA modules (diffusers skips a key it cannot place with a log line at most) gets no number: its row
says so. `last100` is the mean of the trainer's own per-step losses over its last 100 steps (its timestep
distribution, so compare it between trainers of one kind only).

--tiny-cpu: 20 steps, seed 0, on the CPU (the toolkit and the scorer; a peer only where .whl-peers/NAME exists),
to check the bench."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
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
# The LoRA's targets are the peer's defaults, not the toolkit's (attention only on SD1.5, no modulation on Flux):
#   sd15: kohya's networks.lora adapts every Linear and 1x1 conv inside Transformer2DModel;
#   flux: kohya's networks.lora_flux every Linear of the double and single blocks, modulation included. kohya's
#         fused layers (a double block's qkv, a single block's linear1: q, k, v and the MLP's input) get one LoRA
#         each, the toolkit's separate ones (to_q, to_k, to_v, proj_mlp) one each: the same weights adapted, with
#         about 1.5x (qkv) and 1.4x (linear1) kohya's LoRA parameters there. kohya's split_qkv would match it, but
#         its split sizes are real Flux's, not the tiny model's;
#   wan:  musubi's every Linear of WanAttentionBlock, which is the toolkit's default already.
SD15_KOHYA_TARGETS = "[to_q,to_k,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,ff.net.2]"
# Every peer starts a LoRA's A kaiming-uniform (kohya's networks/lora.py, musubi-tuner's, ai-toolkit's), not with the
# toolkit's diffusion default (gaussian, 1/rank): network.init=kaiming, or one lr takes steps of different size
# (beside musubi-tuner on Wan, 2026-11-29: held-out +0.0078, se 0.0017, with the default; +0.0003, se 0.0024, with
# kaiming, on the CPU).
PEER_INIT = "network.init=kaiming"
TOOLKIT_SETTINGS = {
    "sd15": ["train.timestep_sampling=uniform", "train.min_snr_gamma=0", f"network.target_modules={SD15_KOHYA_TARGETS}",
             PEER_INIT],
    "flux": ["train.timestep_sampling=logit_normal", "train.logit_mean=0", "train.logit_std=1", "train.flow_shift=auto",
             "train.guidance=1.0", "network.target_modules=all-linear", PEER_INIT],
    "wan": ["train.timestep_sampling=logit_normal", "train.logit_mean=0", "train.logit_std=1", "train.flow_shift=3.0",
            "data.num_frames=1", PEER_INIT],
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
    work.mkdir(parents=True, exist_ok=True)
    config = work / f"{name}.yaml"
    config.write_text(
        f"run: {{name: {name}, output_dir: {work / name}, seed: {seed}}}\n"
        f"model: {{family: {FAMILIES[kind]}, name_or_path: {folder}}}\n"
        f"network: {{rank: {rank}, alpha: {alpha}}}\n"
        f"data: {{path: {data}, resolution: {resolution}, caption_dropout: 0.0, random_flip: false}}\n"
        f"train: {{steps: {steps}, batch_size: 1, grad_accum: 1, lr: {lr}, lr_scheduler: constant, warmup_steps: 0,\n"
        f"        optimizer: adamw, weight_decay: 0.01, noise_offset: 0.0, max_grad_norm: 1.0, precision: {precision},\n"
        f"        gradient_checkpointing: false, compile: false}}\n"
        f"save: {{every: 0, dtype: fp32, format: {SAVE_FORMAT[kind]}}}\n"
        "sample: {prompts: []}\n"
        "log: {every: 1, tensorboard: false}\n")
    log = work / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as handle:
        done = subprocess.run([sys.executable, "-m", "toolkit", "train", "--fresh", str(config),
                               *TOOLKIT_SETTINGS[kind]],
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
    pipe = scored_pipeline(folder, lora, scale)
    images = sorted(data.glob("*.png"))
    captions = [image.with_suffix(".txt").read_text().strip() for image in images]
    with torch.no_grad():  # all images in one batch: each level and draw is one forward
        latents, predict = PREDICTORS[kind](pipe, torch.cat([pixels(image) for image in images]), captions)
        generator = torch.Generator().manual_seed(SCORE_SEED)
        noises = torch.randn((LEVELS, DRAWS, *latents.shape), generator=generator).to(latents.device)
        losses = []
        for i in range(LEVELS):
            for draw in range(DRAWS):
                prediction, target = predict(latents, noises[i, draw], (i + 0.5) / LEVELS)
                losses.append(torch.nn.functional.mse_loss(prediction.float(), target.float()).item())
    return sum(losses) / len(losses)


LORA_PARTS = re.compile(r"\.(lora_down|lora_up|lora_A|lora_B|lora\.down|lora\.up|lora_mid|alpha|dora_scale)"
                        r"(\.[^.]+)?(\.weight)?$")


def scored_pipeline(folder: Path, lora: Path | None = None, scale: float = 1.0):
    """The pipeline in `folder` in fp32 on the device with `lora` loaded by diffusers' load_lora_weights as adapter
    `scored` at `scale`. RuntimeError when diffusers adapted fewer layers than the file holds LoRA modules (it skips
    keys it cannot place with a log line at most): the score would not be the file's."""
    from diffusers import DiffusionPipeline

    from peers.kohya_files import kohya_flux_lora_at_width

    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32).to(device())
    if lora is not None:
        converted = kohya_flux_lora_at_width(pipe, lora)  # None: diffusers reads the file itself
        if converted is not None:
            pipe.load_lora_weights(converted, adapter_name="scored")
        else:
            pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="scored")
        pipe.set_adapters(["scored"], [scale])
        in_file, applied = lora_coverage(pipe, lora)
        if applied < in_file:
            raise RuntimeError(f"diffusers applied {applied} of the {in_file} LoRA modules in {lora.name}")
    return pipe


def lora_coverage(pipe, lora: Path, adapter: str = "scored") -> tuple[int, int]:
    """(LoRA modules in the file: its keys less the down/up/alpha suffix, layers of the pipeline's models that
    hold `adapter`). A fused layer that diffusers splits (kohya Flux's qkv, linear1) counts once in the file and
    once per part in the pipeline."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors import safe_open

    with safe_open(str(lora), "pt") as handle:
        modules = {LORA_PARTS.sub("", key) for key in handle.keys()}
    applied = sum(1 for component in pipe.components.values() if isinstance(component, torch.nn.Module)
                  for layer in component.modules()
                  if isinstance(layer, BaseTunerLayer) and adapter in getattr(layer, "lora_A", {}))
    return len(modules), applied


def pixels(image: Path) -> torch.Tensor:
    """The image as a (1, 3, H, W) tensor in [-1, 1] on the device."""
    import numpy as np
    from PIL import Image

    array = np.asarray(Image.open(image).convert("RGB"), dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1)[None].to(device())


def sd_predictor(pipe, image: torch.Tensor, caption: list[str]):
    """Epsilon prediction at the DDPM timestep `level` of the way through the schedule."""
    latents = pipe.vae.encode(image).latent_dist.mode() * pipe.vae.config.scaling_factor
    text = pipe.encode_prompt(caption, device(), 1, False)[0]
    steps = pipe.scheduler.config.num_train_timesteps

    def predict(latents, noise, level):
        t = torch.full((latents.shape[0],), min(int(level * steps), steps - 1), device=latents.device)
        noisy = pipe.scheduler.add_noise(latents, noise, t)
        return pipe.unet(noisy, t, encoder_hidden_states=text).sample, noise

    return latents, predict


def flux_predictor(pipe, image: torch.Tensor, caption: list[str]):
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


def wan_predictor(pipe, image: torch.Tensor, caption: list[str]):
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


# -- the peers -----------------------------------------------------------------------------------------------------
def peer_parity(name: str, kind: str, folder: Path, data: Path, work: Path, seed: int, steps: int, lr: float,
                rank: int, alpha: float, timeout: float) -> tuple[Path, list[float]]:
    """peers.NAME.parity(...), imported only now; RuntimeError saying why when the module or its carried
    installation (.whl-peers/NAME) is missing."""
    import importlib

    if not (REPO / ".whl-peers" / name).exists():
        raise RuntimeError(f".whl-peers/{name} is missing: build it with `bash bench/peers/packages.sh {name}` and "
                           "carry it")
    try:
        module = importlib.import_module(f"peers.{name}")
    except ModuleNotFoundError as error:
        raise RuntimeError(f"bench/peers/{name}.py is not here ({error})") from None
    if not hasattr(module, "parity"):
        raise RuntimeError(f"bench/peers/{name}.py has no parity()")
    return module.parity(kind, folder, data, work, seed, steps, lr, rank, alpha, RESOLUTION, timeout)


# -- the runs and the table ----------------------------------------------------------------------------------------
def last_mean(losses: list[float], n: int = 100) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail) if tail else float("nan")


def score_or_reason(kind: str, folder: Path, data: Path, lora: Path) -> float | str:
    """held_out_loss of `lora`, or why diffusers could not load it (that row says so)."""
    try:
        return held_out_loss(kind, folder, data, lora)
    except Exception as error:  # the row names what diffusers said; the other rows still run
        return f"diffusers cannot load {lora.name}: {type(error).__name__}: {str(error)[:200]}"


def tiny_pipeline(kind: str, trainers: list[str]) -> bool:
    """sd-scripts builds SD1.5's UNet at its real shape only (and reads CLIP-L's 768-wide states into it): beside
    kohya on a GPU, sd15 trains SD1.5 at its real shape with random weights, on the same 64 px images."""
    return not (kind == "sd15" and "kohya" in trainers and device() == "cuda")


def run_kind(kind: str, trainers: list[str], seeds: list[int], args, work: Path) -> dict:
    """Every trainer and seed of `kind`: its rows, per-trainer summaries and the toolkit - peer differences."""
    from diffusion_models import write_pipeline

    folder, data = work / kind, work / f"{kind}-data"
    torch.manual_seed(0)  # the VAE and text encoders too: the same pipeline in every invocation (one kind each)
    write_pipeline(kind, folder, device(), tiny=tiny_pipeline(kind, trainers))
    write_block_images(data)
    base = held_out_loss(kind, folder, data)
    rows = []
    for trainer in trainers:
        for seed in seeds:
            row = {"trainer": trainer, "seed": seed, "base": base}
            runs = work / f"{kind}-{trainer}-s{seed}"
            runs.mkdir(parents=True, exist_ok=True)
            began = time.perf_counter()
            try:
                if trainer == "toolkit":
                    files, losses = toolkit_parity(kind, folder, data, runs, seed, args.steps, args.lr, args.rank,
                                                   args.alpha, RESOLUTION, args.timeout)
                    lora = files.pop("diffusers")
                    for fmt, other in files.items():  # the same LoRA in the toolkit's other export
                        row[f"held_out_{fmt}"] = score_or_reason(kind, folder, data, other)
                else:
                    lora, losses = peer_parity(trainer, kind, folder, data, runs, seed, args.steps, args.lr,
                                               args.rank, args.alpha, args.timeout)
            except Exception as error:  # a trainer that cannot run gives a row with its reason
                row["error"] = f"{type(error).__name__}: {error}"
                rows.append(row)
                print(f"  {trainer} seed {seed}: {row['error']}", flush=True)
                continue
            row.update(train_s=round(time.perf_counter() - began, 1), steps_logged=len(losses),
                       last100=last_mean(losses), lora=str(lora), held_out=score_or_reason(kind, folder, data, lora))
            rows.append(row)
            print(f"  {trainer} seed {seed}: last100 {row['last100']:.5f}, held-out {row['held_out']}", flush=True)
    return {"base": base, "rows": rows, **summarise(rows, trainers)}


def mean_std(values: list[float]) -> tuple[float, float, int]:
    n = len(values)
    mean = sum(values) / n if n else float("nan")
    return mean, statistics.stdev(values) if n > 1 else float("nan"), n


def summarise(rows: list[dict], trainers: list[str]) -> dict:
    """Per trainer mean and std over seeds of last100 and held_out; toolkit - each peer with its standard error."""
    summary = {}
    for trainer in trainers:
        mine = [r for r in rows if r["trainer"] == trainer and "error" not in r]
        summary[trainer] = {metric: dict(zip(("mean", "std", "n"), mean_std(
            [r[metric] for r in mine if isinstance(r.get(metric), float)]))) for metric in ("last100", "held_out")}
    differences = {}
    for peer in trainers:
        if peer == "toolkit" or "toolkit" not in summary:
            continue
        differences[peer] = {}
        for metric in ("last100", "held_out"):
            a, b = summary["toolkit"][metric], summary[peer][metric]
            se = math.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"]) if a["n"] > 1 and b["n"] > 1 else float("nan")
            differences[peer][metric] = {"difference": a["mean"] - b["mean"], "se": se}
    return {"summary": summary, "toolkit_minus_peer": differences}


def number(value, width: int = 10) -> str:
    if isinstance(value, float):
        return f"{value:>{width}.5f}" if math.isfinite(value) else f"{'-':>{width}}"
    return f"{'-':>{width}}"


def print_table(kind: str, result: dict) -> None:
    print(f"\n{kind}: trainer, seed, mean loss of the last 100 steps, held-out loss, held-out of the base")
    print(f"{'trainer':<10} {'seed':>4} {'last100':>10} {'held-out':>10} {'base':>10}")
    for r in result["rows"]:
        reason = r.get("error") or (r["held_out"] if isinstance(r.get("held_out"), str) else "")
        reason += "".join(f" {key.removeprefix('held_out_')} file: {number(value, 0).strip()}"
                          for key, value in r.items() if key.startswith("held_out_"))
        print(f"{r['trainer']:<10} {r['seed']:>4} {number(r.get('last100'))} {number(r.get('held_out'))} "
              f"{number(r['base'])}  {reason}".rstrip())
    for trainer, s in result["summary"].items():
        print(f"{trainer:<10} mean +- std over {s['held_out']['n']} seeds: last100 "
              f"{number(s['last100']['mean'], 0)} +- {number(s['last100']['std'], 0)}, held-out "
              f"{number(s['held_out']['mean'], 0)} +- {number(s['held_out']['std'], 0)}")
    for peer, d in result["toolkit_minus_peer"].items():
        print(f"toolkit - {peer}: last100 {number(d['last100']['difference'], 0)} (se {number(d['last100']['se'], 0)}), "
              f"held-out {number(d['held_out']['difference'], 0)} (se {number(d['held_out']['se'], 0)})")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="sd15,flux,wan")
    parser.add_argument("--peers", default="kohya,musubi", help="the peers to run, each where PEERS pairs it")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=16)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per training run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None, help="keep the models, runs and LoRA files here")
    parser.add_argument("--tiny-cpu", action="store_true", help="20 steps, seed 0, on the CPU: to check the bench")
    args = parser.parse_args(argv)
    if args.tiny_cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # this process and the trainers it starts
        args.steps, args.seeds = min(args.steps, 20), "0"
    seeds = [int(s) for s in args.seeds.split(",")]
    peers = args.peers.split(",") if args.peers else []
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-loss-parity-"))
    name = torch.cuda.get_device_name() if device() == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}; {args.steps} steps, seeds {seeds}, lr {args.lr:g}, "
          f"rank {args.rank}, alpha {args.alpha:g}", flush=True)
    results = {}
    for kind in args.kinds.split(","):
        if kind not in PEERS:
            raise SystemExit(f"--kinds: unknown {kind!r}; available: {', '.join(PEERS)}")
        trainers = ["toolkit", *[p for p in peers if PEERS[kind] == p]]
        print(f"\n{kind}: {' vs '.join(trainers)}", flush=True)
        results[kind] = run_kind(kind, trainers, seeds, args, work)
        print_table(kind, results[kind])
    report = {"device": name, "torch": torch.__version__, "steps": args.steps, "seeds": seeds, "lr": args.lr,
              "rank": args.rank, "alpha": args.alpha, "toolkit_settings": TOOLKIT_SETTINGS, "kinds": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
