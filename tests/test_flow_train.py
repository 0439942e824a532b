"""flux / sd3 / wan21 / wan22 LoRA through the real entry point on tiny pipelines: files, reloading in the
diffusers pipeline, the flow-matching loss, Wan 2.2 expert selection and switching, and resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import REPO
from helpers import adapter_for, diffusion_train_args, mean_loss, per_sample_generators, read_metrics
from toolkit.data.images import load_pixels
from toolkit.models.flow_matching import SigmaSampler, flux_mu
from toolkit.tiny import resolve_model_path

SHAPES = REPO / "configs/examples/data/shapes"
CLIPS = REPO / "configs/examples/data/clips"


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def _pixels(images) -> np.ndarray:
    return np.asarray(images[0], dtype=np.int16)


# family -> its pipeline, the pipeline call settings that match the quickstart's samples, the LoRA file's key prefix
# (the names ComfyUI maps, lora_export.py), one module it must hold, and whether it has `.alpha` keys
IMAGE_FAMILIES = {
    "flux": ("FluxPipeline", dict(guidance_scale=3.5), "transformer.", "transformer_blocks.0.attn.to_q", True),
    "sd3": ("StableDiffusion3Pipeline", dict(guidance_scale=3.0), "transformer.", "transformer_blocks.0.attn.to_q",
            False),
    "qwen_image": ("QwenImagePipeline", dict(true_cfg_scale=4.0, negative_prompt=" "), "diffusion_model.",  # true CFG
                   "transformer_blocks.0.attn.to_q", True),
    "z_image": ("ZImagePipeline", dict(guidance_scale=0.0), "diffusion_model.", "layers.0.attention.to_q", True),
    "flux2": ("Flux2Pipeline", dict(guidance_scale=4.0), "transformer.",
              "single_transformer_blocks.0.attn.to_qkv_mlp_proj", False),
}


@pytest.mark.parametrize("family", list(IMAGE_FAMILIES))
def test_image_family_trains_and_its_lora_reloads_in_the_diffusers_pipeline(family, tmp_path, run_cli, capsys):
    pipeline_name, guidance, prefix, known_module, alphas = IMAGE_FAMILIES[family]
    out = tmp_path / "run"
    # alpha != rank: the file's adapter metadata makes diffusers scale by alpha/rank, as training did
    assert run_cli(*diffusion_train_args(f"quickstart_{family}.yaml", out, "sample.prompts=[sks a red circle]",
                                         "network.alpha=16")) == 0
    err = capsys.readouterr().err
    # 24 captions + the sample prompt (+ the negative prompt "" for the families that sample with one)
    assert f"text embeddings: 0 cached, {25 if family in ('flux', 'flux2') else 26} encoded" in err
    assert "text encoders: freed after caching" in err
    losses = _losses(out)
    assert len(losses) == 2 and all(np.isfinite(losses))

    weights = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    suffixes = (".lora_A.weight", ".lora_B.weight") + ((".alpha",) if alphas else ())
    assert all(k.startswith(prefix) and k.endswith(suffixes) for k in weights)
    assert f"{prefix}{known_module}.lora_A.weight" in weights
    if family == "flux":  # single blocks, but not the model's final proj_out
        assert "transformer.single_transformer_blocks.0.proj_out.lora_A.weight" in weights
        assert not any(k.startswith("transformer.proj_out.") for k in weights)
    if family != "sd3":  # the quickstarts with save.format=comfyui
        assert (out / "final" / f"quickstart_{family}_comfyui.safetensors").is_file()

    import diffusers

    pipe = getattr(diffusers, pipeline_name).from_pretrained(resolve_model_path(f"tiny:{family}"))
    pipe.set_progress_bar_config(disable=True)
    call = dict(num_inference_steps=2, width=64, height=64, **guidance)

    def generate() -> np.ndarray:
        return _pixels(pipe(prompt="sks a red circle", generator=torch.Generator("cpu").manual_seed(42),
                            **call).images)

    base = generate()
    pipe.load_lora_weights(str(out / "final"))
    with_lora = generate()
    trained = np.asarray(Image.open(out / "samples" / "step-000002" / "00.png"), dtype=np.int16)
    assert np.abs(with_lora - base).max() >= 2
    assert np.abs(with_lora - trained).max() <= 1


@pytest.mark.parametrize("family", ["z_image", "flux2", "chroma"])
def test_resume_from_a_checkpoint_is_bit_identical(family, tmp_path, run_cli):
    common = ("sample.prompts=[]", "save.every=1", "save.format=diffusers")
    full = tmp_path / "full"
    assert run_cli(*diffusion_train_args(f"quickstart_{family}.yaml", full, *common)) == 0
    resumed = tmp_path / "resumed"
    assert run_cli(*diffusion_train_args(f"quickstart_{family}.yaml", resumed, *common,
                                         f"train.resume={full / 'checkpoints' / 'step-000001'}")) == 0
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step-000002"]
    assert _losses(resumed) == _losses(full)[1:]
    a, b = (load_file(str(run / "final" / "pytorch_lora_weights.safetensors")) for run in (full, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family, pipeline_name, latent_shape", [
    ("z_image", "ZImagePipeline", (1, 16, 8, 8)),     # the VAE's latents at 64x64
    ("flux2", "Flux2Pipeline", (1, 128, 4, 4)),       # 32 channels patchified 2x2
])
def test_predict_is_the_velocity_the_pipeline_steps_with(family, pipeline_name, latent_shape, tmp_path):
    """The family's conventions checked against its pipeline rather than restated: the cached text is the pipeline's
    own encoding; one scheduler step of the pipeline from latents x at its first sigma moves x by
    (sigma_1 - sigma_0) * predict(x, sigma_0); the training sigmas are shifted as the pipeline shifts them; Flux.2's
    latents are what the pipeline encodes a reference image to."""
    import diffusers

    from toolkit.models.diffusion_base import Denoiser
    from toolkit.models.objectives import Noised

    guidance = ["train.guidance=4.0"] if family == "flux2" else []  # what the pipeline call below feeds it
    adapter, dataset = adapter_for(f"quickstart_{family}.yaml", tmp_path, *guidance)
    prompt = adapter.sample_prompts()[0]  # cached
    text = adapter.embeddings_for(prompt)
    fresh = getattr(diffusers, pipeline_name).from_pretrained(resolve_model_path(f"tiny:{family}"))
    with torch.no_grad():
        if family == "z_image":
            (own,), _ = fresh.encode_prompt([prompt], device="cpu", do_classifier_free_guidance=False)
            tokens = text["prompt_embeds"][0][text["prompt_embeds_mask"][0].bool()]
            pipeline_text = dict(prompt_embeds=[tokens], guidance_scale=0.0)
        else:
            own, tokens = fresh.encode_prompt(prompt, device="cpu")[0][0], text["prompt_embeds"][0]
            pipeline_text = dict(prompt_embeds=text["prompt_embeds"], guidance_scale=4.0)
    assert torch.equal(tokens, own)

    pipe, steps = adapter.pipe, 2 if family == "z_image" else 50  # flux2: its training shift is the one at 50 steps
    pipe.set_progress_bar_config(disable=True)
    x = torch.randn(latent_shape, generator=torch.Generator().manual_seed(0))
    seen = []

    def first_step(pipeline, i, t, kwargs):
        seen.append(kwargs["latents"].clone())
        pipeline._interrupt = True  # the remaining steps are skipped
        return {}

    pipe(**pipeline_text, num_inference_steps=steps, width=64, height=64, latents=x.clone(), output_type="latent",
         callback_on_step_end=first_step)
    sigmas = pipe.scheduler.sigmas
    transformer = pipe.transformer
    with torch.no_grad():
        velocity = adapter.predict(Denoiser(transformer, transformer.dtype, transformer.config),
                                   Noised(x, sigmas[:1], torch.zeros_like(x)), text, {})
    after = seen[0] if family == "z_image" else seen[0].transpose(1, 2).reshape(latent_shape)  # flux2: tokens
    torch.testing.assert_close(after, x + (sigmas[1] - sigmas[0]) * velocity, rtol=1e-5, atol=1e-6)
    # sigma 1 - 1/steps (the pipelines' unshifted schedule) shifted as the training sampler shifts
    sampler = adapter.sampler_for(x)
    assert float(sampler.shifted(torch.tensor(1 - 1 / steps))) == pytest.approx(float(sigmas[1]), rel=1e-5)
    if family == "z_image":
        assert not adapter.dynamic_shift and sampler.shift == 3.0 and sampler.mu is None
    else:
        batch = dataset.collate([0])
        pixels = load_pixels(dataset.items[0])[0][None]
        assert torch.allclose(batch["latents"], fresh._encode_vae_image(pixels, None), atol=1e-5)


def test_flux_loss_is_the_velocity_mse_with_resolution_dependent_shift(tmp_path):
    from diffusers import FluxPipeline

    adapter, dataset = adapter_for("quickstart_flux.yaml", tmp_path, "train.guidance=2.0")
    batch = dataset.collate([i for i, g in enumerate(dataset.groups) if g == 1][:2])  # 128x64 bucket
    with torch.no_grad():
        loss = mean_loss(adapter, batch)
        latents = batch["latents"]
        b, c, h, w = latents.shape
        generators = per_sample_generators(batch)  # each sample's noise, then its sigma's uniform draw
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g) for g in generators])
        config = adapter.pipe.scheduler.config
        mu = flux_mu(h // 2 * w // 2, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                     config.max_shift)
        p = torch.stack([torch.rand((), generator=g) for g in generators])
        u = torch.sigmoid(torch.special.ndtri(p.clamp(1e-7, 1 - 1e-7)))
        sigma = (np.exp(mu) * u / (1 + (np.exp(mu) - 1) * u)).view(-1, 1, 1, 1)
        noisy = (1 - sigma) * latents + sigma * noise
        pred = adapter.pipe.transformer(
            hidden_states=FluxPipeline._pack_latents(noisy, b, c, h, w), timestep=sigma.flatten(),
            guidance=torch.full((b,), 2.0), pooled_projections=batch["pooled_prompt_embeds"],
            encoder_hidden_states=batch["prompt_embeds"], txt_ids=torch.zeros(batch["prompt_embeds"].shape[1], 3),
            img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)).sample
        target = FluxPipeline._pack_latents(noise - latents, b, c, h, w)
    assert latents.shape == (2, 16, 8, 16) and adapter.dynamic_shift
    assert torch.allclose(loss, ((pred - target) ** 2).mean(), rtol=1e-5, atol=1e-7)


def test_sigma_sampler_shift_and_expert_ranges():
    torch.manual_seed(0)
    sampler = SigmaSampler("logit_normal", shift=3.0)
    full = sampler.sample(200_000, torch.device("cpu"))
    u = torch.sigmoid(torch.randn(200_000))
    expected = 3 * u / (1 + 2 * u)
    assert abs(full.mean() - expected.mean()) < 0.005 and abs(full.std() - expected.std()) < 0.005
    high = sampler.sample(50_000, torch.device("cpu"), 0.875, 1.0)
    low = sampler.sample(50_000, torch.device("cpu"), 0.0, 0.875)
    assert high.min() >= 0.875 and low.max() < 0.875
    # restricted to its range, the distribution is the full one conditioned on that range
    assert abs(high.mean() - expected[expected >= 0.875].mean()) < 0.003
    assert abs(low.mean() - expected[expected < 0.875].mean()) < 0.005
    uniform = SigmaSampler("uniform").sample(100_000, torch.device("cpu"))
    assert abs(uniform.mean() - 0.5) < 0.005
    assert flux_mu(256) == pytest.approx(0.5) and flux_mu(4096) == pytest.approx(1.15)


def test_wan21_trains_on_clips_and_stills_writes_video_samples_and_reloads(tmp_path, run_cli, capsys):
    out = tmp_path / "run"
    # gradient checkpointing on: the LoRA still gets gradients (the reloaded LoRA below changes the output)
    assert run_cli(*diffusion_train_args("quickstart_wan21.yaml", out, "sample.num_frames=5", "network.alpha=4",
                                         "train.gradient_checkpointing=true")) == 0
    err = capsys.readouterr().err
    assert "64 x 64    (ratio 1.00) x   9 frames: 6 clips" in err and "x   1 frame : 2 clips" in err
    samples = out / "samples" / "step-000002"
    names = sorted(p.name for p in samples.iterdir())
    assert {"00.png", "00.webp", "grid.png", "prompts.txt"} <= set(names)
    with Image.open(samples / "00.webp") as webp:
        assert webp.n_frames == 5 and webp.size == (64, 64)
    assert 'src="samples/step-000002/00.webp"' in (out / "report.html").read_text()  # the report plays the video

    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(resolve_model_path("tiny:wan21"))
    pipe.set_progress_bar_config(disable=True)

    def generate() -> np.ndarray:
        frames = pipe("a red circle moving right on a white background", num_frames=5, width=64, height=64,
                      num_inference_steps=2, guidance_scale=3.0, output_type="np",
                      generator=torch.Generator("cpu").manual_seed(42)).frames[0]
        return frames

    base = generate()
    pipe.load_lora_weights(str(out / "final"))
    with_lora = generate()
    middle = np.asarray(Image.open(samples / "00.png"), dtype=np.float32)
    assert np.abs(with_lora - base).max() > 1e-3
    assert np.abs(with_lora[2] * 255 - middle).max() <= 1.5  # the sample's middle frame is the pipeline's


@pytest.fixture
def experts_seen(monkeypatch) -> list:
    """(expert, sigma low, sigma high) of every Wan 2.2 loss call."""
    from toolkit.models.diffusion_wan import Wan22Adapter

    seen = []
    loss = Wan22Adapter.loss
    monkeypatch.setattr(Wan22Adapter, "loss", lambda self, batch, modules:
                        seen.append((self.active_denoiser(), *self.noise_range())) or loss(self, batch, modules))
    return seen


def test_wan22_trains_both_experts_alternately_and_saves_each(tmp_path, run_cli, experts_seen):
    seen = experts_seen
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_wan22.yaml", out, "train.steps=5", "train.expert_switch_every=2",
                                         "sample.prompts=[]")) == 0
    assert [name for name, _, _ in seen] == ["transformer", "transformer", "transformer_2", "transformer_2", "transformer"]
    assert seen[0][1:] == (0.875, 1.0) and seen[2][1:] == (0.0, 0.875)
    final = out / "final"
    assert sorted(str(p.relative_to(final)) for p in final.rglob("*.safetensors")) == [
        "high_noise/pytorch_lora_weights.safetensors", "low_noise/pytorch_lora_weights.safetensors",
        "quickstart_wan22_high_noise_comfyui.safetensors", "quickstart_wan22_low_noise_comfyui.safetensors"]
    high = load_file(str(final / "high_noise" / "pytorch_lora_weights.safetensors"))
    low = load_file(str(final / "low_noise" / "pytorch_lora_weights.safetensors"))
    assert high.keys() == low.keys() and all(k.startswith("diffusion_model.blocks.") for k in high)
    assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in low
    comfy = load_file(str(final / "quickstart_wan22_low_noise_comfyui.safetensors"))
    assert comfy.keys() == low.keys() and all(torch.equal(comfy[k], low[k]) for k in low)

    # Each file loads into its expert with diffusers' loader, and together they change the output.
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(resolve_model_path("tiny:wan22"))
    pipe.set_progress_bar_config(disable=True)

    def generate() -> np.ndarray:
        return pipe("a red circle moving right", num_frames=5, width=64, height=64, num_inference_steps=4,
                    guidance_scale=3.0, output_type="np", generator=torch.Generator("cpu").manual_seed(0)).frames[0]

    base = generate()
    pipe.load_lora_weights(str(final / "high_noise"))
    pipe.load_lora_weights(str(final / "low_noise"), load_into_transformer_2=True, adapter_name="low")
    a = pipe.transformer.blocks[0].attn1.to_q.lora_B["default_0"].weight
    b = pipe.transformer_2.blocks[0].attn1.to_q.lora_B["low"].weight
    assert torch.equal(a, high["diffusion_model.blocks.0.self_attn.q.lora_B.weight"])
    assert torch.equal(b, low["diffusion_model.blocks.0.self_attn.q.lora_B.weight"])
    assert np.abs(generate() - base).max() > 1e-3


def test_wan22_one_expert_only(tmp_path, run_cli, experts_seen):
    ranges = experts_seen
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_wan22.yaml", out, "train.experts=low_noise",
                                         "save.format=diffusers", "sample.prompts=[]")) == 0
    assert ranges == [("transformer_2", 0.0, 0.875)] * 2
    assert sorted(p.name for p in (out / "final").iterdir()) == ["low_noise"]
    adapter, _ = adapter_for("quickstart_wan22.yaml", tmp_path / "probe", "train.experts=low_noise")
    assert list(adapter.network.keys()) == ["transformer_2"]
    assert not any("lora" in n for n, _ in adapter.pipe.transformer.named_parameters())


def test_wan22_resume_across_an_expert_switch_with_flipped_clips_is_bit_identical(tmp_path, run_cli):
    common = ("sample.prompts=[]", "train.expert_switch_every=2", "save.every=3", "save.format=diffusers",
              "data.random_flip=true", "data.shuffle_tags=true")
    full = tmp_path / "full"
    assert run_cli(*diffusion_train_args("quickstart_wan22.yaml", full, "train.steps=6", *common)) == 0
    split = tmp_path / "split"
    assert run_cli(*diffusion_train_args("quickstart_wan22.yaml", split, "train.steps=3", *common)) == 0
    # resumes at step 3
    assert run_cli(*diffusion_train_args("quickstart_wan22.yaml", split, "train.steps=6", *common)) == 0
    assert _losses(split)[-3:] == _losses(full)[-3:]
    for expert in ("high_noise", "low_noise"):
        a = load_file(str(full / "final" / expert / "pytorch_lora_weights.safetensors"))
        b = load_file(str(split / "final" / expert / "pytorch_lora_weights.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_wan22_5b_takes_a_timestep_per_latent_patch(tmp_path):
    adapter, dataset = adapter_for("quickstart_wan22.yaml", tmp_path, "model.name_or_path=tiny:wan22-5b")
    assert adapter.denoiser_names == ("transformer",) and adapter.expand_timesteps
    seen = {}
    forward = adapter.pipe.transformer.forward

    def spy(*args, **kwargs):
        seen["timestep"] = kwargs["timestep"]
        return forward(*args, **kwargs)

    adapter.pipe.transformer.forward = spy
    batch = dataset.collate([i for i, g in enumerate(dataset.groups) if g == 1][:2])  # 9-frame clips
    loss = mean_loss(adapter, batch)
    # 9 frames -> 3 latent frames; 64 px / 16 -> 4x4 latents -> 2x2 patches: 12 tokens, one timestep each
    assert batch["latents"].shape == (2, 48, 3, 4, 4) and seen["timestep"].shape == (2, 12)
    assert torch.isfinite(loss)
    with pytest.raises(Exception, match="train.experts=high_noise: .* has one transformer"):
        adapter_for("quickstart_wan22.yaml", tmp_path / "x", "model.name_or_path=tiny:wan22-5b",
                    "train.experts=high_noise")


def test_caption_dropout_uses_the_cached_empty_caption(tmp_path):
    adapter, dataset = adapter_for("quickstart_sd3.yaml", tmp_path, "data.caption_dropout=1.0")
    batch = dataset.collate([i for i, g in enumerate(dataset.groups) if g == 0][:2])
    empty = adapter.prompt_cache[""]
    assert all(torch.equal(batch["prompt_embeds"][i], empty["prompt_embeds"]) for i in range(2))
    assert adapter.pipe.text_encoder is None and adapter.pipe.text_encoder_3 is None


@pytest.mark.parametrize("backend, mode", [("torchao", "8bit"), ("bitsandbytes", "4bit")])
def test_quantized_frozen_base_trains(backend, mode, tmp_path, run_cli, capsys):
    pytest.importorskip(backend)
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_flux.yaml", out, f"model.quantize={mode}",
                                         f"model.quantize_backend={backend}", "sample.prompts=[]",
                                         "save.format=diffusers")) == 0
    err = capsys.readouterr().err
    assert f"model: quantized 20 linear layers of the transformer to {mode} ({backend})" in err
    assert all(np.isfinite(_losses(out)))
    assert len(load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))) == 3 * 17  # A, B, alpha


def test_bad_num_frames_is_a_short_error(tmp_path, run_cli, capsys):
    assert run_cli(*diffusion_train_args("quickstart_wan21.yaml", tmp_path / "run", "data.num_frames=6")) == 2
    err = capsys.readouterr().err
    assert "'data.num_frames' in command line: 6 is not 4k+1 (the VAE compresses time by 4); use 5 or 9" in err
    assert "Traceback" not in err


def test_a_module_without_a_wan_name_falls_back_to_diffusers_layout_with_a_warning(tmp_path, run_cli, capsys):
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_wan21.yaml", out, "save.format=comfyui", "sample.prompts=[]",
                                         "network.target_modules=[to_q,patch_embedding]")) == 0
    err = capsys.readouterr().err
    assert ("pytorch_lora_weights.safetensors: written in diffusers' own layout, which diffusers loads but ComfyUI "
            "and kohya's tools do not: no ComfyUI Wan name for the LoRA modules ['patch_embedding']") in err
    assert "warning: save.format=comfyui: quickstart_wan21_comfyui.safetensors not written" in err
    assert sorted(p.name for p in (out / "final").iterdir()) == ["pytorch_lora_weights.safetensors"]
    weights = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    assert "transformer.patch_embedding.lora_A.weight" in weights
    # quickstart_flux.yaml asks for save.format=comfyui, which holds no DoRA: refused
    assert run_cli(*diffusion_train_args("quickstart_flux.yaml", tmp_path / "dora", "network.type=dora")) == 2
    assert "network.type is dora" in capsys.readouterr().err


def test_text_encoder_lora_is_refused_before_loading_a_flow_model(tmp_path, run_cli, capsys, monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers.FluxPipeline, "from_pretrained", lambda *a, **k: pytest.fail("loaded anyway"))
    assert run_cli(*diffusion_train_args("quickstart_flux.yaml", tmp_path / "run",
                                         "train.train_text_encoder=true")) == 2
    assert ("'train.train_text_encoder' in command line has no effect for model.family flux"
            in capsys.readouterr().err)


def test_wan_samples_are_drawn_in_the_multiple_of_each_model(tmp_path):
    """Wan 2.2 TI2V-5B's VAE downscales 16x (the A14B's and Wan 2.1's 8x), times the patch of 2: its pipeline draws
    multiples of 32, and resizes anything else without a word; the adapter rounds down to it and says so."""
    from helpers import adapter_for

    logs = []
    for name, multiple, size in (("tiny:wan22-5b", 32, (32, 32)), ("tiny:wan22", 16, (48, 48))):
        adapter, _ = adapter_for("quickstart_wan22.yaml", tmp_path / name[5:], f"model.name_or_path={name}",
                                 "sample.width=48", "sample.height=48")
        adapter.log = logs.append
        assert (adapter.sample_multiple(), adapter.sample_size()) == (multiple, size), name
    assert logs == ["samples are drawn at 32x32: 48x48 (sample.width/height, 0 taking data.resolution) rounded down to "
                    "a multiple of 32, as this model's pipeline draws them"]
