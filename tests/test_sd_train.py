"""sd / sdxl LoRA through the real entry point on tiny pipelines: files, caches, loss targets, reloading."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import REPO
from helpers import adapter_for, diffusion_train_args, mean_loss, per_sample_generators, read_metrics
from toolkit.plan.run import load_run
from toolkit.models.diffusion_sd import StableDiffusionAdapter
from toolkit.models.objectives import min_snr_weights, sample_timesteps
from toolkit.tiny import resolve_model_path
from toolkit.tiny.fixtures import write_shapes_dataset


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """4 images in 2 buckets (64x64 and 128x64 at resolution 96)."""
    path = tmp_path_factory.mktemp("shapes")
    write_shapes_dataset(path, sizes=((64, 64), (128, 64)), count=2)
    return path


def _args(config: str, shapes: Path, out: Path, *extra: str) -> list[str]:
    return diffusion_train_args(config, out, f"data.path={shapes}", *extra)


def _adapter(config: str, shapes: Path, tmp_path: Path, *overrides: str):
    return adapter_for(config, tmp_path, f"data.path={shapes}", *overrides)


def test_sd_trains_saves_a_diffusers_lora_and_reuses_its_caches(shapes, tmp_path, run_cli, monkeypatch, capsys,
                                                                own_data_caches):
    out = tmp_path / "run"
    assert run_cli(*_args("quickstart_sd.yaml", shapes, out)) == 0
    err = capsys.readouterr().err
    assert "latents: 0 cached, 4 encoded" in err and "text embeddings: 0 cached, 4 encoded" in err
    assert "64 x 64    (ratio 1.00): 2 images" in err and "128 x 64    (ratio 2.00): 2 images" in err

    assert sorted(p.name for p in (out / "final").iterdir()) == ["pytorch_lora_weights.safetensors"]
    weights = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    assert len(weights) == 3 * 32  # down/up/alpha on to_q, to_k, to_v, to_out.0 of 8 attention modules
    assert all(k.startswith("lora_unet_") and k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha"))
               for k in weights)
    assert "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in weights
    assert all(v.dtype == torch.float32 for v in weights.values())
    samples = out / "samples" / "step-000002"
    assert sorted(p.name for p in samples.iterdir()) == ["00.png", "01.png", "grid.png", "prompts.txt"]
    # the trigger word replaces [trigger], or is prepended where the prompt lacks it
    assert (samples / "prompts.txt").read_text().splitlines() == ["00: sks, a red circle on a white background",
                                                                 "01: sks a blue square"]
    assert len([r for r in read_metrics(out) if np.isfinite(r["loss"])]) == 2

    # The diffusers loader reads the file, changes the output, and matches the trained model's own sample.
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(resolve_model_path("tiny:sd"), safety_checker=None)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)

    def generate() -> np.ndarray:
        image = pipe("sks, a red circle on a white background", num_inference_steps=2, guidance_scale=3.0, width=64,
                     height=64, generator=torch.Generator("cpu").manual_seed(42)).images[0]
        return np.asarray(image, dtype=np.int16)

    base = generate()
    pipe.load_lora_weights(str(out / "final"))
    with_lora = generate()
    trained = np.asarray(Image.open(samples / "00.png"), dtype=np.int16)
    assert np.abs(with_lora - base).max() >= 2
    assert np.abs(with_lora - trained).max() <= 1

    # A second run with the same data and model encodes nothing: both caches hit.
    calls = {"pixels": 0, "text": 0}
    encode_pixels, encode_text = StableDiffusionAdapter.encode_pixels, StableDiffusionAdapter.encode_text
    monkeypatch.setattr(StableDiffusionAdapter, "encode_pixels",
                        lambda self, x: calls.__setitem__("pixels", calls["pixels"] + 1) or encode_pixels(self, x))
    monkeypatch.setattr(StableDiffusionAdapter, "encode_text",
                        lambda self, x: calls.__setitem__("text", calls["text"] + 1) or encode_text(self, x))
    assert run_cli(*_args("quickstart_sd.yaml", shapes, tmp_path / "again", "train.steps=1", "sample.prompts=[]")) == 0
    err = capsys.readouterr().err
    assert "latents: 4 cached, 0 encoded" in err and "text embeddings: 4 cached, 0 encoded" in err
    assert calls == {"pixels": 0, "text": 0}


def test_a_run_that_encodes_trains_as_one_that_reads_its_caches(shapes, tmp_path, run_cli, monkeypatch, capsys,
                                                                own_data_caches):
    """Encoding may draw from the RNG streams (a VAE that samples its posterior, a text encoder with dropout):
    data preparation leaves every stream as it found it. Here encoding draws from each stream on purpose."""
    import random

    encode_pixels = StableDiffusionAdapter.encode_pixels

    def drawing(self, pixels):
        torch.randn(7), np.random.rand(), random.random()
        return encode_pixels(self, pixels)

    monkeypatch.setattr(StableDiffusionAdapter, "encode_pixels", drawing)
    losses = []
    for name in ("cold", "warm"):
        out = tmp_path / name
        assert run_cli(*_args("quickstart_sd.yaml", shapes, out, "train.steps=3", "sample.prompts=[]")) == 0
        losses.append([r["loss"] for r in read_metrics(out)])
    err = capsys.readouterr().err
    assert "latents: 0 cached, 4 encoded" in err and "latents: 4 cached, 0 encoded" in err
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_writing_a_tiny_model_leaves_every_rng_stream_as_it_was(tmp_path, monkeypatch):
    """Writers call torch.manual_seed, which also reseeds every GPU's generator. On an H200 a run that wrote its
    tiny SD model drew other timesteps at its first step than one that found it (their sum over the batch 394
    against 1072; text, LoRA and base weights equal): the writers forked only the CPU stream. Here the GPU reseed is
    recorded wherever it happens: none may stay in effect after the writer."""
    from toolkit.tiny import write_tiny

    reseeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeds.append(seed))
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["state before"])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(states))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    write_tiny("sd", tmp_path / "sd")
    assert torch.equal(torch.get_rng_state(), before)
    assert reseeds and restored and restored[-1] == ["state before"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_the_gpu_a_run_that_writes_and_encodes_trains_as_one_that_reads(tmp_path, run_cli, monkeypatch):
    """The first run writes the tiny model and encodes its data into an empty cache, the second finds both: the
    same loss at the first step, bit for bit (eager, fp32, math attention). The second step's loss follows the first
    step's gradients, whose GPU kernels add in no fixed order (convolution and norm backward): equal to within
    float32 rounding, 3e-6 apart on an H100. Before the tiny writers left the CUDA generator alone, the noise drawn
    differed and the first losses did too."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    losses = []
    for name in ("cold", "warm"):
        out = tmp_path / name
        assert run_cli(*diffusion_train_args("quickstart_sd.yaml", out, "train.steps=2", "train.compile=false",
                                             "train.precision=fp32", "device.sdpa_backend=math")) == 0
        losses.append([r["loss"] for r in read_metrics(out)])
    assert len(losses[0]) == 2 and losses[0][0] == losses[1][0]
    assert losses[0][1] == pytest.approx(losses[1][1], rel=2e-5)


