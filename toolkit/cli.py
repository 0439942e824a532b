"""Command line: `python -m toolkit <command>`. User errors print one paragraph and exit 2, no traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

from toolkit.errors import UserError

USAGE_EXAMPLES = """examples:
  ./start_toolkit.sh train configs/examples/quickstart_llm.yaml
  ./start_toolkit.sh train my.yaml train.lr=5e-5 train.steps=4000
  ./start_toolkit.sh train my.yaml --gpus all          # one process per visible GPU
  ./start_toolkit.sh validate my.yaml
  ./start_toolkit.sh sample outputs/my_run --checkpoint 200 --prompt "a red fox"
  ./start_toolkit.sh presets
  ./start_toolkit.sh doctor
  ./start_toolkit.sh import-aitk job.yaml > config.yaml   # from an ai-toolkit job
  ./start_toolkit.sh caption data/my_images --prefix "sks, "   # captions for the images that have none
  ./start_toolkit.sh ui                                   # the web UI on http://127.0.0.1:8642/
"""


def _quiet_libraries() -> None:
    """Keep third-party progress bars and advisory warnings out of the training output."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Library deprecation notices say nothing a user of the toolkit can act on.
    warnings.filterwarnings("ignore", category=FutureWarning)
    # PEFT's note that a torchao LoRA layer cannot be merged: the toolkit never merges into a quantized base.
    warnings.filterwarnings("ignore", message=".*TorchaoLoraLinear was instantiated without")
    # bitsandbytes' 8-bit matmul notes, on every call, that bf16 inputs run in fp16: how LLM.int8 works.
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
    for name in ("bitsandbytes", "torchao", "torch.utils._pytree"):  # import-time notices of optional kernels
        logging.getLogger(name).setLevel(logging.ERROR)


def cmd_train(args: argparse.Namespace) -> int:
    from toolkit import launch, startup

    startup.CLOCK.profile_from_env()
    from toolkit.plan.run import load_run, split_args

    files, overrides = split_args(args.config)
    # A worker started by --gpus (a parent like this one), torchrun or accelerate launch trains as its rank.
    worker = launch.launched_worker()
    main_process = os.environ.get("RANK", "0") == "0"
    if worker and main_process and launch.launch_requested(args):
        print(f"note: already one of {os.environ.get('WORLD_SIZE', '?')} launched processes: the launch flags "
              "(--gpus, --nnodes, ...) are ignored", file=sys.stderr)
    single = launch.accelerate_single_process_note()
    if single:
        print(single, file=sys.stderr)
    from toolkit.preflight import path_checks

    # In a launching parent a config error stops here, before any worker starts. The data, model and output
    # locations are checked with the config, before any model loads; the output location by the process that
    # owns the run folder.
    run = load_run(files, overrides, check_paths=path_checks(check_output=main_process))
    startup.mark("imports and config")
    if not worker and launch.launch_requested(args):
        visible = 0 if run.device.backend == "cpu" else run.device.device_count
        plan = launch.plan_from_args(args, visible, run.device.backend)
        if plan.several or plan.max_restarts:
            return launch.launch_train(plan, args.config, fresh=args.fresh)
    from toolkit.train.trainer import Trainer

    startup.mark("trainer imports")
    fresh = args.fresh
    restart = launch.restart_number()
    if restart:  # the launcher restarted every process after one died: go on from what the run saved
        from datetime import timedelta

        from toolkit.train.distributed import join_restarted_group

        fresh = False
        join_restarted_group(run.device.backend, timedelta(seconds=run.cfg.device.collective_timeout))
    if main_process:
        if restart:
            print(f"restart {restart}: the launcher restarted every process after one stopped; resuming from the "
                  "newest checkpoint that verifies" + (" (--fresh applied to the first start only)" if args.fresh
                                                       else ""), file=sys.stderr)
        _print_decisions(run)
    Trainer(run, fresh=fresh, restarted=bool(restart)).run()
    return 0


def _print_notes(run) -> None:
    """What the config's layers noted while read (a setting read by its old name)."""
    for layer in run.layers:
        for note in layer.notes:
            print(f"note: {note}", file=sys.stderr)


def _print_decisions(run) -> None:
    _print_notes(run)
    print(f"device: {run.device.summary()}", file=sys.stderr)
    for reason in run.device.reasons:
        print(f"  {reason}", file=sys.stderr)
    print(f"  {run.preset_reason}", file=sys.stderr)
    for line in run.plan.lines("static"):
        print(f"  {line}", file=sys.stderr)


