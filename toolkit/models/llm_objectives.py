"""train.objective for the llm family beyond sft: dpo, orpo, kto (on preference data) and grpo (on prompts,
generating its own completions). Each turns a batch into the sum of its units' losses through the trainer's
module; the reference is the same model with the LoRA disabled (PEFT's disable_adapter), never a second copy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import torch

from toolkit.data.preference import pad_rows
from toolkit.errors import UserError
from toolkit.models.generation import EagerGeneration
from toolkit.models.llm_logps import TokenLogps, TokenScorer
from toolkit.models.preference_losses import (dpo_losses, group_advantages, grpo_token_losses, kto_kl, kto_losses,
                                              orpo_losses)
from toolkit.models.rewards import reward_functions


class Generator(Protocol):
    """What GRPO samples its completions with (train.generation)."""

    def width(self, longest: int) -> int:
        """The width a batch of prompts whose longest has `longest` tokens is left-padded to."""

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, **sampling: Any) -> torch.Tensor:
        """generate()'s output: the padded prompts and the new tokens."""


class StatsFile:
    """objective.jsonl in the run folder: each training step's objective figures (margins, rewards), one line per
    micro-batch, main process only; a resumed run appends."""

    def __init__(self, path: Path | None):
        self.path, self.step = path, 0

    def write(self, **values: float) -> None:
        # eval and no-grad passes are not training steps, nor is the batch-size probe before step 1
        if self.path is None or self.step == 0 or not torch.is_grad_enabled():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as out:
            figures = {k: round(float(torch.as_tensor(v).detach()), 6) for k, v in values.items()}
            out.write(json.dumps({"step": self.step, **figures}) + "\n")


class Objective:
    """What every objective shares: the scorer, the network (its adapter switched off for the reference) and the
    module the reference runs through (the unwrapped forward module: no gradient, so no DDP)."""

    def __init__(self, scorer: TokenScorer, network: torch.nn.Module, reference_module: torch.nn.Module, train_cfg,
                 stats: StatsFile):
        self.scorer, self.network, self.reference_module = scorer, network, reference_module
        self.cfg, self.stats = train_cfg, stats

    def reference(self, batch: dict[str, torch.Tensor]) -> TokenLogps:
        """The base model's log-probs: the LoRA disabled, no gradient."""
        with torch.no_grad(), self.network.disable_adapter():
            return self.scorer(self.reference_module, batch)

    def reference_sums(self, batch: dict[str, Any]) -> torch.Tensor:
        if "reference_logps" in batch:  # train.reference_logps=precompute
            return batch["reference_logps"].to(self.scorer.device, non_blocking=True)
        return self.reference(batch).sums()

    def units(self, batch: dict[str, Any]) -> tuple[int, int]:
        """(units, tokens) of the batch: pairs or examples, and the tokens of every row."""
        rows = batch["input_ids"]
        return len(batch["desirable"]), rows.numel()


class DPO(Objective):
    def loss(self, batch: dict[str, Any], module: torch.nn.Module) -> torch.Tensor:
        pairs = len(batch["desirable"])
        chosen, rejected = self.scorer(module, batch).sums().split(pairs)
        ref_chosen, ref_rejected = self.reference_sums(batch).split(pairs)
        losses, margins = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, self.cfg.beta)
        self.stats.write(loss=losses.mean(), margin=margins.mean(), accuracy=(margins > 0).float().mean())
        return losses.sum()


class ORPO(Objective):
    def loss(self, batch: dict[str, Any], module: torch.nn.Module) -> torch.Tensor:
        pairs = len(batch["desirable"])
        chosen, rejected = self.scorer(module, batch).means().split(pairs)
        losses, log_odds = orpo_losses(chosen, rejected, self.cfg.beta)
        self.stats.write(loss=losses.mean(), log_odds=log_odds.mean(),
                         margin=(chosen - rejected).detach().mean())
        return losses.sum()


class KTO(Objective):
    def loss(self, batch: dict[str, Any], module: torch.nn.Module) -> torch.Tensor:
        logps = self.scorer(module, batch).sums()
        with torch.no_grad():  # the reference point: mismatched (prompt, completion) pairs of the batch
            kl = kto_kl(self.scorer(self.reference_module, batch["kl"]).sums(), self.reference(batch["kl"]).sums())
        ref = self.reference_sums(batch)
        losses = kto_losses(logps, ref, batch["desirable"], kl, self.cfg.beta, self.cfg.desirable_weight,
                            self.cfg.undesirable_weight)
        ratio = (logps - ref).detach()
        desirable = batch["desirable"].to(ratio.device)
        self.stats.write(loss=losses.mean(), kl=kl, margin=(torch.where(desirable, ratio, -ratio)).mean())
        return losses.sum()


