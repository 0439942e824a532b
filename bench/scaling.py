"""1 GPU vs N GPUs (default 2) in one run: the toolkit's real launcher beside a plain hand-written DDP loop.

    python bench/scaling.py [--gpus 2] [--llm-warmup 10 --llm-steps 20] [--sdxl-warmup 5 --sdxl-steps 10]
                            [--skip-llm] [--skip-sdxl] [--no-plain-sdxl] [--no-plain-compiled] [--fsdp]
                            [--fsdp-whole-state] [--fsdp-offload] [--fsdp-gathered]
                            [--stacks toolkit,plain,plain-compiled] [--counts 1,2] [--out results.json] [--logs DIR]
    python bench/scaling.py --tiny      # tiny:llm and tiny:sdxl on the CPU, 2 processes over gloo (a check)

Workloads (random weights, nothing downloaded):
- LLM: the Llama-3.2-1B shape that bench/llm.py writes (its write_model / write_data are imported), PEFT LoRA
  r=16 on all linear layers, bf16, fused AdamW (train.optimizer=adamw), batch 4 x 2048 tokens per GPU.
- SDXL: an SDXL-base-shaped UNet (2.6B) with small text encoders of SDXL's widths (768 + 1280) and a small VAE
  that downsamples 8x, LoRA r=16 on attention (to_q/k/v/out), bf16, fused AdamW, 1024 x 1024 px, batch 2 per GPU.

Each workload runs, every run a fresh process (group):
- toolkit, 1 GPU:  `python -m toolkit train <cfg> ...`
- toolkit, N GPUs: `python -m toolkit train <cfg> ... --gpus N` (the toolkit's own launcher)
- plain, 1 and N GPUs: this file's --plain-worker under torchrun: transformers / diffusers + PEFT + torch fused
  AdamW, bf16 weights under bf16 autocast (as bench/llm.py's plain loop), wrapped in DistributedDataParallel
  when N > 1; each rank draws its own data. For the LLM also plain-compiled: the same loop with each decoder layer
  compiled (`layer.compile()`), the fastest plain loop a user writes.
- --fsdp: the toolkit on N GPUs with device.distributed=ddp, then fsdp, on a 12B-class base (bench/llm.py's
  nemo-12b shape; gradient checkpointing, 1 x 1024 tokens per GPU, compile off): per-GPU peak memory and the ratio.
  fsdp runs with device.shard_optimizer=true; --fsdp-whole-state adds fsdp with it false (what auto runs now): the
  optimizer state's saving and the all-gather's cost, measured. --fsdp-offload adds fsdp with the optimizer state
  sharded and train.checkpoint_offload=true (the checkpointed layers' inputs in pinned CPU memory).
  --fsdp-gathered adds fsdp-whole-state with device.fsdp_embeddings=gathered: the input embeddings gathered whole
  by FSDP2 beside the lookup in the shards (the default), in one run.

Throughput: the time from the end of the warm-up steps to the end of the last step. The toolkit's comes from its
own logs/metrics.jsonl (log.every = warm-up steps): each record's steps_per_s, timed between the CUDA events that
end the logged steps, so the GPU's time (the records' host clock, "host_seconds", is kept beside it: with CUDA
graphs the host may run steps ahead of the GPU, and it wrote the records when it read them); the plain loop
synchronises the GPU at both ends. Units per step are per-GPU batch x GPUs (tokens: x sequence length).
Memory: torch.cuda.max_memory_allocated of every rank (the toolkit's processes report theirs at exit through a
sitecustomize hook that this script puts on PYTHONPATH for its child processes only; without a report the
main process's memory_mb from metrics.jsonl is used).
Ranks: the plain loop all-gathers the LoRA weights and reports max |rank r - rank 0|; the toolkit compares a
sha256 of every rank's LoRA weights at the end of a run (and stops with an error when they differ): the line
"processes: LoRA weights identical on all N (sha256 ...)" is parsed, and reported as max diff 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))
from memory_hook import MEMORY_HOOK  # noqa: E402

CHECKSUM = re.compile(r"processes: LoRA weights identical on all (\d+) \(sha256 ([0-9a-f]+)\)")
FIRST_STEP = re.compile(r"train\.compile: the first step took ([\d.]+) s \(compilation included\), ([\d.]+) s after")
UNET_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]   # the toolkit's default sdxl targets (UNET_TARGETS)
SDXL_UNET = dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, norm_num_groups=32,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 block_out_channels=(320, 640, 1280), transformer_layers_per_block=(1, 2, 10),
                 attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816)   # stabilityai/stable-diffusion-xl-base-1.0's UNet

class RunFailed(RuntimeError):
    pass


def log_tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("    " + line for line in text[-lines:])


def run_logged(cmd: list[str], log: Path, env: dict, timeout: float) -> float:
    """Run `cmd` in the repository root with its output in `log`; the wall seconds, or RunFailed."""
    start = time.perf_counter()
    with log.open("w") as handle:
        handle.write("$ " + " ".join(cmd) + "\n")
        handle.flush()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"timed out after {timeout:.0f}s; last lines of {log}:\n{log_tail(log)}") from None
    if proc.returncode != 0:
        raise RunFailed(f"exit code {proc.returncode}; last lines of {log}:\n{log_tail(log)}")
    return time.perf_counter() - start


def child_env(work: Path, **extra: str) -> dict:
    env = dict(os.environ)  # NCCL_* (NVLink multicast off on the device machines) are kept
    env.update(PYTHONUNBUFFERED="1", TOOLKIT_CACHE=str(work / "cache"), **extra)
    return env


# -- the toolkit ----------------------------------------------------------------------------------------------

def toolkit_run(name: str, config_yaml: str, overrides: list[str], work: Path, gpus: int, warmup: int, steps: int,
                units_per_gpu_step: int, timeout: float) -> dict:
    """One `python -m toolkit train` run (with `--gpus N` when N > 1): units/s, per-rank peak GiB, rank check."""
    tag = f"toolkit-{name}-{gpus}"
    out, memory, log = work / f"run-{tag}", work / f"memory-{tag}", work / f"{tag}.log"
    for again in range(2, 100):  # a --work folder reused: a fresh run folder (the toolkit resumes an existing one)
        if not out.exists():
            break
        out, memory, log = (work / f"run-{tag}-{again}", work / f"memory-{tag}-{again}", work / f"{tag}-{again}.log")
    memory.mkdir(parents=True, exist_ok=True)
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(MEMORY_HOOK)
    cfg = work / f"{name}.yaml"
    cfg.write_text(config_yaml)
    cmd = [sys.executable, "-m", "toolkit", "train", str(cfg), *overrides, f"train.steps={warmup + steps}",
           f"run.output_dir={out}", f"log.every={warmup}"]
    if gpus > 1:
        cmd += ["--gpus", str(gpus)]
    pythonpath = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    wall = run_logged(cmd, log, child_env(work, SCALING_BENCH_MEMORY=str(memory), PYTHONPATH=pythonpath), timeout)

    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in records if "steps_per_s" in r}
    first, last = logged.get(warmup), logged.get(warmup + steps)
    if first is None or last is None:
        raise RunFailed(f"metrics.jsonl has no record at step {warmup} and {warmup + steps}: {sorted(logged)}")
    timed = [r for s, r in logged.items() if s > warmup]
    # Each record's steps_per_s covers the steps since the record before, timed between the CUDA events that end
    # them (the host clock on a CPU): the GPU's time, whatever the host was doing when it wrote the record.
    seconds, previous, per_record = 0.0, warmup, []
    for s in sorted(r["step"] for r in timed):
        seconds += (s - previous) / logged[s]["steps_per_s"]
        per_record.append(round(1000 / logged[s]["steps_per_s"], 2))
        previous = s
    host_seconds = last["time"] - first["time"]
    result = {"stack": "toolkit", "gpus": gpus, "seconds": seconds, "host_seconds": host_seconds, "steps": steps,
              "units_per_s": steps * units_per_gpu_step * gpus / seconds, "process_wall_s": wall,
              "metrics_tokens_per_s": (sum(r.get("tokens_per_s", 0) for r in timed) / len(timed)) or None,
              "step_ms_by_record": per_record}   # a step's mean time in each logged interval: spread within a run

    reports = [json.loads(p.read_text()) for p in sorted(memory.glob("memory-*.json"))]
    # by rank, the process that trained: the launcher's agent and torch.compile's worker processes report too
    # (with the rank of the process that started them), with little or no GPU memory of their own
    by_rank: dict = {}
    for r in reports:
        kept = by_rank.get(r["rank"])
        if (r["rank"] is not None) == (gpus > 1) and "gib" in r and (kept is None or r["gib"] > kept["gib"]):
            by_rank[r["rank"]] = r
    workers = sorted(by_rank.values(), key=lambda r: int(r["rank"] or 0))
    if len(workers) == gpus:
        result["peak_gib"] = [r["gib"] for r in workers]
        result["memory_kind"] = workers[0]["kind"]
    else:  # no hook report: the main process's own figure (metrics.jsonl)
        result["peak_gib"] = [last["memory_mb"] / 1024]
        result["memory_kind"] = last["memory_kind"] + " (rank 0 only, from metrics.jsonl)"
        result["memory_hook"] = reports

    text = log.read_text(errors="replace")
    first = FIRST_STEP.search(text)
    if first is not None:  # the compile: cold in a model's first run here, warm (its cache filled) in the later ones
        result["first_step_s"], result["first_step_after_start_s"] = float(first.group(1)), float(first.group(2))
    result["notes"] = [line for line in text.splitlines()
                       if line.startswith(("blocks:", "device.gradient_sync", "train.gradient_checkpointing=auto",
                                           "train.batch_size=auto", "attention:"))]
    if gpus > 1:
        match = CHECKSUM.search(text)
        if match is None:
            raise RunFailed(f"no 'processes: LoRA weights identical' line in {log}")
        result["rank_check"] = f"sha256 {match.group(2)} on all {match.group(1)}"
        result["rank_max_diff"] = 0.0 if int(match.group(1)) == gpus else None
    return result


# -- the plain loop (this file's --plain-worker, under torchrun) ----------------------------------------------

def plain_run(kind: str, model_dir: Path, work: Path, gpus: int, warmup: int, steps: int, batch: int, size: int,
              tiny: bool, timeout: float, compiled: bool = False) -> dict:
    tag = f"plain{'-compiled' if compiled else ''}-{kind}-{gpus}"
    result_file, log = work / f"{tag}.json", work / f"{tag}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           str(Path(__file__).resolve()), "--plain-worker", kind, "--model", str(model_dir),
           "--result", str(result_file), "--worker-warmup", str(warmup), "--worker-steps", str(steps),
           "--worker-batch", str(batch), "--worker-size", str(size), "--worker-compile", str(int(compiled))]
    cmd += ["--tiny"] if tiny else []
    wall = run_logged(cmd, log, child_env(work), timeout)
    result = json.loads(result_file.read_text())
    result["process_wall_s"] = wall
    return result


def plain_worker(args) -> None:
    import torch.distributed as dist

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)  # the same LoRA initialisation on every rank (DDP also broadcasts rank 0's)
    build = {"llm": plain_llm, "sdxl": plain_sdxl, "wan": plain_wan}[args.plain_worker]
    model, params, step = build(args, device, dtype, rank)
    if args.worker_compile and args.plain_worker == "llm":  # each decoder layer compiled, as a user would
        for layer in model.get_base_model().model.layers:
            layer.compile()
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[local] if cuda else None)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = None
    for i in range(args.worker_warmup + args.worker_steps):
        if i == args.worker_warmup:
            sync()
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = step(model)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    seconds = time.perf_counter() - start

    peak = (torch.cuda.max_memory_allocated(device) if cuda else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 2**10) / 2**30
    weights = torch.cat([p.detach().float().flatten() for p in params])
    diff, peaks = None, [peak]
    if world > 1:
        gathered = [torch.empty_like(weights) for _ in range(world)]
        dist.all_gather(gathered, weights)
        diff = max((g - gathered[0]).abs().max().item() for g in gathered)
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
        dist.barrier()
    if rank == 0:
        units = args.worker_batch * (args.worker_size if args.plain_worker == "llm" else 1)  # tokens, images, clips
        Path(args.result).write_text(json.dumps({
            "stack": "plain-compiled" if args.worker_compile else "plain", "gpus": world, "seconds": seconds,
            "steps": args.worker_steps,
            "units_per_s": args.worker_steps * units * world / seconds, "peak_gib": peaks,
            "memory_kind": "gpu_max_allocated" if cuda else "process_max_rss", "rank_max_diff": diff,
            "lora_parameters": weights.numel()}))
    if world > 1:
        dist.destroy_process_group()


def plain_llm(args, device, dtype, rank):
    """bench/llm.py's plain loop: transformers + PEFT LoRA r=16 all-linear, bf16 weights, SDPA."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").to(device)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
    vocab = min(400, model.config.vocab_size)
    ids = torch.randint(4, vocab, (args.worker_batch, args.worker_size), generator=g).to(device)

    def step(m):
        return m(input_ids=ids, labels=ids).loss

    return model, params, step


