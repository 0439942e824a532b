"""Diffusion and video LoRA step time: the toolkit beside the plain diffusers loop a user writes, eager and with
torch.compile, in one run on one GPU, every row in a fresh process of its own.

    python bench/diffusion.py [--models sd15,sdxl,flux,flux_kontext,chroma,wan,wan22,ltx2,hunyuan15,qwen_image,qwen_image_edit] [--rows plain,plain-compiled,toolkit] [--steps 6]
                              [--warmup 4] [--out result.json] [--tiny] [--profile] [--set KEY=VALUE ...]

Workloads (random weights in the real shapes, bench/diffusion_models.py; nothing downloaded), LoRA r=16 alpha 16
on the toolkit's default targets (attention for the UNets, attention + feed-forward for the DiTs), bf16 weights
under bf16 autocast, fused AdamW, gradient norm clipped to 1.0:
  sd15  SD1.5 UNet, 512 px, batch 4          sdxl  SDXL UNet, 1024 px, batch 2
  flux  Flux.1-dev transformer, 1024 px, 1   wan   Wan 2.1 1.3B transformer, 81 x 480 x 832, 1 clip
  chroma  Chroma1-HD transformer (8.9B: Flux's 19 + 38 blocks without their modulation layers, the guidance
        approximator), 1024 px, batch 1; the plain loop passes the pipeline's 512-token T5 text with its mask (64
        tokens attended), the toolkit trims the text to the captions' tokens. Not in the default --models
  hunyuan15 HunyuanVideo 1.5 480p T2V transformer (8.3B: 54 dual-stream blocks, 2048 wide), 33 x 480 x 832, 1 clip
        (9 x 30 x 52 = 14040 latent tokens, patch 1); the text as the pipeline passes it: 1000 Qwen2.5-VL tokens
        (64 attended), 256 ByT5 tokens (none: no quoted text), 729 zero image tokens (masked out); the toolkit
        leaves the masked tokens out (the captions' own, one ByT5 and one image token). Its 16-bit
        weights (16.7 GB) leave toolkit-swap24 ~5 GiB for activations: block_swap=auto swaps what does not fit.
        Not in the default --models
  wan22 Wan 2.2 T2V A14B (two 14B experts), 17 x 480 x 832, 1 clip: the toolkit trains the high-noise expert
        alone (train.experts=high_noise, as A14B LoRAs are trained on 24 GB cards; model.expert_offload=auto),
        the plain loop the high-noise `transformer` at sigmas >= the boundary, 0.875. 17 frames, not 81: at 81
        the activations alone (~27 GiB) exceed toolkit-swap24's cap. Not in the default --models: it writes
        ~29 GB to the temporary folder (the two experts share their files)
  flux_kontext  FLUX.1 Kontext [dev] (Flux.1-dev's transformer), 1024 px, batch 1, one 1024 px reference image per
        target (name_ref0.png): the reference's 4096 tokens follow the image's, as FluxKontextPipeline passes them
        (ids' first axis 1), so a step sees twice Flux's image tokens. Not in the default --models
  qwen_image_edit  Qwen-Image-Edit-2509 (Qwen-Image's 20B transformer), 1024 px, batch 1, one 1024 px reference per
        target: its 4096 tokens after the image's; the plain loop adds 16 text tokens for the reference's vision
        tokens (the bench's processor makes 4 to 16). Not in the default --models: it writes ~41 GB
  qwen_image  Qwen-Image 20B transformer (60 dual-stream blocks, 3072 wide), 1024 px, batch 1; the plain loop feeds 16
        text tokens (a caption's length: the pipeline pads a batch to its longest prompt only). Not in the default
        --models: it writes ~41 GB to the temporary folder
  ltx2  LTX-2 19B audio-video transformer (48 blocks), 121 x 512 x 768 (LTX2Pipeline's default shape: 6144 video
        tokens, 126 audio tokens of noise), 1024 text tokens, 1 clip; the video branch trains. Its bf16 weights
        (~38 GB) exceed the 24 GiB of toolkit-swap24, where model.block_swap=auto swaps blocks. Not in the default
        --models: it writes ~38 GB to the temporary folder

Rows (--rows):
  plain                 diffusers + PEFT + torch.optim.AdamW(fused=True), a hand-written loop, eager
  plain-ckpt            the same with diffusers' gradient checkpointing (every block)
  plain-compiled        plain + torch.compile as a user adds it: the whole UNet, or each DiT block
  plain-compiled-ckpt   both
  toolkit-eager         the toolkit's Trainer, train.compile=false
  toolkit               the Trainer with train.compile=true (its SDPA backend measured at start: device.sdpa_backend=auto;
                        train.cuda_graphs=auto: the SD/SDXL UNet compiled whole is replayed as a CUDA graph)
  toolkit-auto          the toolkit's defaults, as a user's run gets them: train.compile, train.cuda_graphs,
                        train.gradient_checkpointing and model.block_swap all auto (the peers' rows compare with it);
                        what auto settles from the run's length is planned for a --auto-steps run (2,000)
  toolkit-nographs      the same with train.cuda_graphs=false
  toolkit-ckpt          toolkit + train.gradient_checkpointing=true
  toolkit-ckpt-N        toolkit + N of the blocks checkpointed
  ROW-pointwise         any toolkit row + train.compile_recompute=pointwise (elementwise results recomputed in
                        backward instead of kept)
  ROW-attention         any checkpointed toolkit row + train.checkpoint_keeps=attention (each checkpointed block
                        keeps its attention outputs; backward recomputes the rest); -attention-pointwise: both
  ROW-recompute         any checkpointed toolkit row + train.checkpoint_keeps=nothing (backward recomputes every
                        checkpointed block whole: the least memory; the peers' checkpointing does this)
  ROW-eager             any toolkit row with train.compile=false (toolkit-ckpt-eager, toolkit-swap24-eager): the
                        compiled row's eager twin, which train.compile=auto's decision for a family needs
  toolkit-swap24        toolkit + checkpointing, in a process capped at 24 GiB of GPU memory, the toolkit told it
                        has 24 GB (device.memory_fraction scaled): model.block_swap=auto decides what to swap
  toolkit-cap25         toolkit in a process capped at 25 GiB, the toolkit told so (device.memory_fraction), with
                        train.gradient_checkpointing and model.block_swap auto: what the toolkit chooses to fit
  kohya, kohya-24g      kohya sd-scripts (sd15, sdxl, flux), its docs' fastest settings / its 24 GB settings
                        (bench/peers/kohya.py); a kind it does not train prints why
  musubi, musubi-24g    musubi-tuner (bench/peers/musubi.py): its Wan (wan, wan22) and Qwen-Image trainers with
                        its documented settings for speed; -24g its 24 GB settings (fp8 base, block swap)
  aitk, aitk-24g        ai-toolkit's run.py (flux, qwen_image, wan) with a job file from its examples: their
                        large-GPU settings / their 24 GB settings (bench/peers/aitk.py); a kind it does not train
                        prints why
  ROW-fp8               any toolkit row + model.quantize=fp8 (the frozen blocks' linear layers in e4m3 with fp8
                        matmuls: another precision than the plain loop's; its losses are printed to compare)

Images/s (or s/step for flux and the Wan models) over the timed steps: CUDA events for the plain loops, the
Trainer's own step rate for the toolkit (it includes data loading and the host side of the step). After each
workload, the time to 200 and 2,000 steps of every toolkit and peer row: from its process start to its first step
(start-up, loading, caching, compile; a peer's separate caching processes added), then the measured rate. --tiny runs tiny
shapes on the CPU (or the GPU) to check the bench itself. Each row records how many CPUs other processes kept busy
while it ran ("other_cpus"; a note when above 1): SD1.5 and SDXL steps are host-bound, so run them with the machine
to themselves. --profile (GPU) runs a few more steps of every row under the profiler, after the timed ones, and
prints where the GPU's time went and its idle gaps (bench/kernel_profile.py). --set adds a config override to every
toolkit row. A row that fails leaves its whole output beside --out (RESULT-KIND-ROW.log).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.time()  # a row's process start: its time to the first step counts from here, as the peers' do

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import PEERS  # noqa: E402

WORKLOADS = {  # family, batch, resolution (or frames x height x width), images per step for the rate
    "sd15": dict(family="sd", batch=4, size=512),
    "sdxl": dict(family="sdxl", batch=2, size=1024),
    "flux": dict(family="flux", batch=1, size=1024),
    "chroma": dict(family="chroma", batch=1, size=1024),
    "wan": dict(family="wan21", batch=1, frames=81, height=480, width=832),
    # 81 x 480 x 832 is 32760 tokens: every block's checkpointed input (12.5 GiB) and one block's backward (~14 GiB)
    # do not fit 24 GiB whatever block swap does; 17 frames (7800 tokens, ~6.5 GiB) leave room for the ~13 GiB of
    # weights block_swap=auto keeps resident under toolkit-swap24
    "wan22": dict(family="wan22", batch=1, frames=17, height=480, width=832),
    "ltx2": dict(family="ltx2", batch=1, frames=121, height=512, width=768),
    "hunyuan15": dict(family="hunyuan_video15", batch=1, frames=33, height=480, width=832),
    "qwen_image": dict(family="qwen_image", batch=1, size=1024),
    "flux_kontext": dict(family="flux_kontext", batch=1, size=1024, references=1),
    "qwen_image_edit": dict(family="qwen_image_edit", batch=1, size=1024, references=1),
}
TINY = {"sd15": dict(size=64), "sdxl": dict(size=64), "flux": dict(size=64), "chroma": dict(size=64),
        "wan": dict(frames=5, height=64, width=64),
        "wan22": dict(frames=5, height=64, width=64), "ltx2": dict(frames=9, height=64, width=64),
        "hunyuan15": dict(frames=5, height=64, width=64), "qwen_image": dict(size=64), "flux_kontext": dict(size=64),
        "qwen_image_edit": dict(size=64)}
ROWS = ("plain", "plain-compiled", "toolkit-eager", "toolkit")
TOOLKIT_ROWS = ("toolkit", "toolkit-auto", "toolkit-eager", "toolkit-nographs", "toolkit-ckpt", "toolkit-swap24", "toolkit-cap25")
CAP_GIB = 24
FIT_GIB = 25  # toolkit-cap25: the Flux.1 memory target


def workload(kind: str, tiny: bool) -> dict:
    return {**WORKLOADS[kind], **(TINY[kind] if tiny else {})}


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# -- the plain loop ------------------------------------------------------------------------------------------------
def plain_model(kind: str, folder: Path, ckpt: bool, compiled: bool):
    from diffusers import (ChromaTransformer2DModel, FluxTransformer2DModel, HunyuanVideo15Transformer3DModel,
                           LTX2VideoTransformer3DModel, QwenImageTransformer2DModel,
                           UNet2DConditionModel, WanTransformer3DModel)
    from peft import LoraConfig

    from toolkit.models.base import repeated_blocks
    from toolkit.models.diffusion_flow import FLUX_TARGETS
    from toolkit.models.diffusion_hunyuan15 import HUNYUAN15_TARGETS
    from toolkit.models.diffusion_ltx2 import LTX2_TARGETS
    from toolkit.models.diffusion_qwen import QWEN_TARGETS
    from toolkit.models.diffusion_sd import UNET_TARGETS
    from toolkit.models.diffusion_wan import WAN_TARGETS

    cls, sub, targets = {"sd15": (UNet2DConditionModel, "unet", UNET_TARGETS),
                         "sdxl": (UNet2DConditionModel, "unet", UNET_TARGETS),
                         "flux": (FluxTransformer2DModel, "transformer", FLUX_TARGETS),
                         "flux_kontext": (FluxTransformer2DModel, "transformer", FLUX_TARGETS),
                         "chroma": (ChromaTransformer2DModel, "transformer", FLUX_TARGETS),
                         "wan": (WanTransformer3DModel, "transformer", WAN_TARGETS),
                         "wan22": (WanTransformer3DModel, "transformer", WAN_TARGETS),  # the high-noise expert
                         "ltx2": (LTX2VideoTransformer3DModel, "transformer", LTX2_TARGETS),
                         "hunyuan15": (HunyuanVideo15Transformer3DModel, "transformer", HUNYUAN15_TARGETS),
                         "qwen_image": (QwenImageTransformer2DModel, "transformer", QWEN_TARGETS),
                         "qwen_image_edit": (QwenImageTransformer2DModel, "transformer", QWEN_TARGETS)}[kind]
    torch.manual_seed(0)
    model = cls.from_pretrained(folder / sub, torch_dtype=torch.bfloat16).to(device())
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets, init_lora_weights="gaussian"))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if ckpt:
        model.enable_gradient_checkpointing()
    if compiled:
        if kind in ("sd15", "sdxl"):
            model.compile()
        else:  # LTX-2's and HunyuanVideo 1.5's _no_split_modules name more than their blocks: the blocks alone
            blocks = (model.transformer_blocks if kind in ("ltx2", "hunyuan15")
                      else repeated_blocks(model, outermost=True))
            for block in blocks:
                block.compile()
    return model


def kontext_plain_inputs(model, latents, img_ids, txt_ids, b: int):
    dev, bf16 = latents.device, torch.bfloat16
    reference = torch.randn_like(latents).to(bf16)
    ref_ids = img_ids.clone()
    ref_ids[:, 0] = 1
    ids = torch.cat([img_ids, ref_ids])
    text = torch.randn(b, 512, model.config.joint_attention_dim, device=dev, dtype=bf16)
    pooled = torch.randn(b, model.config.pooled_projection_dim, device=dev, dtype=bf16)
    guidance, n = torch.ones(b, device=dev), latents.shape[1]
    return latents, lambda noisy, sigma: model(
        hidden_states=torch.cat([noisy.to(bf16), reference], 1), timestep=sigma, guidance=guidance,
        pooled_projections=pooled, encoder_hidden_states=text, txt_ids=txt_ids, img_ids=ids,
        return_dict=False)[0][:, :n]


def plain_inputs(kind: str, model, w: dict):
    """(latents, forward(noisy, sigma) -> prediction) for one batch of random conditioning."""
    dev, b = device(), w["batch"]
    bf16 = torch.bfloat16
    if kind in ("sd15", "sdxl"):
        side = w["size"] // 8
        latents = torch.randn(b, 4, side, side, device=dev)
        text = torch.randn(b, 77, model.config.cross_attention_dim, device=dev, dtype=bf16)
        extra = {}
        if kind == "sdxl":
            pooled = model.config.projection_class_embeddings_input_dim - 6 * model.config.addition_time_embed_dim
            time_ids = torch.tensor([[w["size"], w["size"], 0, 0, w["size"], w["size"]]] * b, device=dev, dtype=bf16)
            extra = {"added_cond_kwargs": {"text_embeds": torch.randn(b, pooled, device=dev, dtype=bf16),
                                           "time_ids": time_ids}}
        return latents, lambda noisy, sigma: model(noisy.to(bf16), (sigma * 999).long(), text, **extra).sample
    if kind in ("flux", "chroma", "flux_kontext"):
        side = w["size"] // 16
        latents = torch.randn(b, side * side, 64, device=dev)
        ids = torch.zeros(side, side, 3, device=dev)
        ids[..., 1] += torch.arange(side, device=dev)[:, None]
        ids[..., 2] += torch.arange(side, device=dev)[None, :]
        img_ids, txt_ids = ids.reshape(-1, 3), torch.zeros(512, 3, device=dev)
        if kind == "flux_kontext":  # as FluxKontextPipeline: the reference's tokens after the image's (ids' first
            return kontext_plain_inputs(model, latents, img_ids, txt_ids, b)  # axis 1), the prediction the image's
        text = torch.randn(b, 512, model.config.joint_attention_dim, device=dev, dtype=bf16)
        if kind == "chroma":  # the pipeline's mask: a caption's tokens and its first padding token, then the image
            mask = torch.ones(b, 512 + side * side, dtype=torch.bool, device=dev)
            mask[:, 64:512] = False
            return latents, lambda noisy, sigma: model(hidden_states=noisy.to(bf16), timestep=sigma,
                                                       encoder_hidden_states=text, txt_ids=txt_ids, img_ids=img_ids,
                                                       attention_mask=mask, return_dict=False)[0]
        pooled = torch.randn(b, model.config.pooled_projection_dim, device=dev, dtype=bf16)
        guidance = torch.ones(b, device=dev)
        return latents, lambda noisy, sigma: model(hidden_states=noisy.to(bf16), timestep=sigma, guidance=guidance,
                                                   pooled_projections=pooled, encoder_hidden_states=text,
                                                   txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
    if kind == "ltx2":
        return ltx2_plain_inputs(model, w)
    if kind in ("qwen_image", "qwen_image_edit"):  # 2x2-packed latents; the caption's text tokens (16, all attended),
        side = w["size"] // 16  # as the pipeline pads a batch to its longest prompt only
        latents = torch.randn(b, side * side, model.config.in_channels, device=dev)
        n, edit = latents.shape[1], kind == "qwen_image_edit"
        # the edit pipeline: the reference's tokens after the image's (img_shapes lists both), its vision tokens in
        # the text (16 more), the prediction the image's
        reference = torch.randn_like(latents).to(bf16) if edit else latents[:, :0].to(bf16)
        text = torch.randn(b, 32 if edit else 16, model.config.joint_attention_dim, device=dev, dtype=bf16)
        mask = torch.ones(b, text.shape[1], device=dev, dtype=torch.long)
        shapes = [[(1, side, side)] * (2 if edit else 1)] * b
        return latents, lambda noisy, sigma: model(hidden_states=torch.cat([noisy.to(bf16), reference], 1),
                                                   timestep=sigma, encoder_hidden_states=text,
                                                   encoder_hidden_states_mask=mask, img_shapes=shapes,
                                                   return_dict=False)[0][:, :n]
    if kind == "hunyuan15":  # [noisy | zero condition | zero mask], the pipeline's text-to-video inputs
        c = model.config
        latents = torch.randn(b, c.out_channels, (w["frames"] - 1) // 4 + 1, w["height"] // 16, w["width"] // 16,
                              device=dev)
        cond = torch.zeros(b, c.in_channels - c.out_channels, *latents.shape[2:], device=dev, dtype=bf16)
        text = torch.randn(b, 1000, c.text_embed_dim, device=dev, dtype=bf16)
        mask = torch.zeros(b, 1000, device=dev, dtype=torch.long)
        mask[:, :64] = 1
        glyphs = torch.zeros(b, 256, c.text_embed_2_dim, device=dev, dtype=bf16)
        image = torch.zeros(b, 729, c.image_embed_dim, device=dev, dtype=bf16)
        return latents, lambda noisy, sigma: model(
            hidden_states=torch.cat([noisy.to(bf16), cond], dim=1), timestep=sigma * 1000,
            encoder_hidden_states=text, encoder_attention_mask=mask, encoder_hidden_states_2=glyphs,
            encoder_attention_mask_2=torch.zeros(b, 256, device=dev, dtype=torch.long), image_embeds=image,
            return_dict=False)[0]
    latents = torch.randn(b, 16, (w["frames"] - 1) // 4 + 1, w["height"] // 8, w["width"] // 8, device=dev)
    text = torch.randn(b, 512, model.config.text_dim, device=dev, dtype=bf16)
    return latents, lambda noisy, sigma: model(hidden_states=noisy.to(bf16), timestep=sigma * 1000,
                                               encoder_hidden_states=text, return_dict=False)[0]


def ltx2_plain_inputs(model, w: dict):
    """Packed video latents (time / 8, space / 32), the audio stream's noise at sigma 1 (its length the clip's
    duration at 24 fps) and 1024 text tokens per stream, as the toolkit's ltx2 adapter feeds the transformer."""
    from diffusers import LTX2Pipeline

    dev, b, bf16, c = device(), w["batch"], torch.bfloat16, model.config
    f, h, wd = (w["frames"] - 1) // 8 + 1, w["height"] // 32, w["width"] // 32
    latents = LTX2Pipeline._pack_latents(torch.randn(b, c.in_channels, f, h, wd, device=dev))
    audio_len = round(w["frames"] / 24 * 25)
    audio = torch.randn(b, audio_len, c.audio_in_channels, device=dev, dtype=bf16)
    text = torch.randn(b, 1024, c.caption_channels, device=dev, dtype=bf16)
    mask = torch.ones(b, 1024, device=dev, dtype=torch.long)
    one = torch.full((b,), 1000.0, device=dev)

    def forward(noisy, sigma):
        return model(hidden_states=noisy.to(bf16), audio_hidden_states=audio, encoder_hidden_states=text,
                     audio_encoder_hidden_states=text, timestep=sigma * 1000, audio_timestep=one, sigma=sigma * 1000,
                     audio_sigma=one, encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=f,
                     height=h, width=wd, fps=24.0, audio_num_frames=audio_len, return_dict=False)[0]

    return latents, forward


