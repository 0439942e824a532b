"""Data for the llm objectives beyond sft, in TRL's formats, plain text or conversational:

  preference  {"prompt", "chosen", "rejected"}       dpo, orpo
  unpaired    {"prompt", "completion", "label"}      kto (label: true for a desirable completion)
  prompt      {"prompt", ...}                        grpo (the other fields go to the reward functions)

Plain: strings. Conversational: `prompt` a list of {role, content} messages, the completions lists of
(assistant) messages; the prompt is rendered with the chat template and add_generation_prompt, a completion as
what the whole conversation adds to it. Completions end with EOS (plain) or the template's end of turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from toolkit.data.chat_tools import check_rendered, openai_message, record_tools
from toolkit.data.records import read_records, where
from toolkit.data.samples import IGNORE_INDEX, long_tensor
from toolkit.data.text import TEMPLATE_FIX, render_chat, split_eval
from toolkit.errors import UserError

FIELDS = {"preference": ("prompt", "chosen", "rejected"), "unpaired": ("prompt", "completion", "label"),
          "prompt": ("prompt",)}
COMPLETIONS = {"preference": ("chosen", "rejected"), "unpaired": ("completion",), "prompt": ()}


def is_messages(value: Any) -> bool:
    return (isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value))


def prompt_text(prompt: Any) -> str | None:
    """A record's prompt as a sample prompt: the string, or a conversation's last user message (sampling renders
    it through the chat template again); None when it is neither."""
    if isinstance(prompt, str):
        return prompt
    if is_messages(prompt):
        return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), None)
    return None


def missing_fields(record: dict, fmt: str) -> str:
    """What a record of format `fmt` lacks ('' when nothing): the fields it needs, the missing and the found."""
    missing = [name for name in FIELDS[fmt] if name not in record]
    if not missing:
        return ""
    keys = sorted(k for k in record if k != "__line__")
    article = "an" if fmt[0] in "aeiou" else "a"
    return f"{article} {fmt} record needs the fields {list(FIELDS[fmt])}, missing {missing} (found {keys})"


FIELDS_FIX = "use TRL's field names, or the objective that matches the data (train.objective)"


def check_example(record: dict, fmt: str, path: str) -> None:
    """Raise the UserError encode_records would raise for the record itself, without a tokenizer (the preflight
    reads every record of the data with it before the run folder is made): its fields, a prompt and completions
    that are all strings or all message lists, a kto label that is a boolean, the tools of a conversation."""
    if (missing := missing_fields(record, fmt)):
        raise UserError(f"{where(path, record)}: {missing}\n  fix: {FIELDS_FIX}")
    prompt = record["prompt"]
    if not isinstance(prompt, str) and not is_messages(prompt):
        raise UserError(f"{where(path, record)}: 'prompt' must be a string or a list of "
                        "{\"role\": ..., \"content\": ...} messages\n  fix: give the prompt as text, or as "
                        "messages with a string 'role' and 'content' each")
    for name in COMPLETIONS[fmt]:
        completion = record[name]
        if is_messages(prompt) != is_messages(completion):
            raise UserError(f"{where(path, record)}: 'prompt' and '{name}' must both be strings or both be "
                            "message lists (TRL's plain and conversational formats)\n  fix: write both as text, or "
                            f"both as messages ('{name}': [{{\"role\": \"assistant\", \"content\": ...}}])")
        if not isinstance(completion, str) and not is_messages(completion):
            raise UserError(f"{where(path, record)}: '{name}' must be a string or a list of messages\n  fix: "
                            "give each message a string 'role' and 'content'")
    if fmt == "unpaired" and not isinstance(record["label"], bool):
        raise UserError(f"{where(path, record)}: 'label' must be true or false (a desirable completion or not)"
                        "\n  fix: write it as a JSON true or false, not a string or a number")
    if is_messages(prompt):
        record_tools(record, path)  # a conversation's tools reach the chat template


class PromptEncoder:
    """Token ids of prompts and completions, plain or through the chat template, with the exact boundary (of
    records check_example has passed)."""

    def __init__(self, tokenizer, path: str):
        self.tokenizer, self.path = tokenizer, path

    def prompt(self, record: dict) -> list[int]:
        prompt = record["prompt"]
        if is_messages(prompt):
            return self._chat(record, prompt, add_generation_prompt=True)
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def completion(self, record: dict, name: str, prompt_ids: list[int]) -> list[int]:
        prompt, completion = record["prompt"], record[name]
        if isinstance(completion, str):
            ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
            eos = self.tokenizer.eos_token_id
            return ids + [eos] if eos is not None else ids
        whole = self._chat(record, prompt + completion, add_generation_prompt=False)
        if whole[:len(prompt_ids)] != prompt_ids:
            raise UserError(f"{where(self.path, record)}: the chat template renders the prompt differently once "
                            f"'{name}' follows it, so the completion's tokens cannot be located\n"
                            "  fix: use a template that only appends, or plain-text records")
        return whole[len(prompt_ids):]

    def _chat(self, record: dict, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise UserError(f"{self.path}: the tokenizer has no chat template, so conversational records cannot be "
                            "rendered\n  fix: use a chat/instruct model, or plain-text records")
        messages = [openai_message(m, record, self.path) for m in messages]  # is_messages checked each
        tools = record_tools(record, self.path)  # tools and tool calls reach the template, or are refused by name
        try:
            if tools or any("tool_calls" in m for m in messages):
                check_rendered(lambda m, tools: render_chat(self.tokenizer, m, tools=tools), messages, tools, record,
                               self.path)
            text = render_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except UserError:
            raise
        except Exception as err:  # jinja raises its own errors, e.g. "roles must alternate"
            raise UserError(f"{where(self.path, record)}: the chat template refused this conversation: {err}\n"
                            f"  {TEMPLATE_FIX}") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Example:
    """A prompt and its completions (preference: chosen, rejected; unpaired: one; prompt: none)."""

    prompt: list[int]
    completions: list[list[int]]
    label: bool = True
    record: dict = field(default_factory=dict)   # prompt data: the record, for the reward functions


def encode_records(records: list[dict], fmt: str, tokenizer, max_seq_len: int, path: str) -> list[Example]:
    """Each record as an Example; a prompt plus completion longer than max_seq_len keeps the prompt's last tokens
    (TRL truncates prompts from the left) and the completion's first; a completion left empty is refused."""
    encoder, examples = PromptEncoder(tokenizer, path), []
    for record in records:
        check_example(record, fmt, path)
        prompt = encoder.prompt(record)
        if fmt == "prompt":
            examples.append(Example(prompt[-max_seq_len:], [], record={k: v for k, v in record.items()
                                                                         if k != "__line__"}))
            continue
        completions = [encoder.completion(record, name, prompt) for name in COMPLETIONS[fmt]]
        keep = max(1, max_seq_len - max(len(c) for c in completions))
        prompt = prompt[-min(keep, len(prompt)):]
        completions = [c[:max_seq_len - len(prompt)] for c in completions]
        if not all(completions):
            raise UserError(f"data.max_seq_len: the prompt of {where(path, record)} leaves no room for its "
                            "completion\n  fix: raise data.max_seq_len")
        examples.append(Example(prompt, completions, record.get("label", True)))
    return examples


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_token_id: int,
             width: int | None = None) -> dict[str, torch.Tensor]:
    """(prompt, completion) rows right-padded (to the longest row, or to `width`); labels on the completion tokens
    only."""
    width = max([len(p) + len(c) for p, c in rows] + [width or 0])
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        input_ids[row, :n] = long_tensor(prompt + completion)
        labels[row, len(prompt):n] = long_tensor(completion)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