def plain_sdxl(args, device, dtype, rank):
    """diffusers UNet2DConditionModel + PEFT LoRA r=16 on attention (fp32 LoRA over a bf16 base), DDPM eps loss
    on random latents and text states of the pipeline's shapes (what the toolkit's caches hold)."""
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from peft import LoraConfig

    model_dir = Path(args.model)
    unet = UNet2DConditionModel.from_pretrained(model_dir / "unet", torch_dtype=dtype).to(device)
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=UNET_ATTENTION, init_lora_weights="gaussian"))
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    vae = json.loads((model_dir / "vae" / "config.json").read_text())
    down = 2 ** (len(vae["block_out_channels"]) - 1)
    c = unet.config
    pooled_dim = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
    b, side = args.worker_batch, args.worker_size // down
    g = torch.Generator().manual_seed(1000 + rank)
    latents = torch.randn(b, c.in_channels, side, side, generator=g).to(device)
    text = torch.randn(b, 77, c.cross_attention_dim, generator=g).to(device, dtype)
    pooled = torch.randn(b, pooled_dim, generator=g).to(device, dtype)
    px = args.worker_size
    time_ids = torch.tensor([[px, px, 0, 0, px, px]] * b, dtype=dtype, device=device)
    alphas = DDPMScheduler.from_pretrained(model_dir / "scheduler").alphas_cumprod.to(device)

    def step(m):
        noise = torch.randn_like(latents)
        t = torch.randint(0, len(alphas), (b,), device=device)
        a = alphas[t].view(-1, 1, 1, 1)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        pred = m(noisy.to(dtype), t, encoder_hidden_states=text,
                 added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}, return_dict=False)[0]
        return torch.nn.functional.mse_loss(pred.float(), noise)

    return unet, params, step