def plain_loop(kind: str, folder: Path, w: dict, steps: int, warmup: int, ckpt: bool, compiled: bool) -> dict:
    from toolkit.tiny.flow import WAN22_BOUNDARY_RATIO

    if kind in ("flux", "chroma", "flux_kontext"):  # cuDNN SDPA crashes on Flux shapes (FINDINGS.md): a user turns it off
        torch.backends.cuda.enable_cudnn_sdp(False)
    model = plain_model(kind, folder, ckpt, compiled)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device() == "cuda")
    latents, forward = plain_inputs(kind, model, w)
    view = (-1,) + (1,) * (latents.dim() - 1)
    low = WAN22_BOUNDARY_RATIO if kind == "wan22" else 0.0  # the high-noise expert's sigmas: [boundary, 1)
    cuda = device() == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    import time

    def one_step():
        noise = torch.randn_like(latents)
        sigma = low + (1 - low) * torch.sigmoid(torch.randn(latents.shape[0], device=latents.device))
        noisy = (1 - sigma.view(view)) * latents + sigma.view(view) * noise
        with torch.autocast(device(), dtype=torch.bfloat16):
            pred = forward(noisy, sigma)
        target = noise if kind in ("sd15", "sdxl") else noise - latents
        torch.nn.functional.mse_loss(pred.float(), target).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for step in range(steps + warmup):
        if step == warmup:
            start.record() if cuda else None
            began = time.perf_counter()
        one_step()
    if cuda:
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000 / steps
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        seconds, peak = (time.perf_counter() - began) / steps, 0.0
    result = {"s_per_step": seconds, "peak_gib": peak}
    if os.environ.get("BENCH_PROFILE"):
        from kernel_profile import profiled
        from trainer_rate import PROFILED_STEPS

        result["profile"] = {}
        with profiled(PROFILED_STEPS, result["profile"]):
            for _ in range(PROFILED_STEPS):
                one_step()
    return result