class ExampleDataset:
    """Examples batched as rows: preference pairs as [chosen rows; rejected rows], unpaired examples one row each
    (with `desirable`), prompts as token lists for generation. `reference` (set by a precompute pass) holds each
    row's reference log-prob, keyed by example: (chosen, rejected) or (completion,)."""

    def __init__(self, examples: list[Example], fmt: str, pad_token_id: int):
        self.examples, self.format, self.pad_token_id = examples, fmt, pad_token_id
        self.groups = [0] * len(examples)
        self.reference: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def epoch_entries(self, epoch: int) -> Sequence[int]:
        """Every item once an epoch (one dataset: no repeats or weights)."""
        return range(len(self))

    def collate(self, indices: Sequence[int], epoch: int = 0) -> dict[str, Any]:
        """The batch of `indices` (not augmented: `epoch` changes nothing)."""
        chosen = [self.examples[i] for i in indices]
        if self.format == "prompt":
            return {"prompts": [e.prompt for e in chosen], "records": [e.record for e in chosen]}
        columns = len(chosen[0].completions)
        rows = [(e.prompt, e.completions[k]) for k in range(columns) for e in chosen]
        batch = pad_rows(rows, self.pad_token_id)
        batch["desirable"] = torch.tensor([e.label for e in chosen])
        if self.format == "unpaired":  # KTO's reference point: each prompt with the previous example's completion
            batch["kl"] = pad_rows([(e.prompt, chosen[k - 1].completions[0]) for k, e in enumerate(chosen)],
                                   self.pad_token_id)
        if self.reference is not None:  # rows in the batch's order: column by column
            batch["reference_logps"] = self.reference[list(indices)].t().reshape(-1)
        return batch

    def largest_batch(self, size: int) -> list[int]:
        """The longest example `size` times."""
        def length(i: int) -> int:
            return len(self.examples[i].prompt) + max((len(c) for c in self.examples[i].completions), default=0)

        return [max(range(len(self.examples)), key=length)] * size


@dataclass
class ExampleData:
    train: ExampleDataset
    eval: ExampleDataset | None
    format: str
    conversational: bool


def build_example_data(data_cfg, fmt: str, tokenizer, seed: int) -> ExampleData:
    """Read and encode data.path (and the eval set: data.eval_path, or data.eval_fraction of data.path)."""
    records = read_records(data_cfg.path)
    examples = encode_records(records, fmt, tokenizer, data_cfg.max_seq_len, data_cfg.path)
    eval_examples = None
    if data_cfg.eval_path:
        eval_examples = encode_records(read_records(data_cfg.eval_path, key="data.eval_path"), fmt, tokenizer,
                                       data_cfg.max_seq_len, data_cfg.eval_path)
    elif data_cfg.eval_fraction > 0:
        examples, eval_examples = split_eval(examples, data_cfg.eval_fraction, seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return ExampleData(ExampleDataset(examples, fmt, pad),
                       ExampleDataset(eval_examples, fmt, pad) if eval_examples and fmt != "prompt" else None,
                       fmt, is_messages(records[0].get("prompt")))
