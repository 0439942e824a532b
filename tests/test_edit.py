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

    from toolkit.data.qwen_vl_processor import processor_override

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


KONTEXT = REPO / "configs/examples/data/kontext"
TWO_SAMPLES = {"qwen_image_edit": [[EDIT / "green_circle_ref0.png", EDIT / "blue_square_ref1.png"],
                                   [EDIT / "red_square_ref0.png", EDIT / "green_circle_ref1.png"]],
               "flux2": [[EDIT / "green_circle_ref0.png", EDIT / "blue_square_ref1.png"],
                         [EDIT / "red_square_ref0.png", EDIT / "green_circle_ref1.png"]],
               "flux_kontext": [[KONTEXT / "blue_circle_ref0.png"], [KONTEXT / "red_square_ref0.png"]]}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_sample_prompt_takes_its_own_references(family, tmp_path, run_cli, monkeypatch):
    """Two sample prompts of one text, each with its own sample.references: the trainer's pipeline call for sample i
    gets prompt i's reference images (their pixels) and seed sample.seed + i, and sample 1 is the edit pipeline's
    image with the run's LoRA for its references. (The tiny models' images move by under 1/255 when only the
    references change, except Kontext's: the call's images are compared, not the samples.)"""
    import diffusers

    config, pipeline_name, tiny, call, _, _ = FAMILIES[family]
    text = PROMPTS.get(family, PROMPT)
    refs = TWO_SAMPLES[family]
    seen = []
    pipeline_class = getattr(diffusers, pipeline_name)
    original = pipeline_class.__call__

    def watched(pipe, *args, **kwargs):
        images = kwargs["image"] if isinstance(kwargs["image"], list) else [kwargs["image"]]
        seen.append(([np.asarray(image) for image in images], kwargs["generator"].initial_seed()))
        return original(pipe, *args, **kwargs)

    out = tmp_path / "run"
    with monkeypatch.context() as patched:
        patched.setattr(pipeline_class, "__call__", watched)
        assert run_cli(*diffusion_train_args(config, out, "network.alpha=16", "save.every=2", "sample.every=2",
                                             f"sample.prompts=[{text}, {text}]",
                                             "sample.references=[" + ", ".join(f"[{', '.join(map(str, r))}]"
                                                                               for r in refs) + "]")) == 0
    folder = out / "samples" / "step-000002"
    assert (folder / "prompts.txt").read_text().splitlines() == [f"00: {text}", f"01: {text}"]
    assert [seed for _, seed in seen] == [42, 43]
    for (images, _), paths in zip(seen, refs):
        assert len(images) == len(paths)
        assert all(np.array_equal(image, np.asarray(Image.open(p).convert("RGB"))) for image, p in zip(images, paths))
    assert not np.array_equal(seen[0][0][0], seen[1][0][0])

    pipe = load_pipeline(pipeline_name, tiny)
    pipe.load_lora_weights(str(out / "final"))
    images = [Image.open(p).convert("RGB") for p in refs[1]]
    result = pipe(prompt=text, image=images[0] if family == "flux_kontext" else images, num_inference_steps=2,
                  width=64, height=64, generator=torch.Generator("cpu").manual_seed(43), **call)
    sample = np.asarray(Image.open(folder / "01.png"), dtype=np.int16)
    assert np.abs(np.asarray(result.images[0], dtype=np.int16) - sample).max() <= 1


def _copy_edit_data(folder: Path) -> Path:
    shutil.copytree(EDIT, folder)
    return folder


@pytest.mark.parametrize("family", ["qwen_image_edit", "flux2"])
def test_changing_only_the_second_reference_changes_the_loss(family, tmp_path):
    """Both references reach the model: the same batch and noise give a bit-identical loss, and a dataset that
    differs only in one target's second reference gives another (qwen_image_edit: its text too, which the
    Qwen2.5-VL encoder computes with the references in the prompt). The second reference's latents alone, the
    cached text kept, change the loss too: the image path, not only the text, carries it."""
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
        return losses[0], batch, adapter

    loss, batch, adapter = loss_and_batch(same)
    other_loss, other, _ = loss_and_batch(changed)
    assert torch.equal(batch["latents"], other["latents"])
    assert torch.equal(batch["reference_latents.0"], other["reference_latents.0"])
    assert not torch.equal(batch["reference_latents.1"], other["reference_latents.1"])
    if family == "qwen_image_edit":
        assert not torch.equal(batch["prompt_embeds"], other["prompt_embeds"])
    assert abs(float(loss) - float(other_loss)) > 1e-6

    # The image path alone: the first batch, its cached text included, with only the second reference's latents
    # taken from the other (for qwen_image_edit, the text its encoder computed with the new reference left out).
    alone = {**batch, "reference_latents.1": other["reference_latents.1"]}
    torch.manual_seed(0)
    with torch.no_grad():
        image_path = mean_loss(adapter, alone)
    assert abs(float(image_path) - float(loss)) > 1e-5  # 4.6e-4 (qwen_image_edit), 4.8e-5 (flux2); float noise ~1e-7
    if family == "flux2":  # its text does not depend on the references: that is the other dataset's loss
        assert torch.equal(image_path, other_loss)


