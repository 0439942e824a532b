"""`import-aitk`: ai-toolkit job files (tests/fixtures/aitk/, written in ai-toolkit's layout) translated through the
CLI entry point: the values carried over, the settings reported as not translated, and the translation validating
with load_run once it points at a tiny model and a data folder that exist."""

from __future__ import annotations

import re

import pytest
import yaml

from conftest import REPO
from toolkit.device.detect import DeviceInfo

FIXTURES = REPO / "tests" / "fixtures" / "aitk"
DATA = REPO / "configs" / "examples" / "data"
H100 = DeviceInfo("cuda", "sm_90", "test H100", 80.0, bf16=True)  # the jobs are GPU jobs (fp16, bf16)

# fixture -> (tiny model and data folder to validate with, expected values, settings reported as not translated)
CASES = {
    "flux": ("tiny:flux", "shapes", {
        "run.name": "shapes_flux_v1", "run.output_dir": "output/${run.name}", "model.family": "flux",
        "model.name_or_path": "black-forest-labs/FLUX.1-dev", "model.quantize": "8bit", "network.init": "kaiming",
        "network.rank": 16,
        "network.alpha": 8.0, "data.path": "/data/shapes", "data.caption_ext": ".txt", "data.trigger_word": "sks",
        "data.caption_dropout": 0.05, "data.resolution": 1024, "data.resolutions": [512, 768, 1024], "train.steps": 1500, "train.lr": 1e-4,
        "train.optimizer": "adamw8bit", "train.eps": 1e-6, "train.weight_decay": 0.01, "train.precision": "bf16",
        "train.ema_decay": 0.99, "train.timestep_sampling": "logit_normal", "train.flow_shift": 1.0,
        "save.dtype": "fp16", "save.every": 200, "save.keep_last": 3, "sample.every": 200,
        "sample.prompts": ["[trigger] a red circle on a white background", "a blue square, [trigger] style"],
        "sample.guidance_scale": 3.5, "sample.num_inference_steps": 28, "sample.seed": 42},
        ["model.low_vram", "train.content_or_style", "performance_log_every"]),
    "sdxl": ("tiny:sdxl", "shapes", {
        "run.output_dir": "/runs/${run.name}", "model.family": "sdxl", "model.dtype": "fp16", "network.init": "kaiming",
        "network.rank": 32,
        "network.alpha": 16.0, "data.path": "/data/sdxl", "data.caption_ext": ".caption", "data.shuffle_tags": True,
        "data.keep_tokens": 1, "data.bucket_step": 32, "data.cache_latents": False, "train.batch_size": 4,
        "train.grad_accum": 2, "train.lr": 5e-5, "train.optimizer": "adamw", "train.weight_decay": 0.02,
        "train.betas": [0.9, 0.99], "train.lr_scheduler": "cosine", "train.warmup_steps": 100,
        "train.precision": "fp16", "train.max_grad_norm": 0.5, "train.train_text_encoder": True,
        "train.noise_offset": 0.05, "train.min_snr_gamma": 5.0, "sample.prompts": ["a red circle", "a green triangle"],
        "sample.negative_prompt": "blurry, low quality", "log.every": 5, "log.wandb": True,
        "log.wandb_project": "shapes", "data.random_flip": True, "data.repeats": 10},
        ["network.conv", "network.conv_alpha", "sample.samples[1].width"]),
    "sd15": ("tiny:sd", "shapes", {
        "model.family": "sd", "network.type": "lokr", "network.lokr_factor": 4, "network.rank": 8,
        "network.alpha": 1.0, "data.path": "/data/sd15",
        "data.trigger_word": "zxq", "train.steps": 800, "train.optimizer": "prodigy", "train.lr": 1.0,
        "train.precision": "fp32", "save.every": 100, "save.keep_last": 5, "save.dtype": "fp16",
        "sample.prompts": ["zxq a yellow star", "a purple circle"], "sample.negative_prompt": "text, watermark",
        "data.datasets": [{"path": "/data/sd15_extra", "resolution": 512}]},
        ["device", "sample.walk_seed"]),
    "datasets": ("tiny:sd", "shapes", {
        "model.family": "sd", "data.path": "/data/person", "data.trigger_word": "zxq", "data.resolution": 768, "data.resolutions": [512, 768],
        "data.repeats": 4, "data.masked_loss": True, "data.mask_folder": "/data/person_masks", "data.mask_min": 0.1,
        "data.random_flip": True,
        "data.datasets": [{"path": "/data/people", "caption_ext": ".caption", "is_regularization": True,
                           "resolution": 512, "masked_loss": False}],
        "train.prior_loss_weight": 0.5, "train.dop_class": "person", "train.dop_weight": 0.8},
        ["datasets[1].flip_x", "datasets[1].cache_latents_to_disk"]),
    "wan21": ("tiny:wan21", "clips", {
        "model.family": "wan21", "model.name_or_path": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "network.rank": 32,
        "data.path": "/data/clips", "data.num_frames": 33, "data.resolution": 480, "train.lr": 2e-4,
        "train.weight_decay": 1e-4, "sample.num_frames": 37, "sample.fps": 15, "sample.width": 832,
        "sample.height": 480, "sample.negative_prompt": "static, blurry",
        "sample.prompts": ["a red circle moving right on a white background"]},
        ["model.quantize_te"]),
    # ai-toolkit's arch "chroma" (its ChromaModel); the model a diffusers folder here (Chroma1-HD), not a single file
    "chroma": ("tiny:chroma", "shapes", {
        "model.family": "chroma", "model.name_or_path": "lodestones/Chroma1-HD", "model.quantize": "8bit",
        "network.rank": 16, "network.alpha": 16.0, "data.trigger_word": "sks", "data.resolution": 1024,
        "train.steps": 2000, "train.optimizer": "adamw8bit", "train.precision": "bf16", "train.ema_decay": 0.99,
        "sample.negative_prompt": "blurry", "sample.guidance_scale": 4.0, "sample.num_inference_steps": 25,
        "data.resolutions": [512, 768, 1024]},
        []),
    # ai-toolkit's arch "ltx2" (its LTX2Model): the dataset's fps is the transformer's frame rate there; 8k+1 frames;
    # do_audio: true is data.audio=auto
    "ltx2": ("tiny:ltx2", "clips", {
        "model.family": "ltx2", "model.name_or_path": "Lightricks/LTX-2", "model.quantize": "8bit",
        "data.num_frames": 121, "train.frame_rate": 24.0, "sample.num_frames": 97, "sample.fps": 24,
        "sample.width": 768, "sample.height": 512, "sample.negative_prompt": "worst quality, blurry, jittery",
        "train.timestep_sampling": "logit_normal", "data.audio": "auto"},
        []),
    # the edit families: control_path_1 .. _3 (or control_path) -> data.reference_paths, ctrl_img_* -> sample.references
    "qwen_image_edit_plus": ("tiny:qwen_image_edit", "edit", {
        "model.family": "qwen_image_edit", "model.name_or_path": "Qwen/Qwen-Image-Edit-2509",
        "data.path": "/data/edit/targets", "data.reference_paths": ["/data/edit/outlines", "/data/edit/colours"],
        "sample.prompts": ["[trigger] fill the circle with blue"],
        "sample.references": [["/data/edit/outlines/green_circle.png", "/data/edit/colours/blue_square.png"]]},
        []),
    "flux_kontext": ("tiny:flux_kontext", "kontext", {
        "model.family": "flux_kontext", "data.path": "/data/kontext/targets",
        "data.reference_paths": ["/data/kontext/originals"],
        "sample.references": [["/data/kontext/originals/blue_circle.png"]]},
        []),
    # only a folder and a model: ai-toolkit's own defaults where they differ from this toolkit's
    "minimal": ("tiny:sd", "shapes", {
        "run.name": "defaults_only", "model.family": "sd", "network.rank": 4, "network.alpha": 1.0,
        "data.path": "/data/minimal", "data.resolution": 512, "train.steps": 1000, "train.batch_size": 1,
        "train.lr": 1e-6, "train.optimizer": "adamw", "train.precision": "fp32", "save.every": 1000,
        "save.keep_last": 5, "sample.every": 100, "sample.prompts": [], "sample.seed": 0,
        "sample.guidance_scale": 7.0, "sample.num_inference_steps": 20, "sample.width": 512},
        []),
}


