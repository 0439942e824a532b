"""A disk that fills up mid-run: every writer's full-disk error is recognised, the run stops with exit 2 naming the
disk and the room needed, the earlier checkpoints verify and no temporary file or folder is left. In-process runs
on a disk that fills at a chosen write (tests/filling_disk.py), and, as root on Linux, a real tmpfs that fills."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from conftest import REPO
from filling_disk import FillingDisk, enospc
from toolkit.disk import DiskFull, as_disk_full, disk_of, is_disk_full
from toolkit.train.checkpoint import list_checkpoints, verify_checkpoint
from toolkit.train.run_lock import lock_path

LLM = str(REPO / "configs/examples/quickstart_llm.yaml")
SD = str(REPO / "configs/examples/quickstart_sd.yaml")
LLM_RUN = ["data.max_seq_len=32", "train.batch_size=8", "train.steps=2", "save.every=1", "sample.every=1",
           "log.every=1", "save.dtype=fp32"]


def assert_stopped_cleanly(code: int, err: str, out: Path, checkpoints: list[str]) -> None:
    """Exit 2 with one message naming the disk and the room needed; the checkpoints written before verify, nothing
    temporary is left, the lock is released."""
    assert code == 2, err
    assert "Traceback" not in err and "Exception in thread" not in err
    message = err[err.index("error: disk full while writing"):]
    assert " needs about " in message and " is free on the disk mounted at " in message
    assert "\n  fix: free space on that disk" in message
    assert [p.name for _, p in sorted(list_checkpoints(out / "checkpoints"))] == checkpoints
    for _, folder in list_checkpoints(out / "checkpoints"):
        assert verify_checkpoint(folder)[0] is not None
    leftovers = [p for p in out.rglob("*") if p.name.startswith((".tmp-", ".final.tmp")) or p.name.endswith(".tmp")]
    assert leftovers == []
    assert not lock_path(out).exists()


# Each writer of a run, and where the disk fills: (writer, a part of the path, whether the first checkpoint exists).
LLM_WRITERS = {
    "checkpoint tensors (safetensors)": ("safetensors", "trainable_state.safetensors", True),
    "optimizer state (torch.save)": ("open().write", "optimizer.pt", True),
    "checkpoint meta.json": ("write_text", "meta.json", True),
    "checkpoint LoRA files (PEFT)": ("safetensors", "/.tmp-step-", True),
    "metrics.jsonl": ("open().write", "metrics.jsonl", True),
    "TensorBoard (its writer thread)": ("tensorboard", "", True),
    "samples": ("write_text", "samples.jsonl", True),
    "loss plot (matplotlib)": ("matplotlib", "", True),
    "report": ("write_text", "report.html", True),
    "final LoRA": ("safetensors", ".final.tmp", True),
    "config.yaml": ("write_text", "config.yaml", False),
}


@pytest.mark.parametrize("target", list(LLM_WRITERS))
def test_a_disk_that_fills_under_each_writer_stops_the_run_cleanly(tmp_path, run_cli, capsys, monkeypatch, target):
    writer, part, after_first = LLM_WRITERS[target]
    out = tmp_path / "run"
    first = out / "checkpoints" / "step-000001" / "meta.json"
    disk = FillingDisk(monkeypatch, lambda w, path, n: w == writer and part in path and first.exists() == after_first)
    code = run_cli("train", LLM, f"run.output_dir={out}", *LLM_RUN)
    err = capsys.readouterr().err
    assert disk.failed is not None and disk.failed[0] == writer, disk.writes[-5:]
    checkpoints = {"final LoRA": ["step-000001", "step-000002"], "config.yaml": []}.get(target, ["step-000001"])
    assert_stopped_cleanly(code, err, out, checkpoints)
    assert not (out / "final").exists()


def test_the_checkpoint_message_names_the_checkpoint_its_size_and_what_was_kept(tmp_path, run_cli, capsys, monkeypatch):
    out = tmp_path / "run"
    FillingDisk(monkeypatch, lambda w, path, n: "step-000002" in path and path.endswith("optimizer.pt"))
    assert run_cli("train", LLM, f"run.output_dir={out}", *LLM_RUN, "train.steps=3", "sample.prompts=[]") == 2
    err = capsys.readouterr().err
    checkpoints = out / "checkpoints"
    # 32,768 LoRA weights: fp32 tensors, and 8-bit optimizer states with their scales
    assert (f"error: disk full while writing checkpoint step-000002 in {checkpoints}: it needs about " in err
            and f" is free on {disk_of(checkpoints)}; its temporary files were removed, the earlier checkpoints are "
                "as they were (step-000001)\n  fix: free space on that disk (or set run.output_dir on another disk and "
                "move the run folder there), then run the same command: it resumes from the last checkpoint" in err)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001"]


SD_RUN = ["train.steps=2", "train.batch_size=2", "save.every=1", "sample.every=1", "sample.num_inference_steps=1",
          "sample.prompts=[a red circle]", "log.tensorboard=false"]


def test_a_full_disk_under_the_latent_cache_names_the_cache_disk(tmp_path, run_cli, capsys, monkeypatch,
                                                                  own_data_caches):
    out = tmp_path / "run"
    disk = FillingDisk(monkeypatch, lambda w, path, n: "/latents/" in path)
    code = run_cli("train", SD, f"run.output_dir={out}", *SD_RUN)
    err = capsys.readouterr().err
    assert disk.failed is not None and disk.failed[0] == "safetensors"
    assert_stopped_cleanly(code, err, out, [])
    latents = own_data_caches / "diffusion" / "latents"
    assert f"error: disk full while writing the latents cache in {latents}: this entry needs about " in err
    assert "fix: free space on that disk, or set TOOLKIT_CACHE to a folder on another disk" in err
    assert [p for p in latents.rglob("*") if p.is_file()] == []  # the entry's temporary file was removed


def test_a_full_disk_under_a_sample_image_keeps_the_checkpoint_of_its_step(tmp_path, run_cli, capsys, monkeypatch):
    out = tmp_path / "run"
    first = out / "checkpoints" / "step-000001" / "meta.json"
    disk = FillingDisk(monkeypatch, lambda w, path, n: w == "PIL" and first.exists())
    code = run_cli("train", SD, f"run.output_dir={out}", *SD_RUN)
    err = capsys.readouterr().err
    assert disk.failed is not None and disk.failed[1] == str(out / "samples" / "step-000001" / "00.png")
    assert_stopped_cleanly(code, err, out, ["step-000001"])
    assert f"error: disk full while writing samples in {out / 'samples' / 'step-000001'}: the next checkpoint needs" in err


def test_sample_and_merge_commands_on_a_full_disk(tiny_runs, tmp_path, run_cli, capsys, monkeypatch):
    run = tiny_runs["llm"]
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    FillingDisk(monkeypatch, lambda w, path, n: True)
    assert run_cli("sample", run, "--out", tmp_path / "samples") == 2
    err = capsys.readouterr().err
    assert f"error: disk full while writing samples in {tmp_path / 'samples'}" in err and "Traceback" not in err
    assert "fix: free space on that disk, or give --out DIR on another disk" in err
    assert run_cli("merge", run, tmp_path / "merged") == 2
    err = capsys.readouterr().err
    assert f"error: disk full while writing the merged model in {tmp_path}: it needs about " in err
    assert "Traceback" not in err and not (tmp_path / "merged").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".merged")] == []
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before


def test_a_full_disk_while_writing_an_mp4_stops_instead_of_skipping_the_video(tmp_path, monkeypatch):
    import av
    from PIL import Image

    from toolkit.data import video

    def full_disk(path, mode="r", *args, **kwargs):
        raise av.error.OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(av, "open", full_disk)
    frames = [Image.new("RGB", (8, 8), (i * 30, 0, 0)) for i in range(3)]
    with pytest.raises(OSError) as info:
        video.write_video(frames, tmp_path / "clip", fps=4)
    assert is_disk_full(info.value) and not (tmp_path / "clip.mp4").exists()


def _raised(make) -> BaseException:
    try:
        make()
    except BaseException as err:  # noqa: BLE001
        return err
    raise AssertionError("nothing raised")


def _torch_save_on_full_disk() -> None:
    # what torch.save into a Python file raises when the file's write fails (toolkit/train/checkpoint.py)
    try:
        raise enospc()
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None


def test_every_writers_full_disk_error_is_recognised_and_nothing_else_is():
    from safetensors import SafetensorError

    full = [enospc("/x/a.png"), OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
            SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
            _raised(_torch_save_on_full_disk)]
    assert all(is_disk_full(err) for err in full)
    others = [PermissionError(errno.EACCES, "Permission denied"), RuntimeError("unexpected pos 704 vs 598"),
              ValueError("no space"), FileNotFoundError(errno.ENOENT, "No such file or directory")]
    assert not any(is_disk_full(err) for err in others)
    named = as_disk_full(enospc("/x/a.png"), Path("/run"))
    assert isinstance(named, DiskFull) and named.what == "a.png" and named.folder == Path("/x")
    assert as_disk_full(full[2], Path("/run")).what == "the run's files"
    assert as_disk_full(others[0], Path("/run")) is None


def _mounted_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def _unmount(path: Path) -> None:
    """Unmount the test's tmpfs; one that is still busy means a file of the run was left open (a bug)."""
    done = subprocess.run(["umount", str(path)], capture_output=True, text=True)
    if done.returncode:
        subprocess.run(["umount", "-l", str(path)], check=False)
        raise AssertionError(f"umount {path}: {done.stderr.strip()} (a file left open?)")


