"""DPO and GRPO LoRA training beside TRL's trainers, plain and as unsloth patches them, in one run on one GPU,
every row in a fresh process of its own.

    python bench/llm_objectives.py --objective dpo [--rows toolkit,trl,unsloth-trl] [--steps 20 --warmup 5]
    python bench/llm_objectives.py --objective grpo [--steps 10 --warmup 3] [--out result.json]
    python bench/llm_objectives.py --objective dpo --tiny      # CPU check: tiny:llm, the toolkit rows and trl
    python bench/llm_objectives.py --objective grpo --rows toolkit --set model.fuse_projections=true  # a variant
    python bench/llm_objectives.py --objective grpo --rows toolkit,toolkit-ckpt,toolkit-geneager,trl,unsloth-trl

Rows:
  toolkit      the toolkit's Trainer, train.objective=dpo|grpo, its defaults on a GPU (train.compile and
               model.kernels auto: the chunked log-probs, no full logits; grpo: train.generation auto, compiled on
               NVIDIA GPUs), fused AdamW
  toolkit-ckpt the toolkit row with train.gradient_checkpointing=true (unsloth's rows checkpoint by default)
  toolkit-gencompiled  grpo only: the toolkit row with train.generation=compiled (the LoRA merged into a copy,
               a static KV cache, the decode step compiled with CUDA graphs: models/compiled_generation.py); on an
               NVIDIA GPU the toolkit row gives the same where the copy fits, the CPU decodes eagerly
  toolkit-geneager  grpo only: the toolkit row with train.generation=eager (HF generate on the trained network)
  trl          TRL's DPOTrainer / GRPOTrainer with a PEFT LoRA, fused AdamW, no gradient checkpointing
  unsloth-trl  the same TRL trainer on unsloth's FastLanguageModel (unsloth patches TRL's trainers on import);
               runs from the carried archive (bench/device_packages.sh, --unsloth-path), as bench/peer_unsloth.py

The workload, the same for every row (random weights: bench/llm.py's --shape, Llama-3.2-1B by default; LoRA r=16,
alpha 16, no dropout, every linear layer of the decoder; bf16; lr 1e-5):
- dpo: 4 pairs a step, prompt 256 + completion 768 tokens (each sequence 1,024, chosen and rejected), beta 0.1,
  the sigmoid loss; the reference is the base with the adapter disabled, computed every step (TRL's default with
  a PEFT model; the toolkit's train.reference_logps=live).
- grpo: 4 prompts of 128 tokens a step, 8 completions each, sampled (temperature 1.0) to 256 new tokens (random
  weights almost never sample the end token, so each completion is that long), the length reward, a KL term
  (beta 0.04: a reference pass), one optimizer step per generation batch (TRL: steps_per_generation=1,
  num_iterations=1).
Prompts and completions are words that are one token each in the bench tokenizer, so every row reads the same
number of tokens (give or take the end token each stack appends).

Rates are over the timed steps: the toolkit's from its own step rate (CUDA events, bench/trainer_rate.py), TRL's
between a GPU synchronisation before step warmup + 1 and after the last step (a TrainerCallback). Peak memory is
torch.cuda.max_memory_allocated over the whole run. Units: dpo sequences (2 a pair) x 1,024 tokens; grpo
completions x 256 new tokens (the generation and the training step both in the time).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

ROWS = ("toolkit", "toolkit-ckpt", "toolkit-gencompiled", "toolkit-geneager", "trl", "unsloth-trl")
DEFAULT_ROWS = {"dpo": "toolkit,toolkit-ckpt,trl,unsloth-trl", "grpo": "toolkit,toolkit-ckpt,toolkit-geneager,trl,unsloth-trl"}
# The toolkit rows: the settings each adds to the toolkit's defaults.
TOOLKIT_ROWS = {"toolkit": [], "toolkit-ckpt": ["train.gradient_checkpointing=true"],
                "toolkit-gencompiled": ["train.generation=compiled"], "toolkit-geneager": ["train.generation=eager"]}
GENERATION_ROWS = ("toolkit-gencompiled", "toolkit-geneager")  # grpo's: dpo generates nothing
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# objective: (prompts or pairs a step, prompt tokens, completion tokens, completions per prompt)
WORKLOADS = {"dpo": dict(batch=4, prompt=256, completion=768, generations=1),
             "grpo": dict(batch=4, prompt=128, completion=256, generations=8)}
TINY = {"dpo": dict(batch=2, prompt=8, completion=16, generations=1),
        "grpo": dict(batch=2, prompt=8, completion=8, generations=4)}
LR, BETA_DPO, BETA_GRPO = 1e-5, 0.1, 0.04


def one_token_words(tokenizer) -> list[str]:
    """Words that the tokenizer encodes as one token each after a space, so that a text of n of them is n tokens
    (from its vocabulary: byte-level BPE marks a leading space with "Ġ")."""
    candidates = sorted(k[1:] for k in tokenizer.get_vocab() if k.startswith("\u0120") and k[1:].isalpha())
    single = [w for w in candidates if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    if len(single) < 4:
        raise RuntimeError(f"the bench tokenizer has too few one-token words: {single}")
    return single


def write_data(path: Path, objective: str, w: dict, rows: int, tokenizer) -> None:
    """JSONL in TRL's standard (not conversational) formats: prompt/chosen/rejected for dpo, prompt for grpo."""
    words = one_token_words(tokenizer)
    g = torch.Generator().manual_seed(0)

    def text(n: int) -> str:
        return "".join(" " + words[i] for i in torch.randint(len(words), (n,), generator=g).tolist())

    with path.open("w") as handle:
        for _ in range(rows):
            record = {"prompt": text(w["prompt"])}
            if objective == "dpo":
                record.update(chosen=text(w["completion"]), rejected=text(w["completion"]))
            handle.write(json.dumps(record) + "\n")


