"""The tiny causal LM behind `tiny:llm`: a 2-layer Llama-style model with a small BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

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


def write_tokenizer(out: Path) -> "PreTrainedTokenizerFast":  # noqa: F821
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

    tokenizer = write_tokenizer(out)
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
