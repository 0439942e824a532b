"""LLM LoRA training throughput: the toolkit beside the plain loop and the peers users pick for speed, in one run
on one GPU, every stack in a fresh process of its own (liger-kernel and unsloth patch transformers globally).

The workload (random weights, nothing downloaded): PEFT LoRA r=16 (alpha 16, no dropout) on every linear layer
of the decoder, bf16 weights under bf16 autocast, SDPA attention, batch 4 x 2048 tokens, fused AdamW, gradient
norm clipped to 1.0, no gradient checkpointing unless a row says so. Shapes (--shape): llama-1b (Llama-3.2-1B,
128k vocabulary, the default), qwen2.5-1.5b (152k), gemma2-2b (256k, soft-capped logits),
llama-8b (Llama-3.1-8B: the long-context rows, --batch 1 --seq 32768), nemo-12b (fsdp, bench/scaling.py).

`--objective dpo|grpo` hands the command to bench/llm_objectives.py (the toolkit beside TRL's trainers, plain and
on unsloth; its docstring has the rows and workloads).

Rows (--rows, comma-separated; a row whose package is missing is reported as skipped):
  plain            transformers + PEFT + torch.optim.AdamW(fused=True), a hand-written loop, eager
  plain-compiled   the same with each decoder layer compiled (the torch.compile a user adds by hand)
  plain-read       plain + reading the loss on the host every step (diagnostic: the cost of one sync a step)
  liger            liger-kernel on the model (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy), eager
  liger-compiled   liger's fused linear cross-entropy only + each decoder layer compiled (its fastest, FINDINGS.md)
  unsloth          bench/peer_unsloth.py: unsloth's FastLanguageModel, no gradient checkpointing
  unsloth-ckpt     the same with unsloth's own (offloading) gradient checkpointing
  toolkit-eager    the toolkit's Trainer, train.compile=false model.kernels=none (adamw)
  toolkit          the toolkit's Trainer with its defaults on a GPU (train.compile and model.kernels auto), adamw
  toolkit-8bit     the same with the toolkit's adamw8bit
  toolkit-nofuse   train.compile on, model.kernels=none (what the fused loss adds)
  toolkit-ckpt     the defaults + train.gradient_checkpointing=true (memory)
  toolkit-ckpt-offload  toolkit-ckpt + train.checkpoint_offload=true (the layer inputs in pinned CPU memory)
  toolkit-keepall  the defaults + train.compile_recompute=none (PyTorch's default partition of each block; the
                   default, auto, is pointwise for an LLM)
  toolkit-nofuseproj  the defaults + model.fuse_projections=false (q/k/v and gate/up as separate LoRA layers)
  toolkit-fp8      the defaults + model.quantize=fp8 (the frozen linear layers in e4m3, fp8 matmuls: another
                   precision than every other row, so compare its loss too)
  toolkit-fp8-ckpt toolkit-fp8 + train.gradient_checkpointing=true

    python bench/llm.py [--shape llama-1b] [--steps 30 --warmup 5] [--rows plain,toolkit] [--out result.json]
                        [--profile] [--memory] [--phases]

--phases (toolkit rows): after the timed steps, 10 more timed per phase on the host and the GPU, with the GPU's
queue of launched work ahead of the host at the end of each phase and its SM clock and power (bench/step_phases.py):
whether the GPU waits for the host anywhere in the step, or runs its kernels at a power-limited clock.

Tokens/s are over the timed steps (CUDA events for the hand-written loops, the Trainer's own step rate for the
toolkit). MFU = (4·N·T + 3·A) / step time / 989e12, with N the base parameters (a tied embedding once), T the
tokens of a step and A the causal attention forward flops of a step (2·layers·batch·seq²·heads·head_dim): frozen
weights need no weight gradients, so forward + backward is 4·N·T; attention's backward is twice its forward.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kernel_profile import print_summary  # noqa: E402  (bench/ is on the path when a script here runs)
from memory_peak import print_breakdown  # noqa: E402
from step_phases import print_phases  # noqa: E402

H100_H200_BF16_FLOPS = 989e12
ROWS = ("plain", "plain-compiled", "liger", "liger-compiled", "unsloth", "toolkit-eager", "toolkit", "toolkit-8bit")
SHAPES = {
    "llama-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                               tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, rope_theta=1000000.0,
                                   tie_word_embeddings=True)),
    "gemma2-2b": ("gemma2", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                 final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
                                 sliding_window=4096, tie_word_embeddings=True)),
    # Llama-3.1-8B's shape (untied head, 128k context): the long-context rows (--batch 1 --seq 32768)
    "llama-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                               max_position_embeddings=131072, tie_word_embeddings=False)),
    # a 12B-class base (Mistral-Nemo-12B's shape): bench/scaling.py's fsdp memory comparison
    "nemo-12b": ("mistral", dict(vocab_size=131072, hidden_size=5120, intermediate_size=14336, num_hidden_layers=40,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
                                 tie_word_embeddings=False)),
}


def write_model(folder: Path, shape: str = "llama-1b", layers: int | None = None) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.tiny.llm import write_tokenizer

    write_tokenizer(folder)  # a small BPE tokenizer; its ids are valid in the large vocabulary
    model_type, fields = SHAPES[shape]
    fields = {**fields, **({"num_hidden_layers": layers} if layers else {})}
    fields = {"max_position_embeddings": 8192, **fields}
    config = AutoConfig.for_model(model_type, bos_token_id=1, eos_token_id=3, pad_token_id=0, **fields)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


def write_data(path: Path, rows: int, seq: int = 2048) -> None:
    """Rows of at least `seq` words (3000 at the usual 2048), so that a packed sequence is one document."""
    words = "the quick brown fox jumps over the lazy dog red circle blue square green triangle".split()
    g = torch.Generator().manual_seed(0)
    with path.open("w") as handle:
        for _ in range(rows):
            idx = torch.randint(len(words), (max(3000, seq),), generator=g).tolist()
            handle.write(json.dumps({"text": " ".join(words[i] for i in idx)}) + "\n")


def model_flops_per_step(model_dir: Path, batch: int, seq: int) -> float:
    """4·N·T + 3·A (module docstring), from the saved config, counted on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 2 * config.num_hidden_layers * batch * seq * seq * config.num_attention_heads * head_dim
    return 4 * params * batch * seq + 3 * attention


