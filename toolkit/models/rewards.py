"""GRPO's reward functions (train.reward): the built-ins and 'module:function' callables, called as TRL calls
a reward function: f(prompts=..., completions=..., completion_ids=..., **the records' other fields) -> floats."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Callable

from toolkit.errors import UserError

FORMAT_PATTERN = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
RewardFn = Callable[..., list]


def _text(completion) -> str:
    """A completion's text: the string, or a conversational completion's message contents."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def format_reward(pattern: str | None) -> RewardFn:
    compiled = re.compile(pattern or FORMAT_PATTERN, re.DOTALL)
    return lambda completions, **_: [1.0 if compiled.match(_text(c)) else 0.0 for c in completions]


def regex_reward(pattern: str | None) -> RewardFn:
    if not pattern:
        raise UserError("train.reward: the regex reward needs train.reward_pattern\n"
                        "  fix: set train.reward_pattern to the expression a good completion contains")
    compiled = re.compile(pattern)
    return lambda completions, **_: [1.0 if compiled.search(_text(c)) else 0.0 for c in completions]


def length_reward(target: int) -> RewardFn:
    return lambda completions, **_: [1.0 - abs(len(_text(c)) - target) / target for c in completions]


def imported_reward(name: str) -> RewardFn:
    """'module:function', imported with the working folder on the path."""
    module_name, _, attribute = name.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise UserError(f"train.reward: cannot import '{name}': {err}\n  fix: give module:function of a module "
                        "importable from the working folder, or a built-in (format, regex, length)") from None
    if not callable(function):
        raise UserError(f"train.reward: '{name}' is not callable")
    return function


def reward_functions(names: list[str], pattern: str | None, length: int) -> list[tuple[str, RewardFn]]:
    """Each name of train.reward with its function; an unknown built-in lists the valid ones."""
    builtins = {"format": lambda: format_reward(pattern), "regex": lambda: regex_reward(pattern),
                "length": lambda: length_reward(length)}
    functions = []
    for name in names:
        if ":" in name:
            functions.append((name, imported_reward(name)))
        elif name in builtins:
            functions.append((name, builtins[name]()))
        else:
            raise UserError(f"train.reward: unknown reward '{name}'\n  fix: one of {', '.join(builtins)}, or "
                            "module:function")
    if not functions:
        raise UserError("train.reward: grpo needs at least one reward\n  fix: e.g. train.reward=[length]")
    return functions
