"""The one registry of rules that settle a run's settings, keyed by setting, each at its stage.

A rule reads `Facts` (the config as asked, the device, the values decided so far, and the stage's own facts: the
model's size once loaded, the measurements once measured) and returns a Decision, or None when the config already
says what to do. `decide(stage, facts)` runs that stage's rules in registry order, so a rule may read what an
earlier rule of the stage decided (model.dtype follows train.precision). Checks of what a device cannot run go to
`facts.problems`, reported together as one ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from toolkit.config.families import applies_to
from toolkit.device.detect import DeviceInfo
from toolkit.plan.decisions import STAGES, Decision


@dataclass
class Facts:
    """What a stage's rules read. `cfg` is the config as asked (frozen, `auto` where the user left it)."""

    cfg: DictConfig
    device: DeviceInfo
    decided: dict[str, Decision] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # the stage's own facts (see each stage's rules)

    @property
    def family(self) -> str:
        return self.cfg.model.family

    def asked(self, key: str) -> Any:
        """The config's value of dotted `key` as the user left it (`auto` included)."""
        return OmegaConf.select(self.cfg, key)

    def value(self, key: str) -> Any:
        """The value decided so far for `key`, else the config's."""
        return self.decided[key].value if key in self.decided else self.asked(key)

    def reads(self, key: str) -> bool:
        """Whether the run's family reads `key` (family-scoped settings: config/families.py)."""
        return applies_to(key, self.family)


@dataclass(frozen=True)
class Rule:
    key: str
    stage: str
    decide: Callable[[Facts], Decision | None]
    needs: tuple[str, ...] = ()  # facts (Facts.extra keys) the rule reads: it runs once they are all known


RULES: dict[str, list[Rule]] = {stage: [] for stage in STAGES}


def rule(key: str, stage: str, needs: tuple[str, ...] = ()):
    """Register the decorated function as the rule for `key` at `stage`, run once `needs` are known."""
    def register(decide: Callable[[Facts], Decision | None]):
        if key in {r.key for r in RULES[stage]}:
            raise ValueError(f"two {stage} rules for {key}")
        RULES[stage].append(Rule(key, stage, decide, needs))
        return decide
    return register
