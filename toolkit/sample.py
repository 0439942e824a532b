"""`sample`: images, video or text from a run's LoRA, with the run's own base model and sample settings.

    python -m toolkit sample outputs/my_run                        # final/ (or, while training, the latest checkpoint)
    python -m toolkit sample outputs/my_run --checkpoint 200       # checkpoints/step-000200
    python -m toolkit sample outputs/my_run --prompt "a red fox" --prompt "[trigger] at night" --seed 7
    python -m toolkit sample outputs/my_run sample.num_inference_steps=30 device.backend=cpu

The run's resolved config (RUN_DIR/config.yaml) gives the family, base model and sample settings; command-line
key=value overrides may change only what a resumed run may change (sample.*, device.*, ...: nothing that alters
the trained model). The LoRA files are copied first (train/lora_source.py) and loaded through the family's own
loader (Adapter.load_lora); the adapter then samples exactly as the trainer does at a sample step, into
RUN_DIR/samples/cli-<time>-<final|step-N>/ (a new folder; nothing there is overwritten). The run's lock is not
taken, so a run that is still training can be sampled, on another device or the same one if it has the room.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from toolkit.disk import disk_full_named
from toolkit.errors import UserError


def new_output_folder(run_dir: Path, tag: str, out: Path | None) -> Path:
    """The folder samples go to, created empty: `out` (which must not hold anything), or a new
    samples/cli-<time>-<tag>/ in the run folder."""
    if out is not None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UserError(f"sample --out: {out} exists and is not an empty folder\n  fix: choose a new folder")
        out.mkdir(parents=True, exist_ok=True)
        return out
    stem = f"cli-{time.strftime('%Y%m%d-%H%M%S')}-{tag}"
    samples = run_dir / "samples"
    samples.mkdir(exist_ok=True)
    for n in range(1000):
        folder = samples / (stem if n == 0 else f"{stem}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise UserError(f"sample: could not create a new folder {samples / stem}-N")


def load_sampling_run(run_dir: Path, overrides: list[str], prompts: list[str] | None, seed: int | None,
                      log: Callable[[str], None] = print):
    """The run's resolved config with the overrides (resume-safe keys only), prompts and seed applied; with no
    prompts there, the training data's (toolkit/sample_prompts.py)."""
    from toolkit.plan.run import load_run
    from toolkit.train.resume import is_resume_safe

    config = run_dir / "config.yaml"
    if not config.is_file():
        raise UserError(f"{run_dir}: no config.yaml (the resolved config every run writes at its start)\n  fix: give "
                        "a run folder written by `train`")
    refused = [o for o in overrides if not is_resume_safe(o.split("=", 1)[0].strip())]
    if refused:
        raise UserError(f"sample: {', '.join(refused)}: only settings that do not change the trained model may be "
                        "overridden (sample.*, device.*, save.*, log.*, ...)\n  fix: drop them; the run's own "
                        "model and network settings are used")
    # --prompt and --seed as the command line's last layer: the config is read-only once loaded
    extra = [prompts_override(prompts)] if prompts else []
    extra += [f"sample.seed={seed}"] if seed is not None else []
    from toolkit.preflight import sample_checks

    run = load_run([config], overrides + extra, check_paths=sample_checks)
    if not list(run.cfg.sample.prompts):
        from toolkit.sample_prompts import prompts_from_training_data

        found = prompts_from_training_data(run.cfg, config, log)
        run = load_run([config], overrides + extra + [prompts_override(found)], check_paths=sample_checks)
    return run


def prompts_override(prompts: list[str]) -> str:
    """sample.prompts=[...] as a command-line layer that gives back each prompt as written: any character (emoji
    too: no surrogate escapes), and `${` kept as text, not read as an OmegaConf interpolation."""
    import json

    return f"sample.prompts={json.dumps([p.replace('${', chr(92) + '${') for p in prompts], ensure_ascii=False)}"


def sample_run(run_dir: str | Path, step: int | None = None, prompts: list[str] | None = None,
               seed: int | None = None, overrides: list[str] = (), out: str | Path | None = None,
               log: Callable[[str], None] = print) -> list[Path]:
    """Sample from the run's final/ LoRA (or its checkpoint of `step`); returns the files written."""
    from toolkit.models import build_adapter
    from toolkit.models.base import DTYPES, Runtime
    from toolkit.train.lora_source import LoraSnapshot, run_lora
    from toolkit.rng import seed_everything

    run_dir = Path(run_dir)
    source = run_lora(run_dir, step, log)  # a missing folder, step or LoRA is reported before any model loads
    run = load_sampling_run(run_dir, list(overrides), prompts, seed, log)
    cfg = run.cfg
    with LoraSnapshot(source) as lora:  # copied now: the run may rotate its checkpoints while the model loads
        runtime = Runtime(device=torch.device(run.device.torch_device), info=run.device,
                          base_dtype=DTYPES[cfg.model.dtype], compute_dtype=DTYPES[cfg.train.precision],
                          run_dir=run_dir, log=log)
        log(f"sample: {cfg.model.family} {cfg.model.name_or_path} with the LoRA of {source.label}, on "
            f"{run.device.summary()}")
        seed_everything(cfg.run.seed)
        adapter = build_adapter(cfg, runtime)
        adapter.load()
        adapter.load_lora(lora.path, label=source.label)
    adapter.prepare_sampling()
    out_dir = new_output_folder(run_dir, source.tag, Path(out) if out is not None else None)
    try:
        with torch.no_grad(), disk_full_named("samples", out_dir, fix="free space on that disk, or give --out DIR "
                                              "on another disk, then run the same command"):
            files = adapter.sample(out_dir)
            (out_dir / "source.txt").write_text(f"{source.label}\nseed {cfg.sample.seed}\n", encoding="utf-8")
    except BaseException:
        if out is None and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # a failed sample leaves no empty folder behind in the run's samples (--out: the user's)
        raise
    log(written_files_line(out_dir))
    from toolkit.train.report import refresh_samples

    report = refresh_samples(run_dir) if out is None else None  # --out: a folder of the user's, not the run's
    if report is not None:
        log(f"report: {report} (its samples section now shows these too)")
    return files


def written_files_line(folder: Path, shown: int = 8) -> str:
    """'sample: N files in FOLDER: a, b, ...': every file the folder holds (the samples, grid, prompts and
    source.txt), named up to `shown`."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    listed = ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")
    return f"sample: {len(names)} file{'s' if len(names) != 1 else ''} in {folder}: {listed}"
