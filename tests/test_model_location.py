"""model.name_or_path checked before any model loads: a folder without the family's layout, a tiny model of
another family, a Hub id without network (fast, in seconds)."""

from __future__ import annotations

import shutil
import time

from conftest import REPO, run_toolkit
from toolkit.tiny import resolve_model_path

LLM = REPO / "configs/examples/quickstart_llm.yaml"
SD = REPO / "configs/examples/quickstart_sd.yaml"


def validate(*args, env=None):
    proc = run_toolkit("validate", *args, timeout=60, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_a_folder_that_holds_no_model_names_what_is_missing_and_the_layout(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no_weights"
    shutil.copytree(resolve_model_path("tiny:llm"), no_weights)
    for weights in no_weights.glob("*.safetensors"):
        weights.unlink()
    err = validate(LLM, f"model.name_or_path={empty}")
    assert (f"'model.name_or_path' in command line: {empty} holds no llm model: config.json is missing; no weights "
            "(*.safetensors or pytorch_model*.bin); no tokenizer files (tokenizer.json or tokenizer_config.json). "
            "Expected a transformers model folder: config.json, weights") in err
    err = validate(LLM, f"model.name_or_path={no_weights}")
    assert f"{no_weights} holds no llm model: no weights (*.safetensors or pytorch_model*.bin). Expected" in err
    sd = tmp_path / "sd"
    shutil.copytree(resolve_model_path("tiny:sd"), sd)
    shutil.rmtree(sd / "vae")
    err = validate(SD, f"model.name_or_path={sd}")
    assert f"{sd} holds no sd model: vae/ is missing. Expected a diffusers pipeline folder: model_index.json" in err
    err = validate(SD, f"model.name_or_path={tmp_path / 'nope'}")
    assert f"the folder {tmp_path / 'nope'} does not exist" in err


def test_the_wrong_familys_layout_is_named(tmp_path):
    flux = resolve_model_path("tiny:flux")
    err = validate(SD, f"model.name_or_path={flux}")
    assert f"{flux} holds no sd model: it is a FluxPipeline (model.family flux), not a StableDiffusionPipeline" in err
    sd = resolve_model_path("tiny:sd")
    err = validate(LLM, f"model.name_or_path={sd}")
    assert f"{sd} holds no llm model: it is a diffusers pipeline (StableDiffusionPipeline, model.family sd)" in err
    err = validate(LLM, "model.name_or_path=tiny:sd")
    assert "tiny:sd is a sd model, and model.family is llm; use tiny:llm" in err


def test_a_hub_id_without_network_fails_in_seconds_naming_offline_mode_and_a_local_folder(tmp_path):
    repo = "toolkit-tests/not-a-cached-model"
    hub_cache = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    started = time.monotonic()
    proc = run_toolkit("train", LLM, f"model.name_or_path={repo}", f"run.output_dir={tmp_path / 'run'}", timeout=60,
                       env={**hub_cache, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (f"'{repo}' is not in the local Hugging Face cache, and offline mode is on (HF_HUB_OFFLINE=1)" in proc.stderr
            and "point model.name_or_path at a local folder" in proc.stderr)
    # No offline flag, and the Hub does not answer (a closed port stands for no network).
    proc = run_toolkit("train", LLM, f"model.name_or_path={repo}", f"run.output_dir={tmp_path / 'run'}", timeout=60,
                       env={**hub_cache, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (f"'{repo}' is not in the local Hugging Face cache and http://127.0.0.1:9 did not answer within 3 s" in proc.stderr
            and "HF_HUB_OFFLINE=1" in proc.stderr and "local folder" in proc.stderr)
    assert time.monotonic() - started < 20  # both runs, interpreter start-up included (from_pretrained: ~50 s)
    assert not (tmp_path / "run").exists()


def test_a_cached_hub_model_without_network_runs_in_offline_mode_with_a_note(tmp_path):
    repo = "toolkit-tests/cached-model"
    snapshot = tmp_path / "hub" / "models--toolkit-tests--cached-model" / "snapshots" / "abc123"
    shutil.copytree(resolve_model_path("tiny:llm"), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    proc = run_toolkit("validate", LLM, f"model.name_or_path={repo}", timeout=60,
                       env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert proc.returncode == 0, proc.stderr
    assert (f"note: http://127.0.0.1:9 did not answer within 3 s; '{repo}' is in the local cache, so this run uses "
            "it in offline mode (HF_HUB_OFFLINE=1)") in proc.stderr


def test_the_new_familys_tiny_folders_pass_as_local_folders(run_cli, capsys):
    """A pipeline folder given by path is checked component by component: FLUX.2's tokenizer, saved by transformers 5
    as TokenizersBackend, holds no weights (as PixtralProcessor, the real folder's, does not)."""
    for family in ("z_image", "flux2"):
        folder = resolve_model_path(f"tiny:{family}")
        assert run_cli("validate", REPO / f"configs/examples/quickstart_{family}.yaml",
                       f"model.name_or_path={folder}") == 0, capsys.readouterr().err