def units(objective: str, w: dict) -> tuple[int, int, str]:
    """(units a step, tokens a unit, the unit's name)."""
    if objective == "dpo":
        return 2 * w["batch"], w["prompt"] + w["completion"], "sequences"
    return w["batch"] * w["generations"], w["completion"], "completions"


# -- the rows (each in a process of its own) ---------------------------------------------------------------------

def toolkit_row(args, w: dict, model_dir: str, data: Path, work: Path, row: str) -> dict:
    from trainer_rate import trainer_rate

    seq = w["prompt"] + w["completion"]
    config = ("model: {family: llm}\nnetwork: {rank: 16, alpha: 16}\nsave: {every: 0}\nlog: {tensorboard: false}\n"
              f"train: {{lr: {LR}, gradient_checkpointing: false, objective: {args.objective}}}\n")
    overrides = [f"model.name_or_path={model_dir}", f"data.path={data}", f"data.max_seq_len={seq}",
                 f"train.batch_size={w['batch']}"]
    if args.objective == "dpo":
        overrides += [f"train.beta={BETA_DPO}", "train.reference_logps=live"]
    else:
        overrides += [f"train.kl_coef={BETA_GRPO}", f"train.num_generations={w['generations']}",
                      f"train.max_completion_length={w['completion']}", "train.reward=[length]",
                      "train.generation_temperature=1.0"]
    if args.tiny:
        overrides += ["device.backend=cpu", "train.precision=fp32"]
    else:
        overrides += ["train.precision=bf16"]
    overrides += TOOLKIT_ROWS[row] + args.set
    rate, peak = trainer_rate(config, overrides, work / f"run-{row}", "adamw", args.steps, args.warmup)
    return {"steps_per_s": rate, "peak_gib": peak}


class StepTimer:
    """A transformers TrainerCallback (made by timer_callback) timing the steps after `warmup`."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total, self.start, self.seconds = warmup, total, None, None

    def now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.warmup and self.start is None:
            self.start = self.now()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.total:
            self.seconds = self.now() - self.start


def timer_callback(warmup: int, total: int):
    from transformers import TrainerCallback

    return type("Timer", (StepTimer, TrainerCallback), {})(warmup, total)


def config_fields(config_class, wanted: dict) -> dict:
    """`wanted` limited to the fields this TRL version's config has (the dropped ones are printed)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_class)}
    dropped = sorted(set(wanted) - names)
    if dropped:
        print(f"{config_class.__name__}: no field {', '.join(dropped)} in this TRL; left out", file=sys.stderr)
    return {k: v for k, v in wanted.items() if k in names}


