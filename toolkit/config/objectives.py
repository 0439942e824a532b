"""The LLM settings that only some values of train.objective read (docs/objectives.md). A value set for an
objective that does not read it is a config error, as a setting of another model family is: it would be ignored.
Beside them, the data formats each objective trains on (the first: data.format=auto's)."""

from __future__ import annotations

PREFERENCE = ("dpo", "orpo", "kto")

OBJECTIVE_FORMATS = {"sft": ("text", "alpaca", "chat"), "dpo": ("preference",), "orpo": ("preference",),
                     "kto": ("unpaired",), "grpo": ("prompt",)}

OBJECTIVE_SETTINGS: dict[str, tuple[str, ...]] = {
    "train.beta": PREFERENCE,
    "train.reference_logps": ("dpo", "kto"),
    "train.desirable_weight": ("kto",),
    "train.undesirable_weight": ("kto",),
    **{f"train.{key}": ("grpo",) for key in ("reward", "reward_pattern", "reward_length", "num_generations", "kl_coef",
                                             "max_completion_length", "generation_temperature", "generation")},
}
