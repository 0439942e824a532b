"""What a run says and takes on its command line: a max_seq_len past the model's context, eager attention, a batch
larger than the data's buckets, options between the config and its overrides."""

from __future__ import annotations

import pytest

from conftest import REPO

CONFIG = REPO / "configs/examples/quickstart_llm.yaml"


def test_a_sequence_length_past_the_models_context_is_said(tmp_path, run_cli, capsys):
    common = [f"run.output_dir={tmp_path / 'run'}", "train.steps=1", "save.every=0", "sample.every=0"]
    assert run_cli("train", CONFIG, *common, "data.max_seq_len=1024") == 0
    out = "".join(capsys.readouterr())
    assert ("note: data.max_seq_len=1024 is past the model's context of 512 tokens (max_position_embeddings in its "
            "config.json)") in out and "set data.max_seq_len=512" in out

    assert run_cli("train", CONFIG, f"run.output_dir={tmp_path / 'within'}", *common[1:]) == 0
    assert "past the model's context" not in "".join(capsys.readouterr())


def test_options_between_the_config_and_its_overrides(tmp_path, run_cli, capsys):
    """`train CONFIG --fresh key=value`: the overrides after an option count (argparse alone refused them)."""
    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"run.output_dir={out}", "train.steps=1", "save.every=0", "sample.every=0") == 0
    assert run_cli("train", CONFIG, "--fresh", f"run.output_dir={out}", "train.steps=2", "save.every=0",
                   "sample.every=0", "model.attention=eager") == 0
    said = "".join(capsys.readouterr())
    assert "done: 2 steps" in said and "--fresh: the previous run was moved to" in said
    # eager attention calls no SDPA: the log says so instead of naming an SDPA choice
    assert "attention: the model's attention is eager (model.attention=eager); device.sdpa_backend does not apply" in said
    assert "PyTorch's own SDPA choice" not in said.split("--fresh: the previous run")[1]


def test_a_batch_larger_than_the_buckets_says_what_a_step_trains(tmp_path, run_cli, capsys):
    sd = REPO / "configs/examples/quickstart_sd.yaml"   # 24 images, two aspect-ratio buckets of 12
    common = ["train.steps=1", "save.every=0", "sample.every=0"]
    assert run_cli("train", sd, f"run.output_dir={tmp_path / 'big'}", "train.batch_size=64", *common) == 0
    assert ("note: a micro-batch asks for 64 samples, but the data gives at most 12 at once (24 samples; a batch "
            "takes them from one bucket): each micro-batch trains at most 12; set train.batch_size=12 to say what "
            "runs, or give more data") in "".join(capsys.readouterr())
    assert run_cli("train", sd, f"run.output_dir={tmp_path / 'fits'}", "train.batch_size=12", *common) == 0
    assert "note: a micro-batch asks for" not in "".join(capsys.readouterr())


@pytest.mark.parametrize("used, calls_sdpa", [("sdpa", True), ("sdpa_paged", True), (None, True), ("eager", False),
                                              ("flash_attention_2", False), ("flex_attention", False),
                                              ("kernels-community/flash-attn3", False)])
def test_which_attention_implementations_leave_the_sdpa_choice_unused(used, calls_sdpa):
    from types import SimpleNamespace

    from toolkit.models.llm import LLMMemory

    memory = LLMMemory(SimpleNamespace(network=SimpleNamespace(config=SimpleNamespace(_attn_implementation=used)),
                                       cfg=SimpleNamespace(model=SimpleNamespace(attention="auto"))))
    said = memory.attention_without_sdpa()
    assert said is None if calls_sdpa else said == f"the model's attention is {used} (model.attention=auto)"


def test_fresh_with_init_from_inside_the_moved_run_names_where_it_went(tmp_path, run_cli, capsys):
    """`train --fresh network.init_from=RUN/final`: the earlier run (its final/ included) is moved aside before this
    run writes its own final/ there, so config.yaml and the checkpoints' copies name the moved folder, and the run
    resumes from its own config.yaml."""
    out = tmp_path / "run"
    common = [f"run.output_dir={out}", "train.steps=2", "save.every=1", "sample.every=0"]
    assert run_cli("train", CONFIG, *common) == 0
    capsys.readouterr()
    assert run_cli("train", CONFIG, "--fresh", *common, f"network.init_from={out / 'final'}") == 0
    said = "".join(capsys.readouterr())
    [old] = tmp_path.glob("run.old-*")
    assert f"network.init_from: {out / 'final'} was moved with the earlier run; the run's config names it at " \
           f"{old / 'final'}" in said
    assert f"network.init_from: the LoRA starts from folder {old / 'final'}" in said
    for config in (out / "config.yaml", out / "checkpoints" / "step-000002" / "config.yaml"):
        assert f"init_from: {old / 'final'}\n" in config.read_text(), config
    assert run_cli("train", str(out / "config.yaml"), "train.steps=3") == 0
    assert f"resumed from {out / 'checkpoints' / 'step-000002'} (step 2)" in "".join(capsys.readouterr())
