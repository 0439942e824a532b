"""Text datasets for causal LMs: records -> token ids and labels, batched with padding or packed.

Formats (data.format, auto detects from the first record's fields):
  text    {"text": ...}                                  loss on every token
  alpaca  {"instruction", "input"?, "output"}             loss on the response (unless train_on_prompt)
  chat    {"messages": [{"role", "content"}, ...]}        rendered with the tokenizer's chat template;
          or ShareGPT's {"conversations":                 loss on assistant turns (unless train_on_prompt)
          [{"from", "value"}, ...], "system"?}             tools and tool calls: data/chat_tools.py
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from toolkit.data.chat_tools import check_rendered, openai_message, record_tools, sharegpt_call
from toolkit.data.packing import PackedTextDataset
from toolkit.data.records import read_records, where
from toolkit.data.samples import IGNORE_INDEX, TokenizedSample, long_tensor
from toolkit.errors import UserError

FORMATS = ("text", "alpaca", "chat")

# ShareGPT's speakers (axolotl's and LLaMA-Factory's `from`) as chat templates name them.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
                  "function_call": "assistant"}  # LLaMA-Factory's: a JSON call (data/chat_tools.py)

ALPACA_PROMPT = ("Below is an instruction that describes a task{with_input}. "
                 "Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n{input_block}### Response:\n")


def format_of(record: dict, text_field: str) -> str | None:
    """The format a record's fields say (None when they match none)."""
    if "messages" in record or "conversations" in record:
        return "chat"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if text_field in record:
        return "text"
    return None


def format_fields(text_field: str) -> str:
    """The fields of each format, for messages that ask for one."""
    return (f"'{text_field}' (text, data.text_field), instruction/input/output (alpaca), or messages or ShareGPT's "
            "conversations (chat)")


def detect_format(record: dict, requested: str, text_field: str, path: str) -> str:
    """The sample format: `requested` unless it is auto, else taken from the first record's fields."""
    if requested != "auto":
        return requested
    fmt = format_of(record, text_field)
    if fmt is None:
        raise UserError(f"{where(path, record)}: data.format is auto but the fields {_keys(record)} match no format\n"
                        f"  fix: use {format_fields(text_field)}, or set data.format")
    return fmt