# -- the toolkit ---------------------------------------------------------------------------------------------------
def capped(gib: float) -> float:
    """Cap this process at `gib` GiB of GPU memory; returns that cap as a share of the GPU's memory."""
    share = gib * 2**30 / torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, share))
    return share


STEP_PLANNED = ("train.compile", "train.compile_regions")  # what auto settles from train.steps


def toolkit_row(kind: str, row: str, folder: Path, data: Path, work: Path, w: dict, steps: int, warmup: int,
                settings: list[str], auto_steps: int) -> dict:
    from trainer_rate import planned, trainer_rate

    name, overrides, eager = row, [], False
    suffixes = {"-eager": None, "-pointwise": "train.compile_recompute=pointwise",
                "-attention": "train.checkpoint_keeps=attention", "-recompute": "train.checkpoint_keeps=nothing",
                "-fp8": "model.quantize=fp8"}
    while row != "toolkit-eager" and (suffix := next((x for x in suffixes if row.endswith(x)), None)):
        row, setting = row.removesuffix(suffix), suffixes.pop(suffix)  # in any order, each once
        if setting is None:
            eager = True
        else:
            overrides.append(setting)
    eager = eager or row == "toolkit-eager"
    if row not in TOOLKIT_ROWS and not (row.startswith("toolkit-ckpt-") and row.rsplit("-", 1)[1].isdigit()):
        raise SystemExit(f"unknown toolkit row {name!r}: {', '.join(TOOLKIT_ROWS)} or toolkit-ckpt-N, each with any "
                         "of the suffixes -eager, -pointwise, -attention, -recompute, -fp8")
    overrides += [f"model.name_or_path={folder}", f"data.path={data}", f"train.batch_size={w['batch']}",
                 "train.compile=false" if eager else f"train.compile={device() == 'cuda'}"]
    if row == "toolkit-auto":  # what a user's run gets: every auto setting the toolkit's to settle
        overrides[-1] = "train.compile=false" if eager else "train.compile=auto"
    if row == "toolkit-nographs":
        overrides.append("train.cuda_graphs=false")
    if "frames" in w:
        overrides += [f"data.num_frames={w['frames']}", f"data.resolution={math.ceil(math.sqrt(w['height'] * w['width']))}",
                      "data.bucket_step=32"]
    else:
        overrides += [f"data.resolution={w['size']}"]
    if kind == "wan22":
        overrides.append("train.experts=high_noise")
    if row == "toolkit-ckpt":
        overrides.append("train.gradient_checkpointing=true")
    elif row.startswith("toolkit-ckpt-"):
        overrides.append(f"train.gradient_checkpointing={int(row.rsplit('-', 1)[1])}")
    elif row == "toolkit-swap24":
        share = capped(CAP_GIB)
        overrides += ["train.gradient_checkpointing=true", "model.block_swap=auto",
                      f"device.memory_fraction={0.9 * share:.4f}"]
    elif row == "toolkit-cap25":
        overrides += ["train.gradient_checkpointing=auto", "model.block_swap=auto",
                      f"device.memory_fraction={capped(FIT_GIB):.4f}"]
    elif row != "toolkit-auto":
        overrides.append("train.gradient_checkpointing=false")
    overrides += settings  # --set: last, so they win
    config = (f"model: {{family: {w['family']}}}\nnetwork: {{rank: 16, alpha: 16}}\n"
              "train: {lr: 1.0e-4, precision: bf16}\nsave: {every: 0}\nsample: {prompts: []}\n"
              "log: {tensorboard: false}\n")
    notes = []
    if row == "toolkit-auto" and not eager:  # the few timed steps of a run a user makes --auto-steps long
        pinned = planned(config, overrides, STEP_PLANNED, auto_steps)
        overrides += pinned
        notes.append(f"planned as a {auto_steps}-step run (--auto-steps): {', '.join(pinned) or 'nothing settled by length'}")
    logs: list[str] = []
    losses: list[float] = []
    first_step: dict = {}
    profile = {} if os.environ.get("BENCH_PROFILE") else None
    rate, peak = trainer_rate(config, overrides, work / f"run-{kind}-{name}", "adamw", steps, warmup, logs,
                              profile=profile, losses=losses, first_step=first_step)
    shown = ("attention:", "blocks:", "train.compile", "train.cuda_graphs", "model.quantize", "wan22 experts:",
             "train.gradient_checkpointing=auto", "model: quantized")
    notes += [line for line in logs if line.startswith(shown)]
    started = {"seconds_to_first_step": round(first_step["at"] - STARTED, 1)} if "at" in first_step else {}
    return {"s_per_step": 1 / rate, "peak_gib": peak, "notes": notes, "losses": [round(x, 4) for x in losses],
            **started, **({"profile": profile} if profile else {})}