def _dotted(config: dict, key: str):
    section, name = key.split(".", 1)
    return config[section][name]


@pytest.mark.parametrize("job", list(CASES))
def test_job_translates_reports_what_it_cannot_and_validates(job, tmp_path, run_cli, capsys):
    from toolkit.plan.run import load_run
    from toolkit.preflight import path_checks

    tiny, data, expected, untranslated = CASES[job]
    assert run_cli("import-aitk", FIXTURES / f"{job}.yaml") == 0
    captured = capsys.readouterr()
    config = yaml.safe_load(captured.out)
    assert {key: _dotted(config, key) for key in expected} == expected
    reported = re.findall(r"^not translated: (\S+) = ", captured.err, flags=re.M)
    assert reported == untranslated
    assert f"# {len(untranslated)} setting" in captured.out  # and each one as a comment after the config
    assert all(f"# not translated: {key} = " in captured.out for key in untranslated)

    translated = tmp_path / "config.yaml"
    for entry in config.get("data", {}).get("datasets", []):  # validated with folders that exist
        entry["path"] = str(DATA / data)
    if "mask_folder" in config.get("data", {}):
        config["data"]["mask_folder"] = str(DATA / data)
    if config.get("sample", {}).get("references"):  # the job's reference images, as images that exist here
        image = str(next(p for p in sorted((DATA / data).rglob("*")) if p.suffix in (".png", ".jpg", ".webp")))
        config["sample"]["references"] = [[image] * len(refs) for refs in config["sample"]["references"]]
    translated.write_text(yaml.safe_dump(config))
    run = load_run([translated], [f"model.name_or_path={tiny}", f"data.path={DATA / data}"], device=H100,
                   check_paths=path_checks(check_output=False))
    assert run.cfg.model.family == expected["model.family"] and run.cfg.data.path == str(DATA / data)
    assert run.cfg.train.steps == config["train"]["steps"]