def cmd_validate(args: argparse.Namespace) -> int:
    from toolkit.plan.run import load_run, split_args

    from toolkit.preflight import path_checks

    files, overrides = split_args(args.config)
    run = load_run(files, overrides, check_paths=path_checks())
    _print_notes(run)
    rows = run.provenance()
    width_key = max(len(r[0]) for r in rows)
    width_value = min(max(len(r[1]) for r in rows), 40)
    print(f"# device: {run.device.summary()}; {run.preset_reason}")
    for key, value, source in rows:
        print(f"{key:<{width_key}} = {value:<{width_value}}  # {source}")
    print("\n# the plan's static stage: what each auto setting is before the model loads; the trainer settles the "
          "rest\n# (the model's size and memory plan, measurements on the GPU) and writes the whole plan to plan.json")
    for line in run.plan.lines("static"):
        print(f"#   {line}")
    print(f"\nconfig OK ({len(files)} file{'s' if len(files) != 1 else ''}, {len(overrides)} override"
          f"{'s' if len(overrides) != 1 else ''})", file=sys.stderr)
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from toolkit.device.detect import detect_device
    from toolkit.config.presets import describe_presets

    print(describe_presets(detect_device()))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from toolkit.doctor import run_doctor

    return run_doctor()


def cmd_merge(args: argparse.Namespace) -> int:
    from toolkit.merge import merge_lora

    merge_lora(args.adapter, args.out_dir, dtype=args.dtype, log=lambda msg: print(msg, file=sys.stderr), step=args.step)
    return 0


def cmd_import_aitk(args: argparse.Namespace) -> int:
    from toolkit.aitk import render, translate_job

    translation = translate_job(args.job)
    print(render(translation, args.job), end="")
    for skipped in translation.skipped:
        print(f"not translated: {skipped.key} = {skipped.value!r}: {skipped.reason}", file=sys.stderr)
    for note in translation.notes:
        print(f"changed: {note}", file=sys.stderr)
    if translation.as_here:
        print(f"as here: {', '.join(s.key for s in translation.as_here)} (nothing to set: this toolkit does that "
              "anyway; the reasons are at the end of the config)", file=sys.stderr)
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from toolkit.sample import sample_run

    sample_run(args.run_dir, step=args.checkpoint, prompts=args.prompt, seed=args.seed, overrides=args.overrides,
               out=args.out, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    return 0


def cmd_caption(args: argparse.Namespace) -> int:
    from toolkit.caption import CaptionJob, caption_folder, summary

    job = CaptionJob(Path(args.folder), model=args.model, prompt=args.prompt, prefix=args.prefix,
                     caption_ext=args.caption_ext, replace=args.replace, max_new_tokens=args.max_new_tokens,
                     max_pixels=args.max_pixels, device=args.device, revision=args.revision)
    report = caption_folder(job, lambda msg: print(msg, file=sys.stderr, flush=True))
    print(summary(job, report), file=sys.stderr)
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    from toolkit.ui.serve import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="start_toolkit.sh", description="YAML-driven LoRA training toolkit.",
                                     epilog=USAGE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="train a LoRA (resumes when the run folder has checkpoints)")
    train.add_argument("config", nargs="+", metavar="CONFIG.yaml|key=value",
                       help="YAML files (merged in order) and key=value overrides")
    train.add_argument("--fresh", action="store_true",
                       help="start over: move an existing run folder aside (it is never deleted)")
    from toolkit.launch import add_launch_arguments

    add_launch_arguments(train)
    train.set_defaults(func=cmd_train)
    validate = sub.add_parser("validate", help="print the merged config and where each value came from")
    validate.add_argument("config", nargs="+", metavar="CONFIG.yaml|key=value")
    validate.set_defaults(func=cmd_validate)
    sub.add_parser("presets", help="list the arch presets and which one applies here").set_defaults(func=cmd_presets)
    sub.add_parser("doctor", help="check the environment: backend, arch, versions, ROCm variables, bitsandbytes"
                   ).set_defaults(func=cmd_doctor)
    merge = sub.add_parser("merge", help="fold a trained LLM LoRA into its base and save a full model with its tokenizer")
    merge.add_argument("adapter", metavar="RUN_DIR_OR_ADAPTER_DIR",
                       help="a run folder (its final/), an adapter folder or a checkpoint folder")
    merge.add_argument("out_dir", metavar="OUT_DIR", help="new folder for the merged model")
    merge.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                       help="dtype of the saved weights (auto: the base model's)")
    merge.add_argument("--step", type=int, default=None, help="merge the run folder's checkpoint of this step")
    merge.set_defaults(func=cmd_merge)
    aitk = sub.add_parser("import-aitk", help="translate an ai-toolkit job file into this toolkit's config (YAML on "
                          "stdout; what does not translate, on stderr)")
    aitk.add_argument("job", metavar="JOB.yaml", help="an ai-toolkit job file (config.process[0] is translated)")
    aitk.set_defaults(func=cmd_import_aitk)
    sample = sub.add_parser("sample", help="images, video or text from a run's LoRA (final/ or a checkpoint) with the "
                            "run's own model and sample settings")
    sample.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (run.output_dir)")
    sample.add_argument("overrides", nargs="*", metavar="key=value",
                        help="sample.* or device.* settings for this sampling (e.g. sample.num_inference_steps=30)")
    sample.add_argument("--checkpoint", type=int, default=None, metavar="STEP",
                        help="the LoRA of checkpoints/step-STEP instead of final/")
    sample.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="a prompt (repeat for more); default: the run's sample.prompts, else (an llm trained "
                        "with train.objective) the first 3 prompts of its training data")
    sample.add_argument("--seed", type=int, default=None, help="sampling seed (default: the run's sample.seed)")
    sample.add_argument("--out", default=None, metavar="DIR",
                        help="a new folder for the samples (default: RUN_DIR/samples/cli-<time>-<final|step-N>/)")
    sample.set_defaults(func=cmd_sample)
    caption = sub.add_parser("caption", help="write a caption file for each image of a training folder that has none, "
                             "with a vision-language model (Qwen2.5-VL, Qwen3-VL)")
    add_caption_arguments(caption)
    caption.set_defaults(func=cmd_caption)
    ui = sub.add_parser("ui", help="a local web UI: start, watch and compare runs (localhost; other hosts need a token)")
    from toolkit.ui.serve import add_arguments as add_ui_arguments

    add_ui_arguments(ui)
    ui.set_defaults(func=cmd_ui)
    return parser