def run_row(kind: str, row: str, args, folder: Path, data: Path, work: Path) -> dict:
    w = workload(kind, args.tiny)
    if (peer := row.split("-", 1)[0]) in PEERS:  # kohya, kohya-24g, ...: the peer's own trainer
        variant = row.removeprefix(peer).removeprefix("-")
        return importlib.import_module(PEERS[peer]).row(kind, variant, folder, data, work, w, args.steps, args.warmup,
                                                        0.95 * args.timeout)
    if row.startswith("plain"):
        return plain_loop(kind, folder, w, args.steps, args.warmup, ckpt="ckpt" in row, compiled="compiled" in row)
    return toolkit_row(kind, row, folder, data, work, w, args.steps, args.warmup, args.set, args.auto_steps)


def measure(kind: str, row: str, args, folder: Path, data: Path, work: Path) -> dict:
    """One row in a process of its own: {"s_per_step", "peak_gib"} or {"skipped": why}."""
    result = work / f"{kind}-{row}.json"
    command = [sys.executable, __file__, "--worker", f"{kind}:{row}", "--folder", str(folder), "--data", str(data),
               "--work", str(work), "--json", str(result), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--timeout", str(args.timeout)]
    command += ["--tiny"] if args.tiny else []
    command += [f"--set={setting}" for setting in args.set] + ["--auto-steps", str(args.auto_steps)]
    others_busy = cpus_busy_elsewhere()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {"skipped": f"over {args.timeout} s"}
    if done.returncode != 0 or not result.exists():
        tail = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()][-3:]
        skipped = {"skipped": f"exit {done.returncode}: " + " | ".join(tail)}
        if args.out:  # the whole output of the failed row, beside the results
            log = args.out.with_name(f"{args.out.stem}-{kind}-{row}.log")
            log.write_text(f"{' '.join(command)}\n\n{done.stdout}\n{done.stderr}")
            skipped["log"] = str(log)
        return skipped
    measured = json.loads(result.read_text())
    others = others_busy()
    measured["other_cpus"] = round(others, 2)
    if others > 1.0:
        measured.setdefault("notes", []).append(
            f"other processes kept {others:.1f} CPUs busy during this row: a host-bound row (SD1.5, SDXL) runs "
            "slower than on an idle machine")
    return measured


