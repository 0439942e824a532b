"""Settings that `train` used to refuse only once the model had loaded, named by `validate` (and by `train` before
anything loads): clip lengths a video VAE cannot compress, output preservation without a trigger word or with a
LoRA on the text encoders."""

from __future__ import annotations

import pytest

from conftest import REPO

EXAMPLES = REPO / "configs/examples"


@pytest.mark.parametrize("config, overrides, expected", [
    ("quickstart_ltx2.yaml", ["data.num_frames=5"],
     "'data.num_frames' in command line: 5 is not 8k+1 (the VAE compresses time by 8); use 1 or 9"),
    ("quickstart_wan21.yaml", ["data.frame_extraction=head", "data.target_frames=[9,10]"],
     "'data.target_frames' in command line: 10 is not 4k+1 (the VAE compresses time by 4); use 9 or 13"),
    ("quickstart_wan21.yaml", ["data.num_frames=10"],
     "'data.num_frames' in command line: 10 is not 4k+1 (the VAE compresses time by 4); use 9 or 13"),
    ("quickstart_sd.yaml", ["train.dop_class=shape", "train.train_text_encoder=true"],
     "'train.dop_class': output preservation compares with the base model through the text encoders, and "
     "train.train_text_encoder puts a LoRA on them: set train.train_text_encoder=false, or unset train.dop_class"),
    ("quickstart_sd.yaml", ["train.dop_class=shape", "data.trigger_word=null"],
     "'train.dop_class': output preservation replaces the trigger word, and data has no trigger_word: set "
     "data.trigger_word (the word the LoRA learns), or unset train.dop_class"),
])
def test_validate_names_what_train_would_refuse_after_loading(run_cli, capsys, config, overrides, expected):
    assert run_cli("validate", EXAMPLES / config, *overrides) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_what_is_allowed_passes(run_cli, capsys):
    assert run_cli("validate", EXAMPLES / "quickstart_ltx2.yaml", "data.num_frames=9") == 0
    assert run_cli("validate", EXAMPLES / "quickstart_wan21.yaml", "data.frame_extraction=head",
                   "data.target_frames=[5,9]") == 0
    # a regularisation dataset needs no trigger word for output preservation
    assert run_cli("validate", EXAMPLES / "quickstart_sd.yaml", "train.dop_class=shape",
                   "data.datasets=[{path: configs/examples/data/shapes, is_regularization: true}]") == 0


def test_validate_names_the_package_save_format_gguf_needs(run_cli, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)   # as if it were not installed
    assert run_cli("validate", EXAMPLES / "quickstart_llm.yaml", "save.format=gguf") == 2
    err = capsys.readouterr().err
    assert ("'save.format': save.format=gguf needs the gguf package (llama.cpp's GGUF writer), which is not "
            "installed: pip install gguf (or pip install -e '.[gguf]' in the toolkit's .venv), or set "
            "save.format=peft") in err and "Traceback" not in err