def _keys(record: dict) -> list[str]:
    return sorted(k for k in record if k != "__line__")


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    return ids + [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else ids


def record_text(record: dict, text_field: str, path: str) -> str:
    """A text record's text (its data.text_field, a string)."""
    text = record.get(text_field)
    if not isinstance(text, str):
        raise UserError(f"{where(path, record)}: expected a string field '{text_field}' "
                        f"(data.text_field), found keys {_keys(record)}\n  fix: set data.text_field to the field that "
                        "holds the text, or data.format to the format of the records")
    return text


def tokenize_text(record: dict, tokenizer, text_field: str, path: str) -> TokenizedSample:
    """Raw-text (completion) sample: loss on every token, EOS appended."""
    text = record_text(record, text_field, path)
    ids = _with_eos(tokenizer(text, add_special_tokens=True)["input_ids"], tokenizer)
    return TokenizedSample(ids, list(ids))


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
    """The Stanford Alpaca prompt, with or without the input block."""
    if input_text:
        return ALPACA_PROMPT.format(with_input=", paired with an input that provides further context",
                                    instruction=instruction, input_block=f"### Input:\n{input_text}\n\n")
    return ALPACA_PROMPT.format(with_input="", instruction=instruction, input_block="")


def alpaca_fields(record: dict, path: str) -> tuple[str, str, str]:
    """An alpaca record's instruction, input ('' without one) and output."""
    instruction, input_text, output = record.get("instruction"), record.get("input", ""), record.get("output")
    if not isinstance(instruction, str) or not isinstance(output, str) or not isinstance(input_text, (str, type(None))):
        raise UserError(f"{where(path, record)}: an alpaca record needs string fields 'instruction' and 'output' "
                        f"(and optionally 'input'), found keys {_keys(record)}\n  fix: give every record those "
                        "fields, or set data.format to the format of the records")
    return instruction, input_text or "", output


def tokenize_alpaca(record: dict, tokenizer, train_on_prompt: bool, path: str) -> TokenizedSample:
    """Prompt and response are tokenized apart, so the boundary is exact; EOS ends the response."""
    instruction, input_text, output = alpaca_fields(record, path)
    prompt = tokenizer(alpaca_prompt(instruction, input_text), add_special_tokens=True)["input_ids"]
    response = _with_eos(tokenizer(output, add_special_tokens=False)["input_ids"], tokenizer)
    prompt_labels = list(prompt) if train_on_prompt else [IGNORE_INDEX] * len(prompt)
    return TokenizedSample(prompt + response, prompt_labels + response)


TEMPLATE_FIX = ("fix: order the turns as the model's chat template expects (many want user and assistant to "
                "alternate, after at most one system turn)")


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
                tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _encode(tokenizer, text: str) -> list[int]:
    # The chat template writes the special tokens (BOS) itself.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_messages(record: dict, path: str) -> list[dict]:
    """The record's conversation as {role, content} messages: its `messages`, or ShareGPT's `conversations` of
    {from, value} turns (speakers mapped by SHAREGPT_ROLES), after its top-level `system` prompt if it has one.
    Tool calls and results are kept (data/chat_tools.py)."""
    if "messages" not in record and "conversations" in record:
        return _sharegpt_messages(record, path)
    messages = record.get("messages")
    kept = [openai_message(m, record, path) for m in messages] if isinstance(messages, list) else []
    if not kept or None in kept:
        raise UserError(f"{where(path, record)}: a chat record needs 'messages': a non-empty list of "
                        f"{{\"role\": ..., \"content\": ...}} objects, found keys {_keys(record)}\n"
                        "  fix: give each message a string 'role' and 'content' (an assistant's tool_calls may stand "
                        "for its content), or use ShareGPT's 'conversations' of 'from'/'value' turns")
    return kept


def _sharegpt_messages(record: dict, path: str) -> list[dict]:
    turns, system = record["conversations"], record.get("system") or ""
    if (not isinstance(turns, list) or not turns or not isinstance(system, str)
            or not all(isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str)
                       for t in turns)):
        raise UserError(f"{where(path, record)}: a ShareGPT record needs 'conversations': a non-empty list of "
                        "{\"from\": ..., \"value\": ...} objects (and 'system', if given, a string)\n"
                        "  fix: give each turn a string 'from' and 'value'")
    unknown = sorted({t["from"] for t in turns} - SHAREGPT_ROLES.keys())
    if unknown:
        raise UserError(f"{where(path, record)}: ShareGPT speakers {unknown} are not known\n"
                        f"  fix: use one of {', '.join(SHAREGPT_ROLES)} in 'from'")
    head = [{"role": "system", "content": system}] if system else []
    return head + [sharegpt_call(t["value"], record, path) if t["from"] == "function_call" else
                   {"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]


def chat_conversation(record: dict, train_on_prompt: bool, path: str) -> tuple[list[dict], list[dict] | None]:
    """A chat record's messages and tools, as far as they can be checked without the chat template: an assistant
    turn to learn from, and (unless train_on_prompt) a prompt before the first one."""
    messages = chat_messages(record, path)
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where(path, record)}: the conversation has no assistant turn to learn from\n"
                        "  fix: add the assistant's answer (role assistant, or ShareGPT's gpt), or drop the record")
    if not train_on_prompt and messages[0]["role"] == "assistant":
        # nothing before it renders: its header could not be told from its text
        raise UserError(f"{where(path, record)}: the conversation begins with an assistant turn, which has no prompt "
                        "before it\n  fix: start it with a user (or system) turn, or set data.train_on_prompt=true")
    return messages, record_tools(record, path)


