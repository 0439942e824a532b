"""Tiny, deterministic random models written in the real Hugging Face layout.

Tests and the quickstart configs use `model.name_or_path: tiny:<kind>`: the first use writes the
model into the cache folder (TOOLKIT_CACHE, default ~/.cache/lora-toolkit) and everything then
loads it through the same `from_pretrained` path as a Hub id. Nothing is downloaded.

    python -m toolkit.models.tiny llm /tmp/tiny-llm     # write one to a folder of your choice
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

TINY_PREFIX = "tiny:"
# Bump when a writer changes, so caches of older tiny models are not reused.
TINY_VERSION = "1"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A small corpus for the tokenizer's merges: the words the quickstart data and tests use.
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a tiny model learns to repeat simple sentences about colours and shapes",
    "red circle blue square green triangle yellow star purple heart orange diamond",
    "question answer instruction input output user assistant system",
    "one two three four five six seven eight nine ten",
    "hello world this is a test of the training toolkit on the cpu",
    "what is the capital of france paris is the capital of france",
]


def cache_root() -> Path:
    return Path(os.environ.get("TOOLKIT_CACHE", Path.home() / ".cache" / "lora-toolkit"))


def _write_tokenizer(out: Path) -> "PreTrainedTokenizerFast":  # noqa: F821
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", additional_special_tokens=specials[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def write_tiny_llm(out: Path) -> None:
    """A 2-layer Llama-style causal LM (hidden 64, GQA 4/2 heads) with its BPE tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _write_tokenizer(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)


TINY_WRITERS: dict[str, Callable[[Path], None]] = {
    "llm": write_tiny_llm,
    "sd": lambda out: __import__("toolkit.models.tiny_diffusion", fromlist=["x"]).write_tiny_sd(out),
    "sd-v": lambda out: __import__("toolkit.models.tiny_diffusion", fromlist=["x"]).write_tiny_sd_v(out),
    "sdxl": lambda out: __import__("toolkit.models.tiny_diffusion", fromlist=["x"]).write_tiny_sdxl(out),
    "flux": lambda out: __import__("toolkit.models.tiny_flow", fromlist=["x"]).write_tiny_flux(out),
    "sd3": lambda out: __import__("toolkit.models.tiny_flow", fromlist=["x"]).write_tiny_sd3(out),
    "wan21": lambda out: __import__("toolkit.models.tiny_flow", fromlist=["x"]).write_tiny_wan21(out),
    "wan22": lambda out: __import__("toolkit.models.tiny_flow", fromlist=["x"]).write_tiny_wan22(out),
    "wan22-5b": lambda out: __import__("toolkit.models.tiny_flow", fromlist=["x"]).write_tiny_wan22_5b(out),
}


def write_tiny(kind: str, out: Path) -> Path:
    """Write tiny model `kind` into `out` atomically (a temporary folder renamed into place)."""
    if kind not in TINY_WRITERS:
        from toolkit.errors import UserError
        raise UserError(f"unknown tiny model 'tiny:{kind}'; available: {', '.join('tiny:' + k for k in TINY_WRITERS)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # Writers seed torch; a run that writes its tiny model must not have its own RNG streams reset.
        with torch.random.fork_rng(devices=[]):
            TINY_WRITERS[kind](tmp)
        (tmp / "tiny_model.json").write_text(json.dumps({"kind": kind, "version": TINY_VERSION}) + "\n")
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "tiny_model.json").exists():  # another process did not win the race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(name_or_path: str) -> str:
    """Map `tiny:<kind>` to a cached folder (written on first use); anything else is returned as is."""
    if not name_or_path.startswith(TINY_PREFIX):
        return name_or_path
    kind = name_or_path[len(TINY_PREFIX):]
    out = cache_root() / "tiny" / f"{kind}-v{TINY_VERSION}"
    if not (out / "tiny_model.json").exists():
        write_tiny(kind, out)
    return str(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(f"usage: python -m toolkit.models.tiny KIND OUT_DIR   (KIND: {', '.join(TINY_WRITERS)})", file=sys.stderr)
        sys.exit(2)
    print(write_tiny(sys.argv[1], Path(sys.argv[2])))