# Real writers on a real full disk (root on Linux): what each one raises is recognised.
def _torch_save(folder: Path) -> None:
    with (folder / "a.pt").open("wb") as handle:  # as checkpoints are saved
        torch.save({"a": torch.zeros(2**16)}, handle)


def _json_dump(folder: Path) -> None:
    with (folder / "a.json").open("w") as handle:
        json.dump(list(range(2**16)), handle)


def _safetensors(folder: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2**16)}, str(folder / "a.safetensors"))


def _pil(folder: Path) -> None:
    from PIL import Image

    Image.effect_noise((512, 512), 64).save(folder / "a.png")


WRITERS_ON_A_FULL_DISK = {"safetensors": _safetensors, "torch.save into a file": _torch_save,
                          "write_text": lambda folder: (folder / "a.txt").write_text("x" * 2**18),
                          "json.dump": _json_dump, "PIL": _pil}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounting a tmpfs needs root on Linux")
def test_real_writers_on_a_full_tmpfs_are_recognised(tmp_path):
    disk = tmp_path / "disk"
    if not _mounted_tmpfs(disk, "64k"):
        pytest.skip("mount -t tmpfs failed here")
    try:
        for name, write in WRITERS_ON_A_FULL_DISK.items():
            err = _raised(lambda: write(disk))
            assert is_disk_full(err), f"{name}: {type(err).__name__}: {err}"
            for child in disk.iterdir():
                child.unlink()
        assert disk_of(disk / "x") == f"the disk mounted at {disk} (tmpfs)"
    finally:
        _unmount(disk)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounting a tmpfs needs root on Linux")
