"""The llm family's samples: each prompt's completion (greedy, or drawn at sample.temperature from sample.seed),
written as samples.jsonl and samples.txt; and an objective run's first training prompts, for `sample` without a
prompt (toolkit/sample_prompts.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig

from toolkit.data.preference import prompt_text
from toolkit.data.records import read_records
from toolkit.errors import UserError
from toolkit.models.base import eval_mode
from toolkit.models.generation import generating


def objective_prompts(cfg: DictConfig, count: int) -> tuple[list[str], str]:
    """The first `count` distinct prompts of an objective's data (dpo, orpo, kto, grpo: the `prompt` field, of a
    conversation its last user message); sft data has no prompts apart from their answers."""
    if cfg.train.objective == "sft":
        raise UserError("train.objective=sft: its training data is not split into prompts and answers")
    records = read_records(cfg.data.path)
    prompts = list(dict.fromkeys(p for p in (prompt_text(r.get("prompt")) for r in records) if p))[:count]
    if not prompts:
        raise UserError(f"data.path={cfg.data.path}: no record has a 'prompt'")
    return prompts, (f"the first {len(prompts)} prompts of the training data (data.path={cfg.data.path}, "
                     f"train.objective={cfg.train.objective})")


@torch.no_grad()
def sample_completions(model: torch.nn.Module, tokenizer, prompts: list[str], prompt_ids: Callable[[str], list[int]],
                       sample: DictConfig, device: torch.device) -> list[dict[str, str]]:
    """Each prompt's completion from `model` (the sample section's seed, temperature and max_new_tokens)."""
    results = []
    generator_seed = sample.seed
    for prompt in prompts:
        torch.manual_seed(generator_seed)
        input_ids = torch.tensor([prompt_ids(prompt)], device=device)
        greedy = sample.temperature == 0
        with eval_mode(model), generating():  # eager, no cuDNN attention
            output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=sample.max_new_tokens, do_sample=not greedy,
                                    temperature=None if greedy else sample.temperature,
                                    top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id,
                                    use_cache=True)
        completion = tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)
        results.append({"prompt": prompt, "completion": completion})
    return results


def write_samples(out_dir: Path, results: list[dict[str, str]]) -> list[Path]:
    """samples.jsonl (one {prompt, completion} a line) and samples.txt (each prompt as a heading) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "samples.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results), encoding="utf-8")
    text = out_dir / "samples.txt"
    text.write_text("".join(f"### {r['prompt']}\n{r['completion']}\n\n" for r in results), encoding="utf-8")
    return [jsonl, text]
