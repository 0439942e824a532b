"""How long train.compile takes, cold (nothing compiled before) and warm (a second run of the same model and settings,
its compiled code kept under the toolkit's cache folder), and the steady step time it buys, per workload.

    python bench/compile_times.py [--jobs sd15:whole,sd15:blocks,sdxl:whole,sdxl:blocks] [--parallel]
                                  [--steps 8 --warmup 3] [--out results.json]
    python bench/compile_times.py --tiny --jobs sd15:whole,sd15:blocks      # a check on the CPU

A job is `workload:regions`: a bench/diffusion.py workload (sd15, sdxl, flux, wan; the real shapes, random weights)
and, for the UNet families, train.compile_regions (whole: the UNet as one graph; blocks: its transformer and resnet
blocks one by one; the DiT families are always compiled block by block: give `blocks`). Each job runs the toolkit
twice in fresh processes with one TOOLKIT_CACHE of its own: the first run finds nothing compiled (cold), the second
finds what the first kept (warm). Per run: the first step's time (compilation included), the seconds from the
process's start to the end of its first step, and the steady s/step over the timed steps (metrics.jsonl). With
--parallel, groups of jobs separated by | run at once, each group on a GPU of its own (CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

STARTUP = re.compile(r"start-up: .*")
FIRST_STEP = re.compile(r"train\.compile: the first step took ([\d.]+) s \(compilation included\), ([\d.]+) s after")


def job_config(kind: str, regions: str, folder: Path, data: Path, tiny: bool) -> tuple[str, list[str], int]:
    """(config YAML, overrides, images per step) of a job, as bench/diffusion.py's toolkit row trains it."""
    import math

    from diffusion import workload

    w = workload(kind, tiny)
    config = (f"model: {{family: {w['family']}}}\nnetwork: {{rank: 16, alpha: 16}}\n"
              f"train: {{lr: 1.0e-4, precision: {'fp32' if tiny else 'bf16'}, optimizer: adamw}}\nsave: {{every: 0}}\n"
              "sample: {prompts: []}\nlog: {tensorboard: false}\n")
    overrides = [f"model.name_or_path={folder}", f"data.path={data}", f"train.batch_size={w['batch']}",
                 "train.compile=true"]
    if kind in ("sd15", "sdxl"):
        overrides += [f"data.resolution={w['size']}", "train.gradient_checkpointing=false",
                      f"train.compile_regions={regions}"]
    elif "frames" in w:
        overrides += [f"data.num_frames={w['frames']}", f"data.resolution={math.ceil(math.sqrt(w['height'] * w['width']))}",
                      "data.bucket_step=32"]
    else:
        overrides += [f"data.resolution={w['size']}"]
    if tiny:
        overrides.append("device.backend=cpu")
    return config, overrides, w["batch"]


def one_run(config: Path, overrides: list[str], out: Path, env: dict, steps: int, warmup: int, log: Path,
            timeout: float, profile: Path | None = None) -> dict:
    if profile is not None:  # the start-up only: the entry point to the end of the first step (toolkit/startup.py)
        env = dict(env, TOOLKIT_PROFILE_STARTUP=str(profile))
    cmd = [sys.executable, "-m", "toolkit", "train", str(config), *overrides, f"train.steps={warmup + steps}",
           f"run.output_dir={out}", f"log.every={warmup}", "--fresh"]
    started = time.perf_counter()
    with log.open("w") as handle:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: " + " | ".join(text.strip().splitlines()[-3:])}
    first = FIRST_STEP.search(text)
    records = {r["step"]: r for r in map(json.loads, (out / "logs" / "metrics.jsonl").read_text().splitlines())
               if "steps_per_s" in r}
    steady = records.get(warmup + steps, {}).get("steps_per_s")
    startup = STARTUP.search(text)
    result = {"first_step_s": float(first.group(1)) if first else None,
            "first_step_after_start_s": float(first.group(2)) if first else None,
            "s_per_step": 1 / steady if steady else None, "process_s": time.perf_counter() - started,
            "startup": startup.group(0) if startup else None,
            "notes": [line for line in text.splitlines() if line.startswith(("blocks:", "train.compile:", "latents:",
                                                                            "text embeddings:", "attention:"))]}
    if profile is not None and profile.is_file():  # where the start-up's Python time goes, the slowest calls first
        import io
        import pstats

        listing = io.StringIO()
        stats = pstats.Stats(str(profile), stream=listing).sort_stats("cumulative")
        stats.print_stats(120)
        stats.print_callers(r"\(compile\)|_register_to_dispatcher|packages_distributions|from_pretrained|add_adapter")
        profile.with_suffix(".txt").write_text(listing.getvalue())
        result["profile"] = str(profile.with_suffix(".txt"))
    return result


