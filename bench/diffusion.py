"""Diffusion families on a GPU: a smoke run of each through the trainer, and Wan video LoRA step time beside
the plain stack a user would write.

    python bench/diffusion.py [--steps 10] [--warmup 3] [--frames 81] [--height 480] [--width 832] [--skip-smoke]

Smoke: every tiny flow-matching family (flux with bitsandbytes 8-bit, sd3 with torchao 8-bit, wan21, wan22 with
expert offload, also over quantized bases, wan22-5b) trains a few bf16 steps on the GPU with samples and
checkpoints; prints OK or the error.

Timing: a Wan 2.1 1.3B-shaped transformer (random weights, no download; a small VAE and text encoder, whose
outputs are cached anyway), LoRA r=16 on attention + FFN, bf16, gradient checkpointing, one clip of
--frames x --height x --width:
- plain:   diffusers WanTransformer3DModel + PEFT + torch.optim.AdamW(fused=True), a hand-written flow loop;
- toolkit: the Trainer (`python -m toolkit train` machinery), optimizer adamw (fused) and adamw8bit.
Prints s/step, peak memory and the ratio plain/toolkit (above 1: the toolkit is faster).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
WAN_1P3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def smoke(work: Path) -> None:
    from toolkit.config.run import load_run
    from toolkit.train.trainer import Trainer

    cases = [("flux", ["model.quantize=8bit", "model.quantize_backend=bitsandbytes", "train.optimizer=adamw8bit"]),
             ("sd3", ["model.quantize=8bit", "model.quantize_backend=torchao"]),
             ("wan21", ["train.optimizer=adamw8bit"]),
             ("wan22", ["model.expert_offload=true", "train.expert_switch_every=2", "train.ema_decay=0.99"]),
             ("wan22", ["model.expert_offload=true", "train.expert_switch_every=2", "model.quantize=8bit",
                        "model.quantize_backend=bitsandbytes"]),
             ("wan22", ["model.expert_offload=true", "train.expert_switch_every=2", "model.quantize=8bit",
                        "model.quantize_backend=torchao"]),
             ("wan22", ["model.expert_offload=true", "train.expert_switch_every=2", "model.quantize=4bit"]),
             ("wan22", ["model.name_or_path=tiny:wan22-5b"])]
    for family, extra in cases:
        out = work / f"smoke-{family}-{len(extra)}"
        overrides = [f"run.output_dir={out}", "device.preset=auto", "train.steps=4", "save.every=2", "sample.every=2",
                     "train.precision=bf16", "sample.num_inference_steps=2", *extra]
        try:
            run = load_run([REPO / "configs/examples" / f"quickstart_{family}.yaml"], overrides)
            trainer = Trainer(run, fresh=True, log=lambda m: None)
            final = trainer.run()
            files = sorted(str(p.relative_to(final)) for p in final.rglob("*.safetensors"))
            placement = ""
            if "model.expert_offload=true" in extra:
                adapter = trainer.adapter
                placement = "; " + ", ".join(
                    f"{name} base on {next(p for p in adapter.component(name).parameters() if not p.requires_grad).device}"
                    f" / LoRA on {next(p for p in adapter.component(name).parameters() if p.requires_grad).device}"
                    for name in adapter.denoiser_names)
            print(f"smoke {family:6s} {' '.join(extra):80s} OK  {files}{placement}", flush=True)
        except Exception:
            print(f"smoke {family:6s} {' '.join(extra):80s} FAILED\n{traceback.format_exc()}", flush=True)
        torch.cuda.empty_cache()


def write_wan_1p3b(folder: Path) -> None:
    """WanPipeline layout with a 1.3B-shaped transformer, the tiny Wan VAE and a tiny UMT5 of width 4096."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from toolkit.tiny.flow import t5_config, wan21_vae, wan_scheduler, write_t5_tokenizer

    tokenizer = write_t5_tokenizer(folder / "tokenizer")
    torch.manual_seed(0)
    with torch.device("cuda"):
        transformer = WanTransformer3DModel(**WAN_1P3B).to(torch.bfloat16)
    text_encoder = UMT5EncoderModel(t5_config(len(tokenizer), d_model=4096, umt5=True))
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=wan21_vae(),
                       scheduler=wan_scheduler(3.0), transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    del pipe, transformer
    torch.cuda.empty_cache()


