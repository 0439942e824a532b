"""`sample RUN_DIR` through the real entry point, on tiny finished runs (sd images, wan21 video, llm text).

The samples of final/ and of a checkpoint equal, pixel for pixel and token for token, what the trainer itself
sampled at that step with the same prompts and seeds (the LoRA files loaded back by diffusers / PEFT give the
trained update exactly); another checkpoint gives other samples; --prompt and --seed are used; nothing the run
wrote is touched and a run whose lock is held (still training) is sampled without taking the lock; a missing run
folder, LoRA or step is exit 2 naming what exists."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


@pytest.fixture
def runs(tiny_runs, monkeypatch):
    """The session's tiny finished runs (helpers.TINY_RUNS), with their own latent and text caches in force."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tiny_runs.cache))
    return tiny_runs


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def frames(path: Path) -> list[np.ndarray]:
    """Every frame of an animated webp."""
    from PIL import ImageSequence

    return [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(path))]


def sample(run_cli, run: Path, *args) -> Path:
    """`sample RUN *args` through the CLI; the one new samples/cli-* folder it wrote."""
    before = set((run / "samples").glob("cli-*"))
    assert run_cli("sample", run, *args) == 0
    [folder] = set((run / "samples").glob("cli-*")) - before
    return folder


def test_sd_samples_equal_the_trainers_for_final_and_each_checkpoint(runs, run_cli, capsys):
    from toolkit.train.run_lock import RunLock, lock_path

    run = runs["sd"]
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    # A run still training holds its lock: sample neither waits for it nor takes it.
    lock = RunLock(run)
    lock.acquire(lambda _: None)
    try:
        held = lock_path(run).read_text()
        final = sample(run_cli, run)
        assert lock_path(run).read_text() == held
    finally:
        lock.release()
    assert final.name.startswith("cli-") and final.name.endswith("-final")
    assert sorted(p.name for p in final.iterdir()) == ["00.png", "01.png", "grid.png", "prompts.txt", "source.txt"]
    err = capsys.readouterr().err
    assert f"sample: 5 files in {final}: 00.png, 01.png, grid.png, prompts.txt, source.txt\n" in err
    assert f"report: {run / 'report.html'} (its samples section now shows these too)" in err
    step2, step1 = run / "samples" / "step-000002", run / "samples" / "step-000001"
    for name in ("00.png", "01.png"):
        assert np.array_equal(pixels(final / name), pixels(step2 / name)), name
    assert (final / "prompts.txt").read_text() == (step2 / "prompts.txt").read_text()

    checkpoint = sample(run_cli, run, "--checkpoint", "1")
    assert checkpoint.name.endswith("-step-000001")
    assert np.array_equal(pixels(checkpoint / "00.png"), pixels(step1 / "00.png"))
    assert not np.array_equal(pixels(checkpoint / "00.png"), pixels(final / "00.png"))  # another LoRA, other pixels
    assert "checkpoint step 1 of" in (checkpoint / "source.txt").read_text()

    out = run.parent / "sd-own-prompt"
    assert run_cli("sample", run, "--prompt", "[trigger] a green triangle", "--seed", "7", "--out", out) == 0
    assert (out / "prompts.txt").read_text() == "00: sks a green triangle\n"
    assert sorted(p.name for p in out.iterdir()) == ["00.png", "grid.png", "prompts.txt", "source.txt"]
    assert not np.array_equal(pixels(out / "00.png"), pixels(final / "00.png"))
    # Nothing the run wrote changed but report.html's samples section; only the new sample folders were added.
    report = run / "report.html"
    assert {p: p.stat().st_mtime_ns for p in before if p != report} == {p: t for p, t in before.items() if p != report}
    added = {p for p in run.rglob("*") if p.is_file()} - set(before)
    assert {p.parent for p in added} == {final, checkpoint}
    page = report.read_text(encoding="utf-8")
    headings = re.findall(r"<h3>([^<]*)</h3>", page)
    assert headings[:2] == ["step 1", "step 2"] and len(headings) == 4
    assert re.fullmatch(rf"sample command: final/ of {re.escape(str(run))} \(\d{{4}}-\d\d-\d\d \d\d:\d\d\)",
                        headings[2]), headings
    assert headings[3].startswith(f"sample command: checkpoint step 1 of {run} (")
    assert f'src="samples/{final.name}/grid.png"' in page and f'src="samples/{checkpoint.name}/grid.png"' in page
    assert "finished: step 2 of 2" in page  # the trainer's part of the page is as it was
    capsys.readouterr()
    assert run_cli("sample", run, "--out", out) == 2  # never into a folder that holds something
    assert f"sample --out: {out} exists and is not an empty folder" in capsys.readouterr().err