def plain_wan(args, device, dtype, rank):
    """bench/diffusion.py's plain Wan loop: the transformer with PEFT LoRA r=16 on the toolkit's targets (fp32 LoRA
    over bf16 weights), gradient checkpointing and each block compiled (the fastest plain loop of that bench), the
    flow-matching loss on random latents of the clip's shape and random text states; each rank its own batch."""
    import diffusion as bench_diffusion

    w = bench_diffusion.workload("wan", args.tiny)
    model = bench_diffusion.plain_model("wan", Path(args.model), ckpt=True, compiled=bool(args.worker_compile))
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1000 + rank)
    b = args.worker_batch
    latents = torch.randn(b, 16, (w["frames"] - 1) // 4 + 1, w["height"] // 8, w["width"] // 8, generator=g).to(device)
    dtype = torch.bfloat16  # plain_model's weights (bf16 on the CPU too, where autocast is off)
    text = torch.randn(b, 512, model.config.text_dim, generator=g).to(device, dtype)
    view = (-1,) + (1,) * (latents.dim() - 1)

    def step(m):  # through `m`, the DDP wrapper with several processes: its forward is what all-reduces
        noise = torch.randn_like(latents)
        sigma = torch.sigmoid(torch.randn(b, device=device))
        noisy = (1 - sigma.view(view)) * latents + sigma.view(view) * noise
        pred = m(hidden_states=noisy.to(dtype), timestep=sigma * 1000, encoder_hidden_states=text, return_dict=False)[0]
        return torch.nn.functional.mse_loss(pred.float(), noise - latents)

    return model, params, step


# -- the models and data --------------------------------------------------------------------------------------

def write_sdxl(folder: Path) -> None:
    """StableDiffusionXLPipeline layout: SDXL-base-shaped UNet (bf16, random), 2-layer CLIP text encoders of SDXL's
    widths (768; 1280 with a 1280 projection), a small VAE with SDXL's 8x downsampling and 4 latent channels."""
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from toolkit.tiny.diffusion import write_clip_tokenizer

    for sub in ("tokenizer", "tokenizer_2"):
        write_clip_tokenizer(folder / sub)
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    tokenizer_2 = CLIPTokenizer.from_pretrained(folder / "tokenizer_2")

    def clip(vocab: int, width: int, heads: int):
        return CLIPTextConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=2,
                              num_attention_heads=heads, max_position_embeddings=77, projection_dim=width,
                              bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1,
                              hidden_act="gelu")

    torch.manual_seed(0)
    with torch.device("cuda"):
        unet = UNet2DConditionModel(**SDXL_UNET).to(torch.bfloat16)
    vae = AutoencoderKL(block_out_channels=(32, 32, 64, 64), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=32, sample_size=1024, scaling_factor=0.13025)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear", clip_sample=False, prediction_type="epsilon",
                              steps_offset=1)
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=CLIPTextModel(clip(len(tokenizer), 768, 12)),
                                     text_encoder_2=CLIPTextModelWithProjection(clip(len(tokenizer_2), 1280, 20)),
                                     tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler,
                                     force_zeros_for_empty_prompt=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    del pipe, unet
    torch.cuda.empty_cache()