def write_clip(folder: Path, frames: int, height: int, width: int) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    base = (torch.rand(height // 8, width // 8, 3, generator=g) * 255).to(torch.uint8)
    images = [Image.fromarray(torch.roll(base, shifts=i, dims=1).numpy()).resize((width, height), Image.NEAREST)
              for i in range(frames)]
    images[0].save(folder / "clip.webp", save_all=True, append_images=images[1:], duration=62, loop=0, quality=60)
    (folder / "clip.txt").write_text("a random pattern drifting right\n")


def plain_stack(model_dir: Path, steps: int, warmup: int, frames: int, height: int, width: int,
                cudnn_sdpa: bool) -> dict:
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from toolkit.models.diffusion_wan import WAN_TARGETS

    torch.backends.cuda.enable_cudnn_sdp(cudnn_sdpa)
    torch.manual_seed(0)
    transformer = WanTransformer3DModel.from_pretrained(model_dir / "transformer", torch_dtype=torch.bfloat16).cuda()
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=WAN_TARGETS, init_lora_weights="gaussian"))
    params = [p for p in transformer.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    transformer.enable_gradient_checkpointing()
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    latents = torch.randn(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8, device="cuda")
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in range(steps + warmup):
        if step == warmup:
            start.record()
        noise = torch.randn_like(latents)
        u = torch.sigmoid(torch.randn(1, device="cuda"))
        sigma = (3 * u / (1 + 2 * u)).view(-1, 1, 1, 1, 1)
        noisy = (1 - sigma) * latents + sigma * noise
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = transformer(hidden_states=noisy.to(torch.bfloat16), timestep=(sigma.flatten() * 1000),
                               encoder_hidden_states=text, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), noise - latents)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    end.record()
    torch.cuda.synchronize()
    result = {"s_per_step": start.elapsed_time(end) / 1000 / steps, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del transformer, opt
    torch.cuda.empty_cache()
    return result


def toolkit_run(model_dir: Path, data: Path, out: Path, optimizer: str, steps: int, warmup: int, frames: int,
                height: int, width: int) -> dict:
    from trainer_rate import trainer_rate

    overrides = [f"model.name_or_path={model_dir}", f"data.path={data}", f"data.num_frames={frames}",
                 f"data.resolution={math.ceil(math.sqrt(height * width))}"]
    config = ("model: {family: wan21}\nnetwork: {rank: 16, alpha: 16}\ndata: {bucket_step: 32}\n"
              "train: {lr: 1.0e-4, precision: bf16, gradient_checkpointing: true, batch_size: 1}\n"
              "save: {every: 0}\nsample: {prompts: []}\nlog: {tensorboard: false}\n")
    rate, peak = trainer_rate(config, overrides, out, optimizer, steps, warmup)
    return {"s_per_step": 1 / rate, "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--skip-smoke", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-diffusion-"))
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    if not args.skip_smoke:
        smoke(work)
    model_dir, data = work / "wan", work / "clips"
    write_wan_1p3b(model_dir)
    write_clip(data, args.frames, args.height, args.width)
    print(f"\nWan 2.1 1.3B shape, LoRA r=16 attention + FFN, bf16, gradient checkpointing, "
          f"{args.frames} x {args.height} x {args.width}, mean of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'stack':<28} {'s/step':>8} {'peak GiB':>9} {'plain/toolkit':>14}", flush=True)
    # PyTorch's SDPA may pick its cuDNN backend; the toolkit decides per family (device.cudnn_sdpa): time both
    plain = plain_stack(model_dir, args.steps, args.warmup, args.frames, args.height, args.width, cudnn_sdpa=True)
    print(f"{'plain (PEFT + fused AdamW)':<28} {plain['s_per_step']:>8.3f} {plain['peak_gib']:>9.1f} {1.0:>14.2f}", flush=True)
    other = plain_stack(model_dir, args.steps, args.warmup, args.frames, args.height, args.width, cudnn_sdpa=False)
    print(f"{'plain, SDPA cuDNN off':<28} {other['s_per_step']:>8.3f} {other['peak_gib']:>9.1f} "
          f"{plain['s_per_step'] / other['s_per_step']:>14.2f}", flush=True)
    for optimizer in ("adamw", "adamw8bit"):
        try:
            r = toolkit_run(model_dir, data, work / f"run-{optimizer}", optimizer, args.steps, args.warmup,
                            args.frames, args.height, args.width)
            print(f"{'toolkit (' + optimizer + ')':<28} {r['s_per_step']:>8.3f} {r['peak_gib']:>9.1f} "
                  f"{plain['s_per_step'] / r['s_per_step']:>14.2f}", flush=True)
        except Exception:
            print(f"toolkit ({optimizer}) FAILED\n{traceback.format_exc()}", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