class GRPO(Objective):
    """Per prompt, num_generations completions sampled by the model itself (generate with the KV cache, the
    batch's prompts at once, left-padded); rewards summed over train.reward; advantages within each group; the
    loss per completion is its mean token loss (TRL's loss_type='grpo'). `generator` samples the completions
    (train.generation: models/generation.py's EagerGeneration or models/compiled_generation.py's)."""

    def __init__(self, *args, tokenizer, conversational: bool, scoring_width: int | None, generator: Generator):
        super().__init__(*args)
        self.tokenizer, self.conversational, self.scoring_width = tokenizer, conversational, scoring_width
        self.generator = generator
        self.rewards = reward_functions(list(self.cfg.reward), self.cfg.reward_pattern, self.cfg.reward_length)

    def units(self, batch: dict[str, Any]) -> tuple[int, int]:
        group = self.cfg.num_generations
        return len(batch["prompts"]) * group, sum(len(p) for p in batch["prompts"]) * group

    @torch.no_grad()
    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """num_generations completions per prompt (consecutive), each cut after its first EOS."""
        group, pad, eos = self.cfg.num_generations, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width = self.generator.width(max(len(p) for p in prompts))  # compiled: a few fixed widths
        rows = [p for p in prompts for _ in range(group)]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=self.scorer.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=self.scorer.device)
        out = self.generator(ids, mask, do_sample=True, temperature=self.cfg.generation_temperature, top_k=0,
                             top_p=1.0, max_new_tokens=self.cfg.max_completion_length, pad_token_id=pad,
                             eos_token_id=eos)
        completions = []
        for row in out[:, width:].tolist():
            end = row.index(eos) + 1 if eos in row else len(row)
            completions.append(row[:end])
        return completions

    def score(self, batch: dict[str, Any], completions: list[list[int]]) -> torch.Tensor:
        group = self.cfg.num_generations
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        if self.conversational:
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        records = [r for r in batch["records"] for _ in range(group)]
        columns = {k: [r[k] for r in records] for k in records[0] if k != "prompt"}
        total = torch.zeros(len(texts), dtype=torch.float32)
        for name, function in self.rewards:
            total += reward_values(name, function, len(texts), prompts=[r["prompt"] for r in records],
                                   completions=texts, completion_ids=completions, **columns)
        return total

    def loss(self, batch: dict[str, Any], module: torch.nn.Module) -> torch.Tensor:
        group = self.cfg.num_generations
        completions = self.generate(batch["prompts"])
        rewards = self.score(batch, completions)
        advantages = group_advantages(rewards, group).to(self.scorer.device)
        rows = pad_rows([(batch["prompts"][i // group], c) for i, c in enumerate(completions)],
                        self.tokenizer.pad_token_id, self.scoring_width)
        logps = self.scorer(module, rows)
        ref = self.reference(rows).values if self.cfg.kl_coef > 0 else None
        tokens = grpo_token_losses(logps.values, advantages[logps.rows], ref, self.cfg.kl_coef)
        per_completion = TokenLogps(tokens, logps.rows, logps.count).means()
        self.stats.write(reward=rewards.mean(), reward_std=rewards.std(),
                         completion_tokens=sum(map(len, completions)) / len(completions))
        return per_completion.sum()


OBJECTIVES = {"dpo": DPO, "orpo": ORPO, "kto": KTO, "grpo": GRPO}


def build_objective(name: str, scorer: TokenScorer, network: torch.nn.Module, reference_module: torch.nn.Module,
                    train_cfg, stats: StatsFile, tokenizer, conversational: bool,
                    scoring_width: int | None = None, generator: Generator | None = None) -> Objective:
    """The objective class registered for train.objective `name` (sft is the adapter's own loss); grpo's scored
    rows padded to at least `scoring_width` tokens, its completions sampled by `generator` (eager by default)."""
    if name == "grpo":
        return GRPO(scorer, network, reference_module, train_cfg, stats, tokenizer=tokenizer,
                    conversational=conversational, scoring_width=scoring_width,
                    generator=generator or EagerGeneration(network))
    return OBJECTIVES[name](scorer, network, reference_module, train_cfg, stats)


def reward_values(name: str, function, count: int, **inputs) -> torch.Tensor:
    """One reward function's scores of `count` completions, as TRL's GRPOTrainer calls it (keyword arguments: the
    prompts, the completions, their token ids and the data's other columns). A None score adds nothing (TRL's
    nansum). What a user's function can get wrong is a UserError naming it: it raised, it does not take the
    keyword arguments, or it returned something other than one number (or None) per completion."""
    fix = ("  fix: a reward is f(prompts, completions, **kwargs) -> one float (or None) per completion, as TRL's; "
           "see docs/objectives.md")
    try:
        values = function(**inputs)
    except Exception as err:  # the user's code: any exception is theirs to see, named
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise UserError(f"train.reward: {name} raised {type(err).__name__}: {first}\n{fix}") from None
    try:
        scores = [0.0 if v is None else float(v) for v in values]
    except (TypeError, ValueError):
        raise UserError(f"train.reward: {name} returned {type(values).__name__} {str(values)[:100]!r}, not one "
                        f"number per completion\n{fix}") from None
    if len(scores) != count:
        raise UserError(f"train.reward: {name} returned {len(scores)} scores for {count} completions\n{fix}")
    return torch.tensor(scores, dtype=torch.float32)
