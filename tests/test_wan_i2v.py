"""Wan image-to-video (2.1 I2V, 2.2 I2V-A14B, TI2V-5B) through the real entry point on tiny pipelines: training,
samples from the start image, the condition against WanImageToVideoPipeline's own, reloading the LoRA there,
and the errors a user can make."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import REPO
from helpers import adapter_for, diffusion_train_args, mean_loss, read_metrics
from toolkit.tiny import resolve_model_path
from toolkit.train.checkpoint import trainable_from_file
from toolkit.models.base import load_trainable_state_dict
from toolkit.models.sample_draws import SampleDraws

DATA = REPO / "configs/examples/data/clips_i2v"
START = DATA / "green_circle.png"   # the start image beside green_circle.webp, 128x128
PROMPT = "a green circle moving right on a white background"
# 2 steps on 5 frames of each clip, a 5-frame sample of 2 denoising steps at the end
SHORT = ("data.num_frames=5", "sample.num_frames=5", "sample.num_inference_steps=2", "sample.every=0")
# Latent and text caches of this module's runs kept apart from the session's (conftest.py)
pytestmark = pytest.mark.usefixtures("own_data_caches")


@pytest.fixture(scope="module")
def two_clips(tmp_path_factory) -> Path:
    """green_circle.webp with its start image beside it, and red_circle.webp, which starts from its first frame."""
    data = tmp_path_factory.mktemp("two_clips")
    for name in ("green_circle.webp", "green_circle.png", "green_circle.txt", "red_circle.webp", "red_circle.txt"):
        (data / name).write_bytes((DATA / name).read_bytes())
    return data


def _i2v_pipe(kind: str):
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(resolve_model_path(kind))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _frame(path: Path, size=(64, 64)) -> Image.Image:
    """The start image as training cuts it: resized to cover the bucket, centre-cropped (first frame of a clip)."""
    from toolkit.data.images import cover_and_crop

    with Image.open(path) as image:
        return cover_and_crop(image.convert("RGB"), size)[0]


def _lora_changed(final: Path) -> bool:
    files = sorted(final.rglob("pytorch_lora_weights.safetensors"))
    return bool(files) and all(any(v.abs().sum() > 0 for k, v in load_file(str(f)).items() if "lora_B" in k)
                               for f in files)


def test_wan21_i2v_trains_samples_from_the_start_image_and_its_lora_reloads(tmp_path, run_cli, capsys):
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_wan21_i2v.yaml", out, *SHORT)) == 0
    err = capsys.readouterr().err
    assert "model.task: i2v (auto: the model folder holds a WanImageToVideoPipeline)" in err
    assert "image-to-video: mask and start-frame latents concatenated to the noisy latents, CLIP image " \
           "embeddings cross-attended" in err
    assert "image-to-video: 4 clips, 1 with their own start image, 3 starting from their first frame" in err
    assert "x   5 frames: 4 clips" in err and "1 frame" not in err  # the start image is no training item
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 2 and all(np.isfinite(losses)) and _lora_changed(out / "final")

    # The sample: WanImageToVideoPipeline with the saved LoRA, from the same start image and seed, makes it too.
    pipe = _i2v_pipe("tiny:wan21-i2v")
    call = dict(image=_frame(START), num_frames=5, width=64, height=64, num_inference_steps=2, guidance_scale=3.0,
                output_type="np")
    base = pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(42), **call).frames[0]
    pipe.load_lora_weights(str(out / "final"))
    with_lora = pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(42), **call).frames[0]
    middle = np.asarray(Image.open(out / "samples" / "step-000002" / "00.png"), dtype=np.float32)
    assert np.abs(with_lora - base).max() > 1e-3
    assert np.abs(with_lora[2] * 255 - middle).max() <= 1.5
    with Image.open(out / "samples" / "step-000002" / "00.webp") as webp:
        assert webp.n_frames == 5

    # The transformer with the reloaded file computes what the trained one does (its exact weights from the
    # last checkpoint), on the I2V inputs: 36 channels and image embeddings.
    adapter, _ = adapter_for("quickstart_wan21_i2v.yaml", tmp_path / "probe", "data.num_frames=5")
    load_trainable_state_dict(adapter.network, trainable_from_file(load_file(str(out / "checkpoints" / "step-000002" /
                                                                   "trainable_state.safetensors"))))
    gen = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 36, 2, 8, 8, generator=gen), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 512, 32, generator=gen),
                  encoder_hidden_states_image=torch.randn(1, 17, 32, generator=gen), return_dict=False)
    with torch.no_grad():
        trained, reloaded = adapter.pipe.transformer(**inputs)[0], pipe.transformer(**inputs)[0]
    torch.testing.assert_close(reloaded, trained, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model, task", [("tiny:wan22-i2v", "auto"), ("tiny:wan22-5b", "i2v")])
def test_wan22_i2v_and_ti2v_5b_train_sample_and_reload(model, task, tmp_path, run_cli, capsys):
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_wan22_i2v.yaml", out, *SHORT, f"model.name_or_path={model}",
                                         f"model.task={task}", "train.expert_switch_every=1")) == 0
    err = capsys.readouterr().err
    first_frame = "the start image's latent is the first latent frame (timestep 0 there, left out of the loss)"
    assert (first_frame in err) == (model == "tiny:wan22-5b")
    assert all(np.isfinite(r["loss"]) for r in read_metrics(out)) and _lora_changed(out / "final")
    assert (out / "samples" / "step-000002" / "00.webp").is_file()

    # WanImageToVideoPipeline with the saved LoRA (A14B: each expert's file into its expert) makes the same sample
    pipe = _i2v_pipe(model)
    if model == "tiny:wan22-i2v":
        pipe.load_lora_weights(str(out / "final" / "high_noise"))
        pipe.load_lora_weights(str(out / "final" / "low_noise"), load_into_transformer_2=True, adapter_name="low")
    else:
        pipe.load_lora_weights(str(out / "final"))
    frames = pipe(prompt=PROMPT, image=_frame(START), num_frames=5, width=64, height=64, num_inference_steps=2,
                  guidance_scale=3.0, output_type="np", generator=torch.Generator("cpu").manual_seed(42)).frames[0]
    middle = np.asarray(Image.open(out / "samples" / "step-000002" / "00.png"), dtype=np.float32)
    # within 2 of 255: float rounding through 2 guided steps of the two experts, plus the png's; 1.3 to 1.7 over
    # run.seed 0-2 for the A14B layout (it depends on the trained LoRA)
    assert np.abs(frames[2] * 255 - middle).max() <= 2.0


def test_the_cached_condition_is_the_pipelines_for_every_view(two_clips, tmp_path):
    """Wan 2.1 I2V: mask + start-frame latents from prepare_latents and CLIP embeddings from encode_image, for a
    clip with its own start image (mirrored view) and one starting from its first frame (plain view)."""
    adapter, dataset = adapter_for("quickstart_wan21_i2v.yaml", tmp_path, f"data.path={two_clips}", "data.num_frames=5",
                                   "data.random_flip=true")
    pipe = adapter.pipe
    for name, view in (("green_circle.webp", 1), ("red_circle.webp", 0)):
        index = next(i for i, item in enumerate(dataset.items) if item.path.name == name)
        item = dataset.items[index]
        assert (item.start_image is not None) == (name == "green_circle.webp")
        assert dataset.views[index][view].flip == view
        if item.start_image is not None:
            start = _frame(item.start_image).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        else:
            with Image.open(item.path) as clip:
                start = clip.convert("RGB")  # its first frame
        pixels = pipe.video_processor.preprocess(start, height=64, width=64)
        _, condition = pipe.prepare_latents(pixels, 1, 16, 64, 64, 5, torch.float32, torch.device("cpu"),
                                            generator=torch.Generator().manual_seed(0))
        cached = dataset.encoded[index][view]
        # 4 mask channels (the first latent frame given), 16 latent channels; 2 latent frames
        assert cached["condition"].shape == (20, 2, 8, 8)
        assert cached["condition"][:4, 0].eq(1).all() and cached["condition"][:4, 1].eq(0).all()
        torch.testing.assert_close(cached["condition"], condition[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cached["image_embeds"], pipe.encode_image(start, torch.device("cpu"))[0],
                                   rtol=1e-4, atol=1e-5)


def test_ti2v_5b_sees_the_start_latent_at_timestep_0_and_no_loss_there(two_clips, tmp_path):
    adapter, dataset = adapter_for("quickstart_wan22_i2v.yaml", tmp_path, "model.name_or_path=tiny:wan22-5b",
                                   "model.task=i2v", f"data.path={two_clips}")
    pipe, index = adapter.pipe, next(i for i, item in enumerate(dataset.items) if item.start_image is not None)
    pixels = pipe.video_processor.preprocess(_frame(START), height=64, width=64)
    _, condition, mask = pipe.prepare_latents(pixels, 1, 48, 64, 64, 9, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(dataset.encoded[index][0]["condition"], condition[0], rtol=1e-4, atol=1e-5)
    seen = {}
    forward = pipe.transformer.forward
    pipe.transformer.forward = lambda **kw: seen.update(kw) or forward(**kw)
    batch = dataset.collate([index])
    torch.manual_seed(0)
    loss = mean_loss(adapter, batch)
    # 9 frames -> 3 latent frames of 4x4 -> 2x2 patches: 4 tokens a frame; the first frame is the start image's
    # latent at timestep 0, as the pipeline's mask makes them
    assert torch.equal(seen["hidden_states"][:, :, :1], condition)
    expected = (mask[0, 0, :, ::2, ::2].flatten() * seen["timestep"][0, -1])[None]
    assert torch.equal(seen["timestep"], expected) and seen["timestep"][0, :4].eq(0).all()
    # the loss is the velocity MSE over the two later latent frames only
    noised = adapter.objective.noise(batch["latents"], draws=SampleDraws(batch["draw_seeds"], "cpu"))
    pred = seen["output"] = adapter.predict(*_denoiser(adapter), noised,
                                            adapter.conditioning(batch, adapter.trainable_modules()), batch)
    torch.testing.assert_close(loss, (pred[:, :, 1:] - noised.target[:, :, 1:]).pow(2).mean())

    # Without the latent cache, each step encodes the batch's start images into the same condition.
    uncached, data = adapter_for("quickstart_wan22_i2v.yaml", tmp_path / "uncached", "model.name_or_path=tiny:wan22-5b",
                                 "model.task=i2v", f"data.path={two_clips}", "data.cache_latents=false")
    batch = data.collate([index])
    assert "latents" not in batch and batch["image"].shape == (1, 3, 64, 64)
    cond = uncached.conditioning(batch, uncached.trainable_modules())
    torch.testing.assert_close(cond["condition"], condition, rtol=1e-4, atol=1e-5)
    assert torch.isfinite(mean_loss(uncached, batch))


def _denoiser(adapter):
    from toolkit.models.diffusion_base import Denoiser

    transformer = adapter.pipe.transformer
    return (Denoiser(adapter.trainable_modules()["transformer"], transformer.dtype, transformer.config),)


def test_task_and_sample_image_mistakes_are_short_errors(tmp_path, run_cli, capsys):
    def refused(*overrides: str) -> str:
        assert run_cli(*diffusion_train_args("quickstart_wan21_i2v.yaml", tmp_path / "run", *overrides)) == 2
        return capsys.readouterr().err

    for kind in ("wan21-i2v", "wan21"):  # on this machine: the static checks read the task from the folder
        resolve_model_path(f"tiny:{kind}")
    err = refused("model.task=t2v")
    assert ("'model.task' is t2v, and tiny:wan21-i2v is an image-to-video model (its folder holds a "
            "WanImageToVideoPipeline): set model.task=i2v (or auto)") in err and "Traceback" not in err
    err = refused("model.name_or_path=tiny:wan21", "model.task=i2v")
    assert "model.task=i2v: tiny:wan21 is a text-to-video model" in err  # told by its transformer, once loaded
    assert ("'sample.images': tiny:wan21 trains text-to-video (model.task=auto: its folder holds a WanPipeline), "
            "whose samples take no start image") in refused("model.name_or_path=tiny:wan21")
    assert "'sample.images' is empty, and tiny:wan21-i2v trains image-to-video" in refused("sample.images=[]")
    err = refused("sample.images=[missing.png]")
    assert f"'sample.images' in command line: {REPO / 'missing.png'} does not exist" in err  # made absolute
    assert run_cli("validate", REPO / "configs/examples/quickstart_sd.yaml", "model.task=i2v") == 2
    assert "'model.task' in command line has no effect for model.family sd" in capsys.readouterr().err

    data = tmp_path / "data"
    data.mkdir()
    clip = DATA / "red_circle.webp"
    (data / clip.name).write_bytes(clip.read_bytes())
    Image.new("RGB", (96, 64), "white").save(data / "red_circle.png")  # not the clip's 1:1 aspect ratio
    err = refused(f"data.path={data}")
    assert f"{data / 'red_circle.png'}: 96x64 does not have the aspect ratio of its clip red_circle.webp" in err


@pytest.mark.parametrize("config, overrides, expected", [
    ("quickstart_wan21_i2v.yaml", ["sample.images=[]"],
     "'sample.images' is empty, and tiny:wan21-i2v trains image-to-video (model.task=auto: its folder holds a "
     "WanImageToVideoPipeline): each sample starts from an image: set sample.images: [path/to/start.png] (one per "
     "prompt, or one for all), or sample.prompts: []"),
    ("quickstart_hunyuan15_i2v.yaml", ["sample.images=[]", "model.task=i2v"],
     "'sample.images' is empty, and tiny:hunyuan15-i2v trains image-to-video (model.task=i2v): each sample starts "
     "from an image"),
    ("quickstart_wan21_i2v.yaml", ["sample.prompts=[a,b,c]", f"sample.images=[{START},{START}]"],
     "'sample.images': 2 images for 3 prompts: give one image per prompt, or one for all"),
])
def test_validate_names_the_start_images_samples_need(config, overrides, expected, run_cli, capsys):
    resolve_model_path("tiny:wan21-i2v")  # on this machine: validate reads model.task=auto from its folder
    assert run_cli("validate", REPO / "configs/examples" / config, *overrides) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