def test_changed_values_are_noted(run_cli, capsys):
    """Settings carried over with a change: Wan's 4k+1 frame counts."""
    assert run_cli("import-aitk", FIXTURES / "wan21.yaml") == 0
    err = capsys.readouterr().err
    assert "changed: datasets[0].num_frames: 35 frames -> 33 (clips here are 4k+1 frames)" in err
    assert "changed: sample.num_frames: 40 frames -> 37" in err


@pytest.mark.parametrize("content, message", [
    (None, "config file not found"),
    ("config: {process: [\n", "invalid YAML"),
    ("run: {name: x}\nmodel: {family: sd}\n", "not an ai-toolkit job file: it has no config.process list"),
    ("job: extract\nconfig: {name: x, process: [{type: locon, linear: 64}]}\n",
     "config.process[0].type is 'locon', not a LoRA trainer"),
    ("config: {name: x, process: [{type: sd_trainer, model: {name_or_path: m, arch: hidream}, datasets: []}]}\n",
     "model arch 'hidream' has no family in this toolkit"),
    ("config: {name: x, process: [{type: sd_trainer, model: {name_or_path: m, arch: qwen_image_edit}, datasets: []}]}\n",
     "model arch 'qwen_image_edit' does not translate: the first Qwen-Image-Edit conditions on one image"),
    ("config: {name: x, process: [{type: sd_trainer, model: {name_or_path: m, arch: flux}, train: {steps: 0},"
     " datasets: [{folder_path: /d}]}]}\n", "the translated config does not validate"),
])
def test_a_file_that_does_not_translate_is_a_short_error(content, message, tmp_path, run_cli, capsys):
    job = tmp_path / "job.yaml"
    if content is not None:
        job.write_text(content)
    assert run_cli("import-aitk", job) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err and captured.out == ""


