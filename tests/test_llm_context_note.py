"""data.max_seq_len past the model's max_position_embeddings trains, with a note that names both and the fix."""

from __future__ import annotations

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
