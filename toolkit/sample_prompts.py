"""The prompts `sample` falls back on when neither --prompt nor the run's sample.prompts gives one.

An llm trained with an objective (dpo, orpo, kto, grpo) has no sample.prompts of its own (its quickstarts set none)
but its training data holds prompts: the first few distinct ones are used, and the log says so. Any other run
(diffusion families, llm sft data, an objective's data file that cannot be read) has none to fall back on: that
is a UserError naming the option and the key to fill. Which families' data holds prompts is the adapter's to say
(ModelAdapter.training_prompts)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from toolkit.errors import UserError

TRAINING_PROMPTS = 3  # enough to see what the LoRA does, few enough to sample quickly


def prompts_from_training_data(cfg: DictConfig, config: Path, log: Callable[[str], None]) -> list[str]:
    """The first TRAINING_PROMPTS prompts of the run's training data, said in the log; a UserError naming
    --prompt and sample.prompts when the data gives none."""
    from toolkit.models import adapter_class

    try:
        prompts, source = adapter_class(cfg.model.family).training_prompts(cfg, TRAINING_PROMPTS)
    except UserError as err:  # why the data gives none: part of the message below
        reason = str(err).splitlines()[0]
        raise UserError(f"sample: no prompt to sample from: no --prompt was given, sample.prompts is empty in {config}, "
                        f"and none is taken from the training data ({reason})\n  fix: give --prompt TEXT (repeat it for more; in the web UI: "
                        "the Prompts box, one prompt a line), or set sample.prompts in the config") from None
    log(f"sample: no --prompt and no sample.prompts: sampling {source}")
    return prompts
