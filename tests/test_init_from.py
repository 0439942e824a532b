"""network.init_from through the real entry point: a new run B starts from the LoRA of a finished tiny run A.

B trains one step at lr 0, so its checkpoint holds the LoRA it started from: tensor-equal to A's (and its samples
pixel-equal to A's last ones), read from sd's kohya file, a checkpoint folder (after `--fresh` moved A's run
aside, as the refused resume suggests), flux's ComfyUI file and an llm PEFT adapter folder; steps and optimizer
state start fresh. A file written by diffusers' own save_lora_weights loads too, its scale kept when
network.alpha differs, and modules it lacks keep their usual initialisation. A rank that differs, a key that
maps to no module and modules the run does not train are exit 2, naming them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from conftest import REPO
from helpers import cpu_runtime
from lora_math import expected_updates
from toolkit.train.checkpoint import trainable_from_file
from toolkit.models.base import load_trainable_state_dict

# B: one step at lr 0 (AdamW then leaves every weight as it was), a checkpoint at it, no samples unless asked.
B_ARGS = ["train.steps=1", "train.lr=0", "save.every=1", "save.dtype=fp32", "log.tensorboard=false",
          "sample.prompts=[]"]
SD_B = ["train.batch_size=2", "network.rank=4", "network.alpha=6"]


@pytest.fixture
def runs(tiny_runs, monkeypatch):
    """The session's tiny finished runs (helpers.TINY_RUNS), with their own latent and text caches in force."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tiny_runs.cache))
    return tiny_runs


def trainable(step_dir: Path) -> dict[str, torch.Tensor]:
    return trainable_from_file(load_file(str(step_dir / "trainable_state.safetensors")))


