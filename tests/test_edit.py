"""Edit / reference-image training (docs/edit.md) through the real entry point on tiny pipelines: qwen_image_edit,
flux_kontext and FLUX.2 with references train their quickstarts, their LoRA files load into the diffusers edit
pipeline and change its output as the trainer's samples show; both references of a sample reach the model; odd
datasets are named errors; resume is bit-identical."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import REPO
from helpers import adapter_for, diffusion_train_args, mean_loss, read_metrics
from toolkit.tiny import resolve_model_path

EDIT = REPO / "configs/examples/data/edit"
PROMPT = "sks fill the circle with blue"  # the quickstarts' sample prompt, trigger applied

# family -> quickstart, pipeline, its tiny model, the call that matches the quickstart's samples, the LoRA file's
# key prefix (the base family's style) and whether it has `.alpha` keys
FAMILIES = {
    "qwen_image_edit": ("quickstart_qwen_image_edit.yaml", "QwenImageEditPlusPipeline", "qwen_image_edit",
                        dict(true_cfg_scale=4.0, negative_prompt=" "), "diffusion_model.", True),
    "flux_kontext": ("quickstart_flux_kontext.yaml", "FluxKontextPipeline", "flux_kontext",
                     dict(guidance_scale=2.5), "transformer.", True),
    "flux2": ("quickstart_flux2_references.yaml", "Flux2Pipeline", "flux2", dict(guidance_scale=4.0),
              "transformer.", False),
}
SAMPLE_REFS = {"qwen_image_edit": [EDIT / "green_circle_ref0.png", EDIT / "blue_square_ref1.png"],
               "flux2": [EDIT / "green_circle_ref0.png", EDIT / "blue_square_ref1.png"],
               "flux_kontext": [REPO / "configs/examples/data/kontext/blue_circle_ref0.png"]}
PROMPTS = {"flux_kontext": "sks invert the colours of the blue circle"}


def load_pipeline(name: str, tiny: str):
    import diffusers

    from toolkit.models.qwen_vl_processor import processor_override

    path = resolve_model_path(f"tiny:{tiny}")
    extra = processor_override(path) if name == "QwenImageEditPlusPipeline" else {}
    pipe = getattr(diffusers, name).from_pretrained(path, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("family", list(FAMILIES))
def test_edit_family_trains_and_its_lora_changes_the_edit_pipeline_as_its_samples_show(family, tmp_path, run_cli,
                                                                                       capsys):
    config, pipeline_name, tiny, call, prefix, alphas = FAMILIES[family]
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args(config, out, "network.alpha=16")) == 0
    err = capsys.readouterr().err
    refs = len(SAMPLE_REFS[family])
    assert f"references: {6 * refs} for 6 targets (6 with {refs}), from beside the targets (name_refN)" in err
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 2 and all(np.isfinite(losses))

    weights = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    suffixes = (".lora_A.weight", ".lora_B.weight") + ((".alpha",) if alphas else ())
    assert weights and all(k.startswith(prefix) and k.endswith(suffixes) for k in weights)
    assert (out / "final" / f"{Path(config).stem}_comfyui.safetensors").is_file()

    pipe = load_pipeline(pipeline_name, tiny)
    images = [Image.open(p).convert("RGB") for p in SAMPLE_REFS[family]]
    image = images[0] if family == "flux_kontext" else images

    def generate() -> np.ndarray:
        result = pipe(prompt=PROMPTS.get(family, PROMPT), image=image, num_inference_steps=2, width=64, height=64,
                      generator=torch.Generator("cpu").manual_seed(42), **call)
        return np.asarray(result.images[0], dtype=np.int16)

    base = generate()
    pipe.load_lora_weights(str(out / "final"))
    with_lora = generate()
    trained = np.asarray(Image.open(out / "samples" / "step-000002" / "00.png"), dtype=np.int16)
    assert np.abs(with_lora - base).max() >= 2
    assert np.abs(with_lora - trained).max() <= 1


def _copy_edit_data(folder: Path) -> Path:
    shutil.copytree(EDIT, folder)
    return folder


@pytest.mark.parametrize("family", ["qwen_image_edit", "flux2"])
def test_changing_only_the_second_reference_changes_the_loss(family, tmp_path):
    """Both references reach the model: the same batch and noise give a bit-identical loss, and a dataset that
    differs only in one target's second reference gives another (qwen_image_edit: its text too, which the
    Qwen2.5-VL encoder computes with the references in the prompt)."""
    config = FAMILIES[family][0]
    same = _copy_edit_data(tmp_path / "same")
    changed = _copy_edit_data(tmp_path / "changed")
    Image.new("RGB", (64, 64), (250, 200, 0)).save(changed / "blue_circle_ref1.png")

    def loss_and_batch(data: Path):
        adapter, dataset = adapter_for(config, tmp_path / data.name, f"data.path={data}", "train.batch_size=1")
        index = next(i for i, item in enumerate(dataset.items) if item.path.name == "blue_circle.png")
        batch = dataset.collate([index])
        losses = []
        for _ in range(2):
            torch.manual_seed(0)
            with torch.no_grad():
                losses.append(mean_loss(adapter, batch))
        assert torch.equal(losses[0], losses[1])  # nothing changed: bit-identical
        return losses[0], batch

    loss, batch = loss_and_batch(same)
    other_loss, other = loss_and_batch(changed)
    assert torch.equal(batch["latents"], other["latents"])
    assert torch.equal(batch["reference_latents.0"], other["reference_latents.0"])
    assert not torch.equal(batch["reference_latents.1"], other["reference_latents.1"])
    if family == "qwen_image_edit":
        assert not torch.equal(batch["prompt_embeds"], other["prompt_embeds"])
    assert abs(float(loss) - float(other_loss)) > 1e-6


@pytest.mark.parametrize("change, message", [
    (lambda d: (d / "red_square_ref1.png").unlink(),
     "red_square.png: reference 1 is missing (data.references=2; expected red_square_ref1.png"),
    (lambda d: (d / "red_square_ref1.png").rename(d / "red_square_ref2.png"),
     "red_square.png: its references are numbered with a gap: red_square_ref1 is missing"),
    (lambda d: shutil.copy(d / "red_square_ref0.png", d / "purple_star_ref0.png"),
     "reference file(s) without their target image in"),
    (lambda d: (d / "red_square_ref1.png").write_bytes(b"not an image"),
     "red_square_ref1.png: a reference of red_square.png cannot be read"),
])
def test_missing_or_odd_references_are_named_errors_with_exit_2(change, message, tmp_path, run_cli, capsys):
    data = _copy_edit_data(tmp_path / "data")
    change(data)
    code = run_cli(*diffusion_train_args("quickstart_qwen_image_edit.yaml", tmp_path / "run", f"data.path={data}"))
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "fix:" in err and "Traceback" not in err


def test_a_fourth_reference_is_refused_for_qwen_image_edit_and_a_second_for_kontext(tmp_path, run_cli, capsys):
    data = _copy_edit_data(tmp_path / "data")
    for stem in ("blue_circle", "red_square"):
        shutil.copy(data / f"{stem}_ref0.png", data / f"{stem}_ref2.png")
        shutil.copy(data / f"{stem}_ref0.png", data / f"{stem}_ref3.png")
    assert run_cli(*diffusion_train_args("quickstart_qwen_image_edit.yaml", tmp_path / "a", f"data.path={data}",
                                         "data.references=auto")) == 2
    assert "blue_circle.png: 4 references; this family's pipeline takes at most 3" in capsys.readouterr().err
    assert run_cli(*diffusion_train_args("quickstart_flux_kontext.yaml", tmp_path / "b", f"data.path={data}")) == 2
    assert "this family's pipeline takes at most 1" in capsys.readouterr().err


def test_reference_folders_like_ai_toolkit_control_paths(tmp_path, run_cli, capsys):
    """data.reference_paths: reference i of name.png is folder i's name.* (ai-toolkit's control_path_1 .. _3)."""
    data, first, second = tmp_path / "targets", tmp_path / "outlines", tmp_path / "colours"
    for folder in (data, first, second):
        folder.mkdir()
    for target in EDIT.glob("*.png"):
        if "_ref" not in target.stem:
            shutil.copy(target, data / target.name)
            shutil.copy(target.with_suffix(".txt"), data / f"{target.stem}.txt")
            shutil.copy(EDIT / f"{target.stem}_ref0.png", first / target.name)
            shutil.copy(EDIT / f"{target.stem}_ref1.png", second / target.name)
    args = diffusion_train_args("quickstart_flux2_references.yaml", tmp_path / "run", f"data.path={data}",
                                f"data.reference_paths=[{first},{second}]")
    assert run_cli(*args) == 0
    assert "references: 12 for 6 targets (6 with 2), from data.reference_paths" in capsys.readouterr().err
    (second / "red_square.png").unlink()
    assert run_cli(*args[:2], *args[2:], "train.resume=false", "--fresh") == 2
    assert f"{second}: no reference 1 for red_square.png" in capsys.readouterr().err


def test_edit_resume_from_a_checkpoint_is_bit_identical(tmp_path, run_cli):
    common = ("sample.prompts=[]", "sample.references=[]", "save.every=1", "save.format=diffusers")
    full = tmp_path / "full"
    assert run_cli(*diffusion_train_args("quickstart_qwen_image_edit.yaml", full, *common)) == 0
    resumed = tmp_path / "resumed"
    assert run_cli(*diffusion_train_args("quickstart_qwen_image_edit.yaml", resumed, *common,
                                         f"train.resume={full / 'checkpoints' / 'step-000001'}")) == 0
    losses = [r["loss"] for r in read_metrics(full)]
    assert [r["loss"] for r in read_metrics(resumed)] == losses[1:]
    a, b = (load_file(str(run / "final" / "pytorch_lora_weights.safetensors")) for run in (full, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