def test_a_tmpfs_that_fills_during_a_real_run_then_resumes_once_freed(tmp_path, run_cli, capsys, monkeypatch):
    """The run folder on a tmpfs of 110 MiB (a run needs 100 MiB free to start); once the first checkpoint is written
    another writer fills the disk but 16 KiB, and the next checkpoint meets the real ENOSPC."""
    disk = tmp_path / "disk"
    if not _mounted_tmpfs(disk, "110m"):
        pytest.skip("mount -t tmpfs failed here")
    import toolkit.train.checkpointer as trainer  # where the trainer rotates its checkpoints

    out, filler = disk / "run", disk / "filler"
    rotate = trainer.rotate_checkpoints

    def fill_after_first(checkpoints_dir, keep_last):  # after each checkpoint, once: the disk fills
        if not filler.exists():
            with filler.open("wb") as handle:
                while os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize > 16 * 1024:
                    handle.write(b"\0" * min(2**20, os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - 16384))
                    handle.flush()
        return rotate(checkpoints_dir, keep_last)

    try:
        monkeypatch.setattr(trainer, "rotate_checkpoints", fill_after_first)
        args = ["train", LLM, f"run.output_dir={out}", *LLM_RUN, "train.steps=3", "sample.prompts=[]"]
        code = run_cli(*args)
        err = capsys.readouterr().err
        assert_stopped_cleanly(code, err, out, ["step-000001"])
        assert f"is free on the disk mounted at {disk} (tmpfs)" in err
        monkeypatch.setattr(trainer, "rotate_checkpoints", rotate)
        filler.unlink()  # the user frees space and runs the same command
        assert run_cli(*args) == 0
        resumed = capsys.readouterr().err
        assert f"resumed from {out / 'checkpoints' / 'step-000001'} (step 1)" in resumed
        reference = tmp_path / "reference"
        assert run_cli("train", LLM, f"run.output_dir={reference}", *LLM_RUN, "train.steps=3",
                       "sample.prompts=[]") == 0
        # read, not mapped: a mapped file would keep the tmpfs busy
        a, b = (load(path.read_bytes()) for path in (reference / "final" / "adapter_model.safetensors",
                                                      out / "final" / "adapter_model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    finally:
        _unmount(disk)