def test_wan21_video_samples_equal_the_trainers(runs, run_cli):
    run = runs["wan21"]
    final = sample(run_cli, run)
    step2 = run / "samples" / "step-000002"
    written = sorted(p.name for p in step2.iterdir())
    assert "00.webp" in written and sorted(p.name for p in final.iterdir()) == sorted(written + ["source.txt"])
    video = frames(final / "00.webp")
    assert len(video) == 5
    assert all(np.array_equal(a, b) for a, b in zip(video, frames(step2 / "00.webp"), strict=True))
    assert np.array_equal(pixels(final / "00.png"), pixels(step2 / "00.png"))


def test_llm_text_samples_equal_the_trainers(runs, run_cli):
    run = runs["llm"]
    read = lambda folder: [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    trained = {step: read(run / "samples" / f"step-{step:06d}") for step in (1, 2)}
    assert trained[1] != trained[2]
    final, checkpoint = sample(run_cli, run), sample(run_cli, run, "--checkpoint", "1")
    assert read(final) == trained[2] and read(checkpoint) == trained[1]
    assert read(final)[0]["prompt"] == "the red circle" and read(final)[0]["completion"]


def test_prompts_come_back_as_written(runs, run_cli):
    """--prompt with an emoji, `${...}` (not an OmegaConf interpolation here), a quote and a backslash."""
    prompts = ["the red circle 😀", "fill ${name} in", 'a "quoted" back\\slash']
    args = [a for p in prompts for a in ("--prompt", p)]
    folder = sample(run_cli, runs["llm"], *args)
    records = [json.loads(line) for line in (folder / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["prompt"] for r in records] == prompts


def test_a_prompt_with_dollar_brace_survives_config_yaml(run_cli, tmp_path):
    """A sample prompt written `\\${name}` in the config (OmegaConf's escape) is the text `${name}`: in the run's
    samples, in its config.yaml, and when `sample` reads that back."""
    from conftest import REPO

    run = tmp_path / "run"
    assert run_cli("train", REPO / "configs/examples/quickstart_llm.yaml", f"run.output_dir={run}", "train.steps=1",
                   "save.every=0", "sample.every=1", r"sample.prompts=['fill \${name} in']") == 0
    read = lambda folder: [json.loads(line)["prompt"] for line in (folder / "samples.jsonl").read_text().splitlines()]
    assert read(run / "samples" / "step-000001") == ["fill ${name} in"]
    assert read(sample(run_cli, run)) == ["fill ${name} in"]


def test_missing_run_lora_or_step_is_exit_2_naming_what_exists(runs, run_cli, capsys, tmp_path):
    run = runs["sd"]
    capsys.readouterr()
    assert run_cli("sample", tmp_path / "nothing") == 2
    err = capsys.readouterr().err
    assert f"run folder {tmp_path / 'nothing'} does not exist" in err and "Traceback" not in err

    assert run_cli("sample", run, "--checkpoint", "5") == 2
    err = capsys.readouterr().err
    missing = run / "checkpoints" / "step-000005"
    assert f"{run} has no checkpoint of step 5 ({missing}); its checkpoints: steps 1, 2" in err

    empty = tmp_path / "started"
    (empty / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.yaml", empty / "config.yaml")
    assert run_cli("sample", empty) == 2
    err = capsys.readouterr().err
    assert f"{empty} has no final/ and no finished checkpoint (it holds: checkpoints/, config.yaml)" in err

    # A run with no final/ yet (still training) is sampled from its latest finished checkpoint.
    partial = tmp_path / "training"
    shutil.copytree(run / "checkpoints", partial / "checkpoints")
    shutil.copy(run / "config.yaml", partial / "config.yaml")
    damaged = partial / "checkpoints" / "step-000002"
    (damaged / "pytorch_lora_weights.safetensors").unlink()
    folder = sample(run_cli, partial, "--prompt", "a red circle on a white background")
    err = capsys.readouterr().err
    assert f"warning: skipping checkpoint {damaged}: pytorch_lora_weights.safetensors is missing" in err
    assert f"{partial} has no final/ yet (a run still training, or one that stopped): using its latest finished " \
           "checkpoint, step-000001" in err
    assert folder.name.endswith("-step-000001")
    assert np.array_equal(pixels(folder / "00.png"), pixels(run / "samples" / "step-000001" / "00.png"))

    assert run_cli("sample", run, "model.name_or_path=tiny:sdxl") == 2
    assert "model.name_or_path=tiny:sdxl: only settings that do not change the trained model" in capsys.readouterr().err


def test_wan_i2v_samples_equal_the_trainers_and_seed_keeps_each_prompts_image(own_data_caches, run_cli, tmp_path,
                                                                               monkeypatch, capsys):
    """Wan 2.1 image-to-video with a start image per prompt: `sample` gives the trainer's own samples (the LoRA of
    an image-to-video run loads back, although diffusers' loader adds zero LoRAs on the image cross-attention it did
    not train), and --seed N samples prompt i from seed N + i and still from image i (the family picks the image
    by seed - sample.seed)."""
    from conftest import REPO
    from toolkit.models import diffusion_wan
    from toolkit.models.diffusion_base import DiffusionAdapter

    data = REPO / "configs/examples/data"
    images = [data / "clips_i2v/green_circle.png", data / "clips/blue_circle.png"]
    run = tmp_path / "i2v"
    assert run_cli("train", REPO / "configs/examples/quickstart_wan21_i2v.yaml", f"run.output_dir={run}",
                   "train.steps=1", "save.every=0", "data.num_frames=5", "sample.num_frames=5",
                   "sample.num_inference_steps=1", "sample.prompts=[a green circle,a blue circle]",
                   f"sample.images=[{images[0]},{images[1]}]") == 0
    starts, seeds = [], []
    pick, call = diffusion_wan.sample_image, DiffusionAdapter.pipeline_call

    def sample_image(path, size):
        starts.append(Path(path))
        return pick(path, size)

    def pipeline_call(adapter, seed, **kwargs):
        seeds.append(seed)
        return call(adapter, seed, **kwargs)

    monkeypatch.setattr(diffusion_wan, "sample_image", sample_image)
    monkeypatch.setattr(DiffusionAdapter, "pipeline_call", pipeline_call)
    final = sample(run_cli, run)
    assert seeds == [42, 43] and starts == images
    for name in ("00.png", "01.png", "00.webp", "01.webp"):
        trained = run / "samples" / "step-000001" / name
        assert all(np.array_equal(a, b) for a, b in zip(frames(final / name), frames(trained), strict=True)), name
    seeds.clear(), starts.clear()
    moved = sample(run_cli, run, "--seed", "7")
    assert seeds == [7, 8] and starts == images
    assert (moved / "source.txt").read_text().endswith("seed 7\n")
    assert not np.array_equal(pixels(moved / "00.png"), pixels(final / "00.png"))
    # a start image that is not one is named before the model loads
    text = data / "clips_i2v/red_circle.txt"
    capsys.readouterr()
    assert run_cli("sample", run, "--seed", "7", f"sample.images=[{text},{images[1]}]") == 2
    err = capsys.readouterr().err
    assert (f"'sample.images' in command line: {text} is not an image that can be read (UnidentifiedImageError" in err
            and "Traceback" not in err)


def test_overrides_after_the_options_and_sample_images_checked_before_the_model_loads(runs, run_cli, capsys, tmp_path):
    from conftest import REPO

    run = runs["sd"]
    folder = sample(run_cli, run, "--seed", "3", "sample.num_inference_steps=1")  # the README's order
    assert (folder / "source.txt").read_text().endswith("seed 3\n")
    with pytest.raises(SystemExit) as refused:  # argparse's own exit
        run_cli("sample", run, "--seed", "3", "--unknown")
    assert refused.value.code == 2 and "unrecognized arguments: --unknown" in capsys.readouterr().err
    text = REPO / "configs/examples/data/clips_i2v/red_circle.txt"
    for image, why in ((tmp_path / "none.png", f"{tmp_path / 'none.png'} does not exist; give an image file"),
                       (text, f"{text} is not an image that can be read (UnidentifiedImageError")):
        assert run_cli("validate", REPO / "configs/examples/quickstart_wan21_i2v.yaml", f"sample.images=[{image}]") == 2
        assert f"'sample.images' in command line: {why}" in capsys.readouterr().err


def test_a_failed_sample_leaves_no_empty_folder(runs, run_cli, monkeypatch, tmp_path, capsys):
    """The pipeline failing part-way (here: at its first call) is exit 2 with its message, and the samples/cli-*
    folder made for it is taken away again: the run's samples hold only what was written."""
    import toolkit.models as models
    from helpers import without_others_samples
    from toolkit.errors import UserError

    run = tmp_path / "sd"
    shutil.copytree(runs["sd"], run, ignore=without_others_samples)
    built = models.build_adapter

    def failing(cfg, runtime):
        adapter = built(cfg, runtime)

        def sample(out_dir):
            raise UserError("the pipeline failed (a test's stand-in)")
        adapter.sample = sample
        return adapter

    monkeypatch.setattr(models, "build_adapter", failing)
    before = sorted(p.name for p in (run / "samples").iterdir())
    assert run_cli("sample", run) == 2
    assert "error: the pipeline failed (a test's stand-in)" in capsys.readouterr().err
    assert sorted(p.name for p in (run / "samples").iterdir()) == before