CAPTION_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"  # caption's default (here: --help stays free of torch)


def add_caption_arguments(caption: argparse.ArgumentParser) -> None:
    caption.add_argument("folder", metavar="FOLDER", help="the folder of training images (data.path)")
    caption.add_argument("--model", default=CAPTION_MODEL, help=f"a Hub id or folder (default: {CAPTION_MODEL})")
    caption.add_argument("--prompt", default=None, help="what the model is asked about each image (default: a "
                         "training-caption instruction: subject, setting, composition, light, style)")
    caption.add_argument("--prefix", default="", help='text before each caption, e.g. a trigger word: "sks, "')
    caption.add_argument("--caption-ext", default=".txt", help="caption file suffix, as data.caption_ext (.txt)")
    caption.add_argument("--replace", action="store_true",
                         help="caption images that have a caption too (each old one kept as NAME.txt.old-<time>)")
    caption.add_argument("--max-new-tokens", type=int, default=160, help="longest caption, in tokens (160)")
    caption.add_argument("--max-pixels", type=int, default=None,
                         help="largest image area the model sees (default: the model's image processor's)")
    caption.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:1, ...")
    caption.add_argument("--revision", default=None, help="the model's Hub revision")


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    from toolkit.paths import compiled_code_folders
    from toolkit.startup import share_package_map

    share_package_map()  # before transformers and diffusers are imported

    compiled_code_folders()  # before torch is imported
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    # key=value (and for train/validate YAML files) after the options, as the README writes them: argparse gives a
    # positional list only the words before the first option
    later = rest and not any(a.startswith("-") for a in rest)
    if later and getattr(args, "command", None) == "sample" and all("=" in a for a in rest):
        args.overrides += rest
    elif later and getattr(args, "command", None) in ("train", "validate"):
        args.config += rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from toolkit.train.signals import StopRequested

    try:
        return args.func(args)
    except UserError as err:
        if str(err):  # empty: another process of the run failed and printed its error
            print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except StopRequested as stop:
        print(str(stop), file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a full disk under a writer that no command names itself (toolkit/disk.py)
        from toolkit.disk import as_disk_full

        full = as_disk_full(err, Path.cwd())
        if full is None:
            raise
        print(f"error: {full}", file=sys.stderr)
        return full.exit_code


if __name__ == "__main__":
    sys.exit(main())