def test_every_key_of_a_job_is_translated_or_listed(run_cli, capsys):
    """A job with every key of ai-toolkit's config classes: each one is translated into a setting, or listed as not
    translated or as what this toolkit does anyway, each by name with its own reason (none falls through to the
    catch-all for keys import-aitk does not know)."""
    from toolkit.aitk import translate_job
    from toolkit.aitk.job import UNKNOWN, leaf_keys, read_job

    job = FIXTURES / "every_key.yaml"
    _, process, _ = read_job(job)
    keys = [path for path, _ in leaf_keys(process)]
    assert len(keys) > 250  # every class's keys: a job file that lost some would pass too easily
    out = translate_job(job)
    skipped, as_here = [s.key for s in out.skipped], [s.key for s in out.as_here]
    assert not [s.key for s in out.skipped if s.reason == UNKNOWN]
    assert len(skipped) == len(set(skipped)) and len(as_here) == len(set(as_here)) and not set(skipped) & set(as_here)

    def listed(path: str) -> bool:
        parts = path.replace("[", ".[").split(".")
        prefixes = {".".join(parts[:n]).replace(".[", "[") for n in range(1, len(parts) + 1)}
        return bool(prefixes & out.accounted)

    assert [path for path in keys if not listed(path)] == []
    # the settings the issue and the user's first jobs named, each where it belongs
    as_here_reasons = {s.key: s.reason for s in out.as_here}
    assert as_here_reasons["sample.walk_seed"] == ("each prompt is sampled with sample.seed plus its index here, as "
                                                   "walk_seed does")
    assert {"datasets[0].flip_x", "datasets[0].token_dropout_rate", "datasets[0].random_crop"} <= out.accounted
    assert out.config["data"]["random_flip"] is True and out.config["data"]["tag_dropout"] == 0.1
    assert out.config["data"]["crop_variants"] == 3
    assert out.config["train"]["grad_accum"] == 2 and out.config["sample"]["prompts"] == ["[trigger] a red circle",
                                                                                          "a blue square"]

    assert run_cli("import-aitk", job) == 0
    captured = capsys.readouterr()
    head = f"# {len(skipped)} settings not translated, {len(as_here)} as this toolkit does anyway (see the end)"
    assert head in captured.out
    assert ("# as here: sample.walk_seed = True: each prompt is sampled with sample.seed plus its index here, as "
            "walk_seed does") in captured.out
    line = next(l for l in captured.err.splitlines() if l.startswith("as here: "))
    assert "sample.walk_seed" in line and line.endswith("(nothing to set: this toolkit does that anyway; the reasons "
                                                        "are at the end of the config)")
    assert len(re.findall(r"^not translated: ", captured.err, flags=re.M)) == len(skipped)


