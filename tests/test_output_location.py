"""The output location: checked before any model loads (a disk that fills up mid-run: tests/test_disk_full.py)."""

from __future__ import annotations

import errno
import os

import pytest

from conftest import REPO, run_toolkit

LLM = REPO / "configs/examples/quickstart_llm.yaml"


def test_an_output_path_that_is_a_file_or_under_one_is_refused_before_the_model_loads(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("a user's file")
    for out, expected in ((afile, f"{afile} is a file, not a folder"),
                          (afile / "run", f"{afile / 'run'} cannot be created: {afile} is a file, not a folder")):
        proc = run_toolkit("train", LLM, f"run.output_dir={out}", timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert f"'run.output_dir' in command line: {expected}; set run.output_dir to a folder you can write in" in proc.stderr
        assert "model: llm" not in proc.stderr  # refused before any model loaded
    assert afile.read_text() == "a user's file"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any folder")
def test_a_folder_that_is_not_writable_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        proc = run_toolkit("validate", LLM, f"run.output_dir={locked / 'run'}", timeout=60)
    finally:
        locked.chmod(0o755)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"cannot write in {locked}, the folder (Permission denied)" in proc.stderr


def test_a_write_probe_that_fails_names_the_folder_and_the_reason(tmp_path, run_cli, capsys, monkeypatch):
    """Simulated (tests may run as root, who can write anywhere): the probe's create fails with EROFS."""
    import toolkit.disk

    real_open = os.open

    def read_only(path, flags, *args):
        if ".toolkit-write-probe-" in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(toolkit.disk.os, "open", read_only)
    assert run_cli("validate", LLM, f"run.output_dir={tmp_path / 'run'}") == 2
    err = capsys.readouterr().err
    assert f"cannot write in {tmp_path}, the folder (Read-only file system); set run.output_dir to a folder" in err


def test_a_disk_without_room_is_refused_at_start_naming_the_space(tmp_path, run_cli, capsys, monkeypatch):
    import toolkit.preflight.output_location as output_location

    monkeypatch.setattr(output_location, "free_bytes", lambda path: 5 * 2**20)
    assert run_cli("train", LLM, f"run.output_dir={tmp_path / 'run'}") == 2
    err = capsys.readouterr().err
    assert f"only 5.0 MiB free on the disk of {tmp_path}; a run needs at least 100.0 MiB" in err
    assert "model: llm" not in err and not (tmp_path / "run").exists()


def test_a_checkpoint_that_does_not_fit_is_refused_once_the_lora_is_built(tmp_path, run_cli, capsys, monkeypatch):
    import toolkit.train.checkpointer as checkpointer

    monkeypatch.setattr(checkpointer, "free_bytes", lambda path: 2**20)
    assert run_cli("train", LLM, f"run.output_dir={tmp_path / 'run'}", "train.steps=1") == 2
    err = capsys.readouterr().err
    checkpoints = tmp_path / "run" / "checkpoints"
    # 32,768 LoRA weights x 4 bytes x (weights + 2 optimizer states) + 1 MiB
    assert f"not enough room for a checkpoint in {checkpoints}: one needs about 1.4 MiB (32,768 trainable" in err
    assert not any(checkpoints.iterdir())


SD = REPO / "configs/examples/quickstart_sd.yaml"


def test_a_users_folder_or_the_data_folder_is_refused_as_the_run_folder_and_left_as_it_is(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for f in (REPO / "configs/examples/data/shapes").iterdir():
        (data / f.name).write_bytes(f.read_bytes())
    notes = tmp_path / "mine"
    notes.mkdir()
    (notes / "notes.md").write_text("a user's notes")
    (notes / ".DS_Store").write_text("")
    cases = [(data, data, f"{data} is the data folder of 'data.path'; set run.output_dir to a folder of its own"),
             (tmp_path, data, f"{tmp_path} holds the data folder of 'data.path' ({data}): a fresh start would move "
                              "the data aside"),
             (notes, data, f"{notes} holds files that no run of this toolkit wrote (notes.md); a run's folder is new, "
                           "empty or an earlier run's (with its config.yaml); set run.output_dir to a new folder")]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out, path, expected in cases:
        for command, extra in (("validate", []), ("train", ["--fresh"])):
            proc = run_toolkit(command, SD, f"run.output_dir={out}", f"data.path={path}", *extra, timeout=60)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
            assert f"'run.output_dir' in command line: {expected}" in proc.stderr
    # nothing was moved aside, written or removed
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    # a run folder inside the data folder is fine (data folders are not read recursively), as is an empty one
    (tmp_path / "empty").mkdir()
    for out in (data / "run", tmp_path / "empty"):
        assert run_toolkit("validate", SD, f"run.output_dir={out}", f"data.path={data}", timeout=60).returncode == 0


def test_choose_start_refuses_a_folder_filled_by_the_user_after_the_preflight(tmp_path):
    from toolkit.errors import UserError
    from toolkit.train.resume import choose_start
    from toolkit.train.run_dir import RunDir

    (tmp_path / "photo.png").write_bytes(b"not a run")
    for fresh in (False, True):
        with pytest.raises(UserError, match=r"holds files that no run of this toolkit wrote \(photo.png\)"):
            choose_start("auto", RunDir(tmp_path), fresh, print)
    assert [p.name for p in tmp_path.iterdir()] == ["photo.png"]


def test_a_resume_path_that_does_not_exist_says_so(tmp_path):
    from toolkit.errors import UserError
    from toolkit.train.resume import choose_start
    from toolkit.train.run_dir import RunDir

    with pytest.raises(UserError, match=rf"train.resume: {tmp_path / 'nowhere'} does not exist\n  fix: give a "
                                        r"checkpoint folder \(checkpoints/step-NNNNNN\) or train.resume=auto"):
        choose_start(str(tmp_path / "nowhere"), RunDir(tmp_path / "run"), False, print)