# -- the hand-written loops (one per process) ---------------------------------------------------------------
def plain_stack(model_dir: Path, steps: int, warmup: int, batch: int, seq: int, compile_layers: bool = False,
                liger: str | None = None, read_loss: bool = False) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    if liger is not None:  # patches the model class: before the model is built
        import liger_kernel.transformers as lk

        model_type = AutoConfig.from_pretrained(model_dir).model_type
        patch = getattr(lk, f"apply_liger_kernel_to_{model_type}")
        if liger == "all":
            patch()
        else:  # the fused linear cross-entropy alone (the other kernels' switches differ per model: geglu, ...)
            import inspect

            switches = [n for n, p in inspect.signature(patch).parameters.items() if isinstance(p.default, bool)]
            patch(**{n: n == "fused_linear_cross_entropy" for n in switches})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.config.use_cache = False  # with a KV cache built in training, per-layer compile recompiles (FINDINGS.md)
    # from_pretrained returns the model in eval mode; liger's fused loss runs in training mode only (it computes
    # the logits otherwise), as a user's loop or transformers' Trainer puts it
    model.train()
    if compile_layers:
        for layer in model.base_model.model.model.layers:
            layer.compile()
    return timed_training(model, steps, warmup, batch, seq, read_loss)


def timed_training(model, steps: int, warmup: int, batch: int, seq: int, read_loss: bool = False) -> dict:
    """The hand-written loop every peer row shares: fused AdamW on the trainable weights, bf16 autocast, the
    norm clipped to 1.0; the steps after `warmup` timed with CUDA events. With BENCH_PROFILE set, a few more
    steps run under the profiler and their summary is in the result's "profile"; with BENCH_MEMORY, one more
    step runs with the allocator's history recorded, and what held its peak is in the result's "memory"."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ids = torch.randint(4, 400, (batch, seq), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if read_loss:
            float(loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for n in range(steps + warmup):
        if n == warmup:
            start.record()
        step()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    result = {"tokens_per_s": steps * batch * seq / seconds, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    if os.environ.get("BENCH_PROFILE"):
        from kernel_profile import profiled
        from trainer_rate import PROFILED_STEPS

        result["profile"] = {}
        with profiled(PROFILED_STEPS, result["profile"]):
            for _ in range(PROFILED_STEPS):
                step()
    if os.environ.get("BENCH_MEMORY"):
        from memory_peak import recorded

        result["memory"] = {}
        with recorded(result["memory"]):
            step()
    return result


def toolkit_run(model_dir: Path, data: Path, out: Path, optimizer: str, steps: int, warmup: int, batch: int,
                seq: int, extra: list[str]) -> dict:
    from trainer_rate import trainer_rate

    overrides = [f"model.name_or_path={model_dir}", f"data.path={data}", f"data.max_seq_len={seq}",
                 f"train.batch_size={batch}", *extra]
    config = ("model: {family: llm}\nnetwork: {rank: 16, alpha: 16}\ntrain: {lr: 1.0e-4, precision: bf16,"
              " gradient_checkpointing: false}\nsave: {every: 0}\nlog: {tensorboard: false}\n")
    profile = {} if os.environ.get("BENCH_PROFILE") else None
    memory = {} if os.environ.get("BENCH_MEMORY") else None
    phases = {} if os.environ.get("BENCH_PHASES") else None
    losses = []
    rate, peak = trainer_rate(config, overrides, out, optimizer, steps, warmup, profile=profile, memory=memory,
                              losses=losses, phases=phases)
    return {"tokens_per_s": rate * batch * seq, "peak_gib": peak, "losses": [round(x, 4) for x in losses],
            **({"profile": profile} if profile else {}),
            **({"memory": memory} if memory else {}),
            **({"phases": phases} if phases else {})}


def run_row(row: str, args, model_dir: Path, data: Path, work: Path) -> dict:
    common = (model_dir, args.steps, args.warmup, args.batch, args.seq)
    if row == "plain":
        return plain_stack(*common)
    if row == "plain-compiled":
        return plain_stack(*common, compile_layers=True)
    if row == "plain-read":
        return plain_stack(*common, read_loss=True)
    if row == "liger":
        return plain_stack(*common, liger="all")
    if row == "liger-compiled":
        return plain_stack(*common, compile_layers=True, liger="flce")
    extra = {"toolkit-eager": ["train.compile=false", "model.kernels=none"], "toolkit": [], "toolkit-8bit": [],
             "toolkit-nofuse": ["train.compile=true", "model.kernels=none"],
             "toolkit-ckpt": ["train.gradient_checkpointing=true"],
             "toolkit-ckpt-offload": ["train.gradient_checkpointing=true", "train.checkpoint_offload=true"],
             "toolkit-keepall": ["train.compile_recompute=none"],
             "toolkit-nofuseproj": ["model.fuse_projections=false"],
             "toolkit-fp8": ["model.quantize=fp8"],
             "toolkit-fp8-ckpt": ["model.quantize=fp8", "train.gradient_checkpointing=true"]}[row]
    optimizer = "adamw8bit" if row == "toolkit-8bit" else "adamw"
    return toolkit_run(model_dir, data, work / f"run-{row}", optimizer, args.steps, args.warmup, args.batch,
                       args.seq, extra)


def measure(row: str, args, model_dir: Path, data: Path, work: Path) -> dict:
    """One row in a process of its own: {"tokens_per_s", "peak_gib"} or {"skipped": why}."""
    result = work / f"{row}.json"
    if row in ("unsloth", "unsloth-ckpt"):
        command = [sys.executable, str(Path(__file__).with_name("peer_unsloth.py")), "--model", str(model_dir),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
                   "--seq", str(args.seq), "--out", str(result), *(["--checkpointing"] if row == "unsloth-ckpt" else [])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.unsloth_path,
                                                                         os.environ.get("PYTHONPATH")]))}
    else:
        command = [sys.executable, __file__, "--worker", row, "--model-dir", str(model_dir), "--data", str(data),
                   "--work", str(work), "--json", str(result), "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq)]
        env = dict(os.environ)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not result.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"skipped": f"exit {done.returncode}: " + " | ".join(tail)}
    return json.loads(result.read_text())


def main() -> None:
    if "--objective" in sys.argv:  # dpo and grpo rows: bench/llm_objectives.py, with the same arguments
        script = Path(__file__).resolve().parent / "llm_objectives.py"
        os.execv(sys.executable, [sys.executable, str(script), *sys.argv[1:]])
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape has")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per row")
    parser.add_argument("--profile", action="store_true",
                        help="also profile a few steps of every row after its timed ones; prints where GPU time goes")
    parser.add_argument("--memory", action="store_true",
                        help="after the timed steps, one more step with the allocator's history recorded: what held "
                             "its peak memory, by the code that allocated it (bench/memory_peak.py)")
    parser.add_argument("--phases", action="store_true",
                        help="toolkit rows: time each phase of a step on the host and the GPU, with the GPU's queue "
                             "ahead of the host and its clock (bench/step_phases.py)")
    parser.add_argument("--unsloth-path", default="/tmp/peer", help="where the carried unsloth wheels are installed")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.json.write_text(json.dumps(run_row(args.worker, args, args.model_dir, args.data, args.work)))
        return
    if args.profile:
        os.environ["BENCH_PROFILE"] = "1"  # read by the rows' processes
    if args.memory:
        os.environ["BENCH_MEMORY"] = "1"
    if args.phases:
        os.environ["BENCH_PHASES"] = "1"
    work = Path(tempfile.mkdtemp(prefix="bench-llm-"))
    model_dir, data = work / "model", work / "data.jsonl"
    write_model(model_dir, args.shape, args.layers)
    write_data(data, rows=args.batch * (args.steps + args.warmup) + 8, seq=args.seq)
    flops = model_flops_per_step(model_dir, args.batch, args.seq)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; shape {args.shape}"
          f"{f' ({args.layers} layers)' if args.layers else ''}, LoRA r=16 all-linear, bf16, "
          f"batch {args.batch} x {args.seq}; {args.steps} timed steps after {args.warmup}")
    print(f"{'stack':<16} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9} {'vs plain':>9}", flush=True)
    results, plain = {}, None
    for row in args.rows.split(","):
        r = results[row] = measure(row, args, model_dir, data, work)
        if "skipped" in r:
            print(f"{row:<16} skipped ({r['skipped']})", flush=True)
            continue
        r["mfu"] = r["tokens_per_s"] / (args.batch * args.seq) * flops / H100_H200_BF16_FLOPS
        plain = plain or (r["tokens_per_s"] if row == "plain" else None)
        ratio = f"{r['tokens_per_s'] / plain:>9.2f}" if plain else f"{'':>9}"
        loss = f"  losses {r['losses'][0]:.4f} .. {r['losses'][-1]:.4f}" if r.get("losses") else ""
        print(f"{row:<16} {r['tokens_per_s']:>9.0f} {r['mfu']:>6.3f} {r['peak_gib']:>9.1f} {ratio}{loss}", flush=True)
    peers = {row: r["tokens_per_s"] for row, r in results.items() if "skipped" not in r and not row.startswith("toolkit")}
    if peers:
        fastest = max(peers, key=peers.get)
        for row, r in results.items():
            if row.startswith("toolkit") and "skipped" not in r:
                print(f"{row}: {r['tokens_per_s'] / peers[fastest]:.3f}x the fastest peer ({fastest}, "
                      f"{peers[fastest]:.0f} tokens/s, {results[fastest]['peak_gib']:.1f} GiB)")
    for row, r in results.items():
        if "profile" in r:
            print_summary(row, r["profile"])
    for row, r in results.items():
        if "memory" in r:
            print_breakdown(row, r["memory"])
    for row, r in results.items():
        if "phases" in r:
            print_phases(row, r["phases"])
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "rows": results}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