@pytest.mark.parametrize("model, prediction_type, noise_offset", [("tiny:sd", "epsilon", 0.0),
                                                                  ("tiny:sd-v", "v_prediction", 0.0),
                                                                  ("tiny:sd", "epsilon", 0.1)])
def test_loss_is_the_mse_against_the_scheduler_target(shapes, tmp_path, model, prediction_type, noise_offset):
    adapter, dataset = _adapter("quickstart_sd.yaml", shapes, tmp_path, f"model.name_or_path={model}",
                                f"train.noise_offset={noise_offset}")
    assert adapter.objective.prediction_type == prediction_type
    batch = dataset.collate([i for i, g in enumerate(dataset.groups) if g == 0])
    with torch.no_grad():
        loss = mean_loss(adapter, batch)
        latents = batch["latents"]
        # each sample's noise, offset and (uniform) timestep from its own generator, in that order
        generators = per_sample_generators(batch)
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g) for g in generators])
        if noise_offset:
            noise = noise + noise_offset * torch.stack([torch.randn(latents.shape[1], 1, 1, generator=g)
                                                        for g in generators])
        timesteps = torch.stack([(torch.rand((), generator=g) * 1000).long() for g in generators])
        scheduler = adapter.objective.scheduler
        pred = adapter.pipe.unet(scheduler.add_noise(latents, noise, timesteps), timesteps, batch["prompt_embeds"]).sample
        target = noise if prediction_type == "epsilon" else scheduler.get_velocity(latents, noise, timesteps)
    assert latents.shape == (2, 4, 32, 32)
    assert torch.allclose(loss, F.mse_loss(pred, target), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(loss, F.mse_loss(pred, noise if prediction_type != "epsilon" else
                                                scheduler.get_velocity(latents, noise, timesteps)))


def test_timestep_sampling():
    torch.manual_seed(0)
    uniform = sample_timesteps("uniform", 20000, 1000, torch.device("cpu"))
    logit_normal = sample_timesteps("logit_normal", 20000, 1000, torch.device("cpu"))
    for t in (uniform, logit_normal):
        assert t.dtype == torch.int64 and t.min() >= 0 and t.max() <= 999
    middle = lambda t: ((t >= 250) & (t < 750)).float().mean().item()  # noqa: E731
    assert abs(middle(uniform) - 0.5) < 0.02
    assert abs(middle(logit_normal) - 0.727) < 0.02  # P(|z| < logit(0.75)) for a standard normal z


def test_min_snr_weights():
    alphas = torch.tensor([0.99, 0.5, 0.01])
    t = torch.tensor([0, 1, 2])
    snr = alphas / (1 - alphas)  # 99, 1, 0.0101
    assert torch.allclose(min_snr_weights(alphas, t, 5.0, "epsilon"), torch.stack([5 / snr[0], torch.tensor(1.0), torch.tensor(1.0)]))
    assert torch.allclose(min_snr_weights(alphas, t, 5.0, "v_prediction"), torch.clamp(snr, max=5) / (snr + 1))


def test_sdxl_conditions_on_sizes_and_exports_kohya(shapes, tmp_path, run_cli, capsys):
    adapter, dataset = _adapter("quickstart_sdxl.yaml", shapes, tmp_path / "probe")
    wide = [i for i, item in enumerate(dataset.items) if item.size == (128, 64)]
    batch = dataset.collate(wide)
    latents = adapter.latents_of(batch)
    cond = adapter.conditioning(batch, adapter.trainable_modules())
    embeds, added = cond["prompt_embeds"], adapter.unet_kwargs(cond, batch, torch.float32)["added_cond_kwargs"]
    assert latents.shape == (2, 4, 32, 64) and embeds.shape == (2, 77, 64)  # two encoders: 32 + 32
    assert added["text_embeds"].shape == (2, 32)
    assert added["time_ids"].tolist() == [[64.0, 128.0, 0.0, 0.0, 64.0, 128.0]] * 2

    out = tmp_path / "run"
    assert run_cli(*_args("quickstart_sdxl.yaml", shapes, out, "save.format=kohya", "sample.prompts=[]")) == 0
    assert sorted(p.name for p in (out / "final").iterdir()) == ["pytorch_lora_weights.safetensors",
                                                                "quickstart_sdxl_kohya.safetensors"]
    kohya_file = str(out / "final" / "quickstart_sdxl_kohya.safetensors")
    kohya = load_file(kohya_file)
    downs = [k for k in kohya if k.endswith(".lora_down.weight")]
    assert len(downs) == len([k for k in kohya if k.endswith(".lora_up.weight")]) == len([k for k in kohya if k.endswith(".alpha")])
    assert len(downs) * 3 == len(kohya) and len(downs) > 0
    assert all(k.startswith("lora_unet_") for k in kohya)
    assert "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in kohya
    assert {float(v) for k, v in kohya.items() if k.endswith(".alpha")} == {8.0}
    main = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    assert main.keys() == kohya.keys() and all(torch.equal(main[k], kohya[k]) for k in kohya)
    with safe_open(kohya_file, "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model"] == "tiny:sdxl" and meta["toolkit_family"] == "sdxl"
    assert (meta["ss_network_dim"], meta["ss_network_alpha"], meta["ss_steps"], meta["ss_trigger_word"]) == ("8", "8.0", "2", "sks")


def test_text_encoder_lora_uncached_latents_and_shuffled_captions(shapes, tmp_path, run_cli, capsys):
    out = tmp_path / "run"
    assert run_cli(*_args("quickstart_sd.yaml", shapes, out, "train.steps=1", "sample.prompts=[]",
                          "train.train_text_encoder=true", "data.shuffle_tags=true", "data.cache_latents=false")) == 0
    err = capsys.readouterr().err
    assert "latents:" not in err  # cache_latents off: the VAE encodes every batch
    assert "text embeddings: computed every step, not cached (train.train_text_encoder is on)" in err
    weights = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    prefixes = {k.split("_")[1] for k in weights}
    assert prefixes == {"unet", "te"}
    assert len([k for k in weights if k.startswith("lora_te_text_model_")]) == 3 * 4 * 2  # q/k/v/out of 2 layers
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(resolve_model_path("tiny:sd"), safety_checker=None)
    pipe.load_lora_weights(str(out / "final"))
    assert any("lora_A" in name for name, _ in pipe.text_encoder.named_parameters())

    # The adapter's own loader (for sampling from a finished run) restores exactly what was saved: the file
    # holds the trained alpha, so the factors come back bit for bit.
    adapter, _ = _adapter("quickstart_sd.yaml", shapes, tmp_path / "reload", "train.train_text_encoder=true")
    adapter.load_lora(out)
    restored = adapter.lora_key_style(adapter.lora_factors(torch.float32))
    assert restored.keys() == weights.keys() and all(torch.equal(restored[k], weights[k]) for k in weights)


def test_vae_encoding_runs_with_cudnn_off_when_the_hip_preset_says_so(shapes, tmp_path, monkeypatch):
    assert load_run([REPO / "configs/examples/quickstart_sd.yaml"], ["device.preset=gfx942"]).cfg.device.vae_encode_cudnn is False
    adapter, _ = _adapter("quickstart_sd.yaml", shapes, tmp_path, "device.vae_encode_cudnn=false")
    seen = []
    encode = adapter.pipe.vae.encode
    monkeypatch.setattr(adapter.pipe.vae, "encode", lambda x: seen.append(torch.backends.cudnn.enabled) or encode(x))
    before = torch.backends.cudnn.enabled
    latents = adapter.encode_pixels(torch.zeros(1, 3, 64, 64))
    assert seen == [False] and torch.backends.cudnn.enabled == before
    assert latents.shape == (1, 4, 32, 32)


@pytest.mark.parametrize("config, tiny", [("sd15_lora.yaml", "tiny:sd"), ("sdxl_lora.yaml", "tiny:sdxl")])
def test_real_model_examples_validate(config, tiny, run_cli, capsys):
    """Every key of the real-model examples validates, with their data folder and model present (validate checks
    both: here a folder of images and a local folder of the family's layout stand in for them)."""
    from toolkit.tiny import resolve_model_path

    assert run_cli("validate", REPO / "configs/examples" / config, "data.path=configs/examples/data/shapes",
                   f"model.name_or_path={resolve_model_path(tiny)}") == 0
    out = capsys.readouterr().out
    assert "model.family" in out and "data.resolution" in out


def test_resumed_run_ends_bit_identical(shapes, tmp_path, run_cli):
    common = ("sample.prompts=[]", "save.every=2", "data.shuffle_tags=true", "data.caption_dropout=0.3")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli(*_args("quickstart_sd.yaml", shapes, straight, "train.steps=4", *common)) == 0
    assert run_cli(*_args("quickstart_sd.yaml", shapes, resumed, "train.steps=2", *common)) == 0
    assert run_cli(*_args("quickstart_sd.yaml", shapes, resumed, "train.steps=4", *common)) == 0
    a = load_file(str(straight / "final" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(resumed / "final" / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().sum() > 0 for k, v in a.items() if ".lora_up." in k)


def test_a_finished_run_run_again_says_so_before_loading_the_model(shapes, tmp_path, run_cli, capsys):
    """The same command after the run ended: nothing to train or export, said before the model loads; with final/
    gone (an export that failed on a full disk), the model loads and final/ is written again from the checkpoint."""
    out = tmp_path / "run"
    args = _args("quickstart_sd.yaml", shapes, out, "train.steps=2", "sample.prompts=[]", "save.every=2")
    assert run_cli(*args) == 0
    final = out / "final" / "pytorch_lora_weights.safetensors"
    exported = load_file(str(final))
    capsys.readouterr()
    assert run_cli(*args) == 0
    err = capsys.readouterr().err
    assert f"run already complete at step 2 (train.steps=2); final LoRA: {out / 'final'}" in err
    assert "resumed from" not in err and "latents:" not in err   # no model loaded, no data read
    shutil.rmtree(out / "final")
    assert run_cli(*args) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "run already complete at step 2" in err
    again = load_file(str(final))
    assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in again)


def test_a_sample_at_a_resolution_the_pipeline_cannot_draw_is_drawn_at_the_multiple_below(shapes, tmp_path, run_cli,
                                                                                         capsys):
    """data.resolution=100 with sample.width/height 0: SD's pipeline draws multiples of 8; the samples are drawn at
    96x96, said once (diffusers raised at the first sample, after training had begun)."""
    from PIL import Image

    out = tmp_path / "run"
    assert run_cli(*_args("quickstart_sd.yaml", shapes, out, "train.steps=1", "data.resolution=100", "sample.width=0",
                          "sample.height=0", "sample.prompts=[a red circle, a blue square]", "sample.every=1",
                          "sample.num_inference_steps=1")) == 0
    err = capsys.readouterr().err
    assert err.count("samples are drawn at 96x96: 100x100 (sample.width/height, 0 taking data.resolution) rounded "
                     "down to a multiple of 8") == 1
    assert Image.open(out / "samples" / "step-000001" / "00.png").size == (96, 96)
