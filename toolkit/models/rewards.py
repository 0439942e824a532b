"""GRPO's reward functions (train.reward): the built-ins and 'module:function' callables, called as TRL calls
a reward function: f(prompts=..., completions=..., completion_ids=..., **the records' other fields) -> floats."""

from __future__ import annotations

import ast
import importlib
import importlib.util
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


# The built-in rewards by name, each made from (train.reward_pattern, train.reward_length). The plan's checks read
# the names from here (plan/static_checks.py: reward_checks).
BUILTIN_REWARDS: dict[str, Callable[[str | None, int], RewardFn]] = {
    "format": lambda pattern, length: format_reward(pattern),
    "regex": lambda pattern, length: regex_reward(pattern),
    "length": lambda pattern, length: length_reward(length),
}
IMPORT_FIX = ("give module:function of a module importable from the working folder, or a built-in "
              f"({', '.join(BUILTIN_REWARDS)})")


def _working_folder_on_path() -> None:
    """'module:function' rewards import from the folder the command runs in, as `python -m` scripts do."""
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    importlib.invalidate_caches()  # a module written since the last import is found


def imported_reward(name: str) -> RewardFn:
    """'module:function', imported with the working folder on the path."""
    module_name, _, attribute = name.partition(":")
    _working_folder_on_path()
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise UserError(f"train.reward: cannot import '{name}': {err}\n  fix: {IMPORT_FIX}") from None
    if not callable(function):
        raise UserError(f"train.reward: '{name}' is not callable\n  fix: name a function, f(prompts, completions, "
                        "**kwargs) -> a list of floats")
    return function


def missing_reward(name: str) -> str:
    """Why 'module:function' would not import ('' where it is found), told without running the module: its file is
    looked up as the run imports it (the working folder first) and read for a top-level definition of `function`."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        return f"'{name}' is not module:function"
    _working_folder_on_path()
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as err:  # a dotted name whose package is missing or does not import
        return f"module '{module_name}' cannot be found ({err})"
    if spec is None:
        return f"there is no module '{module_name}' in {Path.cwd()} or on Python's path"
    if not (spec.origin or "").endswith(".py"):
        return ""  # a compiled or namespace module: the run's import tells
    try:
        names = _top_level_names(ast.parse(Path(spec.origin).read_bytes(), spec.origin))
    except SyntaxError as err:
        return f"{spec.origin}:{err.lineno} is not valid Python ({err.msg})"
    if names is None or attribute in names:
        return ""
    return f"{spec.origin} defines no '{attribute}'"


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module defines outside its functions and classes; None where they cannot be read from its text
    (`from x import *`, a module __getattr__)."""
    names, statements = set(), list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        else:  # if / try / with / for at the top level: their bodies define names too
            statements.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return None if "__getattr__" in names else names


def reward_functions(names: list[str], pattern: str | None, length: int) -> list[tuple[str, RewardFn]]:
    """Each name of train.reward with its function; an unknown built-in lists the valid ones."""
    functions = []
    for name in names:
        if ":" in name:
            functions.append((name, imported_reward(name)))
        elif name in BUILTIN_REWARDS:
            functions.append((name, BUILTIN_REWARDS[name](pattern, length)))
        else:
            raise UserError(f"train.reward: unknown reward '{name}'\n  fix: one of {', '.join(BUILTIN_REWARDS)}, or "
                            "module:function")
    if not functions:
        raise UserError("train.reward: grpo needs at least one reward\n  fix: e.g. train.reward=[length]")
    return functions