def run_job(job: str, gpu: int | None, args, work: Path, results: dict) -> None:
    from diffusion import workload
    from diffusion_models import write_clip, write_images, write_pipeline

    kind, regions = job.split(":")
    place = work / job.replace(":", "-")
    place.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOOLKIT_CACHE=str(place / "cache"),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    w = workload(kind, args.tiny)
    folder, data = place / "model", place / "data"
    try:
        write = [sys.executable, "-c", "import sys; sys.path[:0] = sys.argv[1:3]; from diffusion_models import "
                 "write_pipeline; write_pipeline(sys.argv[3], __import__('pathlib').Path(sys.argv[4]), sys.argv[5], "
                 "sys.argv[6] == '1')", str(REPO), str(BENCH), kind, str(folder),
                 "cpu" if args.tiny else "cuda", "1" if args.tiny else "0"]
        if not (folder / "model_index.json").is_file():  # a kept --work folder has it from an earlier call
            subprocess.run(write, env=env, check=True, capture_output=True, timeout=args.timeout)
        if "frames" in w:
            write_clip(data, w["frames"], w["height"], w["width"])
        else:
            write_images(data, max(8, 2 * w["batch"]), w["size"])
        config_yaml, overrides, _ = job_config(kind, regions, folder, data, args.tiny)
        config = place / "job.yaml"
        config.write_text(config_yaml)
        row = {}
        for phase in args.phases.split(","):  # cold first: warm and profile read what it kept
            row[phase] = one_run(config, overrides, place / f"run-{phase}", env, args.steps, args.warmup,
                                 place / f"{phase}.log", args.timeout,
                                 profile=place / "startup-profile.prof" if phase == "profile" else None)
        results[job] = row
    except Exception as err:  # noqa: BLE001 (one job failing leaves the others)
        results[job] = {"error": f"{type(err).__name__}: {err}"}
    print(f"  {job}: {json.dumps(results[job])}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="sd15:whole,sd15:blocks,sdxl:whole,sdxl:blocks")
    parser.add_argument("--parallel", action="store_true",
                        help="with --jobs 'a,b|c,d': a then b on GPU 0 while c then d run on GPU 1, and so on")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--phases", default="cold,warm",
                        help="runs per job, in order: cold (an empty cache; give it first), warm (what cold kept), "
                             "profile (a warm run under cProfile: JOB/warm.txt lists where its Python time went)")
    parser.add_argument("--work", type=Path, default=None,
                        help="the jobs' folder (models, data, caches), kept: a later --phases warm reuses it")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    groups = [group.split(",") for group in args.jobs.split("|")]  # "a,b|c": a then b on one GPU, c on another
    jobs = [job for group in groups for job in group]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-compile-"))
    name = "CPU" if args.tiny else torch.cuda.get_device_name()
    print(f"device: {name}; torch {torch.__version__}; jobs {jobs}", flush=True)
    results: dict = {}
    if args.parallel:  # each group of jobs on a GPU of its own, the groups at once
        if not args.tiny and torch.cuda.device_count() < len(groups):
            sys.exit(f"--parallel: {len(groups)} groups of jobs, {torch.cuda.device_count()} GPUs")

        def on_gpu(index: int) -> None:
            for job in groups[index]:
                run_job(job, None if args.tiny else index, args, work, results)

        threads = [threading.Thread(target=on_gpu, args=(i,)) for i in range(len(groups))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for job in jobs:
            run_job(job, None, args, work, results)
    print(f"\n{'job':<14} {'run':<8} {'first step':>11} {'from start':>11} {'s/step':>8}")
    for job in jobs:
        r = results.get(job, {})
        if "error" in r:
            print(f"{job:<14} FAILED: {r['error']}")
            continue
        for phase, run in r.items():
            if "error" in run:
                print(f"{job:<14} {phase:<8} FAILED: {run['error']}")
                continue
            shown = [f"{v:>9.1f} s" if v is not None else f"{'-':>11}" for v in
                     (run["first_step_s"], run["first_step_after_start_s"])]
            print(f"{job:<14} {phase:<8} {shown[0]} {shown[1]} {run['s_per_step'] or 0:>8.3f}")
            if run.get("startup"):
                print(f"{'':<14}   {run['startup']}")
    if args.out:
        args.out.write_text(json.dumps({"device": name, "torch": torch.__version__, "steps": args.steps,
                                        "warmup": args.warmup, "jobs": results}, indent=1))


if __name__ == "__main__":
    main()
