"""The data folder's report at the start of a diffusion run: files without captions, caption files without a
file, and the caption an uncaptioned file trains with."""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from conftest import REPO
from toolkit.config.data_schemas import ImageDataSection
from toolkit.data.images import scan_images
from toolkit.tiny.fixtures import write_shapes_dataset


def test_train_names_the_uncaptioned_image_and_the_stray_caption(tmp_path, run_cli, capsys, own_data_caches):
    data = tmp_path / "data"
    write_shapes_dataset(data, sizes=((64, 64),), count=4)
    (data / "green_circle_64x64.txt").unlink()
    (data / "notes.txt").write_text("a caption whose image was renamed\n")
    assert run_cli("train", REPO / "configs/examples/quickstart_sd.yaml", f"data.path={data}",
                   f"run.output_dir={tmp_path / 'run'}", "train.steps=1", "train.batch_size=2", "save.every=0",
                   "sample.every=0", "sample.prompts=[]", "log.tensorboard=false") == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    start = lines.index(f"data: 4 images in {data}, 3 with a caption (.txt files), 1 without")
    assert lines[start + 1:start + 3] == [
        "warning: 1 image without a caption (no .txt beside, or an empty one): green_circle_64x64.png; it trains with "
        'the caption "sks" (data.trigger_word alone; data.default_caption is empty)',
        "warning: 1 caption file without an image of the same name, not used: notes.txt (a caption names its image by "
        "its name: cat.txt for cat.png)"]
    assert "; 4 training samples" in err


def _data(path, **kw):
    cfg = OmegaConf.structured(ImageDataSection)
    cfg.path = str(path)
    for key, value in kw.items():
        cfg[key] = value
    return cfg


def test_more_than_five_names_are_counted_and_the_default_caption_is_a_note(tmp_path):
    images = [p.name for p in sorted(write_shapes_dataset(tmp_path, sizes=((64, 64),), count=8))]
    captions = [tmp_path / name.replace(".png", ".txt") for name in images]
    for caption in captions[:2]:
        caption.write_text("  \n")  # only blanks: no caption
    for caption in captions[2:7]:
        caption.unlink()
    for n in range(6):
        (tmp_path / f"orphan{n}.txt").write_text("x")
    logs: list[str] = []
    scan_images(_data(tmp_path, default_caption="a shape", trigger_word="sks"), logs.append)
    assert logs[0] == f"data: 8 images in {tmp_path}, 1 with a caption (.txt files), 7 without"
    names = [f"{images[0]} (empty)", f"{images[1]} (empty)", *images[2:5]]
    assert logs[1] == (f"note: 7 images without a caption (no .txt beside, or an empty one): {', '.join(names)} and 2 "
                       'more; they train with the caption "sks, a shape" (data.default_caption with data.trigger_word)')
    assert logs[2] == ("warning: 6 caption files without an image of the same name, not used: orphan0.txt, orphan1.txt, "
                       "orphan2.txt, orphan3.txt, orphan4.txt and 1 more (a caption names its image by its name: "
                       "cat.txt for cat.png)")


def test_metadata_records_without_text_train_with_the_empty_caption(tmp_path):
    write_shapes_dataset(tmp_path, sizes=((64, 64),), count=2)
    records = [{"file_name": "red_circle_64x64.png", "text": "a red circle"}, {"file_name": "red_square_64x64.png"}]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    logs: list[str] = []
    scan_images(_data(tmp_path), logs.append)
    assert logs[:3] == [
        f"data: 2 images in {tmp_path}, 1 with a caption (metadata.jsonl), 1 without",
        "warning: 1 image without a caption (no text in metadata.jsonl): red_square_64x64.png; it trains with the "
        "empty caption (data.default_caption and data.trigger_word are unset): it learns the images without words; "
        "set data.default_caption or write the caption files",
        f"note: 2 .txt files in {tmp_path} not read: metadata.jsonl gives the captions (red_circle_64x64.txt, "
        "red_square_64x64.txt)"]


def test_metadata_caption_field_the_files_it_leaves_out_and_a_caption_ext_without_its_dot(tmp_path):
    write_shapes_dataset(tmp_path, sizes=((64, 64),), count=3)
    records = [{"file_name": "red_circle_64x64.png", "caption": "a red circle"},
               {"file_name": "red_square_64x64.png", "text": "a red square"}]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    logs: list[str] = []
    found = scan_images(_data(tmp_path), logs.append)
    assert sorted(item.caption for item in found) == ["a red circle", "a red square"]
    assert logs[0] == f"data: 2 images in {tmp_path}, 2 with a caption (metadata.jsonl), 0 without"
    assert f"note: 1 image(s) in {tmp_path} not listed in metadata.jsonl, not used: red_triangle_64x64.png" in logs
    (tmp_path / "metadata.jsonl").unlink()
    logs.clear()
    found = scan_images(_data(tmp_path, caption_ext="txt"), logs.append)
    assert len(found) == 3 and logs[0] == f"data: 3 images in {tmp_path}, 3 with a caption (.txt files), 0 without"
