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


def test_a_key_without_its_colon_above_another_key_names_its_own_line(tmp_path, run_cli, capsys):
    """`family sd` runs on into the next line as one plain value; the parser stops at the next key's colon."""
    config = _write(tmp_path, """\
        model:
          family sd
          name_or_path: tiny:sd
        """)
    assert run_cli("validate", config) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {config}:2: invalid YAML: mapping values are not allowed here (noticed at line 3, "
                          "column 15)\n    2 |   family sd\n")
    assert "  fix: look at line 2: a key needs ':' after it" in err


def test_a_tab_is_named_as_a_tab_on_its_line(tmp_path, run_cli, capsys):
    config = tmp_path / "tab.yaml"
    config.write_text("model:\n  family: sd\n\tname_or_path: tiny:sd\n")
    assert run_cli("validate", config) == 2
    assert capsys.readouterr().err == (f"error: {config}:3:1: invalid YAML: a tab where YAML takes only spaces\n"
                                       "    3 | <tab>name_or_path: tiny:sd\n"
                                       "  fix: indent line 3 with spaces (keys of one section share one indentation)\n")


# Other trainers' names (kohya's sd-scripts, ai-toolkit, diffusers' scripts, Hugging Face's Trainer) -> the toolkit's
FOREIGN = {"learning_rate": "train.lr", "max_train_steps": "train.steps", "network_dim": "network.rank",
           "network_alpha": "network.alpha", "train_batch_size": "train.batch_size",
           "mixed_precision": "train.precision", "output_dir": "run.output_dir",
           "gradient_accumulation_steps": "train.grad_accum", "lr_warmup_steps": "train.warmup_steps",
           "seed": "run.seed", "resolution": "data.resolution", "save_every_n_steps": "save.every",
           "train_data_dir": "data.path", "pretrained_model_name_or_path": "model.name_or_path",
           "caption_extension": "data.caption_ext", "bucket_reso_steps": "data.bucket_step"}
# Names the toolkit has too, in another section: found by the same name elsewhere
SAME_NAME = {"lr_scheduler": "train.lr_scheduler", "max_grad_norm": "train.max_grad_norm"}


def test_other_trainers_key_names_suggest_the_toolkit_key_wherever_written(run_cli, capsys):
    top = [f"{name}=1" for name in {**FOREIGN, **SAME_NAME}]
    nested = [f"train.{name}=1" for name in FOREIGN if not FOREIGN[name].startswith("train.")]
    assert run_cli("validate", REPO / "configs/examples/quickstart_sd.yaml", *top, *nested,
                   "train.learning_rate=1") == 2
    err = capsys.readouterr().err
    assert f"invalid config ({len(top) + len(nested) + 1} problems)" in err
    for name, target in FOREIGN.items():
        assert f"unknown key '{name}' in command line; did you mean '{target}'? ({name}: the name in " in err
    for name, target in SAME_NAME.items():
        assert f"unknown key '{name}' in command line; did you mean '{target}'?\n" in err
    assert ("unknown key 'train.learning_rate' in command line; did you mean 'train.lr'? (learning_rate: the name in "
            "kohya's sd-scripts, diffusers' training scripts and Hugging Face's Trainer)\n") in err
    assert "unknown key 'train.network_dim' in command line; did you mean 'network.rank'?" in err
    assert "valid keys here" not in err


def test_an_epoch_count_says_the_toolkit_counts_steps(run_cli, capsys):
    assert run_cli("validate", LLM, "train.max_train_epochs=3") == 2
    assert ("unknown key 'train.max_train_epochs' in command line; did you mean 'train.steps'? (max_train_epochs: the "
            "name in kohya's sd-scripts; the toolkit counts optimizer steps, not epochs)") in capsys.readouterr().err


def test_an_ai_toolkit_job_given_to_validate_points_at_import_aitk(tmp_path, run_cli, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("job: extension\nconfig:\n  name: x\n  process: [{type: sd_trainer}]\n")
    assert run_cli("validate", job) == 2
    err = capsys.readouterr().err
    assert (f"unknown key 'config' in {job}:2; this looks like an ai-toolkit job file: translate it with "
            "`./start_toolkit.sh import-aitk JOB.yaml > config.yaml`") in err


@pytest.mark.parametrize("name", ["resolution", "caption_extension"])
def test_a_foreign_name_whose_key_the_family_lacks_is_not_suggested(name, run_cli, capsys):
    assert run_cli("validate", LLM, f"{name}=1") == 2
    assert f"unknown key '{name}' in command line; valid keys here: run, device," in capsys.readouterr().err


def test_every_foreign_name_points_at_a_key_of_the_schema():
    from toolkit.config.families import FAMILY_SPECS
    from toolkit.config.foreign_keys import FOREIGN_KEYS
    from toolkit.config.load import iter_schema_fields, schema_for

    keys = {dotted for family in FAMILY_SPECS for dotted, _ in iter_schema_fields(schema_for(family))}
    assert {name: k.target for name, k in FOREIGN_KEYS.items() if k.target not in keys} == {}


def test_a_kohya_flat_config_without_a_family_gets_the_data_keys_suggested(tmp_path, run_cli, capsys):
    config = tmp_path / "kohya.yaml"
    config.write_text("pretrained_model_name_or_path: x\ntrain_data_dir: images\nresolution: 512\n")
    assert run_cli("validate", config) == 2
    err = capsys.readouterr().err
    assert f"unknown key 'train_data_dir' in {config}:2; did you mean 'data.path'? (train_data_dir: the name in" in err
    assert f"unknown key 'resolution' in {config}:3; did you mean 'data.resolution'? (resolution: the name in" in err


def test_a_command_line_setting_without_its_value_or_its_brackets(run_cli, capsys):
    llm = REPO / "configs/examples/quickstart_llm.yaml"
    assert run_cli("validate", llm, "train.steps") == 2
    assert capsys.readouterr().err == ("error: 'train.steps' has no value: a setting on the command line is key=value\n"
                                       "  fix: write train.steps=VALUE (or, if it is a config file, check the path)\n")
    assert run_cli("validate", REPO / "configs/examples/quickstart_sd.yaml", "sample.prompts=a cat") == 2
    assert ("'sample.prompts' in command line: expected a list of strings, got 'a cat': write it as "
            "'sample.prompts=[\"...\", \"...\"]'") in capsys.readouterr().err
    assert run_cli("validate", REPO / "configs/examples/quickstart_sd.yaml", 'sample.prompts=["a cat"]') == 0
