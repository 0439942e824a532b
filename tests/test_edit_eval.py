"""The validation loss (eval.*) and output preservation (train.dop_class) of the edit families (docs/edit.md) through
the real entry point on tiny pipelines: eval.path's images carry their references (laid out as data.path's), their
losses are logged, equal after a kill -9 and resume, and change when only an eval reference changes; DOP at weight 0
trains bit for bit as plain training, at weight 1 another LoRA, its preservation pass on the sample's references."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import REPO, run_toolkit
from helpers import adapter_for, data_cache_apart, diffusion_train_args
from test_resume import SINGLE_THREAD, kill_9_after_checkpoint

QUICKSTARTS = {"qwen_image_edit": ("quickstart_qwen_image_edit.yaml", "edit"),
               "flux_kontext": ("quickstart_flux_kontext.yaml", "kontext"),
               "flux2": ("quickstart_flux2_references.yaml", "edit")}
HELD_OUT = ("blue_circle", "red_square")  # eval targets; the others train
LORA = "pytorch_lora_weights.safetensors"

pytestmark = pytest.mark.usefixtures("own_data_caches")


def split_folders(family: str, root: Path) -> tuple[Path, Path]:
    """(train, held_out): the quickstart's folder split by target, each target with its name_refN files."""
    source = REPO / "configs/examples/data" / QUICKSTARTS[family][1]
    train, held_out = root / "train", root / "held_out"
    for folder in (train, held_out):
        folder.mkdir(parents=True)
    for path in source.iterdir():
        stem = path.stem.split("_ref")[0]
        shutil.copy(path, (held_out if stem in HELD_OUT else train) / path.name)
    return train, held_out


