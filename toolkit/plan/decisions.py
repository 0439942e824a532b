"""A run's decisions: what each `auto` setting (and each setting the run derives) became, why, and at which stage.

A RunPlan is immutable. It grows stage by stage (`with_stage`): static (the config and the device, before anything
loads; `validate` shows it), loaded (once the model is loaded: its size, quantization, sharding, block swap) and
measured (batch size, checkpointing, compile, graphs, attention backend, measured on the device). A later stage may
settle a setting an earlier one left provisional (the batch size from the preset's table, until measured); the plan
keeps the latest decision of each setting. The config itself is never written: `effective` lays the plan over it
for whoever needs the values the run uses, and the run folder keeps both (config.yaml, plan.json).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

STAGES = ("static", "loaded", "measured")
PLAN_VERSION = 1


@dataclass(frozen=True)
class Decision:
    """One setting's value for this run, the reason, the stage that decided it and the measurement behind it
    (an id in bench/results/evidence.json, toolkit/plan/evidence.py)."""

    key: str
    value: Any
    reason: str
    stage: str = "static"
    evidence: str | None = None

    def __str__(self) -> str:
        return f"{self.key}={_shown(self.value)}: {self.reason}"


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class RunPlan:
    """The decisions of a run, in the order they were made; one per setting (the latest stage's)."""

    decisions: tuple[Decision, ...] = ()
    stages: tuple[str, ...] = ()
    _by_key: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_by_key", {d.key: d for d in self.decisions})

    def with_stage(self, stage: str, decisions: list[Decision]) -> "RunPlan":
        """This plan with `stage`'s decisions: a setting decided again keeps its place and takes the new value."""
        if stage not in STAGES:
            raise ValueError(f"unknown plan stage {stage!r}")
        new = {d.key: d for d in decisions}
        kept = tuple(new.pop(d.key, d) for d in self.decisions)
        stages = self.stages if stage in self.stages else (*self.stages, stage)
        return RunPlan(kept + tuple(new.values()), stages)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[Decision]:
        return iter(self.decisions)

    def decision(self, key: str) -> Decision:
        return self._by_key[key]

    def value(self, key: str) -> Any:
        """The value decided for `key` (KeyError when the plan did not decide it)."""
        return self._by_key[key].value

    def effective(self, container: dict) -> dict:
        """The config as the run uses it: `container` (plain data, as asked) with every decided value in place.
        A decision for a setting the container lacks (one its family does not read) is left out."""
        out = json.loads(json.dumps(container))  # a deep copy of plain data
        for d in self.decisions:
            section, _, name = d.key.partition(".")
            if isinstance(out.get(section), dict) and name in out[section]:
                out[section][name] = d.value
        return out

    def to_json(self) -> str:
        return json.dumps({"version": PLAN_VERSION, "stages": list(self.stages),
                           "decisions": [asdict(d) for d in self.decisions]}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "RunPlan":
        data = json.loads(text)
        return cls(tuple(Decision(**d) for d in data["decisions"]), tuple(data.get("stages", ())))

    def lines(self, stage: str | None = None) -> list[str]:
        """One line per decision (of `stage`, or all), as the log and `validate` print them."""
        return [str(d) for d in self.decisions if stage is None or d.stage == stage]
