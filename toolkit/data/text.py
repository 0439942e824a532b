"""Text datasets for causal LMs: records -> token ids and labels, batched with padding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from toolkit.data.records import read_records, where
from toolkit.errors import UserError

IGNORE_INDEX = -100


@dataclass
class TokenizedSample:
    input_ids: list[int]
    labels: list[int]


def tokenize_text_records(records: list[dict], tokenizer, text_field: str, max_seq_len: int, path: str) -> list[TokenizedSample]:
    """Raw-text (completion) samples: loss on every token, EOS appended, truncated to max_seq_len."""
    samples = []
    for record in records:
        text = record.get(text_field)
        if not isinstance(text, str):
            raise UserError(f"{where(path, record)}: expected a string field '{text_field}' "
                            f"(data.text_field), found keys {sorted(k for k in record if k != '__line__')}")
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        ids = ids[:max_seq_len]
        samples.append(TokenizedSample(ids, list(ids)))
    return samples


class TextDataset:
    """Tokenized samples; collate pads to the longest sample of the batch (right padding)."""

    def __init__(self, samples: list[TokenizedSample], pad_token_id: int):
        self.samples = samples
        self.pad_token_id = pad_token_id
        self.groups = [0] * len(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def collate(self, indices: Sequence[int]) -> dict[str, Any]:
        batch = [self.samples[i] for i in indices]
        width = max(len(s.input_ids) for s in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, sample in enumerate(batch):
            n = len(sample.input_ids)
            input_ids[row, :n] = torch.tensor(sample.input_ids)
            labels[row, :n] = torch.tensor(sample.labels)
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def build_text_dataset(data_cfg, tokenizer) -> TextDataset:
    records = read_records(data_cfg.path)
    samples = tokenize_text_records(records, tokenizer, data_cfg.text_field, data_cfg.max_seq_len, data_cfg.path)
    return TextDataset(samples, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
