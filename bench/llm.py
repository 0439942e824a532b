"""LLM LoRA training throughput: the toolkit's trainer beside the plain stack a user would write.

Both train the same Llama-3.2-1B-shaped model (random weights, no download) with PEFT LoRA r=16
on all linear layers, bf16, SDPA, batch 4 x 2048 tokens, on the same GPU in one process:

- plain:   transformers + PEFT + torch.optim.AdamW(fused=True), a hand-written loop, eager and with each
           decoder layer compiled (the torch.compile a user would add by hand);
- toolkit: `python -m toolkit train` machinery (Trainer), optimizer adamw (fused) and adamw8bit, with
           train.compile off and on (auto turns it on for this family on a GPU).

    python bench/llm.py --steps 30 --warmup 5 [--layers 16]
Prints tokens/s, peak memory and the ratio toolkit/plain.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def write_model(folder: Path, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.tiny.llm import write_tokenizer

    write_tokenizer(folder)  # a small BPE tokenizer; its ids are valid in the large vocabulary
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=3,
                         pad_token_id=0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


def write_data(path: Path, rows: int) -> None:
    words = "the quick brown fox jumps over the lazy dog red circle blue square green triangle".split()
    g = torch.Generator().manual_seed(0)
    with path.open("w") as handle:
        for _ in range(rows):
            idx = torch.randint(len(words), (3000,), generator=g).tolist()
            handle.write(json.dumps({"text": " ".join(words[i] for i in idx)}) + "\n")


def plain_stack(model_dir: Path, steps: int, warmup: int, batch: int, seq: int, compile_layers: bool = False) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.config.use_cache = False  # with a KV cache built in training, per-layer compile recompiles (FINDINGS.md)
    if compile_layers:
        for layer in model.base_model.model.model.layers:
            layer.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ids = torch.randint(4, 400, (batch, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in range(steps + warmup):
        if step == warmup:
            start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    result = {"tokens_per_s": steps * batch * seq / seconds, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del model, opt
    torch.cuda.empty_cache()
    return result


def toolkit_run(model_dir: Path, data: Path, out: Path, optimizer: str, steps: int, warmup: int, batch: int,
                seq: int, compile_blocks: bool = False) -> dict:
    from trainer_rate import trainer_rate

    overrides = [f"model.name_or_path={model_dir}", f"data.path={data}", f"data.max_seq_len={seq}",
                 f"train.batch_size={batch}", f"train.compile={str(compile_blocks).lower()}"]
    config = ("model: {family: llm}\nnetwork: {rank: 16, alpha: 16}\ntrain: {lr: 1.0e-4, precision: bf16,"
              " gradient_checkpointing: false}\nsave: {every: 0}\nlog: {tensorboard: false}\n")
    rate, peak = trainer_rate(config, overrides, out, optimizer, steps, warmup)
    return {"tokens_per_s": rate * batch * seq, "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-llm-"))
    model_dir, data = work / "model", work / "data.jsonl"
    write_model(model_dir, args.layers)
    write_data(data, rows=args.batch * (args.steps + args.warmup) + 8)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; Llama-3.2-1B shape "
          f"({args.layers} layers), LoRA r=16 all-linear, bf16, batch {args.batch} x {args.seq}")
    print(f"{'stack':<28} {'tokens/s':>10} {'peak GiB':>9} {'vs plain':>9}", flush=True)
    plain = plain_stack(model_dir, args.steps, args.warmup, args.batch, args.seq)
    rows = [("plain (PEFT + fused AdamW)", lambda: plain),
            ("plain + compiled layers", lambda: plain_stack(model_dir, args.steps, args.warmup, args.batch, args.seq,
                                                            compile_layers=True))]
    rows += [(f"toolkit ({name}{', compile' if comp else ''})",
              lambda name=name, comp=comp: toolkit_run(model_dir, data, work / f"run-{name}-{comp}", name, args.steps,
                                                       args.warmup, args.batch, args.seq, compile_blocks=comp))
             for comp in (False, True) for name in ("adamw", "adamw8bit")]
    for label, measure in rows:
        r = measure()
        print(f"{label:<28} {r['tokens_per_s']:>10.0f} {r['peak_gib']:>9.1f} "
              f"{r['tokens_per_s'] / plain['tokens_per_s']:>9.2f}", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