def write_images(folder: Path, count: int, side: int) -> None:
    """`count` square images (random coloured blocks) with captions: every one lands in the same bucket."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    words = "red green blue yellow circle square triangle star".split()
    for i in range(count):
        blocks = (torch.rand(side // 16, side // 16, 3, generator=g) * 255).to(torch.uint8)
        Image.fromarray(blocks.numpy()).resize((side, side), Image.NEAREST).save(folder / f"img{i:03d}.png")
        (folder / f"img{i:03d}.txt").write_text(f"a {words[i % 8]} {words[(i * 3 + 1) % 8]} pattern\n")


LLM_CONFIG = ("model: {family: llm}\nnetwork: {rank: 16, alpha: 16}\n"
              "train: {lr: 1.0e-4, precision: bf16, gradient_checkpointing: false, optimizer: adamw}\n"
              "save: {every: 0}\nlog: {tensorboard: false}\n")
SDXL_CONFIG = ("model: {family: sdxl}\nnetwork: {rank: 16, alpha: 16}\n"
               "train: {lr: 1.0e-4, precision: bf16, gradient_checkpointing: false, optimizer: adamw}\n"
               "save: {every: 0}\nsample: {prompts: []}\nlog: {tensorboard: false}\n")


WAN_CONFIG = ("model: {family: wan21}\nnetwork: {rank: 16, alpha: 16}\n"
              "train: {lr: 1.0e-4, precision: bf16, optimizer: adamw}\n"
              "save: {every: 0}\nsample: {prompts: []}\nlog: {tensorboard: false}\n")


def wan_workload(tiny: bool) -> dict:
    import diffusion as bench_diffusion

    return bench_diffusion.workload("wan", tiny)


def wan_scaling(args, work: Path, counts: list[int], stacks: set, tiny: bool, tiny_overrides: list[str],
                measure) -> dict:
    """Wan 2.1 1.3B at 81 x 480 x 832 (bench/diffusion.py's workload), 1 clip per GPU: the toolkit as auto sets it
    (compiled block by block; checkpointing and what it keeps measured) beside the plain loop under torchrun/DDP."""
    from diffusion_models import write_clip, write_pipeline

    warmup, steps = args.wan_warmup or (1 if tiny else 3), args.wan_steps or (2 if tiny else 6)
    w = wan_workload(tiny)
    t0 = time.perf_counter()
    folder, clips = work / "wan", work / "wan-clips"
    write_pipeline("wan", folder, "cpu" if tiny else "cuda", tiny=tiny)
    write_clip(clips / "one", w["frames"], w["height"], w["width"])
    for i in range(max(counts) * (warmup + steps) + 1):  # every process a clip of its own each step, no epoch end
        (clips / f"clip{i:03d}.webp").write_bytes((clips / "one" / "clip.webp").read_bytes())
        (clips / f"clip{i:03d}.txt").write_text(f"a random pattern drifting right, number {i}\n")
    shutil.rmtree(clips / "one")
    print(f"Wan 2.1 pipeline and clips written in {time.perf_counter() - t0:.0f}s", flush=True)
    side = int((w["height"] * w["width"]) ** 0.5) + 1
    overrides = [f"model.name_or_path={folder}", f"data.path={clips}", f"data.num_frames={w['frames']}",
                 f"data.resolution={side}", "data.bucket_step=32", "train.batch_size=1",
                 f"train.compile={not tiny}", *tiny_overrides, *args.set]
    rows: dict = {}
    for gpus in counts:
        for stack, extra in (("toolkit", []), ("toolkit-ddp", ["device.gradient_sync=ddp"])):
            if stack in stacks and (gpus > 1 or stack == "toolkit"):
                measure("wan", rows, stack, gpus, lambda: toolkit_run(
                    f"wan-{stack}", WAN_CONFIG, overrides + extra, work, gpus, warmup, steps, 1, args.timeout))
        if "plain" in stacks:
            measure("wan", rows, "plain", gpus, lambda: plain_run(
                "wan", folder, work, gpus, warmup, steps, 1, 0, tiny, args.timeout, compiled=not tiny))
    return rows


# -- fsdp vs ddp memory ---------------------------------------------------------------------------------------

# mode -> its overrides beyond device.distributed (the part before any '-'): fsdp with the optimizer state sharded
# (device.shard_optimizer=true; its auto stays off until these rows are measured), without, and with the
# checkpointed layers' inputs offloaded as well
FSDP_MODES = {"ddp": [], "fsdp": ["device.shard_optimizer=true"], "fsdp-whole-state": ["device.shard_optimizer=false"],
              "fsdp-offload": ["device.shard_optimizer=true", "train.checkpoint_offload=true"],
              "fsdp-gathered": ["device.shard_optimizer=false", "device.fsdp_embeddings=gathered"]}


def fsdp_modes(args) -> tuple[str, ...]:
    """ddp and fsdp; --fsdp-whole-state adds fsdp with the whole optimizer state on every process (the saving of
    device.shard_optimizer, measured), --fsdp-offload fsdp with the checkpointed layers' inputs offloaded too."""
    return ("ddp", "fsdp", *(("fsdp-whole-state",) if args.fsdp_whole_state else ()),
            *(("fsdp-offload",) if args.fsdp_offload else ()), *(("fsdp-gathered",) if args.fsdp_gathered else ()))


def fsdp_memory(args, work: Path, n: int, tiny: bool, tiny_overrides: list[str], measure) -> dict:
    """The toolkit on N GPUs with device.distributed=ddp, then fsdp: a 12B-class base, gradient checkpointing,
    1 x 1024 tokens per GPU, so the per-GPU memory is mostly the frozen base (what fsdp shards)."""
    import llm as bench_llm

    t0 = time.perf_counter()
    if tiny:
        from toolkit.tiny import resolve_model_path
        model_dir = Path(resolve_model_path("tiny:llm"))
    else:
        model_dir = work / "llm-12b"
        bench_llm.write_model(model_dir, shape="nemo-12b")
    data = work / "llm-12b.jsonl"
    warmup, steps = 2, args.fsdp_steps
    bench_llm.write_data(data, rows=n * (warmup + steps) + 16)
    print(f"12B-class model and data written in {time.perf_counter() - t0:.0f}s", flush=True)
    seq = 64 if tiny else 1024
    rows: dict = {}
    for mode in fsdp_modes(args):
        overrides = [f"model.name_or_path={model_dir}", f"data.path={data}", f"data.max_seq_len={seq}",
                     "train.batch_size=1", "train.gradient_checkpointing=true", "train.compile=false",
                     f"device.distributed={mode.split('-')[0]}", *FSDP_MODES[mode], *tiny_overrides]
        measure("fsdp", rows, mode, n, lambda: toolkit_run(
            f"llm-{mode}", LLM_CONFIG, overrides, work, n, warmup, steps, seq, args.timeout))
    return rows



# -- the table ------------------------------------------------------------------------------------------------

def gib(values) -> str:
    return " / ".join(f"{v:.1f}" for v in values) if values else "-"


def measured(rows: dict, key: tuple, label: str) -> dict | None:
    """The row for `key`, or None when there is none or it failed (a failure is printed, under `label`)."""
    r = rows.get(key)
    if r is not None and "error" in r:
        print(f"{label} FAILED: {r['error'].splitlines()[0]}")
        return None
    return r


def print_fsdp(rows: dict, shape: str, n: int) -> None:
    print(f"\nfsdp vs ddp on {n} GPUs: the toolkit, LLM {shape}, LoRA r=16, gradient checkpointing, "
          f"1 sequence per GPU, compile off")
    print(f"{'mode':<16} {'tokens/s':>10} {'per-GPU peak GiB':>18}  ranks")
    for mode in FSDP_MODES:
        if (mode, n) not in rows:
            continue
        r = measured(rows, (mode, n), f"{mode:<16}")
        if r is None:
            continue
        print(f"{mode:<16} {r['units_per_s']:>10,.1f} {gib(r['peak_gib']):>18}  {r.get('rank_check', '-')}")
    ddp = rows.get(("ddp", n), {})
    for mode in FSDP_MODES:
        other = rows.get((mode, n), {})
        if mode != "ddp" and "peak_gib" in ddp and "peak_gib" in other:
            print(f"{mode} / ddp per-GPU peak memory: {max(other['peak_gib']) / max(ddp['peak_gib']):.2f}x, "
                  f"tokens/s: {other['units_per_s'] / ddp['units_per_s']:.2f}x", flush=True)


PLAIN_STACKS = ("plain", "plain-compiled")


def print_table(title: str, unit: str, rows: dict, gpus: int) -> None:
    print(f"\n{title}")
    print(f"{'stack':<15} {'GPUs':>4} {unit + '/s':>12} {'per-GPU peak GiB':>18} {'scaling':>8} "
          f"{'toolkit/plain':>13} {'/plain-compiled':>15}  ranks max|diff|")
    for stack in ("toolkit", "toolkit-ddp", *PLAIN_STACKS):
        for n in sorted({n for s, n in rows}):
            r = measured(rows, (stack, n), f"{stack:<15} {n:>4}")
            if r is None:
                continue
            one = rows.get((stack, 1), {})
            scaling = f"{r['units_per_s'] / one['units_per_s']:.2f}x" if n > 1 and "units_per_s" in one else "-"
            ratios = []
            for plain_stack in PLAIN_STACKS:
                plain = rows.get((plain_stack, n), {})
                ratios.append(f"{r['units_per_s'] / plain['units_per_s']:.2f}"
                              if stack.startswith("toolkit") and "units_per_s" in plain else "-")
            diff = "-" if n == 1 else ("?" if r.get("rank_max_diff") is None else f"{r['rank_max_diff']:g}")
            if n > 1 and "rank_check" in r:
                diff += f" ({r['rank_check']})"
            compiled = (f"  first step {r['first_step_s']:.0f} s ({r['first_step_after_start_s']:.0f} s after start)"
                        if "first_step_s" in r else "")
            print(f"{stack:<15} {n:>4} {r['units_per_s']:>12,.1f} {gib(r['peak_gib']):>18} {scaling:>8} "
                  f"{ratios[0]:>13} {ratios[1]:>15}  {diff}{compiled}")
    kinds = {r.get("memory_kind") for r in rows.values() if "memory_kind" in r}
    print(f"memory: {', '.join(sorted(kinds))}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="tiny:llm and tiny:sdxl on the CPU (gloo), a few steps")
    parser.add_argument("--llm-warmup", type=int, default=None)
    parser.add_argument("--llm-steps", type=int, default=None)
    parser.add_argument("--sdxl-warmup", type=int, default=None)
    parser.add_argument("--sdxl-steps", type=int, default=None)
    parser.add_argument("--layers", type=int, default=16, help="LLM decoder layers (Llama-3.2-1B: 16)")
    parser.add_argument("--skip-llm", action="store_true")
    parser.add_argument("--skip-sdxl", action="store_true")
    parser.add_argument("--skip-wan", action="store_true")
    parser.add_argument("--wan-warmup", type=int, default=None)
    parser.add_argument("--wan-steps", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every diffusion toolkit run (train.compile_regions=blocks, ...)")
    parser.add_argument("--no-plain-sdxl", action="store_true", help="leave out the plain SDXL loop")
    parser.add_argument("--no-plain-compiled", action="store_true",
                        help="leave out the plain LLM loop with each decoder layer compiled")
    parser.add_argument("--fsdp", action="store_true",
                        help="also: per-GPU memory of device.distributed=ddp vs fsdp on N GPUs for a 12B-class base "
                             "(bench/llm.py's nemo-12b shape; tiny:llm with --tiny)")
    parser.add_argument("--fsdp-steps", type=int, default=4)
    parser.add_argument("--fsdp-whole-state", action="store_true",
                        help="with --fsdp: also fsdp with device.shard_optimizer=false (what sharding the LoRA "
                             "optimizer state saves per GPU)")
    parser.add_argument("--fsdp-gathered", action="store_true",
                        help="with --fsdp: also fsdp-whole-state with device.fsdp_embeddings=gathered (the input "
                             "embeddings gathered whole, as FSDP2 does, instead of looked up in the shards)")
    parser.add_argument("--fsdp-offload", action="store_true",
                        help="with --fsdp: also fsdp with the optimizer state sharded and train.checkpoint_offload=true")
    parser.add_argument("--stacks", default="toolkit,plain,plain-compiled",
                        help="which stacks to run (comma-separated; plain-compiled: LLM only; toolkit-ddp: the "
                             "toolkit's diffusion runs with device.gradient_sync=ddp instead of auto)")
    parser.add_argument("--counts", default=None, help="GPU counts to run (comma-separated; default: 1 and --gpus)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for one run")
    parser.add_argument("--out", type=Path, default=None, help="write every measurement here (JSON)")
    parser.add_argument("--logs", type=Path, default=None, help="copy the runs' logs into this folder")
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a new temporary one)")
    # internal: one rank of the plain loop
    parser.add_argument("--plain-worker", choices=("llm", "sdxl", "wan"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    for name in ("warmup", "steps", "batch", "size", "compile"):
        parser.add_argument(f"--worker-{name}", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_worker:
        plain_worker(args)
        return

    tiny, n = args.tiny, args.gpus
    stacks = set(args.stacks.split(","))
    counts = sorted({int(c) for c in args.counts.split(",")}) if args.counts else sorted({1, n})
    llm_warmup = args.llm_warmup or (2 if tiny else 10)
    llm_steps = args.llm_steps or (3 if tiny else 20)
    sdxl_warmup = args.sdxl_warmup or (2 if tiny else 5)
    sdxl_steps = args.sdxl_steps or (3 if tiny else 10)
    llm_batch, seq = (2, 64) if tiny else (4, 2048)
    sdxl_batch, px = 2, (64 if tiny else 1024)
    if not tiny and torch.cuda.device_count() < n:
        sys.exit(f"--gpus {n}: only {torch.cuda.device_count()} GPU(s) visible (use --tiny on a machine without)")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["TOOLKIT_CACHE"] = str(work / "cache")
    if tiny:  # one thread per process for every run (the launchers set this for N > 1 only): comparable CPU rates
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    device = "CPU (gloo), tiny models" if tiny else f"{n} x {torch.cuda.get_device_name()}"
    print(f"device: {device}; torch {torch.__version__}; work folder {work}", flush=True)
    results: dict = {"device": device, "torch": torch.__version__, "llm": {}, "sdxl": {}, "wan": {}, "fsdp": {}}
    started = time.perf_counter()
    tiny_overrides = ["train.precision=fp32", "device.backend=cpu"] if tiny else []

    def measure(section: str, rows: dict, stack: str, gpus: int, fn) -> None:
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as err:  # one failed run does not stop the others
            msg = str(err) if isinstance(err, RunFailed) else traceback.format_exc()
            r = {"stack": stack, "gpus": gpus, "error": msg}
            print(f"  {section} {stack} {gpus} GPU(s): FAILED\n{msg}", flush=True)
        else:
            print(f"  {section} {stack} {gpus} GPU(s): {r['units_per_s']:,.1f}/s, peak GiB {gib(r['peak_gib'])}, "
                  f"rank diff {r.get('rank_max_diff', '-')}, {time.perf_counter() - t0:.0f}s", flush=True)
        rows[(stack, gpus)] = r
        results[section][f"{stack}-{gpus}"] = r
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))

    llm_rows: dict = {}
    if not args.skip_llm:
        import llm as bench_llm   # bench/llm.py: the model and data writers

        t0 = time.perf_counter()
        if tiny:
            from toolkit.tiny import resolve_model_path
            model_dir = Path(resolve_model_path("tiny:llm"))
        else:
            model_dir = work / "llm"
            bench_llm.write_model(model_dir, layers=args.layers)
        data = work / "llm.jsonl"
        bench_llm.write_data(data, rows=llm_batch * n * (llm_warmup + llm_steps) + 16)
        print(f"LLM model and data written in {time.perf_counter() - t0:.0f}s", flush=True)
        overrides = [f"model.name_or_path={model_dir}", f"data.path={data}", f"data.max_seq_len={seq}",
                     f"train.batch_size={llm_batch}", *tiny_overrides]
        for gpus in counts:
            if "toolkit" in stacks:
                measure("llm", llm_rows, "toolkit", gpus, lambda: toolkit_run(
                    "llm", LLM_CONFIG, overrides, work, gpus, llm_warmup, llm_steps, llm_batch * seq, args.timeout))
            if "plain" in stacks:
                measure("llm", llm_rows, "plain", gpus, lambda: plain_run(
                    "llm", model_dir, work, gpus, llm_warmup, llm_steps, llm_batch, seq, tiny, args.timeout))
            if "plain-compiled" in stacks and not args.no_plain_compiled:
                measure("llm", llm_rows, "plain-compiled", gpus, lambda: plain_run(
                    "llm", model_dir, work, gpus, llm_warmup, llm_steps, llm_batch, seq, tiny, args.timeout, True))

    sdxl_rows: dict = {}
    if not args.skip_sdxl:
        t0 = time.perf_counter()
        if tiny:
            from toolkit.tiny import resolve_model_path
            model_dir = Path(resolve_model_path("tiny:sdxl"))
        else:
            model_dir = work / "sdxl"
            if not (model_dir / "model_index.json").is_file():  # a --work folder reused: written by the last run
                write_sdxl(model_dir)
        images = work / "images"
        write_images(images, count=sdxl_batch * n * (sdxl_warmup + sdxl_steps), side=px)  # no epoch ends mid-run
        print(f"SDXL pipeline and images written in {time.perf_counter() - t0:.0f}s", flush=True)
        # compiled as train.compile=auto compiles SDXL for a run of 1,000 steps or more (the CPU: eager)
        overrides = [f"model.name_or_path={model_dir}", f"data.path={images}", f"data.resolution={px}",
                     f"train.batch_size={sdxl_batch}", f"train.compile={not tiny}", *tiny_overrides, *args.set]
        for gpus in counts:
            for stack, extra in (("toolkit", []), ("toolkit-ddp", ["device.gradient_sync=ddp"])):
                if stack in stacks and (gpus > 1 or stack == "toolkit"):
                    measure("sdxl", sdxl_rows, stack, gpus, lambda: toolkit_run(
                        f"sdxl-{stack}", SDXL_CONFIG, overrides + extra, work, gpus, sdxl_warmup, sdxl_steps,
                        sdxl_batch, args.timeout))
            if "plain" in stacks and not args.no_plain_sdxl:
                measure("sdxl", sdxl_rows, "plain", gpus, lambda: plain_run(
                    "sdxl", model_dir, work, gpus, sdxl_warmup, sdxl_steps, sdxl_batch, px, tiny, args.timeout))

    wan_rows: dict = {}
    if not args.skip_wan:
        wan_rows = wan_scaling(args, work, counts, stacks, tiny, tiny_overrides, measure)

    fsdp_rows: dict = {}
    if args.fsdp:
        fsdp_rows = fsdp_memory(args, work, n, tiny, tiny_overrides, measure)

    print(f"\n== {device}; torch {torch.__version__}; whole run {time.perf_counter() - started:.0f}s ==")
    print("throughput: the timed steps' time (toolkit: the steps_per_s of its logs/metrics.jsonl records, timed by "
          "CUDA events; plain: GPU synchronised at both ends)")
    if llm_rows:
        shape = "tiny:llm" if tiny else f"Llama-3.2-1B shape ({args.layers} layers)"
        print_table(f"LLM: {shape}, LoRA r=16 all-linear, {'fp32, AdamW' if tiny else 'bf16, fused AdamW'}, "
                    f"{llm_batch} x {seq} tokens per GPU; {llm_warmup} warm-up + {llm_steps} timed steps",
                    "tokens", llm_rows, n)
    if sdxl_rows:
        shape = "tiny:sdxl" if tiny else "SDXL-base-shaped UNet (2.6B)"
        print_table(f"SDXL: {shape}, LoRA r=16 attention, {'fp32, AdamW' if tiny else 'bf16, fused AdamW'}, {px} px, "
                    f"batch {sdxl_batch} per GPU; {sdxl_warmup} warm-up + {sdxl_steps} timed steps"
                    + ("; plain loop left out (--no-plain-sdxl)" if args.no_plain_sdxl else ""),
                    "images", sdxl_rows, n)
    if wan_rows:
        w = wan_workload(tiny)
        print_table(f"Wan 2.1: {'tiny' if tiny else '1.3B'} transformer, LoRA r=16, {w['frames']} x {w['height']} x "
                    f"{w['width']}, 1 clip per GPU, {'fp32' if tiny else 'bf16'}, fused AdamW; the plain loop "
                    "checkpointed with each block compiled", "clips", wan_rows, n)
    if fsdp_rows:
        print_fsdp(fsdp_rows, "tiny:llm" if tiny else "nemo-12b shape (12.2B)", n)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.log"):
            shutil.copy(log, args.logs / log.name)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
