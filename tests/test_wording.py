"""Lines a new user reads and took the wrong way: the step count of a one-step run, the preset the CPU gets.
(merge's line: test_llm_train.py; sample's file count and its report section: test_sample.py.)"""

from __future__ import annotations

from conftest import REPO

LLM = REPO / "configs/examples/quickstart_llm.yaml"


def test_a_one_step_run_says_one_step(tmp_path, run_cli, capsys):
    assert run_cli("train", LLM, f"run.output_dir={tmp_path / 'run'}", "train.steps=1", "data.max_seq_len=16",
                   "sample.every=0", "save.every=0", "sample.prompts=[]", "log.tensorboard=false") == 0
    err = capsys.readouterr().err
    assert "done: 1 step in " in err and f"s; LoRA written to {tmp_path / 'run' / 'final'}" in err


def test_the_cpu_preset_is_named_as_the_cpus_own(run_cli, capsys):
    assert run_cli("validate", LLM, "device.preset=auto") == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "# device: cpu cpu (CPU); preset cpu: the preset for training on the CPU"
