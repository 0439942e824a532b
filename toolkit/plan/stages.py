"""Running a stage of the plan: its registered rules (plan/rules.py) in order, where their facts are known."""

from __future__ import annotations

import toolkit.plan.loaded_rules  # noqa: F401  (registers the loaded stage's rules)
import toolkit.plan.static_checks  # noqa: F401  (registers the static stage's checks, after its rules and llm_rules)
import toolkit.plan.static_rules  # noqa: F401  (registers the static stage's rules)
from toolkit.plan.decisions import Decision
from toolkit.plan.rules import RULES, Facts


def decide(stage: str, facts: Facts, only: tuple[str, ...] | None = None) -> list[Decision]:
    """The rules of `stage` whose facts are known (`only`: of these settings), in registry order; their
    decisions (also recorded in facts.decided). The loaded stage runs twice: with the model's size before its
    weights load (device.distributed), then with what loading decided (quantization, swap)."""
    made = []
    for r in RULES[stage]:
        if (only is not None and r.key not in only) or any(need not in facts.extra for need in r.needs):
            continue
        decision = r.decide(facts)
        if decision is not None:
            facts.decided[decision.key] = decision
            made.append(decision)
    return made


def registered_keys() -> dict[str, list[str]]:
    """stage -> the settings its rules decide (for docs and tests)."""
    return {stage: [r.key for r in rules] for stage, rules in RULES.items()}
