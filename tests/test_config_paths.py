"""Paths in a config are made absolute where it is read (config/local_paths.py): the run folder's config.yaml
names the same files from any working folder, so resuming it from elsewhere (the web UI, `train
RUN/config.yaml`) finds its data, and a run folder written before, with relative paths, still resumes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from conftest import REPO
from toolkit.cli import main

QUICKSTART = REPO / "configs/examples/quickstart_sd.yaml"
SHAPES = "configs/examples/data/shapes"
SHORT = ["train.steps=2", "save.every=2", "sample.every=0", "log.every=100"]


def train_from(cwd: Path, monkeypatch, *args) -> int:
    monkeypatch.chdir(cwd)
    return main(["train", *map(str, args)])


def test_config_yaml_names_absolute_paths_and_resumes_from_another_folder(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert train_from(REPO, monkeypatch, QUICKSTART, f"run.output_dir={os.path.relpath(run, REPO)}",
                      f"data.path={SHAPES}", *SHORT) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["path"] == str(REPO / SHAPES)
    assert saved["run"]["output_dir"] == str(run)
    assert saved["model"]["name_or_path"] == "tiny:sd"  # not a path: left as it is

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    capsys.readouterr()
    assert train_from(elsewhere, monkeypatch, run / "config.yaml", "train.steps=4") == 0
    out = "".join(capsys.readouterr())
    assert "resumed from" in out and "step-000002" in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert not (elsewhere / "outputs").exists()  # nothing written relative to the other folder


def test_a_run_folder_with_relative_paths_resumes_with_the_absolute_path(tmp_path, monkeypatch, capsys):
    """A run folder from before this change (config.yaml kept data.path as given) resumes when the data is now
    given as an absolute path, and when it is given from another folder as another relative path to it."""
    run = tmp_path / "old-run"
    with monkeypatch.context() as old_toolkit:
        old_toolkit.setattr("toolkit.config.load.make_absolute", lambda cfg: None)
        assert train_from(REPO, monkeypatch, QUICKSTART, f"run.output_dir={run}", f"data.path={SHAPES}",
                          *SHORT) == 0
    assert yaml.safe_load((run / "checkpoints/step-000002/config.yaml").read_text())["data"]["path"] == SHAPES

    capsys.readouterr()
    assert train_from(tmp_path, monkeypatch, QUICKSTART, f"run.output_dir={run}", f"data.path={REPO / SHAPES}",
                      "train.steps=4", "save.every=2", "sample.every=0") == 0
    out = "".join(capsys.readouterr())
    assert "resumed from" in out and "data.path" not in out

    assert train_from(REPO / "configs", monkeypatch, QUICKSTART, f"run.output_dir={run}",
                      "data.path=examples/data/shapes", "train.steps=6", "save.every=2", "sample.every=0") == 0
    assert "resumed from" in "".join(capsys.readouterr())


def test_other_data_still_refuses_the_resume(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    other = tmp_path / "other-shapes"
    other.mkdir()
    for image in (REPO / SHAPES).iterdir():
        (other / image.name).write_bytes(image.read_bytes())
    assert train_from(REPO, monkeypatch, QUICKSTART, f"run.output_dir={run}", f"data.path={SHAPES}", *SHORT) == 0
    capsys.readouterr()
    assert train_from(REPO, monkeypatch, QUICKSTART, f"run.output_dir={run}", f"data.path={other}",
                      "train.steps=4") == 2
    err = capsys.readouterr().err
    assert f"data.path: '{REPO / SHAPES}' in the checkpoint, '{other}' now" in err


def test_what_is_made_absolute(tmp_path, monkeypatch):
    from toolkit.config.layers import Layer
    from toolkit.config.load import merge_layers

    (tmp_path / "base").mkdir()
    (tmp_path / "refs").mkdir()
    monkeypatch.chdir(tmp_path)
    layer = Layer(label="test", data={
        "model": {"family": "qwen_image_edit", "name_or_path": "base"},
        "network": {"init_from": "someone/their-lora"},
        "data": {"path": "images", "reference_paths": ["refs", "/abs/refs"]},
        "sample": {"prompts": ["a"], "references": [["refs/a.png", "refs/b.png"]]},
        "train": {"resume": "auto"},
    })
    cfg = OmegaConf.to_container(merge_layers([layer]).cfg, resolve=True)
    assert cfg["model"]["name_or_path"] == str(tmp_path / "base")   # exists here: a local folder
    assert cfg["network"]["init_from"] == "someone/their-lora"      # does not: a Hub id, as given
    assert cfg["train"]["resume"] == "auto"
    assert cfg["data"]["path"] == str(tmp_path / "images")          # data: always a local path
    assert cfg["data"]["reference_paths"] == [str(tmp_path / "refs"), "/abs/refs"]
    assert cfg["sample"]["references"] == [[str(tmp_path / "refs/a.png"), str(tmp_path / "refs/b.png")]]
    assert cfg["run"]["output_dir"] == str(tmp_path / "outputs/lora")


def test_a_project_moved_with_its_run_and_data_resumes_saying_so(tmp_path, monkeypatch, capsys):
    """config.yaml records absolute paths; moved as a whole, the project's data is found under its new folder (the
    recorded path gone, one of the same last two names there), and the resume says which path it now reads."""
    old, new = tmp_path / "project", tmp_path / "moved"
    shutil.copytree(REPO / SHAPES, old / "data" / "shapes")
    assert train_from(old, monkeypatch, QUICKSTART, "run.output_dir=run", "data.path=data/shapes", *SHORT) == 0
    old.rename(new)
    capsys.readouterr()
    assert train_from(new, monkeypatch, QUICKSTART, "run.output_dir=run", "data.path=data/shapes",
                      "train.steps=4", "save.every=2", "sample.every=0") == 0
    out = "".join(capsys.readouterr())
    assert "resumed from" in out
    assert (f"resume: data.path: {old / 'data/shapes'} is gone; {new / 'data/shapes'}, of the same name, is read in "
            "its place") in out

    other = tmp_path / "other" / "shapes"   # a folder of another name still counts as other data
    shutil.copytree(new / "data" / "shapes", other)
    assert train_from(new, monkeypatch, QUICKSTART, "run.output_dir=run", f"data.path={other}", "train.steps=6") == 2


def test_an_older_runs_bare_name_matches_only_the_file_in_the_folder_it_was_started_from(tmp_path, monkeypatch):
    """An older run's config.yaml kept paths as given. With run.output_dir relative too, the folder it was started
    from is known (the run folder without that tail), and a bare name is resolved there exactly; without it, a bare
    name is never taken for any folder of that name elsewhere (a folder and a name at least must match)."""
    from toolkit.config.load import schema_for
    from toolkit.config.local_paths import adopt_recorded_paths

    schema = schema_for("sd")
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    monkeypatch.chdir(tmp_path)

    def adopted(saved_run: str, saved_data: str, data: Path) -> bool:
        saved = {"run": {"output_dir": saved_run}, "data": {"path": saved_data}}
        current = {"run": {"output_dir": str(project / "runs/a")}, "data": {"path": str(data)}}
        adopt_recorded_paths(saved, current, schema)
        return saved["data"]["path"] == str(data)

    assert adopted("runs/a", "shapes", project / "shapes")           # started from project/: its shapes
    assert not adopted("runs/a", "shapes", elsewhere / "shapes")     # another folder's shapes
    assert adopted("runs/a", "../data/shapes", tmp_path / "data/shapes")
    assert adopted("./runs/a", "data/./shapes", project / "data/shapes")
    # the run folder given absolute: the old working folder is not known
    assert not adopted(str(project / "runs/a"), "shapes", elsewhere / "shapes")
    assert adopted(str(project / "runs/a"), "data/shapes", elsewhere / "data/shapes")  # as before: two names
    assert adopted(str(project / "runs/a"), "shapes", tmp_path / "shapes")             # this folder's own


def test_a_run_folder_moved_without_its_data_still_resumes_with_it(tmp_path, monkeypatch):
    """The older run's working folder, inferred from a run folder that has moved since, is not where its data is: the
    data named from this folder, or a path under ~, are still adopted."""
    from toolkit.config.load import schema_for
    from toolkit.config.local_paths import adopt_recorded_paths

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for recorded, data in (("data/shapes", tmp_path / "data/shapes"), ("~/datasets/x", tmp_path / "home/datasets/x")):
        saved = {"run": {"output_dir": "outputs/x"}, "data": {"path": recorded}}
        current = {"run": {"output_dir": "/mnt/big/outputs/x"}, "data": {"path": str(data)}}
        adopt_recorded_paths(saved, current, schema_for("sd"))
        assert saved["data"]["path"] == str(data), recorded