def cpus_busy_elsewhere():
    """A function that gives how many CPUs other processes than this one's children kept busy on average since
    this call (the machine's busy CPU time from /proc/stat less the children's own). Host-bound rows slow down
    when another process loads the CPUs: a bench compiling on the machine's other GPU once halved SD1.5's rate."""
    import resource
    import time

    def machine() -> float:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return float("nan")
        fields = fields[:8]  # user nice system idle iowait irq softirq steal (guest time is inside user already)
        return (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / os.sysconf("SC_CLK_TCK")

    def children() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    began = (time.perf_counter(), machine(), children())

    def stop() -> float:
        wall = max(time.perf_counter() - began[0], 1e-9)
        return max(0.0, (machine() - began[1]) - (children() - began[2])) / wall

    return stop


def time_to(r: dict, steps: int) -> float | None:
    """Seconds from a row's process start to the end of its `steps`-th step: its start-up, loading, caching and
    first step (its compile), then steps - 1 at its measured rate; None where its first step was not timed.
    caching_s: what a peer caches in processes of its own before training (musubi-tuner's two caching scripts)."""
    if "seconds_to_first_step" not in r:
        return None
    return (r.get("caching_s") or 0.0) + r["seconds_to_first_step"] + (steps - 1) * r["s_per_step"]


def print_time_to(kind: str, rows: dict[str, dict], lengths: tuple[int, ...] = (200, 2000)) -> None:
    timed = {row: r for row, r in rows.items() if time_to(r, 1) is not None}
    if not timed:
        return
    print(f"{kind}, time to N steps from process start (start-up and caching included; the compile cache as this "
          f"machine had it):\n{'row':<22} {'1st step':>9} " + " ".join(f"{f'{n} steps':>12}" for n in lengths))
    for row, r in timed.items():
        print(f"{row:<22} {time_to(r, 1):>8.1f}s " + " ".join(f"{time_to(r, n):>11.0f}s" for n in lengths))
        r["time_to"] = {str(n): round(time_to(r, n), 1) for n in lengths}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="sd15,sdxl,flux,wan")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=400, help="seconds per row")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the bench on the CPU")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every toolkit row (device.sdpa_backend=flash, say); repeatable")
    parser.add_argument("--auto-steps", type=int, default=2000,
                        help="toolkit-auto: the run length its length-dependent auto settings (train.compile, "
                             "train.compile_regions) are planned for, though only --warmup + --steps run")
    parser.add_argument("--profile", action="store_true",
                        help="also profile a few steps of every row after its timed ones; prints where GPU time goes")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, row = args.worker.split(":")
        from peers.common import PeerFailed

        try:
            measured = run_row(kind, row, args, args.folder, args.data, args.work)
        except PeerFailed as failed:  # the row is printed with the peer's message
            measured = {"skipped": str(failed)}
        args.json.write_text(json.dumps(measured))
        return
    from diffusion_models import write_clip, write_images, write_pipeline
    from kernel_profile import print_summary

    if args.profile:
        os.environ["BENCH_PROFILE"] = "1"  # read by the rows' processes
    work = Path(tempfile.mkdtemp(prefix="bench-diffusion-"))
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {name}; torch {torch.__version__}; {args.steps} timed steps after {args.warmup}", flush=True)
    results = {}
    for kind in args.models.split(","):
        w = workload(kind, args.tiny)
        folder, data = work / kind, work / f"{kind}-data"
        write_pipeline(kind, folder, device(), tiny=args.tiny)
        if "frames" in w:
            write_clip(data, w["frames"], w["height"], w["width"])
            what = f"{w['frames']} x {w['height']} x {w['width']}, batch 1"
        else:
            write_images(data, max(8, 2 * w["batch"]), w["size"], references=w.get("references", 0))
            what = f"{w['size']} px, batch {w['batch']}"
        per_image = kind in ("sd15", "sdxl")
        print(f"\n{kind}: {what}\n{'row':<22} {'s/step':>8} {'img/s':>7} {'peak GiB':>9} {'vs plain':>9}", flush=True)
        plain = None
        for row in args.rows.split(","):
            r = results[f"{kind}:{row}"] = measure(kind, row, args, folder, data, work)
            if "skipped" in r:
                print(f"{row:<22} skipped ({r['skipped']})", flush=True)
                continue
            plain = plain or (r["s_per_step"] if row == "plain" else None)
            ratio = f"{plain / r['s_per_step']:>9.2f}" if plain else f"{'':>9}"
            rate = f"{w['batch'] / r['s_per_step']:>7.2f}" if per_image else f"{'':>7}"
            loss = f"  losses {' '.join(f'{x:.4f}' for x in r['losses'])}" if r.get("losses") else ""
            print(f"{row:<22} {r['s_per_step']:>8.3f} {rate} {r['peak_gib']:>9.1f} {ratio}{loss}", flush=True)
            for note in r.get("notes", []):
                print(f"    {note}", flush=True)
        print_time_to(kind, {row: results[f"{kind}:{row}"] for row in args.rows.split(",")})
        shutil.rmtree(folder, ignore_errors=True)
    for key, r in results.items():
        if "profile" in r:
            print_summary(key, r["profile"])
    if args.out:
        args.out.write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": results}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