def _references_folder(data: Path, numbered: bool) -> Path:
    """The dataset at `data` with its references moved into references/: name_refN.png as they are, or (one
    reference a target) name_ref0.png as references/name.png."""
    folder = data / "references"
    folder.mkdir()
    for ref in sorted(data.glob("*_ref*.png")):
        ref.rename(folder / (ref.name if numbered else ref.name.replace("_ref0", "")))
    return data


@pytest.mark.parametrize("family, numbered", [("qwen_image_edit", True), ("flux_kontext", False)])
def test_references_folder_trains_as_references_beside_the_targets(family, numbered, tmp_path, run_cli, capsys):
    """docs/edit.md's references/ layouts: references/name_ref0.png, name_ref1.png (qwen_image_edit's 2), and
    references/name.png alone (flux_kontext's 1): the log says where they came from, and the run's losses are the
    quickstart's with the same references beside the targets."""
    config = FAMILIES[family][0]
    source = EDIT if family == "qwen_image_edit" else REPO / "configs/examples/data/kontext"
    data = shutil.copytree(source, tmp_path / "data")
    refs = len(list(data.glob("*_ref*.png")))
    targets = len([p for p in data.glob("*.png") if "_ref" not in p.stem])
    _references_folder(data, numbered)
    assert not list(data.glob("*_ref*")) and len(list((data / "references").iterdir())) == refs
    assert any(p.name.endswith("_ref1.png") for p in (data / "references").iterdir()) == numbered

    assert run_cli(*diffusion_train_args(config, tmp_path / "folder", f"data.path={data}", "sample.prompts=[]",
                                         "sample.references=[]")) == 0
    per = refs // targets
    assert (f"references: {refs} for {targets} targets ({targets} with {per}), from references/"
            in capsys.readouterr().err)
    assert run_cli(*diffusion_train_args(config, tmp_path / "beside", f"data.path={source}", "sample.prompts=[]",
                                         "sample.references=[]")) == 0
    assert (f"references: {refs} for {targets} targets ({targets} with {per}), from beside the targets (name_refN)"
            in capsys.readouterr().err)
    folder, beside = (read_metrics(tmp_path / name) for name in ("folder", "beside"))
    assert len(folder) == 2 and [r["loss"] for r in folder] == [r["loss"] for r in beside]


# A 128 x 64 second reference of blue_circle and a 48 x 128 first reference of red_square, for 64 x 64 targets at
# data.resolution 64: the size each family's pipeline gives them, with its reference area (1024 x 1024) as 64 x 64.
# Qwen-Image-Edit: calculate_dimensions(area, ratio), sides rounded to multiples of 32. FLUX.2: an image over the
# area is scaled to it (the sides truncated), then each side cut down to a multiple of 16.
ODD_REFERENCES = {("blue_circle", 1): (128, 64), ("red_square", 0): (48, 128)}
ODD_BUCKETS = {"qwen_image_edit": {(128, 64): (96, 32), (48, 128): (32, 96)},
               "flux2": {(128, 64): (80, 32), (48, 128): (32, 96)}}


def _pipeline_reference_size(family: str, size: tuple[int, int], area: int) -> tuple[int, int]:
    """The reference size the family's diffusers pipeline computes (its own helpers) at `area`."""
    from PIL import Image

    if family == "qwen_image_edit":
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        return calculate_dimensions(area, size[0] / size[1])
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    width, height = Flux2ImageProcessor._resize_if_exceeds_area(Image.new("RGB", size), area).size
    return width // 16 * 16, height // 16 * 16  # Flux2Pipeline.__call__: multiple_of = vae_scale_factor * 2


