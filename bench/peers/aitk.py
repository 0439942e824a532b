"""The ai-toolkit rows of bench/diffusion.py: ostris/ai-toolkit's `python run.py job.yaml` (pinned in
bench/peers/aitk.sh), with a job file written from its own examples (config/examples/train_lora_flux_24gb.yaml,
train_lora_qwen_image_24gb.yaml, train_lora_wan21_1b_24gb.yaml) on the bench's diffusers pipeline folder.

Both variants, as the examples give them: LoRA linear 16 / alpha 16 on the examples' default targets (the whole
transformer's linear layers), bf16 weights (train.dtype bf16), flowmatch noise, gradient checkpointing on, latents
cached to disk, text embeddings cached (train.cache_text_embeddings; the text encoder unloaded after), the Wan
example's sigmoid timesteps and weight decay 1e-4, the examples' EMA (decay 0.99) on Flux and Wan, caption dropout
0.05, SDPA attention (model.attention_backend native: xformers, flash-attn and sage are not installed), lr 1e-4.
The examples' adamw8bit needs bitsandbytes, which the GPU machine lacks: torch AdamW (optimizer adamw) instead.
  ""     the large-GPU row: model.quantize false, low_vram false.
  "24g"  the examples' 24 GB settings: Flux quantize (qfloat8, optimum-quanto); Qwen-Image quantize + quantize_te
         (qfloat8; the example's uint3 with an accuracy-recovery adapter downloads that adapter from the Hub, which
         the GPU machine cannot reach) and low_vram; Wan 2.1 1.3B quantize_te (its example quantizes nothing else).
Sampling and saving are pushed past the run (one save at its end, outside the timed steps); its baseline sample
is skipped. Step time from its tqdm bar ("NAME:  40%|...| 4/10 [00:03<00:05, 1.2it/s, lr: 1.0e-04 loss: 1.2e-01]")."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import yaml

from peers.common import (STANDINS, PeerFailed, install, peak_gib, peer_env, run_logged, tensorboard_losses,
                          timed_run)

KINDS = {"flux": "run.py, model.arch flux", "qwen_image": "run.py, model.arch qwen_image",
         "wan": "run.py, model.arch wan21"}
ARCH = {"flux": "flux", "qwen_image": "qwen_image", "wan": "wan21"}
NAME = "bench_"  # the job's name, KIND after it: the training bar's description
# the training bar alone (its latent caching and shard loading draw bars of their own before it)
STEPS = re.compile(NAME + r"\w+:\s*\d+%\|[^|]*\|\s*(\d+)/(\d+) \[")
LOSS = re.compile(NAME + r"\w+:[^\[]*\[[^\]]*?loss: ([-+0-9.eE]+)\]")  # the loss on that bar


def job(kind: str, variant: str, folder: Path, data: Path, out: Path, w: dict, steps: int, device: str) -> dict:
    """The job file: the example's settings for `kind`, the bench's model, data, batch and step count."""
    dataset = {"folder_path": str(data), "caption_ext": "txt", "caption_dropout_rate": 0.05, "shuffle_tokens": False,
               "cache_latents_to_disk": True, "cache_text_embeddings": True}
    if "frames" in w:  # the example's "resolution: [632]  # will be around 480p": the clip's own area
        dataset.update(resolution=[round((w["height"] * w["width"]) ** 0.5)], num_frames=w["frames"])
    else:
        dataset.update(resolution=[w["size"]])
    train = {"batch_size": w["batch"], "steps": steps, "gradient_accumulation": 1, "train_unet": True,
             "train_text_encoder": False, "gradient_checkpointing": True, "noise_scheduler": "flowmatch",
             "optimizer": "adamw", "lr": 1e-4, "dtype": "bf16", "cache_text_embeddings": True,
             "disable_sampling": True, "skip_first_sample": True}
    if kind in ("flux", "wan"):
        train["ema_config"] = {"use_ema": True, "ema_decay": 0.99}
    if kind == "wan":
        train.update(timestep_type="sigmoid", optimizer_params={"weight_decay": 1e-4})
    model = {"name_or_path": str(folder), "arch": ARCH[kind], "quantize": False, "low_vram": False,
             "attention_backend": "native"}
    if variant == "24g":
        model.update({"flux": {"quantize": True, "qtype": "qfloat8"},
                      "qwen_image": {"quantize": True, "qtype": "qfloat8", "quantize_te": True,
                                     "qtype_te": "qfloat8", "low_vram": True},
                      "wan": {"quantize_te": True}}[kind])
    process = {"type": "sd_trainer", "training_folder": str(out), "device": device,
               "network": {"type": "lora", "linear": 16, "linear_alpha": 16},
               "save": {"dtype": "float16", "save_every": steps + 1000, "max_step_saves_to_keep": 1},
               "datasets": [dataset], "train": train, "model": model,
               "sample": {"sampler": "flowmatch", "sample_every": steps + 1000, "width": 64, "height": 64,
                          "prompts": ["a photo"], "neg": "", "seed": 42, "sample_steps": 1}}
    return {"job": "extension", "config": {"name": NAME + kind, "process": [process]},
            "meta": {"name": "[name]", "version": "1.0"}}


def notes(kind: str, variant: str, data: dict) -> list[str]:
    model, train = data["config"]["process"][0]["model"], data["config"]["process"][0]["train"]
    shown = {k: model[k] for k in ("quantize", "qtype", "quantize_te", "qtype_te", "low_vram") if k in model}
    lines = [f"ai-toolkit run.py, model.arch {model['arch']}, train.dtype bf16, gradient_checkpointing on, "
             "SDPA (attention_backend native)",
             "latents cached to disk, text embeddings cached (text encoder unloaded), caption dropout 0.05",
             "optimizer adamw (torch; the examples' adamw8bit needs bitsandbytes, not on the machine), lr 1e-4, "
             "LoRA 16/16" + (", EMA 0.99 as its example" if "ema_config" in train else ""),
             "model: " + ", ".join(f"{k} {v}" for k, v in shown.items())]
    if variant == "24g" and kind == "qwen_image":
        lines.append("qtype qfloat8, not the example's uint3 + accuracy-recovery adapter (a Hub download)")
    return lines


def row(kind: str, variant: str, folder: Path, data: Path, work: Path, w: dict, steps: int, warmup: int,
        timeout: float) -> dict:
    if kind not in KINDS:
        raise PeerFailed(f"ai-toolkit does not train {kind} in this bench (its rows: {', '.join(KINDS)})")
    if variant not in ("", "24g"):
        raise PeerFailed(f"unknown ai-toolkit variant {variant!r}: '' or '24g'")
    src, site = install("aitk")
    work = work / f"aitk-{kind}{'-' + variant if variant else ''}"
    work.mkdir(parents=True, exist_ok=True)
    env = peer_env(site, src, work, NO_ALBUMENTATIONS_UPDATE="1", DISABLE_TELEMETRY="YES", SEED="0")
    env["PYTHONPATH"] += os.pathsep + str(STANDINS)  # last: PyAV's import-only stand-in
    log = work / "aitk.log"
    caching = 0.0
    if "frames" in w:  # ai-toolkit reads clips with OpenCV (mp4, not the bench's animated webp)
        clip = work / "data"
        caching += run_logged([sys.executable, str(Path(__file__).with_name("webp_to_mp4.py")), str(data), str(clip)],
                              work, env, log, timeout)
        data = clip
    import torch

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    total = warmup + steps
    spec = job(kind, variant, folder, data, work / "output", w, total, device)
    config = work / "job.yaml"
    config.write_text(yaml.safe_dump(spec, sort_keys=False))
    measured = timed_run([sys.executable, "run.py", str(config)], src, env, log, warmup, timeout, progress=STEPS)
    return {"s_per_step": measured["s_per_step"], "peak_gib": peak_gib(work),
            "seconds_to_first_step": measured["seconds_to_first_step"], "caching_s": None,
            "converted_s": caching,  # the bench's webp clip to mp4: not a step a user's ai-toolkit run has
            "wall_s": measured["wall_s"], "notes": notes(kind, variant, spec), "losses": losses(log.read_text())}


def losses(output: str) -> list[float]:
    """The per-step losses on its bar. Each step sets the bar's postfix (drawn with the previous count) and then
    counts up (drawn again with the same loss): one loss a step, in order, once its repeats are dropped (two steps
    with the same four digits would count as one)."""
    shown = [float(x) for x in LOSS.findall(output.replace("\r", "\n"))]
    return [x for i, x in enumerate(shown) if i == 0 or x != shown[i - 1]]


def parity(kind: str, folder: Path, data: Path, work: Path, seed: int, steps: int, lr: float, rank: int, alpha: float,
           resolution: int, timeout: float) -> tuple[Path, list[float]]:
    """Flux only (the issue's part 3 names kohya and musubi; this one is cheap): LoRA rank/alpha on its default
    targets, torch AdamW (weight decay 0.01), constant lr without warm-up, batch 1, no noise offset, no caption
    dropout, no EMA, bf16, text embeddings cached. Timesteps: timestep_type flux_shift, a uniform draw over the
    inference schedule shifted by exp(mu) (mu linear in the image tokens, as the pipeline's dynamic shift) - the
    toolkit's default draws the sigmoid of a standard normal and shifts it the same way: the nearest ai-toolkit has.
    Its seed: the SEED environment variable run.py reads. Returns (the LoRA it saves at the end, in diffusers
    `transformer.` names, no alpha: it sets alpha to the rank for every transformer LoRA, so alpha != rank is a
    PeerFailed), and the per-step `loss` of its tensorboard log: steps 1 to steps - 1, as it logs no loss for
    the first step)."""
    if kind != "flux":
        raise PeerFailed(f"ai-toolkit parity covers flux, not {kind}")
    if alpha != rank:  # toolkit/lora_special.py: transformer LoRAs are saved in PEFT names, alpha set to the rank
        raise PeerFailed(f"ai-toolkit trains flux LoRA with alpha = rank ({rank}), not alpha {alpha}")
    src, site = install("aitk")
    work = work / f"aitk-parity-{kind}-{seed}"
    work.mkdir(parents=True, exist_ok=True)
    env = peer_env(site, src, work, NO_ALBUMENTATIONS_UPDATE="1", DISABLE_TELEMETRY="YES", SEED=str(seed))
    env["PYTHONPATH"] += os.pathsep + str(STANDINS)
    import torch

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    spec = job(kind, "", folder, data, work / "output", {"batch": 1, "size": resolution}, steps, device)
    process = spec["config"]["process"][0]
    process["network"].update(linear=rank, linear_alpha=alpha)
    process["datasets"][0]["caption_dropout_rate"] = 0.0
    process["train"].update(lr=lr, lr_scheduler="constant", optimizer_params={"weight_decay": 0.01},
                            noise_offset=0.0, timestep_type="flux_shift", max_grad_norm=1.0)
    process["train"].pop("ema_config", None)
    process.update(log_dir=str(work / "logs"), logging={"log_every": 1, "use_wandb": False})
    config = work / "job.yaml"
    config.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_logged([sys.executable, "run.py", str(config)], src, env, work / "aitk.log", timeout)
    lora = work / "output" / spec["config"]["name"] / f"{spec['config']['name']}.safetensors"
    if not lora.exists():
        raise PeerFailed(f"no LoRA file at {lora}")
    return lora, tensorboard_losses(work / "logs", "loss")
