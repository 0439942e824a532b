"""Unsloth peer of bench/llm.py: the plain loop's LLM LoRA workload, trained through unsloth.

Measures training tokens/s and peak GPU memory for the model that bench/llm.py's write_model() saved in --model
(any of its --shape's: Llama, Qwen2 or Gemma2; random weights, bf16, with the small tokenizer saved beside them),
loaded offline and LoRA-wrapped by unsloth's FastLanguageModel: LoRA r=16, alpha=16, dropout 0 on q,k,v,o,gate,
up,down; --batch x --seq random token ids in [4, 400) as input_ids and labels; torch.optim.AdamW(fused=True) lr
1e-4 over the trainable params; clip_grad_norm 1.0; bf16 autocast; no gradient checkpointing unless
--checkpointing (unsloth's offloaded "unsloth" mode). The steps after --warmup are timed with CUDA events, exactly
as every peer row of bench/llm.py (its timed_training).

Unsloth is no dependency of the toolkit: it runs from its own tree, installed apart and offline. The device has
no registry, so unsloth 2026.10.9 and what it imports (unsloth_zoo, trl, datasets<5, bitsandbytes, tyro, pydantic,
...) are installed here with `pip install --no-deps --target` for Python 3.12 x86_64, their unused parts dropped
(unsloth's studio/ web app, bitsandbytes' libraries for other CUDA versions), and carried as one archive
(bench/device_packages.sh builds it):

    mkdir -p /tmp/peer && tar xzf .whl-unsloth/peer.tar.gz -C /tmp/peer
    PYTHONPATH=/tmp/peer python3 bench/peer_unsloth.py --model DIR --steps 30 --warmup 5 --batch 4 --seq 2048 \\
        --out result.json

Writes {"tokens_per_s", "peak_gib", "unsloth_version"} to --out and prints it as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

# Offline and quiet; set before unsloth (and, through it, transformers and huggingface_hub) is imported.
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                  HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ENABLE_HF_TRANSFER="0",
                  UNSLOTH_DISABLE_STATISTICS="1",  # no statistics download from the Hub on load
                  UNSLOTH_OFFLINE="1")
# unsloth_zoo writes generated modules to ./unsloth_compiled_cache unless told otherwise: keep the checkout clean.
os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", os.path.join(tempfile.gettempdir(), "unsloth_compiled_cache"))

import unsloth  # noqa: E402  (first: unsloth patches transformers and peft on import)
from unsloth import FastLanguageModel  # noqa: E402

import torch  # noqa: E402
from llm import timed_training  # noqa: E402  (bench/llm.py: the loop every peer row shares)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load(model_dir: Path, seq: int, checkpointing: bool):
    """The saved model with unsloth's LoRA r=16 on all linear layers of the decoder."""
    gc = "unsloth" if checkpointing else False
    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(model_dir.resolve()), max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=False,
        full_finetuning=False, local_files_only=True, use_exact_model_name=True, use_gradient_checkpointing=gc)
    return FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                            target_modules=TARGETS, use_gradient_checkpointing=gc, random_state=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="folder written by bench/llm.py write_model()")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--checkpointing", action="store_true", help='unsloth\'s "unsloth" gradient checkpointing')
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load(args.model, args.seq, args.checkpointing)
    model.config.use_cache = False
    model.train()
    result = timed_training(model, args.steps, args.warmup, args.batch, args.seq)
    result["unsloth_version"] = unsloth.__version__
    args.out.write_text(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
