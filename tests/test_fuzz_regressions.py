"""One test per bug the fuzzers of test_fuzz.py found: each input once gave a traceback; now a named error (exit 2)
or a result."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO
from toolkit.config.data_schemas import ImageDataSection, TextDataSection, VideoDataSection
from toolkit.config.layers import parse_scalar, read_yaml_layer
from toolkit.errors import UserError

LLM = REPO / "configs/examples/quickstart_llm.yaml"


def _image_data(schema, path: Path, **settings):
    data = OmegaConf.structured(schema)
    data.path = str(path)
    for key, value in settings.items():
        data[key] = value
    return data


def test_metadata_jsonl_whose_text_is_not_a_string_is_named(tmp_path):
    """Was: AttributeError 'list' object has no attribute 'strip' (a caption that was a JSON list)."""
    from PIL import Image

    from toolkit.data.images import scan_images

    Image.new("RGB", (64, 64)).save(tmp_path / "0.png")
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "0.png", "text": [None]}) + "\n")
    with pytest.raises(UserError, match=r"metadata.jsonl:1: expected a JSON object with file_name and text \(or caption\), strings"
                                        r"\n  fix: write lines like"):
        scan_images(_image_data(ImageDataSection, tmp_path), lambda m: None)


def test_a_model_family_that_is_a_list_is_a_config_error(tmp_path, run_cli, capsys):
    """Was: TypeError unhashable type: 'list' (model.family: [])."""
    config = tmp_path / "c.yaml"
    config.write_text(LLM.read_text().replace("family: llm", "family: []"))
    assert run_cli("validate", config) == 2
    err = capsys.readouterr().err
    assert f"'model.family' in {config}:" in err and "got []" in err


def test_a_yaml_alias_inside_its_own_anchor_is_named(tmp_path):
    """Was: RecursionError in the duplicate-key check (`name: &a [*a]`, a list that contains itself)."""
    config = tmp_path / "c.yaml"
    config.write_text("run:\n  name: &a [*a]\n")
    with pytest.raises(UserError, match=r"c.yaml:2: a YAML alias inside its own anchor \(&name ... \*name\) makes a "
                                        r"value that contains itself"):
        read_yaml_layer(config)
    assert parse_scalar("&a [*a]") == "&a [*a]"  # on the command line: the text as typed
    laughs = "".join(f"{k}: &{k} [{', '.join([f'*{p}'] * 10) if p else '1'}]\n"
                     for k, p in zip("abcdef", ["", "a", "b", "c", "d", "e"]))
    config.write_text(laughs)
    with pytest.raises(UserError, match="its YAML aliases expand to more than 100,000 values"):
        read_yaml_layer(config)


@pytest.mark.parametrize("override, shown", [('network={"\\ud800x": 1}', "network.\\ud800x"),
                                             ('run.name="\\udfffa"', "run.name")])
def test_text_that_is_not_unicode_is_a_config_error(override, shown, run_cli, capsys):
    """Was: UnicodeEncodeError while printing (validate's table, or an error naming the key): a YAML escape of half
    a UTF-16 pair (\\ud800), or a command-line byte that is not UTF-8."""
    assert run_cli("validate", LLM, override) == 2
    err = capsys.readouterr().err
    assert f"- '{shown}' in command line: '" in err
    assert "is not valid Unicode text (half of a UTF-16 surrogate pair, or a byte that is not UTF-8)" in err
    assert run_cli("validate", LLM, b"run.name=caf\xe9".decode("utf-8", "surrogateescape")) == 2
    assert "'run.name' in command line: 'caf\\udce9' is not valid Unicode" in capsys.readouterr().err


def test_a_truncated_gif_is_skipped_as_unreadable(tmp_path):
    """Was: IndexError from Pillow counting the frames of a GIF cut short."""
    from PIL import Image

    from toolkit.data.video import scan_clips

    buffer = io.BytesIO()
    frames = [Image.new("RGB", (1, 1), (i * 40, 100, 200)) for i in range(3)]
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    (tmp_path / "0.png").write_bytes(buffer.getvalue()[:-12])
    Image.new("RGB", (80, 64)).save(tmp_path / "ok.png")
    messages = []
    items = scan_clips(_image_data(VideoDataSection, tmp_path, num_frames=1), messages.append)
    assert [item.path.name for item in items] == ["ok.png"]
    assert messages[0] == f"data: 2 clips in {tmp_path}, 0 with a caption (.txt files), 2 without"
    assert any(m.startswith(f"warning: skipped 1 unreadable clip(s) in {tmp_path}: 0.png (") for m in messages)


def test_a_conversation_that_begins_with_the_assistant_is_named(tmp_path):
    """Was: ValueError from the chat template ("an empty conversation": the prompt before the first turn)."""
    from transformers import AutoTokenizer

    from toolkit.data.text import build_text_data
    from toolkit.tiny import resolve_model_path

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": ""}]}) + "\n")
    data = OmegaConf.structured(TextDataSection)
    data.path, data.max_seq_len = str(path), 8
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny:llm"))
    with pytest.raises(UserError, match=rf"{path}:1: the conversation begins with an assistant turn, which has no "
                                        r"prompt before it\n  fix: start it with a user \(or system\) turn"):
        build_text_data(data, tokenizer, seed=0)
    data.train_on_prompt = True  # every token is learned: nothing to mask
    assert len(build_text_data(data, tokenizer, seed=0).train) == 1
