"""Resume: a run that is stopped (kill -9, SIGTERM, a corrupt checkpoint) and resumed ends bit-identical.

Each family's quickstart is a row of RESUME_CONFIGS; a family is tested once its quickstart exists
(the SD quickstart joins with its own overrides when it is added).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_toolkit
from helpers import read_metrics
from toolkit.train.checkpoint import find_latest_checkpoint, trainable_from_file, verify_checkpoint

STEPS = 24
# Fast and deterministic: fp32 export, the 8-bit optimizer, cosine with warmup, a log line every step.
COMMON = [f"train.steps={STEPS}", "save.every=4", "save.keep_last=10", "save.dtype=fp32", "train.optimizer=adamw8bit",
          "train.lr=3e-3", "train.lr_scheduler=cosine", "train.warmup_steps=3", "log.every=1", "log.tensorboard=false",
          "sample.prompts=[]"]
RESUME_CONFIGS = {
    "llm": ("configs/examples/quickstart_llm.yaml", ["data.max_seq_len=32", "train.batch_size=8"]),
}
# One intra-op thread: CPU reductions then do not depend on how a loaded machine splits the work.
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
FAMILIES = [f for f, (config, _) in RESUME_CONFIGS.items() if (REPO / config).is_file()]


def train_args(family: str, out: Path, *extra: str) -> list[str]:
    config, overrides = RESUME_CONFIGS[family]
    return ["train", str(REPO / config), *COMMON, *overrides, f"run.output_dir={out}", *extra]


def train_subprocess(family: str, out: Path, *extra: str) -> int:
    """Run `python -m toolkit train ...` to the end; its stderr is echoed (for capsys). Returns the exit code.

    Every run of a comparison is a real subprocess: bit-identity is asserted between like processes.
    """
    proc = run_toolkit(*train_args(family, out, *extra), env=SINGLE_THREAD)
    print(proc.stderr, file=sys.stderr)
    return proc.returncode


def start_subprocess(family: str, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "toolkit", *train_args(family, out, *extra)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **SINGLE_THREAD})


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "adapter_model.safetensors"))


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    assert len(a) > 0
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def metric_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out)]


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"training ended (rc {proc.returncode}) before the test could stop it:\n" \
                                    f"{proc.communicate()[1]}"
        assert time.monotonic() < deadline, "timed out waiting for training progress"
        time.sleep(0.005)


def kill_9_after_checkpoint(proc: subprocess.Popen, out: Path, step: int) -> None:
    """SIGKILL the training subprocess as soon as the checkpoint of `step` is complete."""
    try:
        wait_for(lambda: (out / "checkpoints" / f"step-{step:06d}" / "meta.json").is_file(), proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()


@pytest.fixture(scope="module", params=FAMILIES)
def reference(request, tmp_path_factory) -> tuple[str, Path]:
    """One uninterrupted run of STEPS steps per family: what every resumed run must reproduce bit for bit."""
    out = tmp_path_factory.mktemp(f"reference-{request.param}") / "run"
    assert train_subprocess(request.param, out) == 0
    return request.param, out


def test_uninterrupted_run_writes_every_checkpoint_with_all_its_files(reference):
    family, out = reference
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == [f"step-{s:06d}" for s in range(4, STEPS + 1, 4)]
    files = sorted(p.name for p in (out / "checkpoints" / f"step-{STEPS:06d}").iterdir())
    lora_files = ["README.md", "adapter_config.json", "adapter_model.safetensors"]  # what final/ holds
    own = ["config.yaml", "meta.json", "optimizer.pt", "plan.json", "trainable_state.safetensors", "trainer_state.pt"]
    assert files == sorted(own + lora_files) == sorted(own + [p.name for p in (out / "final").iterdir()])
    meta = json.loads((out / "checkpoints" / f"step-{STEPS:06d}" / "meta.json").read_text())
    assert meta["step"] == STEPS
    assert sorted(meta["files"]) == sorted(set(files) - {"meta.json"}) and meta["lora_files"] == lora_files
    assert_bit_identical(load_file(str(out / "checkpoints" / f"step-{STEPS:06d}" / "adapter_model.safetensors")),
                         final_weights(out))
    state = torch.load(out / "checkpoints" / "step-000008" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 8
    assert sorted(state["rng"]) == ["numpy", "python", "torch"] + (["device"] if torch.cuda.is_available() else [])
    assert state["scheduler"]["last_epoch"] == 8
    assert state["data_order"] == {"epoch": 0, "position": 8, "seed": 42, "batch_size": 8, "num_items": 64,
                                   "world_size": 1}  # 64 samples: 8 batches of 8 per epoch, the next one starts epoch 1
    later = torch.load(out / "checkpoints" / "step-000012" / "trainer_state.pt", weights_only=True)
    assert (later["data_order"]["epoch"], later["data_order"]["position"]) == (1, 4)
    assert state["scaler"] is None  # fp32 on the CPU: no loss scaling
    optimizer = torch.load(out / "checkpoints" / "step-000008" / "optimizer.pt", weights_only=True)
    states = list(optimizer["state"].values())
    assert states and all(isinstance(v, torch.Tensor) for s in states for k, v in s.items() if k != "step")
    # AdamW8bit's state as plain tensors (tiny LoRA matrices are under the 8-bit size threshold: fp32 moments)
    assert all({"state1", "state2"} <= set(s) for s in states)
    assert metric_steps(out) == list(range(1, STEPS + 1))


def test_kill_9_mid_run_then_resume_is_bit_identical(reference, tmp_path):
    family, ref = reference
    out = tmp_path / "run"
    proc = start_subprocess(family, out)
    kill_9_after_checkpoint(proc, out, 4)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "final").exists()
    killed_at = max(metric_steps(out))
    assert killed_at < STEPS
    latest = find_latest_checkpoint(out / "checkpoints", warn=lambda _: None)
    assert latest is not None and latest.step >= 4

    assert train_subprocess(family, out) == 0
    assert_bit_identical(final_weights(out), final_weights(ref))
    # metrics.jsonl was appended to: the killed attempt's records, then the resumed run's from its checkpoint on
    assert metric_steps(out) == list(range(1, killed_at + 1)) + list(range(latest.step + 1, STEPS + 1))
    # the resumed records read as the uninterrupted run's, the smoothed loss included (it continues, not restarts)
    resumed = read_metrics(out)[killed_at:]
    assert [(r["loss"], r["loss_smoothed"]) for r in resumed] == \
        [(r["loss"], r["loss_smoothed"]) for r in read_metrics(ref)[latest.step:]]


def test_sigterm_saves_at_the_step_it_stopped_exits_143_and_resumes_bit_identical(reference, tmp_path):
    family, ref = reference
    out = tmp_path / "run"
    proc = start_subprocess(family, out)
    try:
        wait_for(lambda: (out / "logs" / "metrics.jsonl").is_file() and len(metric_steps(out)) >= 2, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    assert "SIGTERM received: finishing this step and saving a checkpoint" in stderr
    stopped = int(stderr.split("stopped at step ")[1].split(";")[0])
    assert 2 <= stopped < STEPS
    assert f"step {stopped}: checkpoint {out / 'checkpoints' / f'step-{stopped:06d}'}" in stderr
    assert "Traceback" not in stderr
    latest = find_latest_checkpoint(out / "checkpoints", warn=lambda _: None)
    assert latest.step == stopped and max(metric_steps(out)) == stopped

    assert train_subprocess(family, out) == 0
    assert_bit_identical(final_weights(out), final_weights(ref))


def test_corrupt_latest_checkpoint_is_skipped_and_resume_uses_the_previous(reference, tmp_path, capsys):
    family, ref = reference
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    shutil.rmtree(out / "final")
    latest = out / "checkpoints" / f"step-{STEPS:06d}"
    weights = latest / "trainable_state.safetensors"
    data = bytearray(weights.read_bytes())
    data[-16:] = bytes(b ^ 0xFF for b in data[-16:])  # same size, different tensor bytes
    weights.write_bytes(bytes(data))
    capsys.readouterr()

    assert train_subprocess(family, out) == 0
    err = capsys.readouterr().err
    assert f"skipping checkpoint {latest}: trainable_state.safetensors does not match its checksum" in err
    assert f"resumed from {out / 'checkpoints' / f'step-{STEPS - 4:06d}'} (step {STEPS - 4})" in err
    assert_bit_identical(final_weights(out), final_weights(ref))
    # the corrupt folder was set aside (kept), and the step was written again, intact
    assert len(list((out / "checkpoints").glob(f".abandoned-step-{STEPS:06d}-*"))) == 1
    assert verify_checkpoint(latest)[0].step == STEPS


def test_resume_from_a_checkpoint_path_with_grad_accum_cosine_warmup_and_ema(tmp_path):
    family = FAMILIES[0]
    extra = ["train.steps=8", "save.every=2", "train.grad_accum=2", "train.warmup_steps=3", "train.ema_decay=0.9"]
    ref = tmp_path / "reference"
    assert train_subprocess(family, ref, *extra) == 0
    assert (ref / "checkpoints" / "step-000004" / "ema.safetensors").is_file()

    out = tmp_path / "resumed"
    assert train_subprocess(family, out, *extra, f"train.resume={ref / 'checkpoints' / 'step-000004'}") == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000006", "step-000008"]
    assert_bit_identical(final_weights(out), final_weights(ref))
    for name in ("trainable_state.safetensors", "ema.safetensors"):
        assert_bit_identical(load_file(str(out / "checkpoints" / "step-000008" / name)),
                             load_file(str(ref / "checkpoints" / "step-000008" / name)))
    # the scheduler continued where it was: the same learning rate at every resumed step
    lr = {r["step"]: r["lr"] for r in read_metrics(ref, key=None)}
    lr_resumed = {r["step"]: r["lr"] for r in read_metrics(out, key=None)}
    assert sorted(lr_resumed) == [5, 6, 7, 8]
    assert all(lr_resumed[s] == lr[s] for s in lr_resumed)
    assert [lr[1], lr[2], lr[3], lr[8]] == pytest.approx([1e-3, 2e-3, 3e-3, 0.0])  # warmup 3, then cosine to 0


def test_ema_is_saved_updated_after_each_step_and_exported(tmp_path):
    family = FAMILIES[0]
    out = tmp_path / "run"
    assert train_subprocess(family, out, "train.steps=3", "save.every=1", "train.ema_decay=0.5") == 0
    ckpt = out / "checkpoints"
    lora = {s: trainable_from_file(load_file(str(ckpt / f"step-{s:06d}" / "trainable_state.safetensors")))
            for s in (1, 2, 3)}
    ema = {s: load_file(str(ckpt / f"step-{s:06d}" / "ema.safetensors")) for s in (1, 2, 3)}
    for step in (2, 3):
        for name, shadow in ema[step].items():
            assert torch.equal(shadow, ema[step - 1][name].lerp(lora[step][name], 0.5)), name
    exported = final_weights(out)
    for name, shadow in ema[3].items():
        key = name.replace(".default.", ".")
        assert torch.equal(exported[key], shadow), key
    assert any(not torch.equal(ema[3][n], lora[3][n]) for n in lora[3])  # the export is the EMA, not the weights
    # every checkpoint's adapter is the EMA of its step, as final/ is
    for step in (1, 2, 3):
        adapter = load_file(str(ckpt / f"step-{step:06d}" / "adapter_model.safetensors"))
        assert all(torch.equal(adapter[n.replace(".default.", ".")], shadow) for n, shadow in ema[step].items())


def test_harmless_changes_apply_with_a_notice_others_are_refused_naming_the_key(reference, tmp_path, capsys):
    family, ref = reference
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    capsys.readouterr()
    assert train_subprocess(family, out, "train.lr=0.001") == 2
    err = capsys.readouterr().err
    assert "cannot resume from" in err and "- train.lr: 0.003 in the checkpoint, 0.001 now" in err
    assert "--fresh" in err and "Traceback" not in err

    assert train_subprocess(family, out, f"train.steps={STEPS + 2}", "save.every=1", "log.every=2") == 0
    err = capsys.readouterr().err
    assert f"resume: applying changed setting train.steps: {STEPS} -> {STEPS + 2}" in err
    assert "resume: applying changed setting save.every: 4 -> 1" in err
    assert "resume: applying changed setting log.every: 1 -> 2" in err
    assert f"resumed from {out / 'checkpoints' / f'step-{STEPS:06d}'} (step {STEPS})" in err
    assert verify_checkpoint(out / "checkpoints" / f"step-{STEPS + 2:06d}")[0].step == STEPS + 2
    assert (out / "checkpoints" / f"step-{STEPS + 1:06d}").is_dir()
    assert len(list(out.glob("final.replaced-*"))) == 1  # the earlier final is kept beside the new one


def test_fresh_moves_the_old_run_aside_and_starts_over(reference, tmp_path, capsys):
    family, ref = reference
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    capsys.readouterr()
    proc = run_toolkit("train", "--fresh", *train_args(family, out, "train.steps=2", "save.every=0")[1:],
                       env=SINGLE_THREAD)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    [old] = list(tmp_path.glob("run.old-*"))
    assert f"--fresh: the previous run was moved to {old}" in err and "resumed" not in err
    assert verify_checkpoint(old / "checkpoints" / f"step-{STEPS:06d}")[0] is not None  # nothing was deleted
    assert_bit_identical(final_weights(old), final_weights(ref))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]  # save.every=0: only the end
    assert metric_steps(out) == [1, 2]


def test_resume_true_with_nothing_to_resume_names_the_folder(tmp_path, capsys):
    out = tmp_path / "empty"
    assert train_subprocess(FAMILIES[0], out, "train.resume=true") == 2
    err = capsys.readouterr().err
    assert f"train.resume is true, but there is no complete checkpoint in {out / 'checkpoints'}" in err
    assert not out.exists()


def test_resume_false_refuses_a_run_folder_with_checkpoints(reference, tmp_path, capsys):
    family, ref = reference
    out = tmp_path / "run"
    shutil.copytree(ref / "checkpoints", out / "checkpoints")
    capsys.readouterr()
    assert train_subprocess(family, out, "train.resume=false") == 2
    err = capsys.readouterr().err
    assert f"train.resume is false, but {out} already has checkpoints" in err and "--fresh" in err


def test_train_resume_given_a_run_folder_or_another_family_s_checkpoint(reference, tmp_path, capsys):
    """A run folder given to train.resume resumes from its newest checkpoint (said), and the same command later
    resumes this run's own progress; --fresh starts it from the other run again. A checkpoint of another family is
    refused in one line naming both families (not the list of every setting that follows from it)."""
    family, ref = reference
    out = tmp_path / "run"
    assert train_subprocess(family, out, f"train.resume={ref}", f"train.steps={STEPS + 1}") == 0
    err = capsys.readouterr().err
    assert (f"train.resume: {ref} is a run folder; resuming from its newest checkpoint, step-{STEPS:06d}" in err
            and f"resumed from {ref / 'checkpoints' / f'step-{STEPS:06d}'} (step {STEPS})" in err)
    assert metric_steps(out) == [STEPS + 1]

    other = run_toolkit("train", REPO / "configs/examples/quickstart_sd.yaml", f"run.output_dir={tmp_path / 'sd'}",
                        f"train.resume={ref}", timeout=120)
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert (f"cannot resume from {ref / 'checkpoints' / f'step-{STEPS:06d}'}: it is a checkpoint of a {family} run, "
            f"and this run trains sd\n  fix: give train.resume a checkpoint of a sd run, or remove it") in other.stderr
    assert other.stderr.count("\n  - ") == 0

    # the same command again: this run's own newest checkpoint, not the other run's
    assert train_subprocess(family, out, f"train.resume={ref}", f"train.steps={STEPS + 2}", "save.every=1") == 0
    err = capsys.readouterr().err
    assert (f"train.resume: {ref} started this run; resuming from its own newest checkpoint, step-{STEPS + 1:06d}"
            in err and "set aside" not in err)
    assert metric_steps(out) == [STEPS + 1, STEPS + 2]
    # with --fresh: this run moved aside, started again from the other run
    assert train_subprocess(family, out, f"train.resume={ref}", f"train.steps={STEPS + 1}", "--fresh") == 0
    err = capsys.readouterr().err
    [aside] = tmp_path.glob("run.old-*")
    assert f"--fresh: the previous run was moved to {aside}" in err and f"(step {STEPS})" in err
    assert metric_steps(out) == [STEPS + 1] and metric_steps(aside) == [STEPS + 1, STEPS + 2]
    # a checkpoint inside the run folder with --fresh (which moves it away) is refused
    inside = out / "checkpoints" / f"step-{STEPS + 1:06d}"
    assert train_subprocess(family, out, f"train.resume={inside}", "--fresh") == 2
    assert f"train.resume={inside} is inside the run folder, which --fresh moves aside" in capsys.readouterr().err


SD_ARGS = ["train", str(REPO / "configs/examples/quickstart_sd.yaml"), "train.steps=6", "save.every=2",
           "save.keep_last=10", "sample.prompts=[]", "log.every=1", "log.tensorboard=false", "train.batch_size=2",
           # every augmentation: its draws must come out the same after the resume
           "data.random_flip=true", "data.crop_variants=3", "data.shuffle_tags=true", "data.tag_dropout=0.2",
           "data.caption_dropout=0.2"]


def test_sd_kill_9_mid_run_then_resume_is_bit_identical_with_augmentation(tmp_path):
    from toolkit.tiny.fixtures import write_shapes_dataset

    ref, out = tmp_path / "reference", tmp_path / "run"
    write_shapes_dataset(tmp_path / "data", sizes=((64, 64), (96, 64)), count=2)  # 96x64: three crops each
    args = [*SD_ARGS, f"data.path={tmp_path / 'data'}"]
    # A private cache: the latent/text caches this writes must not turn other tests' first runs into cache hits.
    env = {**SINGLE_THREAD, "TOOLKIT_CACHE": str(tmp_path / "cache")}
    proc = run_toolkit(*args, f"run.output_dir={ref}", env=env)
    assert proc.returncode == 0, proc.stderr
    killed = subprocess.Popen([sys.executable, "-m", "toolkit", *args, f"run.output_dir={out}"], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    kill_9_after_checkpoint(killed, out, 2)
    assert killed.returncode == -signal.SIGKILL and not (out / "final").exists()
    proc = run_toolkit(*args, f"run.output_dir={out}", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stderr
    name = "pytorch_lora_weights.safetensors"
    assert_bit_identical(load_file(str(out / "final" / name)), load_file(str(ref / "final" / name)))


def test_a_setting_added_since_the_run_began_is_accepted_at_its_default_only():
    from toolkit.train.resume import config_changes

    old = {"model": {"family": "wan21", "name_or_path": "tiny:wan21"}, "train": {"lr": 1e-3}}
    new = {"model": {"family": "wan21", "name_or_path": "tiny:wan21", "quantize_backend": "auto"},
           "train": {"lr": 1e-3, "flow_shift": "auto"}}
    allowed, refused = config_changes(old, new)
    assert allowed == ["model.quantize_backend: new setting, at its default 'auto'",
                       "train.flow_shift: new setting, at its default 'auto'"] and refused == []
    new["train"]["flow_shift"] = 5.0
    assert config_changes(old, new)[1] == ["train.flow_shift: None in the checkpoint, 5.0 now"]


def test_data_that_changed_since_the_run_began_names_the_data_in_the_fix(tmp_path, run_cli, capsys, own_data_caches):
    from helpers import diffusion_train_args
    from toolkit.tiny.fixtures import write_shapes_dataset

    data, out = tmp_path / "data", tmp_path / "run"
    write_shapes_dataset(data, sizes=((64, 64),), count=3)
    first = diffusion_train_args("quickstart_sd.yaml", out, f"data.path={data}", "data.resolution=64", "save.every=2")
    assert run_cli(*first) == 0
    write_shapes_dataset(data, sizes=((64, 128),), count=2)  # two more images
    capsys.readouterr()
    assert run_cli(*first, "train.steps=4") == 2
    err = capsys.readouterr().err
    assert "data order mismatch on resume: num_items was 3, now 5" in err and "train.batch_size" not in err
    assert (f"fix: the data changed since the run began (3 items then, 5 now: files added or removed, or data.repeats, "
            f"data.resolutions or the datasets changed); put it back to resume, or keep what the run learned in a new "
            f"run on this data: network.init_from={out / 'checkpoints' / 'step-000002'} --fresh") in err
    for extra in data.glob("*64x128*"):
        extra.unlink()
    assert run_cli(*first, "train.steps=4") == 0  # the data put back: the run resumes
    assert f"resumed from {out / 'checkpoints' / 'step-000002'} (step 2)" in capsys.readouterr().err


def test_settings_that_change_nothing_a_resumed_run_learns_are_said_not_refused():
    """network.init is read when a run starts (a resumed run's LoRA comes from its checkpoint), and a frame setting
    that no data.frame_extraction mode reads (a run begun before preflight refused it) changes nothing: both are
    said and settled before the comparison, which then finds no change. A frame setting a mode reads is compared
    as before."""
    from toolkit.train.resume import config_changes
    from toolkit.train.resume_unread import settle_unread

    def config(init, data):
        return {"model": {"family": "wan21", "name_or_path": "tiny:wan21"}, "network": {"init": init},
                "data": {"frame_extraction": "spread", "target_frames": [], "frame_stride": 1, "datasets": [], **data}}

    saved = config("auto", {"target_frames": [9], "datasets": [{"path": "a", "frame_stride": 2},
                                                                 {"path": "b", "frame_extraction": "full",
                                                                  "max_frames": 33}]})
    current = config("kaiming", {"datasets": [{"path": "a"}, {"path": "b", "frame_extraction": "full",
                                                              "max_frames": 33}]})
    said = []
    settle_unread(saved, current, said.append)
    assert said == [
        "resume: network.init is 'kaiming' now, 'auto' when the run began: it is read when a run starts, and this "
        "run's LoRA comes from its checkpoint",
        "resume: data.target_frames was [9] when the run began; data.frame_extraction=spread did not read it, so "
        "leaving it out changes nothing",
        "resume: data.datasets[0].frame_stride was 2 when the run began; its frame_extraction (spread) did not read "
        "it, so leaving it out changes nothing"]
    assert config_changes(saved, current) == ([], [])

    saved = config("auto", {"datasets": [{"path": "b", "frame_extraction": "slide", "frame_stride": 3}]})
    current = config("auto", {"datasets": [{"path": "b", "frame_extraction": "slide", "frame_stride": 2}]})
    said.clear()
    settle_unread(saved, current, said.append)
    assert said == [] and config_changes(saved, current)[1] == [
        "data.datasets: [{'path': 'b', 'frame_extraction': 'slide', 'frame_stride': 3}] in the checkpoint, "
        "[{'path': 'b', 'frame_extraction': 'slide', 'frame_stride': 2}] now"]


def test_a_run_resumes_with_another_network_init_saying_it_is_not_read(tmp_path, run_cli, capsys, own_data_caches):
    out = tmp_path / "run"
    args = ["configs/examples/quickstart_sd.yaml", f"run.output_dir={out}", "sample.prompts=[]", "save.every=1"]
    assert run_cli("train", *args, "train.steps=1") == 0
    assert run_cli("train", *args, "train.steps=2", "network.init=kaiming") == 0
    err = capsys.readouterr().err
    assert ("resume: network.init is 'kaiming' now, 'auto' when the run began: it is read when a run starts, and "
            "this run's LoRA comes from its checkpoint") in err
    assert f"resumed from {out / 'checkpoints' / 'step-000001'} (step 1)" in err
    assert (out / "checkpoints" / "step-000002").is_dir() and (out / "final").is_dir()
