"""`validate` and `train` report every problem of a config at once, before any model loads: keys given twice,
unknown names, and what the config points at (data, model, output location)."""

from __future__ import annotations

import textwrap

from conftest import REPO, run_toolkit

LLM = REPO / "configs/examples/quickstart_llm.yaml"


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    config = tmp_path / "twice.yaml"
    config.write_text(textwrap.dedent("""\
        model:
          family: llm
          name_or_path: tiny:llm
        data:
          path: data.jsonl
        model:
          name_or_path: tiny:llm
        train:
          lr: 1.0e-4
          steps: 5
          lr: 2.0e-4
        """))
    proc = run_toolkit("validate", config, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"'model' is given twice in {config}: lines 1 and 6 (YAML would silently keep only the second)" in proc.stderr
    assert f"'train.lr' is given twice in {config}: lines 9 and 11" in proc.stderr


def test_validate_and_train_report_paths_and_names_together_before_any_model_loads(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = [LLM, f"data.path={tmp_path / 'missing.jsonl'}", f"model.name_or_path={tmp_path / 'no-model'}",
            f"run.output_dir={afile}", "train.optimizer=adamw9bit", "train.lr_scheduler=cosin", "device.preset=gfx9999",
            "save.format=kohya"]
    for command in ("validate", "train"):
        proc = run_toolkit(command, *args, timeout=60)
        err = proc.stderr
        assert proc.returncode == 2 and "Traceback" not in err and "config OK" not in err
        assert "invalid config (7 problems)" in err
        assert "'device.preset': unknown preset 'gfx9999'; available: auto, cpu, " in err
        assert "'train.optimizer' in command line: 'adamw9bit' is not one of " in err and "adamw8bit" in err
        assert "'train.lr_scheduler' in command line: 'cosin' is not one of constant, " in err
        assert "'save.format' in command line: kohya is not available for model.family llm; use one of auto, peft" in err
        assert f"'data.path' in command line: the data file {tmp_path / 'missing.jsonl'} does not exist" in err
        assert f"'model.name_or_path' in command line: the folder {tmp_path / 'no-model'} does not exist" in err
        assert f"'run.output_dir' in command line: {afile} is a file, not a folder" in err
        assert "model: llm" not in err


def test_validate_names_a_missing_data_folder(tmp_path):
    proc = run_toolkit("validate", REPO / "configs/examples/quickstart_sd.yaml", f"data.path={tmp_path / 'imgs'}",
                       timeout=60)
    assert proc.returncode == 2 and "config OK" not in proc.stderr
    assert f"'data.path' in command line: the data folder {tmp_path / 'imgs'} does not exist; fix the path" in proc.stderr


def test_a_sample_size_the_pipeline_refuses_is_named_before_training(run_cli, capsys, tmp_path):
    """diffusers refuses a sample size that is not a multiple of the family's (or resizes it without a word) only when
    the first sample is drawn, after training has begun: validate, train and sample name a sample.width given so.
    0 (data.resolution) is rounded down when the samples are drawn, and said (tests/test_sd_train.py)."""
    sd, wan = REPO / "configs/examples/quickstart_sd.yaml", REPO / "configs/examples/quickstart_wan21.yaml"
    assert run_cli("validate", sd, "sample.width=100") == 2
    assert ("'sample.width' is 100, and sd's pipeline draws samples in multiples of 8 pixels: set sample.width to 96 "
            "or 104") in capsys.readouterr().err
    assert run_cli("validate", sd, "data.resolution=100", "sample.width=0", "sample.height=0") == 0
    assert run_cli("validate", sd, "sample.width=100", "sample.prompts=[]") == 0   # no samples: nothing drawn
    capsys.readouterr()
    assert run_cli("train", wan, f"run.output_dir={tmp_path / 'wan'}", "sample.width=72") == 2
    err = capsys.readouterr().err
    assert ("'sample.width' is 72, and wan21's pipeline draws samples in multiples of 16 pixels: set sample.width to "
            "64 or 80") in err and "Traceback" not in err
    assert not (tmp_path / "wan").exists()                                            # refused before the run folder


def test_a_data_folder_without_images_is_named_by_validate(run_cli, capsys, tmp_path):
    (tmp_path / "captions").mkdir()
    (tmp_path / "captions" / "cat.txt").write_text("a cat")
    sd = REPO / "configs/examples/quickstart_sd.yaml"
    assert run_cli("validate", sd, f"data.path={tmp_path / 'captions'}") == 2
    assert (f"'data.path' in command line: no images or videos in {tmp_path / 'captions'} (it holds cat.txt); add "
            "them (.png, .jpg, .webp, .mp4, ...), each with a same-name .txt caption") in capsys.readouterr().err


def test_a_missing_init_from_is_named_by_validate_unless_the_run_resumes(run_cli, capsys, tmp_path):
    sd = REPO / "configs/examples/quickstart_sd.yaml"
    missing = tmp_path / "nope"
    assert run_cli("validate", sd, f"network.init_from={missing}", f"run.output_dir={tmp_path / 'run'}") == 2
    assert (f"'network.init_from' in command line: {missing} does not exist; give a LoRA file (.safetensors), an "
            "adapter folder, a run folder or a checkpoint folder") in capsys.readouterr().err
    step = tmp_path / "run" / "checkpoints" / "step-000002"   # a run that resumes never reads it
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    assert run_cli("validate", sd, f"network.init_from={missing}", f"run.output_dir={tmp_path / 'run'}") == 0