@pytest.mark.parametrize("family", ["qwen_image_edit", "flux2"])
def test_references_of_another_size_than_their_target_get_their_own_buckets(family, tmp_path, run_cli, capsys,
                                                                            own_data_caches):
    """References of other sizes and aspect ratios than their 64 x 64 targets are cut to the bucket the family's
    pipeline would resize them to: the latent cache holds them at those sizes, an item is batched only with items
    whose references share its buckets, and the transformer gets their tokens at those sizes (qwen_image_edit: its
    img_shapes; flux2: its reference position ids)."""
    config = FAMILIES[family][0]
    data = _copy_edit_data(tmp_path / "data")
    for (stem, i), size in ODD_REFERENCES.items():
        path = data / f"{stem}_ref{i}.png"
        Image.open(path).convert("RGB").resize(size).save(path)
    expected = ODD_BUCKETS[family]
    assert all(_pipeline_reference_size(family, size, 64 * 64) == bucket for size, bucket in expected.items())
    down, channels = (8, 16) if family == "qwen_image_edit" else (16, 128)  # the latents' pixels per side, channels

    assert run_cli(*diffusion_train_args(config, tmp_path / "run", f"data.path={data}", "sample.prompts=[]",
                                         "sample.references=[]")) == 0
    err = capsys.readouterr().err
    assert "references: 12 for 6 targets (6 with 2), from beside the targets (name_refN)" in err
    assert "latents: 0 cached, 6 encoded" in err
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 2 and all(np.isfinite(losses))
    entries = [load_file(str(p)) for p in (own_data_caches / "diffusion" / "latents").rglob("*.safetensors")]
    shapes = sorted(tuple(t.shape) for e in entries for k, t in e.items() if k.startswith("reference_latents."))
    square = (channels, 64 // down, 64 // down)
    odd = sorted((channels, h // down, w // down) for w, h in expected.values())
    assert len(entries) == 6 and shapes == sorted([square] * 10 + odd)

    adapter, dataset = adapter_for(config, tmp_path / "again", f"data.path={data}", "sample.prompts=[]",
                                   "sample.references=[]")
    assert adapter.latent_cache.hits == 6 and adapter.latent_cache.misses == 0  # the run's entries
    for size in ((2048, 1024), (1020, 1020), (1200, 1000), (700, 1500)):  # at the pipelines' own 1024 x 1024 too
        assert adapter.references.sizing.bucket(size, 1024 ** 2) == _pipeline_reference_size(family, size, 1024 ** 2)
    by_name = {item.path.stem: i for i, item in enumerate(dataset.items)}
    for (stem, index), size in ODD_REFERENCES.items():
        item = dataset.items[by_name[stem]]
        assert item.bucket == (64, 64) and item.reference_buckets[index] == expected[size]
        assert tuple(dataset.encoded[by_name[stem]][0][f"reference_latents.{index}"].shape[-2:]) == \
            (expected[size][1] // down, expected[size][0] // down)
    groups = {stem: dataset.groups[i] for stem, i in by_name.items()}
    plain = {groups[s] for s in ("blue_square", "green_circle", "green_square", "red_circle")}
    assert len(plain) == 1 and len({*plain, groups["blue_circle"], groups["red_square"]}) == 3

    seen = []
    hook = adapter.pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    try:
        for stem, _ in ODD_REFERENCES:
            torch.manual_seed(0)
            with torch.no_grad():
                assert mean_loss(adapter, dataset.collate([by_name[stem]])).isfinite()
    finally:
        hook.remove()
    patch = 2 if family == "qwen_image_edit" else 1  # Qwen-Image packs 2 x 2 latents a token; FLUX.2's are packed
    side = 64 // down // patch  # a 64 x 64 image's tokens per side: 4
    assert len(seen) == 2
    for kwargs, ((stem, index), size) in zip(seen, ODD_REFERENCES.items()):
        tokens = [(side, side)] * 2  # each reference's (h, w) in tokens
        tokens[index] = (expected[size][1] // down // patch, expected[size][0] // down // patch)
        assert kwargs["hidden_states"].shape[1] == side * side + sum(h * w for h, w in tokens)
        if family == "qwen_image_edit":
            assert kwargs["img_shapes"] == [[(1, side, side), *((1, h, w) for h, w in tokens)]]
        else:  # FLUX.2's ids: (t, h, w, l), reference i at t = 10 (i + 1)
            ids = kwargs["img_ids"].reshape(-1, 4)
            for i, (h, w) in enumerate(tokens):
                mine = ids[ids[:, 0] == 10 * (i + 1)]
                assert len(mine) == h * w and (int(mine[:, 1].max()) + 1, int(mine[:, 2].max()) + 1) == (h, w)


@pytest.mark.parametrize("family", ["qwen_image_edit", "flux2"])
def test_changing_one_reference_re_encodes_only_its_target(family, tmp_path, run_cli, capsys, own_data_caches):
    """A second run after one reference image changed: 5 targets come from the latent cache as they are (their
    files untouched), red_square is encoded again into a new entry, whose target latents and first reference are
    the old entry's and whose second reference is not (qwen_image_edit: its text too, encoded with the
    references)."""
    config = FAMILIES[family][0]
    data = _copy_edit_data(tmp_path / "data")

    def train(name: str) -> str:
        assert run_cli(*diffusion_train_args(config, tmp_path / name, f"data.path={data}", "sample.prompts=[]",
                                             "sample.references=[]", "train.steps=1")) == 0
        return capsys.readouterr().err

    assert "latents: 0 cached, 6 encoded" in train("first")
    cache = own_data_caches / "diffusion" / "latents"
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}
    assert len(before) == 6
    Image.new("RGB", (64, 64), (250, 200, 0)).save(data / "red_square_ref1.png")
    err = train("second")
    assert "latents: 5 cached, 1 encoded" in err
    if family == "flux2":  # its captions' text is cached apart from the references
        assert "text embeddings: 6 cached, 0 encoded" in err
    after = {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}
    assert len(after) == 7 and all(after[p] == mtime for p, mtime in before.items())
    (new,) = (load_file(str(p)) for p in set(after) - set(before))
    (old,) = (e for e in (load_file(str(p)) for p in before) if torch.equal(e["latents"], new["latents"]))
    assert torch.equal(old["reference_latents.0"], new["reference_latents.0"])
    assert (old["reference_latents.1"] - new["reference_latents.1"]).abs().max() > 1e-2
    if family == "qwen_image_edit":
        assert not torch.equal(old["prompt_embeds"], new["prompt_embeds"])


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
    assert run_cli(*args, "--fresh") == 2
    assert f"{second}: no reference 1 for red_square.png" in capsys.readouterr().err
    assert run_cli(*args, f"data.datasets=[{{path: {EDIT}}}]", "--fresh") == 2
    assert "data.reference_paths: its folders hold data.path's references, and data.datasets adds" in \
        capsys.readouterr().err
    (data / "blue_circle_ref0.png").write_bytes((first / "blue_circle.png").read_bytes())  # one target has one
    assert run_cli(*diffusion_train_args("quickstart_flux2_references.yaml", tmp_path / "beside",
                                         f"data.path={data}")) == 2
    assert "blue_square.png: reference 0 is missing (other targets of this dataset have references" in \
        capsys.readouterr().err


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


def _first_transformer_call(pipe, **call) -> tuple[dict, torch.Tensor]:
    """The keyword arguments and output of the pipeline's first transformer call (of two denoising steps: one step
    would end Qwen-Image's stretched schedule at 0 / 0)."""
    seen = {}

    def before(module, args, kwargs):
        seen.setdefault("kwargs", {k: v for k, v in kwargs.items()})

    def after(module, args, kwargs, output):
        seen.setdefault("output", output[0])

    hooks = [pipe.transformer.register_forward_pre_hook(before, with_kwargs=True),
             pipe.transformer.register_forward_hook(after, with_kwargs=True)]
    try:
        with torch.no_grad():
            pipe(num_inference_steps=2, width=64, height=64, generator=torch.Generator().manual_seed(0), **call)
    finally:
        for hook in hooks:
            hook.remove()
    return seen["kwargs"], seen["output"]


def test_qwen_image_edit_conditions_as_the_pipeline_does(tmp_path, monkeypatch):
    """What the trainer caches and feeds is what QwenImageEditPlusPipeline computes for the same target and
    references: the references' packed latents after the target's tokens, the prompt encoded with the references by
    the Qwen2.5-VL encoder, img_shapes, and the prediction for the target's tokens. (The pipeline's reference area,
    1024 x 1024, is set to the quickstart's 64 x 64.)"""
    from diffusers import QwenImagePipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    from toolkit.models.diffusion_base import Denoiser
    from toolkit.models.objectives import Noised

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 64 * 64)
    adapter, dataset = adapter_for("quickstart_qwen_image_edit.yaml", tmp_path)
    index = next(i for i, item in enumerate(dataset.items) if item.path.name == "blue_circle.png")
    item, cached = dataset.items[index], dataset.encoded[index][0]
    pipe = adapter.pipe
    for encoder in adapter.text_encoders:
        encoder.to("cpu")
    kwargs, output = _first_transformer_call(pipe, prompt=item.caption,
                                             image=[Image.open(p).convert("RGB") for p in item.references])
    pack = QwenImagePipeline._pack_latents
    refs = [cached[f"reference_latents.{i}"][None] for i in range(2)]
    target_tokens = 16  # 64 x 64 px: 8 x 8 latents, 4 x 4 patches
    packed_refs = torch.cat([pack(r, 1, 16, 8, 8) for r in refs], dim=1)
    assert torch.allclose(kwargs["hidden_states"][:, target_tokens:], packed_refs, atol=1e-5)
    assert kwargs["img_shapes"] == [[(1, 4, 4), (1, 4, 4), (1, 4, 4)]]
    length = int(cached["prompt_embeds_mask"].sum())
    assert torch.allclose(kwargs["encoder_hidden_states"][0], cached["prompt_embeds"][:length], atol=1e-5)

    x = QwenImagePipeline._unpack_latents(kwargs["hidden_states"][:, :target_tokens], 64, 64, 8)[:, :, 0]
    cond = {"prompt_embeds": cached["prompt_embeds"][None], "prompt_embeds_mask": cached["prompt_embeds_mask"][None]}
    transformer = pipe.transformer
    with torch.no_grad():
        pred = adapter.predict(Denoiser(transformer, transformer.dtype, transformer.config),
                               Noised(x, kwargs["timestep"], None), cond,
                               {f"reference_latents.{i}": r for i, r in enumerate(refs)})
    expected = QwenImagePipeline._unpack_latents(output[:, :target_tokens], 64, 64, 8)[:, :, 0]
    assert torch.allclose(pred, expected, atol=1e-5)


@pytest.mark.parametrize("family", ["flux_kontext", "flux2"])
def test_flux_references_are_placed_as_the_pipeline_places_them(family, tmp_path):
    """flux_kontext and flux2: the cached reference latents, packed, are the pipeline's reference tokens for the
    same image; the ids the trainer gives them are the pipeline's; the prediction for the image's tokens is the
    pipeline's transformer output (Kontext's auto-resize off, so the reference keeps its 64 x 64)."""
    from toolkit.models.diffusion_base import Denoiser
    from toolkit.models.objectives import Noised

    config = FAMILIES[family][0]
    adapter, dataset = adapter_for(config, tmp_path)
    item, cached = dataset.items[0], dataset.encoded[0][0]
    refs = [cached[k][None] for k in sorted(k for k in cached if k.startswith("reference_latents."))]
    images = [Image.open(p).convert("RGB") for p in item.references]
    text = dataset.text[0]
    pipe = adapter.pipe
    seen = {}
    original = adapter.predict

    if family == "flux_kontext":
        call = dict(image=images[0], _auto_resize=False, max_area=64 * 64, guidance_scale=2.5,
                    prompt_embeds=text["prompt_embeds"][None], pooled_prompt_embeds=text["pooled_prompt_embeds"][None])
    else:
        call = dict(image=images, guidance_scale=1.0, prompt_embeds=text["prompt_embeds"][None])
    kwargs, output = _first_transformer_call(pipe, **call)
    hidden = kwargs["hidden_states"]
    target_tokens = hidden.shape[1] - sum(r.shape[-2] * r.shape[-1] // (1 if family == "flux2" else 4) for r in refs)

    def capture(module, args, kw):
        seen["img_ids"] = kw["img_ids"]

    hook = pipe.transformer.register_forward_pre_hook(capture, with_kwargs=True)
    if family == "flux_kontext":
        from diffusers import FluxPipeline

        from toolkit.models.diffusion_flow import unpack_flux

        packed = torch.cat([FluxPipeline._pack_latents(r, 1, 16, 8, 8) for r in refs], dim=1)
        x = unpack_flux(hidden[:, :target_tokens], 1, 16, 8, 8)
        expected = unpack_flux(output[:, :target_tokens], 1, 16, 8, 8)
        cond = {k: text[k][None] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    else:
        from diffusers import Flux2Pipeline

        from toolkit.models.diffusion_flux2 import unpack_flux2

        packed = torch.cat([Flux2Pipeline._pack_latents(r) for r in refs], dim=1)
        x = unpack_flux2(hidden[:, :target_tokens], 4, 4)
        expected = unpack_flux2(output[:, :target_tokens], 4, 4)
        cond = {"prompt_embeds": text["prompt_embeds"][None]}
    # The pipeline's own encoding of the same pixels is the cached one; in its call the pixels come as a tensor of
    # other strides, and the tiny random VAE's convolutions then sum in another order (up to about 1e-2 after
    # FLUX.2's batch-norm scaling, with the thread count): the tokens there are compared loosely.
    from toolkit.data.references import load_references

    with torch.no_grad():
        own = [pipe._encode_vae_image(pixels[None], None) for pixels in load_references(item, flip=False)]
    assert all(torch.allclose(o, r, atol=1e-5) for o, r in zip(own, refs))
    assert hidden[:, target_tokens:].shape == packed.shape
    assert float((hidden[:, target_tokens:] - packed).abs().max()) < 5e-2
    assert adapter.cfg.train.guidance == call["guidance_scale"]  # the quickstart's: what the pipeline was given
    transformer = pipe.transformer
    try:
        with torch.no_grad():
            pred = original(Denoiser(transformer, transformer.dtype, transformer.config),
                            Noised(x, kwargs["timestep"], None), cond,
                            {f"reference_latents.{i}": r for i, r in enumerate(refs)})
    finally:
        hook.remove()
    ids = kwargs["img_ids"]
    assert torch.equal(seen["img_ids"].reshape(ids.shape).to(ids.dtype), ids)
    assert torch.allclose(pred, expected, atol=1e-5)


@pytest.mark.parametrize("setting, fix", [
    ("data.caption_dropout=0.1", "set data.caption_dropout=0"),
    ("data.shuffle_tags=true", "set data.shuffle_tags=false"),
    ("data.cache_latents=false", "set data.cache_latents=true"),
])
def test_qwen_image_edit_refuses_captions_that_change_per_step(setting, fix, run_cli, capsys):
    """Its text is encoded with each target's references and cached with the latents: settings that would change
    it per step are named by validate (and train) before the model loads."""
    assert run_cli("validate", REPO / "configs/examples/quickstart_qwen_image_edit.yaml", setting) == 2
    err = capsys.readouterr().err
    key, value = setting.split("=")
    assert (f"'{key}' is {value}: qwen_image_edit encodes each "
            "caption with its reference images once and caches it with the latents, so captions cannot change per "
            f"step: {fix}") in err and "Traceback" not in err


KONTEXT_REF = "configs/examples/data/kontext/blue_circle_ref0.png"


@pytest.mark.parametrize("config, overrides, expected", [
    ("quickstart_flux_kontext.yaml", ["data.references=2"],
     "'data.references' is 2, and flux_kontext's pipeline takes 1 reference image per target: set "
     "data.references=1 (or auto), or train a family that takes 2: qwen_image_edit (1-3), flux2 (any number, or "
     "none)"),
    ("quickstart_flux_kontext.yaml", [f"sample.references=[[{KONTEXT_REF},{KONTEXT_REF}]]"],
     "'sample.references[0]' holds 2 images, and flux_kontext's pipeline takes 1 reference image per prompt: keep 1"),
    ("quickstart_qwen_image_edit.yaml", ["data.references=4"],
     "'data.references' is 4, and qwen_image_edit's pipeline takes 1-3 reference images per target: set "
     "data.references=3 (or auto), or train a family that takes 4: flux2 (any number, or none)"),
    ("quickstart_qwen_image_edit.yaml", ["sample.references=[]"],
     "'sample.references': qwen_image_edit edits reference images, and a sample prompt has none: set "
     "sample.references: [[ref.png], ...] (one list per prompt), or sample.prompts: []"),
    ("quickstart_flux_kontext.yaml", ["sample.prompts=[a,b]"],
     "'sample.references': 1 list for 2 prompts: give one list of reference images per prompt, in the order of "
     "sample.prompts"),
    ("quickstart_flux_kontext.yaml", [f"sample.references=[[{REPO}/configs/examples/data/kontext/no_such.png]]"],
     f"'sample.references[0]' in command line: {REPO}/configs/examples/data/kontext/no_such.png does not exist; give "
     "an image file"),
])
def test_validate_names_references_the_family_cannot_take(config, overrides, expected, run_cli, capsys):
    assert run_cli("validate", REPO / "configs/examples" / config, *overrides) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