def test_a_key_the_translator_does_not_know_is_listed(tmp_path, run_cli, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("config:\n  name: x\n  process:\n    - type: sd_trainer\n"
                   "      model: {name_or_path: m, arch: flux}\n      datasets: [{folder_path: /d}]\n"
                   "      future_setting: 3\n      network: {linear: 8, wobble: 2}\n")
    assert run_cli("import-aitk", job) == 0
    err = capsys.readouterr().err
    assert "not translated: future_setting = 3: no equivalent setting in this toolkit" in err
    assert "not translated: network.wobble = 2: no equivalent setting in this toolkit" in err


def test_a_full_rank_lokr_job_translates(tmp_path, run_cli, capsys):
    """ai-toolkit's README LoKr (lokr_full_rank, lokr_factor 8): the same keys here; the config validates."""
    job = tmp_path / "job.yaml"
    job.write_text("config:\n  name: x\n  process:\n    - type: sd_trainer\n"
                   "      model: {name_or_path: m, arch: flux}\n      datasets: [{folder_path: /d}]\n"
                   "      network: {type: lokr, linear: 16, lokr_full_rank: true, lokr_factor: 8}\n")
    assert run_cli("import-aitk", job) == 0
    captured = capsys.readouterr()
    network = yaml.safe_load(captured.out)["network"]
    assert network == {"type": "lokr", "lokr_full_rank": True, "lokr_factor": 8, "rank": 16, "alpha": 1.0}
    assert "not translated: network" not in captured.err


@pytest.mark.parametrize("shrink, expected", [(False, "head"), (True, None)])
def test_shrink_video_to_frames_translates_to_frame_extraction(shrink, expected, tmp_path, run_cli, capsys):
    """ai-toolkit's video dataset keys: num_frames with shrink_video_to_frames (true: spread over the whole video,
    this toolkit's default; false: consecutive frames, data.frame_extraction=head)."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"config": {"name": "clips", "process": [{
        "type": "sd_trainer", "model": {"name_or_path": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "arch": "wan21"},
        "train": {"steps": 100}, "datasets": [{"folder_path": "/data/clips", "num_frames": 33,
                                               "shrink_video_to_frames": shrink}]}]}}))
    assert run_cli("import-aitk", job) == 0
    captured = capsys.readouterr()
    data = yaml.safe_load(captured.out)["data"]
    assert data["num_frames"] == 33 and data.get("frame_extraction") == expected
    if shrink:
        assert "not translated: datasets[0].shrink_video_to_frames" not in captured.err
    else:
        assert "datasets[0].shrink_video_to_frames: data.frame_extraction=head" in captured.err


def test_control_paths_of_a_family_without_references_are_listed(tmp_path, run_cli, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("config: {name: x, process: [{type: sd_trainer, model: {name_or_path: m, arch: flux},"
                   " datasets: [{folder_path: /d, control_path: /c}]}]}\n")
    assert run_cli("import-aitk", job) == 0
    captured = capsys.readouterr()
    assert "not translated: datasets[0].control_path = '/c': the flux family trains without control images" \
        in captured.err
    assert "reference_paths" not in captured.out.split("# not translated")[0]


def test_an_ltx2_3_job_translates_as_the_ltx2_family(tmp_path, run_cli, capsys):
    """ai-toolkit's arch "ltx2.3" (its LTX23Model, an LTX2Model) is the ltx2 family here: the ltx2 fixture with
    arch ltx2.3 and Lightricks/LTX-2.3 translates to the same config and the same notes but the model's name (the
    translation says nothing of its own about LTX-2.3), and validates with tiny:ltx2."""
    from toolkit.plan.run import load_run
    from toolkit.preflight import path_checks

    text = (FIXTURES / "ltx2.yaml").read_text()
    for old, new in (("arch: 'ltx2'", "arch: 'ltx2.3'"), ('"Lightricks/LTX-2"', '"Lightricks/LTX-2.3"')):
        assert text.count(old) == 1
        text = text.replace(old, new)
    job = tmp_path / "ltx2_3.yaml"
    job.write_text(text)
    translations = []
    for path in (FIXTURES / "ltx2.yaml", job):
        assert run_cli("import-aitk", path) == 0
        captured = capsys.readouterr()
        translations.append((yaml.safe_load(captured.out), captured.err, captured.out))
    (ltx2, ltx2_err, _), (ltx23, ltx23_err, ltx23_out) = translations
    assert ltx23["model"] == {"family": "ltx2", "name_or_path": "Lightricks/LTX-2.3", "quantize": "8bit"}
    assert {**ltx23, "model": {**ltx23["model"], "name_or_path": "Lightricks/LTX-2"}} == ltx2
    assert ltx23["data"]["num_frames"] == 121 and ltx23["data"]["audio"] == "auto"
    assert ltx23["train"]["frame_rate"] == 24.0 and ltx23["sample"]["num_frames"] == 97
    assert ltx23_err == ltx2_err and "not translated" not in ltx23_err
    assert "changed: sample.num_frames: 100 frames -> 97 (clips here are 8k+1 frames)" in ltx23_err
    assert "# 0 settings not translated, 4 as this toolkit does anyway (see the end)" in ltx23_out
    mentions = [line for line in (ltx23_out + ltx23_err).splitlines() if "LTX-2.3" in line or "ltx2.3" in line]
    assert mentions == ["  name_or_path: Lightricks/LTX-2.3"]

    translated = tmp_path / "config.yaml"
    translated.write_text(yaml.safe_dump(ltx23))
    run = load_run([translated], ["model.name_or_path=tiny:ltx2", f"data.path={DATA / 'clips'}"], device=H100,
                   check_paths=path_checks(check_output=False))
    assert run.cfg.model.family == "ltx2" and run.cfg.data.num_frames == 121 and run.cfg.train.frame_rate == 24.0


def test_a_single_file_checkpoint_is_translated_with_a_note_that_names_the_fix(tmp_path, run_cli, capsys):
    """ai-toolkit's UI gives some arches (LTX-2.3's among them) one checkpoint file; this toolkit loads a diffusers
    folder or Hub id: the translation keeps the path and says so, and validate names the file with the layout."""
    text = (FIXTURES / "ltx2.yaml").read_text()
    file = tmp_path / "ltx-2.3-22b-dev.safetensors"
    file.write_bytes(b"")
    job = tmp_path / "job.yaml"
    job.write_text(text.replace('"Lightricks/LTX-2"', f'"{file}"'))
    assert run_cli("import-aitk", job) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["model"]["name_or_path"] == str(file)
    assert (f"model.name_or_path: {file} is one checkpoint file; this toolkit loads a model from a diffusers folder "
            "or Hub id (validate refuses the file): set model.name_or_path to the model's diffusers repo") in captured.err
    translated = tmp_path / "config.yaml"
    translated.write_text(captured.out)
    assert run_cli("validate", translated, f"data.path={DATA / 'clips'}") == 2
    assert f"{file} is a file; give the folder that holds the model (a diffusers pipeline folder" in capsys.readouterr().err