def tokenize_chat(record: dict, tokenizer, train_on_prompt: bool, path: str) -> TokenizedSample:
    """Render with the chat template; label only the assistant turns.

    Each assistant turn spans from the end of the prefix rendered with add_generation_prompt (so the
    '<|assistant|>' header is masked) to the end of the prefix that includes the turn (so its end-of-turn
    token is learned). Prefixes must tokenize to prefixes of the full conversation; a template that
    rewrites earlier turns is refused rather than silently mislabelled.
    """
    messages, tools = chat_conversation(record, train_on_prompt, path)
    if tokenizer.chat_template is None:
        raise UserError(f"{path}: the tokenizer has no chat template, so chat data cannot be rendered\n"
                        "  fix: use a chat/instruct model, or data in the text or alpaca format")
    try:
        if tools or any("tool_calls" in m for m in messages):
            check_rendered(lambda m, tools: render_chat(tokenizer, m, tools=tools), messages, tools, record, path)
        ids = _encode(tokenizer, render_chat(tokenizer, messages, tools=tools))
    except UserError:
        raise
    except Exception as err:  # jinja raises its own errors, e.g. "roles must alternate"
        raise UserError(f"{where(path, record)}: the chat template refused this conversation: {err}\n"
                        f"  {TEMPLATE_FIX}") from None
    if train_on_prompt:
        return TokenizedSample(ids, list(ids))
    labels = [IGNORE_INDEX] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            start = _encode(tokenizer, render_chat(tokenizer, messages[:index], add_generation_prompt=True,
                                                   tools=tools))
            end = _encode(tokenizer, render_chat(tokenizer, messages[:index + 1], tools=tools))
        except Exception as err:  # a prefix the template refuses, as above
            raise UserError(f"{where(path, record)}: the chat template refused part of this conversation: {err}\n"
                            f"  {TEMPLATE_FIX}, or set data.train_on_prompt=true (it renders the whole conversation "
                            "only)") from None
        if ids[:len(start)] != start or ids[:len(end)] != end:
            raise UserError(f"{where(path, record)}: the chat template renders earlier turns differently once "
                            "later turns are added, so assistant tokens cannot be located\n"
                            "  fix: set data.train_on_prompt=true, or use a template that only appends")
        labels[len(start):len(end)] = ids[len(start):len(end)]
    return TokenizedSample(ids, labels)


def check_record(record: dict, fmt: str, text_field: str, train_on_prompt: bool, path: str) -> None:
    """Raise the UserError tokenize_record would raise for the record itself (its fields, its conversation), without
    a tokenizer: the preflight reads every record of the data with it before the run folder is made."""
    if fmt == "text":
        record_text(record, text_field, path)
    elif fmt == "alpaca":
        alpaca_fields(record, path)
    else:
        chat_conversation(record, train_on_prompt, path)


def tokenize_record(record: dict, fmt: str, tokenizer, data_cfg, path: str) -> TokenizedSample:
    if fmt == "text":
        return tokenize_text(record, tokenizer, data_cfg.text_field, path)
    if fmt == "alpaca":
        return tokenize_alpaca(record, tokenizer, data_cfg.train_on_prompt, path)
    return tokenize_chat(record, tokenizer, data_cfg.train_on_prompt, path)


def tokenize_records(records: list[dict], fmt: str, tokenizer, data_cfg, path: str) -> list[TokenizedSample]:
    """Tokenize and truncate to data.max_seq_len; samples left with no labelled token are dropped."""
    samples = []
    for record in records:
        sample = tokenize_record(record, fmt, tokenizer, data_cfg, path)
        n = data_cfg.max_seq_len
        sample = TokenizedSample(sample.input_ids[:n], sample.labels[:n])
        # Position 0 is never predicted (no token before it), so it does not count as a label.
        if any(label != IGNORE_INDEX for label in sample.labels[1:]):
            samples.append(sample)
    if not samples:
        raise UserError(f"data.max_seq_len: no sample of {path} keeps a response token within "
                        f"{data_cfg.max_seq_len} tokens\n  fix: raise data.max_seq_len")
    return samples


