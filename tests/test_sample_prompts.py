"""`sample` on a tiny llm trained 2 steps with train.objective=dpo (its config has no sample.prompts), through the
entry point: --prompt is sampled (and beats sample.prompts); with no prompt, the first 3 distinct prompts of the
run's training data are, token for token as --prompt samples them, and the log says so; an sft run with no
sample.prompts, and an objective run whose data file is gone, are exit 2 naming --prompt, sample.prompts and why
the data gives none, before any model loads; given a prompt, the run with its data gone samples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from helpers import without_others_samples

FIX = ("  fix: give --prompt TEXT (repeat it for more; in the web UI: the Prompts box, one prompt a line), or set "
       "sample.prompts in the config")


@pytest.fixture
def runs(tiny_runs, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tiny_runs.cache))
    return tiny_runs


def sample(run_cli, run: Path, *args) -> list[dict]:
    """`sample RUN *args` through the CLI: the records of the one new samples/cli-* folder it wrote."""
    before = set((run / "samples").glob("cli-*"))
    assert run_cli("sample", run, *args) == 0
    [folder] = set((run / "samples").glob("cli-*")) - before
    assert sorted(p.name for p in folder.iterdir()) == ["samples.jsonl", "samples.txt", "source.txt"]
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def test_prompt_given_or_taken_from_the_objectives_data(runs, run_cli, capsys):
    run = runs["llm_dpo"]
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["train"]["objective"], config["sample"]["prompts"]) == ("dpo", [])
    lines = (REPO / "configs/examples/data/quickstart_preference.jsonl").read_text().splitlines()
    first = [json.loads(line)["prompt"] for line in lines[:3]]
    assert len(set(first)) == 3

    given = sample(run_cli, run, "--prompt", first[1], "sample.prompts=[what colour is the sun]")
    assert [r["prompt"] for r in given] == [first[1]] and given[0]["completion"]
    assert "no --prompt and no sample.prompts" not in capsys.readouterr().err

    from_data = sample(run_cli, run)
    assert [r["prompt"] for r in from_data] == first
    assert from_data[1] == given[0]  # each prompt samples from the same seed, whichever way it was given
    err = capsys.readouterr().err
    assert "sample: no --prompt and no sample.prompts: sampling the first 3 prompts of the training data (data.path=" \
           in err and "quickstart_preference.jsonl, train.objective=dpo)\n" in err


def test_no_prompt_anywhere_is_exit_2_naming_what_to_fill(runs, run_cli, capsys, tmp_path):
    sft = tmp_path / "sft"
    shutil.copytree(runs["llm"], sft, ignore=without_others_samples)
    capsys.readouterr()
    assert run_cli("sample", sft, "sample.prompts=[]") == 2
    err = capsys.readouterr().err
    assert err == (f"error: sample: no prompt to sample from: no --prompt was given, sample.prompts is empty in "
                   f"{sft / 'config.yaml'}, and none is taken from the training data (train.objective=sft: its "
                   f"training data is not split into prompts and answers)\n{FIX}\n")  # nothing loaded first

    moved = tmp_path / "moved"
    shutil.copytree(runs["llm_dpo"], moved, ignore=without_others_samples)
    config = yaml.safe_load((moved / "config.yaml").read_text())
    config["data"]["path"] = str(tmp_path / "gone.jsonl")
    (moved / "config.yaml").write_text(yaml.safe_dump(config))
    assert run_cli("sample", moved) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"and none is taken from the training data (data.path: data file not found: "
                        f"{tmp_path / 'gone.jsonl'})\n{FIX}\n")
    assert not list((moved / "samples").glob("cli-*"))

    # with a prompt given, the moved data is not needed: the tokenizer says whether prompts go through a template
    records = sample(run_cli, moved, "--prompt", "what colour is the circle")
    assert records[0]["prompt"] == "what colour is the circle" and records[0]["completion"]
    err = capsys.readouterr().err
    assert f"sample: data.path: data file not found: {tmp_path / 'gone.jsonl'}; the prompts go " in err


@pytest.mark.parametrize("config, prompts", [
    ("quickstart_llm_grpo.yaml", ["tell me about the circle", "tell me about the square", "tell me about the triangle"]),
    ("quickstart_llm_kto.yaml", ["what colour is the circle", "what colour is the square", "what colour is the triangle"]),
])
def test_training_prompts_of_conversations_and_of_repeated_prompts(config, prompts, tmp_path):
    """grpo's prompts are conversations (their last user message is the prompt); kto repeats each prompt (once)."""
    from toolkit.models.llm import LLMAdapter
    from toolkit.plan.run import load_run

    cfg = load_run([REPO / "configs/examples" / config], [f"run.output_dir={tmp_path}"]).cfg
    found, source = LLMAdapter.training_prompts(cfg, 3)
    assert found == prompts
    assert source.startswith("the first 3 prompts of the training data (data.path=")