def length_reward(completions, **kwargs):
    """The toolkit's built-in length reward, as a TRL reward function (1 - |characters - 32| / 32)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 - abs(len(t) - 32) / 32 for t in texts]


def trl_row(args, w: dict, model_dir: str, data: Path, work: Path, unsloth: bool) -> dict:
    if unsloth:
        import unsloth as unsloth_module  # noqa: F401  (first: it patches transformers, peft and TRL on import)
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    seq = w["prompt"] + w["completion"]
    peft_config = None
    if unsloth:
        from unsloth import FastLanguageModel

        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=str(Path(model_dir).resolve()), max_seq_length=seq + 8, dtype=dtype, load_in_4bit=False,
            local_files_only=True, use_exact_model_name=True, use_gradient_checkpointing=False)
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                                 target_modules=TARGETS, use_gradient_checkpointing=False,
                                                 random_state=0)
    else:
        from peft import LoraConfig

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        if torch.cuda.is_available():
            model = model.cuda()
        peft_config = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = datasets.load_dataset("json", data_files=str(data), split="train")
    total = args.warmup + args.steps
    common = dict(output_dir=str(work / f"run-{'unsloth' if unsloth else 'trl'}"), max_steps=total,
                  learning_rate=LR, lr_scheduler_type="constant", logging_steps=max(1, total), save_strategy="no",
                  report_to=[], bf16=not args.tiny, use_cpu=args.tiny, optim="adamw_torch" if args.tiny else
                  "adamw_torch_fused", gradient_checkpointing=False, dataloader_num_workers=0, seed=0,
                  max_grad_norm=1.0, disable_tqdm=True)
    if args.objective == "dpo":
        config = trl.DPOConfig(**config_fields(trl.DPOConfig, dict(
            common, per_device_train_batch_size=w["batch"], beta=BETA_DPO, loss_type="sigmoid", max_length=seq + 8,
            precompute_ref_log_probs=False)))
        trainer_class, extra = trl.DPOTrainer, {}
    else:
        config = trl.GRPOConfig(**config_fields(trl.GRPOConfig, dict(
            common, per_device_train_batch_size=w["batch"] * w["generations"], num_generations=w["generations"],
            max_completion_length=w["completion"], temperature=1.0, beta=BETA_GRPO, use_vllm=False,
            steps_per_generation=1, num_iterations=1, max_prompt_length=w["prompt"] + 8, log_completions=False)))
        trainer_class, extra = trl.GRPOTrainer, {"reward_funcs": [length_reward]}
    timer = timer_callback(args.warmup, total)
    trainer = trainer_class(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                            peft_config=peft_config, callbacks=[timer], **extra)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    if timer.seconds is None:
        raise RuntimeError(f"the trainer stopped before step {total}")
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return {"steps_per_s": args.steps / timer.seconds, "peak_gib": peak, "trl_version": trl.__version__,
            **({"unsloth_version": sys.modules["unsloth"].__version__} if unsloth else {})}


def run_row(args, model_dir: str, data: Path, work: Path) -> dict:
    w = (TINY if args.tiny else WORKLOADS)[args.objective]
    if args.worker in TOOLKIT_ROWS:
        return toolkit_row(args, w, model_dir, data, work, args.worker)
    return trl_row(args, w, model_dir, data, work, unsloth=args.worker == "unsloth-trl")


def measure(row: str, args, model_dir: str, data: Path, work: Path) -> dict:
    """One row in a process of its own: {"steps_per_s", "peak_gib", ...} or {"skipped": why}."""
    result = work / f"{row}.json"
    command = [sys.executable, __file__, "--worker", row, "--objective", args.objective, "--model-dir", model_dir,
               "--data", str(data), "--work", str(work), "--json", str(result), "--steps", str(args.steps),
               "--warmup", str(args.warmup), *(["--tiny"] if args.tiny else []),
               *(arg for setting in args.set for arg in ("--set", setting))]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               UNSLOTH_DISABLE_STATISTICS="1", UNSLOTH_OFFLINE="1")
    if row == "unsloth-trl":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.unsloth_path, os.environ.get("PYTHONPATH")]))
        env.setdefault("UNSLOTH_COMPILE_LOCATION", str(work / "unsloth_compiled_cache"))
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"over --timeout {args.timeout} s"}
    (work / f"{row}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not result.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"skipped": f"exit {done.returncode}: " + " | ".join(tail)}
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objective", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--shape", default="llama-1b", help="bench/llm.py's SHAPES")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (dpo 20, grpo 10)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the timed ones (dpo 5, grpo 3)")
    parser.add_argument("--rows", default=None, help=f"comma-separated, of {','.join(ROWS)} (default: dpo "
                        f"{DEFAULT_ROWS['dpo']}, grpo {DEFAULT_ROWS['grpo']}; --tiny: toolkit,toolkit-gencompiled,trl; "
                        "the generation rows run for grpo only)")
    parser.add_argument("--tiny", action="store_true", help="tiny:llm on the CPU, a few steps: checks the rows run")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per row")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a toolkit setting for the toolkit row (repeatable), e.g. train.compile=false")
    parser.add_argument("--unsloth-path", default="/tmp/peer", help="where the carried unsloth archive is unpacked")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.tiny else 20 if args.objective == "dpo" else 10)
    args.warmup = args.warmup or (1 if args.tiny else 5 if args.objective == "dpo" else 3)
    if args.worker:
        args.json.write_text(json.dumps(run_row(args, args.model_dir, args.data, args.work)))
        return
    rows = (args.rows or ("toolkit,toolkit-gencompiled,trl" if args.tiny else DEFAULT_ROWS[args.objective])).split(",")
    if args.objective != "grpo":
        rows = [row for row in rows if row not in GENERATION_ROWS]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: no row {', '.join(unknown)}; the rows are {', '.join(ROWS)}")
    from transformers import AutoTokenizer

    w = (TINY if args.tiny else WORKLOADS)[args.objective]
    work = Path(tempfile.mkdtemp(prefix="bench-objectives-"))
    if args.tiny:
        from toolkit.tiny import resolve_model_path

        model_dir, device = resolve_model_path("tiny:llm"), "CPU, tiny:llm"
    else:
        from llm import write_model

        model_dir, device = str(work / "model"), torch.cuda.get_device_name()
        write_model(Path(model_dir), args.shape)
    data = work / "data.jsonl"
    write_data(data, args.objective, w, w["batch"] * (args.steps + args.warmup) + 8,
               AutoTokenizer.from_pretrained(model_dir))
    per_step, tokens, unit = units(args.objective, w)
    shape = "tiny:llm" if args.tiny else args.shape
    print(f"device: {device}; torch {torch.__version__}; {args.objective} on {shape}, LoRA r=16 all-linear; "
          f"{per_step} {unit} a step of {tokens} tokens; {args.steps} timed steps after {args.warmup}"
          + (f"; toolkit row with {' '.join(args.set)}" if args.set else ""), flush=True)
    print(f"{'row':<20} {unit + '/s':>14} {'tokens/s':>10} {'peak GiB':>9}", flush=True)
    results = {}
    for row in rows:
        r = results[row] = measure(row, args, model_dir, data, work)
        if "skipped" in r:
            print(f"{row:<20} skipped ({r['skipped']})", flush=True)
            continue
        r[f"{unit}_per_s"] = r["steps_per_s"] * per_step
        r["tokens_per_s"] = r[f"{unit}_per_s"] * tokens
        print(f"{row:<20} {r[f'{unit}_per_s']:>14.2f} {r['tokens_per_s']:>10.0f} {r['peak_gib']:>9.2f}", flush=True)
    done = {row: r for row, r in results.items() if "skipped" not in r}
    for ours in (row for row in TOOLKIT_ROWS if row in done):
        for peer in (row for row in done if row not in TOOLKIT_ROWS):
            print(f"{ours}: {done[ours]['steps_per_s'] / done[peer]['steps_per_s']:.2f}x {peer}, memory "
                  f"{done[ours]['peak_gib']:.2f} against {done[peer]['peak_gib']:.2f} GiB")
    if args.out:
        args.out.write_text(json.dumps({"objective": args.objective, "shape": shape, "device": device,
                                        "torch": torch.__version__, "workload": w, "toolkit_set": args.set,
                                        "rows": results}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