def evals(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


def run_args(family: str, out: Path, train: Path, *extra: str) -> list[str]:
    return [*diffusion_train_args(QUICKSTARTS[family][0], out, f"data.path={train}", "train.batch_size=1",
                                  "sample.prompts=[]", "sample.references=[]", "log.tensorboard=false"), *extra]


@pytest.mark.parametrize("family", list(QUICKSTARTS))
def test_edit_eval_loss_is_logged_and_identical_after_kill_9_and_resume(family, tmp_path):
    train, held_out = split_folders(family, tmp_path / "data")
    args = run_args(family, tmp_path / "unused", train, "train.steps=4", "save.every=2", "save.keep_last=10",
                    f"eval.path={held_out}", "eval.every=2", "eval.timesteps=2")
    env = {**SINGLE_THREAD, "TOOLKIT_CACHE": str(data_cache_apart(tmp_path / "cache"))}
    ref, out = tmp_path / "reference", tmp_path / "run"

    proc = run_toolkit(*args, f"run.output_dir={ref}", env=env)
    assert proc.returncode == 0, proc.stderr
    reference = evals(ref)
    assert sorted(reference) == [2, 4] and all(math.isfinite(v) and v > 0 for v in reference.values())
    assert reference[2] != reference[4]  # the LoRA moved between them; the inputs did not
    refs = 1 if family == "flux_kontext" else 2
    assert f"references: {2 * refs} for 2 targets (2 with {refs}), from beside the targets (name_refN)" in proc.stderr

    killed = subprocess.Popen([sys.executable, "-m", "toolkit", *args, f"run.output_dir={out}"], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    kill_9_after_checkpoint(killed, out, 2)
    assert killed.returncode == -signal.SIGKILL and not (out / "final").exists()
    proc = run_toolkit(*args, f"run.output_dir={out}", env=env)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr
    assert evals(out) == reference  # bit for bit: the logged floats are equal


@pytest.mark.parametrize("family", list(QUICKSTARTS))
def test_edit_eval_loss_changes_when_only_an_eval_reference_changes(family, tmp_path):
    train, held_out = split_folders(family, tmp_path / "data")
    changed = tmp_path / "changed"
    shutil.copytree(held_out, changed)
    last = "blue_circle_ref0.png" if family == "flux_kontext" else "blue_circle_ref1.png"
    Image.new("RGB", (64, 64), (250, 200, 0)).save(changed / last)

    def eval_loss(folder: Path) -> float:
        adapter, _ = adapter_for(QUICKSTARTS[family][0], tmp_path / folder.name, f"data.path={train}",
                                 f"eval.path={folder}", "eval.timesteps=2")
        assert len(adapter.eval_set) == 2 and all(len(item.references) == (1 if family == "flux_kontext" else 2)
                                                   for item in adapter.eval_set.items)
        first, again = adapter.eval_loss(1), adapter.eval_loss(1)
        assert first == again  # fixed noise and levels: the same inputs every time
        return first

    assert abs(eval_loss(held_out) - eval_loss(changed)) > 1e-7


@pytest.mark.parametrize("family", list(QUICKSTARTS))
def test_edit_dop_weight_0_trains_as_plain_training_and_weight_1_does_not(family, tmp_path, run_cli, capsys):
    train, _ = split_folders(family, tmp_path / "data")
    finals = {}
    for name, extra in (("plain", []), ("dop0", ["train.dop_class=shape", "train.dop_weight=0"]),
                        ("dop1", ["train.dop_class=shape", "train.dop_weight=1"])):
        out = tmp_path / name
        assert run_cli(*run_args(family, out, train, "train.steps=3", *extra)) == 0
        err = capsys.readouterr().err
        if extra:
            assert ("output preservation: 4 of 4 items with a class caption (their trigger word -> 'shape'; "
                    f"train.dop_weight={extra[1][-1]})") in err
        finals[name] = load_file(str(out / "final" / LORA))
    assert finals["plain"].keys() == finals["dop0"].keys() and len(finals["plain"]) > 0
    assert all(torch.equal(finals["plain"][k], finals["dop0"][k]) for k in finals["plain"])
    assert any(not torch.equal(finals["plain"][k], finals["dop1"][k]) for k in finals["plain"])


@pytest.mark.parametrize("family", list(QUICKSTARTS))
def test_edit_dop_base_prediction_is_the_lora_off_on_the_samples_references(family, tmp_path):
    """The preservation pass conditions on the sample's own references (and, for qwen_image_edit, on the class
    caption encoded with them): its base prediction is the model with its LoRA off on that very input, and the
    preservation term moves when only the references do."""
    train, _ = split_folders(family, tmp_path / "data")
    adapter, dataset = adapter_for(QUICKSTARTS[family][0], tmp_path, f"data.path={train}", "train.dop_class=shape",
                                   "train.dop_weight=0.5")
    lora_b = [p for n, p in adapter.network.named_parameters() if "lora_B" in n]
    torch.manual_seed(1)
    with torch.no_grad():
        for p in lora_b:  # a trained LoRA: its prediction differs from the base model's
            p.normal_(std=0.5)
    batch = dataset.collate([0])
    assert batch["preserve"].tolist() == [True]
    references = [key for key in batch if key.startswith("reference_latents.")]
    assert len(references) == (1 if family == "flux_kontext" else 2)
    if family == "qwen_image_edit":  # the class caption encoded with the item's references, as its caption is
        loaded = adapter.load_item(dataset.items[0], dataset.views[0][0])
        assert loaded["class_caption"] == dataset.dop_captions[0] == loaded["caption"].replace("sks", "shape")
        expected = adapter.encode_edit_text(loaded["class_caption"], loaded["condition_images"])
        assert torch.equal(batch["dop.prompt_embeds"][0], expected["prompt_embeds"])
        assert not torch.equal(batch["dop.prompt_embeds"], batch["prompt_embeds"])
    seen = []
    predict = adapter.predict
    adapter.predict = lambda *args: seen.append((args, predict(*args))) or seen[-1][1]

    def preservation(batch) -> torch.Tensor:
        seen.clear()
        torch.manual_seed(0)
        with torch.no_grad():
            total = adapter.loss(batch, adapter.trainable_modules())
        assert len(seen) == 3  # the sample, the base (LoRA off) and the LoRA's class prediction
        return total - adapter.objective.loss(seen[0][1], seen[0][0][1]).sum()

    term = preservation(batch)
    (denoiser, noised, cond, class_batch), base = seen[1]
    assert all(torch.equal(class_batch[key], batch[key]) for key in references)
    if family == "qwen_image_edit":
        assert torch.equal(cond["prompt_embeds"], batch["dop.prompt_embeds"].to(cond["prompt_embeds"]))
    saved = [p.detach().clone() for p in lora_b]
    with torch.no_grad():
        for p in lora_b:
            p.zero_()
        without = predict(denoiser, noised, cond, class_batch)
        for p, kept in zip(lora_b, saved):
            p.copy_(kept)
    assert torch.equal(base, without)
    assert float(term) > 0

    other = dict(batch)  # the same sample with its last reference swapped for another item's
    other[references[-1]] = dataset.collate([1])[references[-1]]
    assert abs(float(preservation(other)) - float(term)) > 1e-9
