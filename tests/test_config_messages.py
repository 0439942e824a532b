"""What `validate` says about a user's mistakes in a config: a key given twice (only that), a YAML syntax error
(the line to fix), and other trainers' key names (the toolkit's name for them)."""

from __future__ import annotations

import textwrap

import pytest

from conftest import REPO

LLM = REPO / "configs/examples/quickstart_llm.yaml"


def _write(tmp_path, text: str):
    config = tmp_path / "m7.yaml"
    config.write_text(textwrap.dedent(text))
    return config


def test_a_key_given_twice_is_the_only_problem_reported(tmp_path, run_cli, capsys):
    config = _write(tmp_path, """\
        model:
          family: llm
          name_or_path: tiny:llm
        network:
          rank: 8
          rank: 16
        data:
          path: configs/examples/data/quickstart_text.jsonl
        """)
    assert run_cli("validate", config) == 2
    err = capsys.readouterr().err
    assert err == (f"error: invalid config (1 problem):\n  - 'network.rank' is given twice in {config}: lines 5 and 6 "
                   "(YAML would silently keep only the second); merge them into one block\n")


def test_a_section_given_twice_is_checked_as_one_block(tmp_path, run_cli, capsys):
    """The second `model:` block alone has no family: the file is still checked with both blocks merged, so the
    duplicate is reported, not a missing model.family."""
    config = _write(tmp_path, """\
        model:
          family: llm
        data:
          path: configs/examples/data/quickstart_text.jsonl
        model:
          name_or_path: tiny:llm
        train:
          lrr: 1.0e-4
        """)
    assert run_cli("validate", config) == 2
    err = capsys.readouterr().err
    assert "invalid config (2 problems):" in err
    assert f"'model' is given twice in {config}: lines 1 and 5" in err
    assert f"unknown key 'train.lrr' in {config}:8; did you mean 'train.lr'?" in err
    assert "is required" not in err


def test_a_missing_colon_names_the_line_that_lacks_it(tmp_path, run_cli, capsys):
    lines = ["model:", "  family: llm", "  name_or_path: tiny:llm"] + [f"# note {n}" for n in range(4, 18)]
    lines += ["data:", "  path: configs/examples/data/quickstart_text.jsonl", "train", "  lr: 1.0e-4"]
    config = tmp_path / "m7.yaml"
    config.write_text("\n".join(lines) + "\n")
    assert run_cli("validate", config) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {config}:20: invalid YAML: could not find expected ':' (noticed at line 21, column 5)\n"
                   "    20 | train\n"
                   "    21 |   lr: 1.0e-4\n"
                   "             ^ the parser stopped here\n"
                   "  fix: look at line 20: a key needs ':' after it, quotes and brackets must close, and keys of one "
                   "section share one indentation\n")


def test_an_unclosed_quote_names_the_line_it_opens_on(tmp_path, run_cli, capsys):
    config = _write(tmp_path, """\
        sample:
          prompts: ["a red fox]
          every: 5
        """)
    assert run_cli("validate", config) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {config}:2: invalid YAML: ")
    assert "    2 |   prompts: [\"a red fox]\n" in err and "look at line 2" in err


def test_a_line_indented_off_is_named_itself(tmp_path, run_cli, capsys):
    config = _write(tmp_path, """\
        train:
          lr: 1
         steps: 3
        """)
    assert run_cli("validate", config) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {config}:3:2: invalid YAML: expected <block end>, but found '<block mapping start>'\n"
                          "    3 |  steps: 3\n")
    assert "  fix: check that line: its indentation" in err