def assert_same_lora(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and len(got) > 0
    assert all(torch.equal(got[k], want[k]) for k in got)


def train(run_cli, config: str, out: Path, *extra: str) -> int:
    return run_cli("train", REPO / "configs/examples" / config, f"run.output_dir={out}", *B_ARGS, *extra)


def test_sd_from_a_kohya_file_starts_exactly_where_the_file_is(runs, run_cli, tmp_path, capsys):
    a, b = runs["sd"], tmp_path / "b"
    kohya = a / "final" / "quickstart_sd_kohya.safetensors"
    assert train(run_cli, "quickstart_sd.yaml", b, *SD_B, f"network.init_from={kohya}", "sample.every=1",
                 "sample.num_inference_steps=2", "sample.prompts=[a red circle on a white background]") == 0
    assert f"network.init_from: the LoRA starts from file {kohya}; steps, optimizer state and schedule start fresh" \
           in capsys.readouterr().err
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step-000001"]  # steps start at 0
    optimizer = torch.load(b / "checkpoints" / "step-000001" / "optimizer.pt", weights_only=True)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {1.0}  # a fresh optimizer: one step taken
    assert_same_lora(trainable(b / "checkpoints" / "step-000001"), trainable(a / "checkpoints" / "step-000002"))
    # The model's output: B's sample at its start equals A's last sample (same prompt, seed and sample settings).
    ours, theirs = (np.asarray(Image.open(run / "samples" / step / "00.png")) for run, step in
                    ((b, "step-000001"), (a, "step-000002")))
    assert np.array_equal(ours, theirs)


def test_refused_resume_points_at_init_from_and_that_command_keeps_the_weights(runs, run_cli, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["sd"], run)
    # The run's own settings but another learning rate (0, so that its first step leaves the LoRA as it starts).
    args = ["train", REPO / "configs/examples/quickstart_sd.yaml", f"run.output_dir={run}", *B_ARGS, *SD_B,
            "save.format=kohya"]
    capsys.readouterr()
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    checkpoint = run / "checkpoints" / "step-000002"
    assert "- train.lr: 0.001 in the checkpoint, 0.0 now" in err
    hint = f"network.init_from={checkpoint} --fresh"
    assert f"or, to keep what it learned with the new settings, add: {hint} (a new run" in err
    # As it says: --fresh moves the run aside (its checkpoint with it), the new run starts from that checkpoint's LoRA.
    assert run_cli(*args, *hint.split()) == 0
    [old] = tmp_path.glob("run.old-*")
    moved = old / "checkpoints" / "step-000002"  # where --fresh put it: the log and the run's config name it there
    err = capsys.readouterr().err
    assert f"network.init_from: {checkpoint} was moved with the earlier run; the run's config names it at {moved}" in err
    assert f"the LoRA starts from checkpoint {moved}" in err
    assert f"init_from: {moved}\n" in (run / "config.yaml").read_text()
    assert_same_lora(trainable(run / "checkpoints" / "step-000001"), trainable(old / "checkpoints" / "step-000002"))
    # The same command again, with more steps (or after a stop): it resumes the new run, although that run's config
    # names the LoRA where --fresh moved it and the command where it was
    more = [a if a != "train.steps=1" else "train.steps=2" for a in args]
    assert "train.steps=2" in more and run_cli(*more, *hint.split()[:1]) == 0
    out = "".join(capsys.readouterr())
    assert f"resumed from {run / 'checkpoints' / 'step-000001'}" in out and not list(tmp_path.glob("run.old-*-1"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]


@pytest.mark.parametrize("family, config, lora", [
    ("flux", "quickstart_flux.yaml", "final/quickstart_flux_comfyui.safetensors"),  # its ComfyUI copy
    ("llm", "quickstart_llm.yaml", "final"),  # a PEFT adapter folder
])
def test_flux_comfyui_file_and_llm_adapter_folder(family, config, lora, runs, run_cli, tmp_path):
    a, b = runs[family], tmp_path / "b"
    extra = ["data.max_seq_len=32", "train.batch_size=4"] if family == "llm" else ["train.batch_size=2"]
    assert train(run_cli, config, b, *extra, f"network.init_from={a / lora}") == 0
    assert_same_lora(trainable(b / "checkpoints" / "step-000001"), trainable(a / "checkpoints" / "step-000002"))


def sd_adapter(run_dir: Path, *overrides: str, log=None):
    """The sd adapter of `run_dir`'s config (with overrides), its model loaded, no data; `log` receives its notes."""
    from toolkit.plan.run import load_run
    from toolkit.models import build_adapter

    run = load_run([run_dir / "config.yaml"], list(overrides))
    adapter = build_adapter(run.cfg, cpu_runtime(run, run_dir, **({"log": log} if log else {})))
    adapter.load()
    return adapter


def test_a_diffusers_file_keeps_its_scale_and_uncovered_modules_start_as_usual(runs, tmp_path):
    """A file written by diffusers' own save_lora_weights (unet. keys, lora_A/lora_B, the LoRA config as metadata,
    alpha 6 over rank 4) into a run with alpha 4 and LoRA on the text encoder too."""
    from diffusers import StableDiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    a = sd_adapter(runs["sd"])
    load_trainable_state_dict(a.network, trainable(runs["sd"] / "checkpoints" / "step-000002"))
    unet = a.network["unet"]
    StableDiffusionPipeline.save_lora_weights(tmp_path, unet_lora_layers=get_peft_model_state_dict(unet),
                                              unet_lora_adapter_metadata=unet.peft_config["default"].to_dict())
    notes = []
    b = sd_adapter(runs["sd"], "network.alpha=4", "train.train_text_encoder=true", log=notes.append)
    b.load_lora(tmp_path / "pytorch_lora_weights.safetensors", partial=True)
    want, got = expected_updates(unet), expected_updates(b.network["unet"])
    assert got.keys() == want.keys()
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6  # alpha/rank * B @ A is the file's
    key = next(n for n, _ in unet.named_parameters() if "lora_A" in n)
    assert torch.allclose(b.network["unet"].get_parameter(key), unet.get_parameter(key) * 1.5)  # 6/4 over 4/4
    encoder = b.network["text_encoder"]
    assert all(float(p.abs().max()) == 0 for n, p in encoder.named_parameters() if "lora_B" in n)  # usual init
    assert any("8 of the 8 LoRA modules of the text_encoder are not in it and start from the usual initialisation"
               in note for note in notes)


def test_rank_unknown_keys_and_untrained_modules_are_exit_2(runs, run_cli, tmp_path, capsys):
    kohya = runs["sd"] / "final" / "quickstart_sd_kohya.safetensors"
    capsys.readouterr()
    assert train(run_cli, "quickstart_sd.yaml", tmp_path / "rank", "network.rank=8", f"network.init_from={kohya}") == 2
    err = capsys.readouterr().err
    assert f"error: network.init_from (file {kohya}): its LoRA has rank 4 (" in err
    assert "network.rank is 8\n  fix: set network.rank=4" in err and "Traceback" not in err

    state = load_file(str(kohya))
    stem = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_k"
    for suffix in ("alpha", "lora_down.weight", "lora_up.weight"):
        state[f"{stem}_extra.{suffix}"] = state[f"{stem}.{suffix}"].clone()
    bogus = tmp_path / "bogus.safetensors"
    save_file(state, str(bogus))
    assert train(run_cli, "quickstart_sd.yaml", tmp_path / "keys", *SD_B, f"network.init_from={bogus}") == 2
    err = capsys.readouterr().err
    assert f"network.init_from (file {bogus}): 2 of its LoRA weights map to no module of the sd model" in err
    assert "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to.k.extra.lora_A.weight" in err  # diffusers names it

    assert train(run_cli, "quickstart_sd.yaml", tmp_path / "targets", *SD_B, "network.target_modules=[to_q]",
                 f"network.init_from={kohya}") == 2
    assert "modules of the unet that this run does not train (e.g. " in capsys.readouterr().err


def test_another_family_s_run_is_refused_by_name(runs, run_cli, tmp_path, capsys):
    """An llm run's folder, final/ or checkpoint given to an sd run: named as another family's LoRA by validate and
    train before anything loads (it said only that pytorch_lora_weights.safetensors was missing)."""
    llm = runs["llm"]
    for given in (llm, llm / "final", llm / "checkpoints" / "step-000002"):
        assert train(run_cli, "quickstart_sd.yaml", tmp_path / "b", *SD_B, f"network.init_from={given}") == 2
        err = capsys.readouterr().err
        # named with the config's other problems, before anything loads (preflight/init_from.py)
        assert f"'network.init_from' in command line: {given} is the LoRA of a llm run" in err
        assert "and this run trains sd; give a sd LoRA" in err and "Traceback" not in err
        assert run_cli("validate", REPO / "configs/examples/quickstart_sd.yaml", f"network.init_from={given}") == 2


def test_a_resumed_run_does_not_read_its_init_from_again(runs, run_cli, tmp_path, capsys):
    """A run that started from A's LoRA resumes although A's folder has since been reused for another family: a
    resumed run never reads network.init_from, so nothing of it is checked."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(runs["sd"], a)
    assert train(run_cli, "quickstart_sd.yaml", b, *SD_B, f"network.init_from={a}") == 0
    (a / "config.yaml").write_text((a / "config.yaml").read_text().replace("family: sd", "family: llm"))
    capsys.readouterr()
    assert run_cli("train", REPO / "configs/examples/quickstart_sd.yaml", f"run.output_dir={b}",
                   *[x if x != "train.steps=1" else "train.steps=2" for x in B_ARGS], *SD_B,
                   f"network.init_from={a}") == 0
    assert "resumed from" in capsys.readouterr().err
