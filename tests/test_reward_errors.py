"""GRPO rewards a user can get wrong: named before the model loads (unknown built-in, a module:function that does
not import, a pattern that is not a regular expression), or when the reward runs (it raised, takes other arguments, returns another count), each one
error with its fix, exit 2."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from toolkit.errors import UserError
from toolkit.models.llm_objectives import reward_values

GRPO = REPO / "configs/examples/quickstart_llm_grpo.yaml"
INPUTS = {"prompts": ["a", "b"], "completions": ["x", "yy"], "completion_ids": [[1], [2, 3]]}


def boom(**_):
    raise ValueError("the judge is down")


def positional(prompts, completions):
    return [1.0 for _ in completions]


@pytest.mark.parametrize("function, expected", [
    (boom, "train.reward: boom raised ValueError: the judge is down"),
    (positional, "train.reward: positional raised TypeError: positional() got an unexpected keyword argument"),
    (lambda **_: [1.0], "train.reward: one returned 1 scores for 2 completions"),
    (lambda **_: None, "train.reward: none returned NoneType 'None', not one number per completion"),
    (lambda **_: ["good", 1], "not one number per completion"),
])
def test_what_a_reward_gets_wrong_is_named_with_the_fix(function, expected):
    name = getattr(function, "__name__", "f")
    name = {"<lambda>": "one" if "1 scores" in expected else "none"}.get(name, name)
    with pytest.raises(UserError) as err:
        reward_values(name, function, 2, **INPUTS)
    assert expected in str(err.value) and "\n  fix: a reward is f(prompts, completions, **kwargs)" in str(err.value)


def test_a_none_score_adds_nothing():
    scores = reward_values("maybe", lambda completions, **_: [None, 2.0], 2, **INPUTS)
    assert torch.equal(scores, torch.tensor([0.0, 2.0]))


def test_validate_names_an_unknown_reward_and_a_pattern_that_does_not_compile(run_cli, capsys):
    assert run_cli("validate", GRPO, "train.reward=[regex,bogus]", "train.reward_pattern=[unclosed") == 2
    err = capsys.readouterr().err
    assert "'train.reward': unknown reward 'bogus': use one of format, regex, length, or module:function" in err
    assert ("'train.reward_pattern': '[unclosed' is not a regular expression (unterminated character set at position "
            "0): fix it (Python's re syntax)") in err
    assert run_cli("validate", GRPO, "train.reward=[regex]") == 2
    assert "the regex reward needs train.reward_pattern" in capsys.readouterr().err


def test_validate_names_a_module_function_reward_that_does_not_import(run_cli, capsys):
    """Read, not run: the module is looked up as the run imports it, its file read for the function."""
    from grpo_rewards import __file__ as rewards_file

    assert run_cli("validate", GRPO, "train.reward=[no_such_module:score,grpo_rewards:no_such_function]") == 2
    err = capsys.readouterr().err
    fix = "give module:function of a module importable from the working folder, or a built-in (format, regex, length)"
    assert (f"'train.reward': cannot import 'no_such_module:score': there is no module 'no_such_module' in {REPO} or "
            f"on Python's path: {fix}") in err
    assert f"'train.reward': cannot import 'grpo_rewards:no_such_function': {rewards_file} defines no " \
           f"'no_such_function': {fix}" in err
    assert "Traceback" not in err
    assert run_cli("validate", GRPO, "train.reward=[grpo_rewards:low_token_share,length]") == 0


def test_the_built_in_rewards_are_one_table():
    from toolkit.models.rewards import BUILTIN_REWARDS, reward_functions

    assert [name for name, _ in reward_functions(list(BUILTIN_REWARDS), "x", 8)] == ["format", "regex", "length"]
    with pytest.raises(UserError, match="unknown reward 'other'"):
        reward_functions(["other"], "x", 8)


def test_a_reward_that_raises_in_a_run_is_exit_2_naming_it(tmp_path):
    from conftest import run_toolkit

    (tmp_path / "judge.py").write_text("def score(completions, **_):\n    raise RuntimeError('judge offline')\n")
    out = tmp_path / "run"
    proc = run_toolkit("train", GRPO, f"run.output_dir={out}", "train.reward=[judge:score]", "train.steps=2",
                       f"data.path={REPO / 'configs/examples/data/quickstart_grpo.jsonl'}", "sample.prompts=[]",
                       cwd=tmp_path, env={"PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "error: train.reward: judge:score raised RuntimeError: judge offline\n  fix: a reward is" in proc.stderr
    assert "Traceback" not in proc.stderr
