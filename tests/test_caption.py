"""`caption FOLDER` (toolkit/caption.py) through the entry point, with the tiny Qwen2.5-VL: a caption file for each
image without one, the model's greedy answer about that image with the prefix before it; captions a user wrote
are kept (and with --replace kept beside the new ones); masks and edit references get none; what `train` then reads
is every image captioned; wrong folders and models end with exit 2 and a fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from toolkit.tiny.fixtures import write_shapes_dataset

TOKENS = ("--model", "tiny:qwen25_vl", "--max-new-tokens", "8")


def expected_caption(image: Path, prompt: str) -> str:
    """The tiny model's greedy answer about `image`, generated here without the command."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from toolkit.data.vision_chat import VisionChatEncoder
    from toolkit.tiny import resolve_model_path

    path = resolve_model_path("tiny:qwen25_vl")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    settings = type("Data", (), {"max_seq_len": 4096, "train_on_prompt": False, "min_pixels": None,
                                 "max_pixels": None})
    encoder = VisionChatEncoder(tokenizer, AutoImageProcessor.from_pretrained(path), model.config.image_token_id,
                                settings)
    inputs = encoder.prompt(prompt, image)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return " ".join(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).split())


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    images = write_shapes_dataset(data, sizes=((64, 64),), count=3)  # three images, each with its caption
    for image in images[1:]:
        image.with_suffix(".txt").unlink()                           # two of them without
    (data / "red_circle_64x64.mask.png").write_bytes((data / images[0].name).read_bytes())
    return data


def test_captions_the_images_without_one_and_keeps_the_users(folder, run_cli, capsys):
    from toolkit.caption import DEFAULT_PROMPT

    images = sorted(p for p in folder.glob("*.png") if not p.stem.endswith(".mask"))
    images.sort(key=lambda p: not p.with_suffix(".txt").exists())   # the one with the user's caption first
    written_by_user = images[0].with_suffix(".txt").read_bytes()
    assert run_cli("caption", folder, *TOKENS, "--prefix", "sks, ") == 0
    err = capsys.readouterr().err
    assert "caption: 2 caption files written" in err and "1 images kept the caption they had" in err
    assert images[0].with_suffix(".txt").read_bytes() == written_by_user
    for image in images[1:]:
        assert image.with_suffix(".txt").read_text() == f"sks, {expected_caption(image, DEFAULT_PROMPT)}\n"
    assert not (folder / "red_circle_64x64.mask.txt").exists()        # a mask is no training image
    assert not list(folder.glob(".*.tmp"))

    # again: nothing left to write
    assert run_cli("caption", folder, *TOKENS) == 0
    assert "caption: 0 caption files written" in capsys.readouterr().err

    # --replace: every image, each earlier caption kept beside the new one
    before = {p.name: p.read_text() for p in folder.glob("*.txt")}
    assert run_cli("caption", folder, *TOKENS, "--replace", "--prompt", "what colour is the shape") == 0
    assert "3 earlier captions kept as <name>.txt.old-<time>" in capsys.readouterr().err
    for image in images:
        [old] = folder.glob(f"{image.stem}.txt.old-*")
        assert old.read_text() == before[f"{image.stem}.txt"]
        assert image.with_suffix(".txt").read_text() == f"{expected_caption(image, 'what colour is the shape')}\n"


def test_train_then_reads_a_caption_for_every_image(folder, run_cli, capsys, tmp_path):
    from conftest import REPO

    assert run_cli("caption", folder, *TOKENS) == 0
    capsys.readouterr()
    assert run_cli("train", REPO / "configs/examples/quickstart_sd.yaml", f"data.path={folder}",
                   f"run.output_dir={tmp_path / 'run'}", "train.steps=1", "train.batch_size=1", "save.every=0",
                   "sample.every=0") == 0
    err = capsys.readouterr().err
    assert "without a caption" not in err and "3 images" in err


