"""kohya sd-scripts rows of bench/diffusion.py (`kohya`, `kohya-24g`) and its loss-parity trainer.

Pinned in bench/peers/kohya.sh (kohya-ss/sd-scripts 48d368fa, its transformers 4.54.1 / diffusers 0.32.1 /
accelerate 1.6.0 as wheels). Each run is `python SCRIPT.py` in a process of its own (what `accelerate launch` does
for one process), reading a dataset config toml: the image folder, .txt captions, 1 repeat, the workload's square
resolution, buckets off.

Settings, from its docs (docs/train_network.md, sdxl_train_network.md, flux_train_network.md):
  all    LoRA dim 16 alpha 16 on its default targets (networks.lora, networks.lora_flux), lr 1e-4 constant, torch
         AdamW (the docs' AdamW8bit needs bitsandbytes, not on the GPU machine), --sdpa (no xformers there),
         --mixed_precision bf16, --gradient_checkpointing (every example of its docs has it), --cache_latents,
         U-Net/DiT only, seed 0, --persistent_data_loader_workers, saving only at the end, no sampling
  sd15   train_network.py; the SD1.5 script caches no text-encoder outputs (the flag is SDXL's and Flux's)
  sdxl   sdxl_train_network.py + --cache_text_encoder_outputs
  flux   flux_train_network.py + latents and text-encoder outputs cached to disk, --timestep_sampling shift
         --discrete_flow_shift 3.1582 --model_prediction_type raw --guidance_scale 1.0 (its recommended settings),
         --save_precision bf16
  -24g   flux: + --fp8_base (its docs' 24 GB row: "basic settings work fine"; no block swap). SD1.5 and SDXL: the
         same settings (its docs give nothing else for 24 GB LoRA)

Text encoders: transformers 5 (the toolkit's, which writes the bench's pipelines) saves a CLIPTextModel without the
`text_model.` prefix; the pinned transformers 4.54 then loads none of it and initialises it at random (a warning
only), so kohya gets a copy of the folder with those text encoders saved again under the prefix. Flux's parity: kohya
builds Flux.1, its AE, CLIP-L and T5-XXL at their real shapes whatever the files hold, so kohya_launch.py sets them
to the pipeline's (the bench's tiny Flux) and kohya_files.write_flux_pipeline writes every model whole in the names
its loaders read (CLIP-L under the prefix too). Those loaders load with strict=False and only log what they left
out: parity() fails when kohya's log says weights were left out (transformers' warning, or a "Loaded MODEL: ..."
line of kohya's other than all keys matched, or none for a model it loads).

Losses: read from its tensorboard event files (`loss/current`, one per step) with tensorboard's EventAccumulator.
A CPU check (--tiny) needs torchvision and OpenCV importable by the peer; PEER_EXTRA_SITE=DIR adds DIR to its path
(on a CPU-only torch the PyPI torchvision cannot load its CUDA ops: only its transforms are used)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from peers.common import PeerFailed, install, peak_gib, peer_env, tensorboard_losses, timed_run
from peers.kohya_files import (linked_copy, real_unet_folder, tokenizer_cache, unet_is_real, write_flux_encoders,
                               write_flux_pipeline, write_flux_transformer)

KINDS = {"sd15": "train_network.py", "sdxl": "sdxl_train_network.py", "flux": "flux_train_network.py"}
STEPS = re.compile(r"steps:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+) \[")  # its training bar, not the caching bars
NETWORK = {"sd15": "networks.lora", "sdxl": "networks.lora", "flux": "networks.lora_flux"}
# kohya logs through rich, which wraps a record at the terminal's width (80 without one): one line a record, as
# check_loaded reads them
LOG_COLUMNS = "1000"


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _env(work: Path) -> tuple[Path, dict]:
    src, site = install("kohya")
    # TQDM_*: every step's line, for the stamps
    env = peer_env(site, src, work, TQDM_MININTERVAL="0", TQDM_MINITERS="1", COLUMNS=LOG_COLUMNS)
    if os.environ.get("PEER_EXTRA_SITE"):
        env["PYTHONPATH"] += os.pathsep + os.environ["PEER_EXTRA_SITE"]
    return src, env


def _dataset(work: Path, data: Path, size: int, batch: int) -> Path:
    """The dataset config, on a copy of the images: kohya writes its disk caches beside them, each run its own."""
    if not (work / "images").exists():
        shutil.copytree(data, work / "images")
    data = work / "images"
    path = work / "dataset.toml"
    path.write_text(f'[general]\ncaption_extension = ".txt"\nshuffle_caption = false\ncaption_dropout_rate = 0.0\n\n'
                    f'[[datasets]]\nresolution = [{size}, {size}]\nbatch_size = {batch}\nenable_bucket = false\n\n'
                    f'[[datasets.subsets]]\nimage_dir = "{data}"\nnum_repeats = 1\n')
    return path


def _model_args(kind: str, folder: Path, work: Path, env: dict, log: Path, timeout: float,
                same_model: bool = False) -> tuple[list[str], list[str]]:
    """The model arguments of `kind` (files converted once beside work/) and notes on what was written. With
    `same_model` (SD1.5's parity), PeerFailed where kohya would train other weights than the pipeline's. The speed
    rows' Flux: kohya's real shapes, random where the pipeline's are not those (Flux's parity: flux_parity_args)."""
    models = folder / ".kohya"  # shared by the rows and seeds on one pipeline, and removed with it (Flux: ~34 GB)
    tokenizers = ["--tokenizer_cache_dir", str(tokenizer_cache(kind, folder, models / "tokenizers"))]
    if kind in ("sd15", "sdxl"):
        if same_model and not unet_is_real(kind, folder):
            raise PeerFailed(f"sd-scripts builds the {kind} UNet at its real shape only (library/original_unet.py): "
                             f"{folder}/unet is smaller")
        path, notes = real_unet_folder(kind, folder, models / "pipeline", _device())
        path, renamed = transformers4_text_encoders(path, models / "pipeline-te")
        notes += [f"{sub} saved again in the names its pinned transformers 4 reads (text_model.*)" for sub in renamed]
        return ["--pretrained_model_name_or_path", str(path), *tokenizers], notes
    dit = write_flux_transformer(folder, models / "flux1-dev.safetensors")
    files, notes = write_flux_encoders(folder, models, env, _device(), log, timeout)
    return ["--pretrained_model_name_or_path", str(dit), "--clip_l", str(files["clip_l"]), "--t5xxl",
            str(files["t5xxl"]), "--ae", str(files["ae"]), *tokenizers], notes


def flux_parity_args(folder: Path) -> tuple[list[str], list[str]]:
    """(the launcher before the script, the model arguments) that make kohya train the Flux pipeline `folder` itself
    at its own shapes: kohya_launch.py sets kohya's fixed Flux.1 configs to the pipeline's (the bench's tiny one),
    and kohya_files.write_flux_pipeline gives every model's weights whole in the names its loaders read."""
    models = folder / ".kohya-parity"
    files, shapes = write_flux_pipeline(folder, models)
    tokenizers = tokenizer_cache("flux", folder, models / "tokenizers")
    return ([str(Path(__file__).with_name("kohya_launch.py")), str(shapes)],
            ["--pretrained_model_name_or_path", str(files["flux"]), "--clip_l", str(files["clip_l"]), "--t5xxl",
             str(files["t5xxl"]), "--ae", str(files["ae"]), "--tokenizer_cache_dir", str(tokenizers)])


TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
NOT_LOADED = re.compile(r"were not initialized from the model checkpoint|newly initialized|"
                        r"were not used when initializing", re.I)  # transformers' words for weights left out
# kohya's own loaders (library/flux_utils.py) load with strict=False and log load_state_dict's answer
KOHYA_LOADED = re.compile(r"Loaded (Flux|Chroma|AE|CLIP-L|T5xxl|ControlNet): (.*)")
ALL_KEYS = "<All keys matched successfully>"
FLUX_MODELS = ("Flux", "CLIP-L", "T5xxl", "AE")  # what flux_train_network.py loads


def _stale_names(sub: Path) -> bool:
    """True when `sub` is a CLIPTextModel saved by transformers 5, which leaves out the `text_model.` prefix its
    weights have in transformers 4 (CLIPTextModelWithProjection keeps it)."""
    from safetensors import safe_open

    config = sub / "config.json"
    if not config.exists() or json.loads(config.read_text()).get("architectures") != ["CLIPTextModel"]:
        return False
    keys = []
    for file in sorted(sub.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            keys += list(handle.keys())
    return bool(keys) and not all(k.startswith("text_model.") for k in keys)


def transformers4_text_encoders(path: Path, out: Path) -> tuple[Path, list[str]]:
    """(`path`, []) when sd-scripts' pinned transformers 4.54 reads its text encoders as they are, else (a copy of
    `path` (links) with those CLIPTextModels saved again under `text_model.*`, their names). transformers 5 saves a
    CLIPTextModel without that prefix; transformers 4 then finds none of its weights and initialises the whole text
    encoder at random (a warning, not an error): kohya would train on captions encoded by another model than the
    pipeline's, and its LoRA would meet text states at scoring that it never saw in training."""
    from safetensors.torch import load_file, save_file

    stale = [sub for sub in TEXT_ENCODERS if _stale_names(path / sub)]
    if not stale:
        return path, []
    if all((out / sub / "config.json").exists() for sub in stale):
        return out, stale
    linked_copy(path, out, leave_out=stale)
    for sub in stale:
        (out / sub).mkdir(exist_ok=True)
        for item in (path / sub).iterdir():
            if item.suffix == ".safetensors":
                save_file({f"text_model.{k}": v for k, v in load_file(str(item)).items()}, str(out / sub / item.name),
                          metadata={"format": "pt"})
            elif item.name.endswith(".index.json"):
                index = json.loads(item.read_text())
                index["weight_map"] = {f"text_model.{k}": v for k, v in index["weight_map"].items()}
                (out / sub / item.name).write_text(json.dumps(index, indent=2))
        shutil.copy(path / sub / "config.json", out / sub / "config.json")  # last: it marks the folder done
    return out, stale


def check_loaded(log: Path, expected: tuple[str, ...] = ()) -> None:
    """PeerFailed when kohya's log says a model of the pipeline was not loaded whole: transformers' warning of
    weights left at random, or one of kohya's "Loaded MODEL: ..." lines other than all keys matched (missing keys
    stay on the meta device or at random, unexpected ones are dropped), or no such line for a model in `expected`."""
    lines = re.split(r"[\r\n]", log.read_text(errors="replace")) if log.exists() else []
    said = [line for line in lines if NOT_LOADED.search(line)]
    loaded = {m[1]: m[2].strip() for line in lines if (m := KOHYA_LOADED.search(line))}
    said += [f"Loaded {name}: {info}" for name, info in loaded.items() if not info.startswith(ALL_KEYS)]
    said += [f"no 'Loaded {name}: {ALL_KEYS}' line" for name in expected if name not in loaded]
    if said:
        raise PeerFailed(f"kohya did not load the pipeline's weights whole: {said[0][:300]} (whole output: {log})")


def _common(kind: str, out: Path, steps: int, seed: int, lr: float, rank: int, alpha: float) -> list[str]:
    return ["--output_dir", str(out), "--output_name", "lora", "--save_model_as", "safetensors",
            "--network_module", NETWORK[kind], "--network_dim", str(rank), "--network_alpha", f"{alpha:g}",
            "--network_train_unet_only", "--learning_rate", f"{lr:g}", "--lr_scheduler", "constant",
            "--optimizer_type", "AdamW", "--max_train_steps", str(steps), "--seed", str(seed), "--sdpa",
            "--mixed_precision", "bf16", "--cache_latents", "--persistent_data_loader_workers",
            "--max_data_loader_n_workers", "2"]


def _kind_args(kind: str) -> list[str]:
    if kind == "sdxl":
        return ["--cache_text_encoder_outputs"]
    if kind == "flux":
        return ["--cache_latents_to_disk", "--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk",
                "--save_precision", "bf16", "--model_prediction_type", "raw", "--guidance_scale", "1.0"]
    return []


def row(kind: str, variant: str, folder: Path, data: Path, work: Path, w: dict, steps: int, warmup: int,
        timeout: float) -> dict:
    if kind not in KINDS:
        raise PeerFailed(f"kohya sd-scripts does not train {kind}")
    if variant not in ("", "24g"):
        raise PeerFailed(f"no kohya-{variant} row: kohya or kohya-24g")
    if kind == "flux" and _device() == "cpu":
        raise PeerFailed("not run on the CPU: kohya builds Flux.1 at its real width (12B at 19 + 38 blocks) and "
                         "T5-XXL (4.7B) whatever the pipeline's size")
    work = work / f"kohya-{kind}{'-' + variant if variant else ''}"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "output.log"
    src, env = _env(work)
    model, notes = _model_args(kind, folder, work, env, log, timeout)
    cmd = [sys.executable, str(src / KINDS[kind]), *model,
           "--dataset_config", str(_dataset(work, data, w["size"], w["batch"])),
           *_common(kind, work / "out", warmup + steps, 0, 1e-4, 16, 16), *_kind_args(kind), "--gradient_checkpointing"]
    if kind == "flux":
        cmd += ["--timestep_sampling", "shift", "--discrete_flow_shift", "3.1582"]
        cmd += ["--fp8_base"] if variant == "24g" else []
    if variant == "24g" and kind != "flux":
        notes.append("its docs give no other LoRA settings for 24 GB: the same as the kohya row")
    figures = timed_run(cmd, src, env, log, warmup, timeout, progress=STEPS)
    paths = ("--pretrained_model_name_or_path", "--clip_l", "--t5xxl", "--ae", "--tokenizer_cache_dir",
             "--dataset_config", "--output_dir")
    shown = [a for i, a in enumerate(cmd[2:], 2) if a not in paths and cmd[i - 1] not in paths]
    notes += [f"{KINDS[kind]} {' '.join(shown)}",
              "torch AdamW (its docs' AdamW8bit needs bitsandbytes); SDPA (no xformers on the machine); caching "
              "inside the training process, counted in seconds_to_first_step"]
    return {**figures, "peak_gib": peak_gib(work), "caching_s": None, "notes": notes, "losses": []}


def parity(kind: str, folder: Path, data: Path, work: Path, seed: int, steps: int, lr: float, rank: int, alpha: float,
           resolution: int, timeout: float) -> tuple[Path, list[float]]:
    """LoRA rank/alpha, torch AdamW (weight decay 0.01), constant lr, batch 1, no noise offset or caption dropout,
    max grad norm 1.0 (both defaults). SD1.5: its uniform integer timesteps (the toolkit's sd default, uniform).
    Flux: --timestep_sampling flux_shift (the sigmoid of a standard normal shifted by exp(mu), mu linear in the
    image tokens from 0.5 at 256 to 1.15 at 4096: the toolkit's flux default, logit_normal with the pipeline
    scheduler's dynamic shift, exactly), the raw prediction (target noise - latents), guidance 1.0 (train.guidance's
    default). SD1.5: the pipeline must hold the real UNet kohya builds, else PeerFailed (kohya would train other
    weights). Flux: kohya trains the pipeline itself at its own shapes (flux_parity_args). PeerFailed when kohya's
    log says a model was not loaded whole (check_loaded). Returns (its LoRA file, the per-step `loss/current` of its
    tensorboard log)."""
    if kind not in ("sd15", "flux"):
        raise PeerFailed(f"kohya parity covers sd15 and flux, not {kind}")
    work = work / f"kohya-parity-{kind}-{seed}"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "output.log"
    src, env = _env(work)
    if kind == "flux":
        launch, model = flux_parity_args(folder)
    else:
        launch, model = [], _model_args(kind, folder, work, env, log, timeout, same_model=True)[0]
    cmd = [sys.executable, *launch, str(src / KINDS[kind]), *model,
           "--dataset_config", str(_dataset(work, data, resolution, 1)),
           *_common(kind, work / "out", steps, seed, lr, rank, alpha), *_kind_args(kind),
           "--optimizer_args", "weight_decay=0.01", "--noise_offset", "0",
           "--lr_warmup_steps", "0", "--logging_dir", str(work / "logs"), "--log_with", "tensorboard"]
    if kind == "flux":
        cmd += ["--timestep_sampling", "flux_shift", "--sigmoid_scale", "1.0"]
    timed_run(cmd, src, env, log, 0, timeout, progress=STEPS)
    check_loaded(log, FLUX_MODELS if kind == "flux" else ())
    lora = work / "out" / "lora.safetensors"
    if not lora.exists():
        raise PeerFailed(f"no LoRA file at {lora}")
    return lora, tensorboard_losses(work / "logs", "loss/current")