class TextDataset:
    """Tokenized samples; collate pads to the longest sample of the batch (right padding)."""

    def __init__(self, samples: list[TokenizedSample], pad_token_id: int):
        self.samples = samples
        self.pad_token_id = pad_token_id
        self.groups = [0] * len(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def epoch_entries(self, epoch: int) -> Sequence[int]:
        return range(len(self))

    def collate(self, indices: Sequence[int], epoch: int = 0) -> dict[str, Any]:
        """The batch of `indices` (text is not augmented: `epoch` changes nothing)."""
        return pad_samples([self.samples[i] for i in indices], self.pad_token_id)

    def largest_batch(self, size: int) -> list[int]:
        """The longest sample `size` times, its last copy replaced by the shortest sample: the widest batch,
        padded (with an attention mask) as most training batches are."""
        by_length = sorted(range(len(self.samples)), key=lambda i: len(self.samples[i].input_ids))
        batch = [by_length[-1]] * size
        if size > 1 and len(by_length) > 1:
            batch[-1] = by_length[0]
        return batch


def pad_samples(batch: list[TokenizedSample], pad_token_id: int) -> dict[str, torch.Tensor]:
    width = max(len(s.input_ids) for s in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, sample in enumerate(batch):
        n = len(sample.input_ids)
        input_ids[row, :n] = long_tensor(sample.input_ids)
        labels[row, :n] = long_tensor(sample.labels)
        attention_mask[row, :n] = 1
    if all(len(s.input_ids) == width for s in batch):
        # No padding: without a mask, SDPA takes its is_causal fast path (flash attention on GPUs).
        return {"input_ids": input_ids, "labels": labels}
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


@dataclass
class TextData:
    """What build_text_data gives the adapter: the training set, the eval set (or None) and the format."""

    train: Any
    eval: TextDataset | None
    format: str


def split_eval(samples: list[TokenizedSample], fraction: float, seed: int) -> tuple[list, list]:
    """Hold out round(fraction * n) samples (at least one), chosen by a seeded permutation."""
    if fraction >= 1.0:
        raise UserError(f"data.eval_fraction: {fraction} leaves nothing to train on; use a value below 1 (0.05 is usual)")
    n_eval = max(1, round(fraction * len(samples)))
    if n_eval >= len(samples):
        raise UserError(f"data.eval_fraction: {fraction} of {len(samples)} samples leaves nothing to train on")
    held = set(np.random.default_rng([seed, 7]).permutation(len(samples))[:n_eval].tolist())
    return ([s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held])


def load_samples(path: str, key: str, tokenizer, data_cfg) -> tuple[list[TokenizedSample], str]:
    records = read_records(path, key=key)
    fmt = detect_format(records[0], data_cfg.format, data_cfg.text_field, path)
    return tokenize_records(records, fmt, tokenizer, data_cfg, path), fmt


def build_text_data(data_cfg, tokenizer, seed: int) -> TextData:
    """Read, detect the format, tokenize, hold out eval data and (data.packing) pack the training set."""
    samples, fmt = load_samples(data_cfg.path, "data.path", tokenizer, data_cfg)
    eval_samples = None
    if data_cfg.eval_path:
        eval_samples, _ = load_samples(data_cfg.eval_path, "data.eval_path", tokenizer, data_cfg)
    elif data_cfg.eval_fraction > 0:
        samples, eval_samples = split_eval(samples, data_cfg.eval_fraction, seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train = PackedTextDataset(samples, data_cfg.max_seq_len) if data_cfg.packing else TextDataset(samples, pad)
    return TextData(train, TextDataset(eval_samples, pad) if eval_samples else None, fmt)