def test_edit_references_and_kohya_subfolders(tmp_path, run_cli, capsys):
    data = tmp_path / "kohya"
    images = write_shapes_dataset(data / "10_sks shape", sizes=((64, 64),), count=2)
    for image in images:
        image.with_suffix(".txt").unlink()
    shutil.copy(images[0], images[0].with_name(f"{images[0].stem}_ref1.png"))  # the first image's reference
    assert run_cli("caption", data, *TOKENS) == 0                             # no images of its own: the subfolder's
    assert "caption: 2 caption files written" in capsys.readouterr().err
    assert all(image.with_suffix(".txt").is_file() for image in images)
    assert not images[0].with_name(f"{images[0].stem}_ref1.txt").exists()


@pytest.mark.parametrize("layout, said", [
    ("missing", "is not a folder"),
    ("empty", "no images (.png, .jpg, .jpeg, .webp, .bmp) in"),
    ("metadata", "metadata.jsonl holds this folder's captions, and this command writes caption files"),
    ("model", "caption --model: cannot load"),
    ("device", "caption --device cuda:99: not a device of this machine"),
])
def test_what_it_refuses(layout, said, tmp_path, run_cli, capsys):
    data = tmp_path / "data"
    if layout != "missing":
        data.mkdir()
    if layout in ("metadata", "model", "device"):
        write_shapes_dataset(data, sizes=((64, 64),), count=1)
        (data / "red_circle_64x64.txt").unlink()
    if layout == "metadata":
        (data / "metadata.jsonl").write_text('{"file_name": "red_circle_64x64.png", "text": "a red circle"}\n')
    model = ["--model", str(tmp_path / "no-model")] if layout == "model" else list(TOKENS)
    model += ["--device", "cuda:99"] if layout == "device" else []
    assert run_cli("caption", data, *model) == 2
    err = capsys.readouterr().err
    assert said in err and "fix:" in err and "Traceback" not in err


def test_a_model_without_qwen_vl_s_image_layout_is_refused_by_name(folder, run_cli, capsys, tmp_path):
    """The captioner builds Qwen-VL's inputs (merged patches); a model whose image processor has another layout is
    named, not run into a KeyError."""
    import json

    from toolkit.tiny import resolve_model_path

    other = tmp_path / "other-vlm"
    shutil.copytree(resolve_model_path("tiny:qwen25_vl"), other)
    config = json.loads((other / "preprocessor_config.json").read_text())
    config.update(image_processor_type="CLIPImageProcessor", crop_size={"height": 28, "width": 28})
    del config["merge_size"]
    (other / "preprocessor_config.json").write_text(json.dumps(config))
    assert run_cli("caption", folder, "--model", other) == 2
    err = capsys.readouterr().err
    assert f"caption --model: '{other}' is a Qwen2_5_VLForConditionalGeneration; this command reads the Qwen-VL" in err
    assert "fix: use a Qwen2.5-VL or Qwen3-VL instruct model" in err and "Traceback" not in err
    assert sorted(p.name for p in folder.glob("*.txt")) == ["red_circle_64x64.txt"]  # nothing written


def test_an_unreadable_image_is_skipped_and_two_images_of_one_name_share_one_caption(folder, run_cli, capsys):
    """A truncated image is skipped with a warning, as `train` skips it, and the others are captioned; cat.jpg beside
    cat.png (one cat.txt, which train reads for both) is captioned once, with a warning."""
    from PIL import Image

    (folder / "broken.png").write_bytes((folder / "red_circle_64x64.png").read_bytes()[:60])
    Image.open(folder / "red_square_64x64.png").convert("RGB").save(folder / "red_square_64x64.jpg")
    assert run_cli("caption", folder, *TOKENS) == 0
    err = capsys.readouterr().err
    assert "caption: 2 caption files written" in err
    assert "warning: 1 unreadable images skipped: broken.png (" in err and not (folder / "broken.txt").exists()
    assert ("warning: 1 images share a caption file with an image of the same name: red_square_64x64.png (its caption "
            "is red_square_64x64.jpg's)") in err
    assert not list(folder.glob("*.old-*"))  # no fresh caption set aside by its twin
