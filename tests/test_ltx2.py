"""The ltx2 family on tiny:ltx2 through the real entry point: it trains the video branch, its LoRA file loads in
LTX2Pipeline.load_lora_weights (the trained transformer's output, the toolkit's sample frames) and maps onto
ComfyUI's own LTX-2 model with ComfyUI's key map; predict against one pipeline step; block swap and fp8 applied;
resume bit-identical; the 8k+1 frame rule."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import REPO
from helpers import adapter_for, cpu_runtime, diffusion_train_args, read_metrics
from toolkit.tiny import resolve_model_path

pytestmark = pytest.mark.usefixtures("own_data_caches")
PROMPT = "sks a red circle moving right"
NEGATIVE = "blurry, distorted"
COMFYUI_MIRROR = "/work/.mirror/pollockjj+ComfyUI/repo"  # a bare git copy of ComfyUI, where this machine has one


def _pipeline():
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(resolve_model_path("tiny:ltx2"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _transformer_inputs(pipe) -> dict:
    """A video of 2 latent frames of 8x8 and 9 audio tokens, with the pipeline's own text tokens for PROMPT."""
    from diffusers import LTX2Pipeline

    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt([PROMPT], do_classifier_free_guidance=False, device="cpu")
        video, audio, mask = pipe.connectors(embeds, mask, padding_side="left")
    latents = LTX2Pipeline._pack_latents(torch.randn(1, 8, 2, 8, 8, generator=g))
    return dict(hidden_states=latents, audio_hidden_states=torch.randn(1, 9, 4, generator=g),
                encoder_hidden_states=video, audio_encoder_hidden_states=audio, timestep=torch.tensor([600.0]),
                audio_timestep=torch.tensor([1000.0]), encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                num_frames=2, height=8, width=8, fps=24.0, audio_num_frames=9, return_dict=False)


def _trained(run_dir):
    """The run's adapter holding step 2's exact tensors."""
    from toolkit.models import build_adapter
    from toolkit.models.base import load_trainable_state_dict
    from toolkit.plan.run import load_run
    from toolkit.train.checkpoint import trainable_from_file

    run = load_run([run_dir / "config.yaml"], [])
    adapter = build_adapter(run.cfg, cpu_runtime(run, run_dir))
    adapter.load()
    state = load_file(str(run_dir / "checkpoints" / "step-000002" / "trainable_state.safetensors"))
    load_trainable_state_dict(adapter.network, trainable_from_file(state))
    return adapter


def test_ltx2_trains_and_its_lora_loads_in_ltx2_pipeline(tmp_path, run_cli, capsys):
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_ltx2.yaml", out, f"sample.prompts=[{PROMPT}]", "network.alpha=4",
                                         "save.every=2", "sample.every=2", "save.format=comfyui")) == 0
    log = capsys.readouterr().err
    assert "LTX-2: the video branch trains, the audio stream is pure noise at sigma 1" in log
    assert "64 x 64    (ratio 1.00) x   9 frames: 6 clips" in log
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 2 and all(np.isfinite(losses))
    final = out / "final" / "pytorch_lora_weights.safetensors"
    weights = load_file(str(final))
    modules = {k.rsplit(".lora_", 1)[0] for k in weights}
    # the video stream of each of the 2 blocks: self-attention and text cross-attention (q, k, v, out), feed-forward
    assert len(modules) == 2 * 10 and len(weights) == 2 * len(modules)
    assert all(k.startswith("diffusion_model.transformer_blocks.") for k in weights)
    assert not any("audio" in k for k in weights)
    assert weights["diffusion_model.transformer_blocks.1.ff.net.2.lora_B.weight"].shape == (16, 8)
    assert (out / "final" / "quickstart_ltx2_comfyui.safetensors").read_bytes() == final.read_bytes()

    # The trained PEFT model against a fresh pipeline that loaded the file (alpha 4 / rank 8 folded into lora_A).
    adapter = _trained(out)
    pipe = _pipeline()
    inputs = _transformer_inputs(pipe)
    with torch.no_grad():
        base = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(str(out / "final"))
        loaded = pipe.transformer(**inputs)[0]
        trained = adapter.pipe.transformer(**inputs)[0]
    assert (trained - base).abs().max() > 1e-3  # the LoRA moves the output well beyond the tolerance
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)

    # LTX2Pipeline with the LoRA, from the prompt strings (Gemma 3 and its connectors run by the pipeline), draws the
    # toolkit's sample, which came from the cached text tokens.
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=2, guidance_scale=3.0, width=64,
                height=64, num_frames=9, frame_rate=24.0, use_cross_timestep=False, output_type="pil")
    with torch.no_grad():
        frames = pipe(**call, generator=torch.Generator("cpu").manual_seed(42)).frames[0]
    with_lora = np.asarray(frames[len(frames) // 2], dtype=np.int16)
    sample = np.asarray(Image.open(out / "samples" / "step-000002" / "00.png"), dtype=np.int16)
    assert len(frames) == 9 and np.abs(with_lora - sample).max() <= 1
    pipe.disable_lora()
    with torch.no_grad():
        frames = pipe(**call, generator=torch.Generator("cpu").manual_seed(42)).frames[0]
    assert np.abs(np.asarray(frames[len(frames) // 2], dtype=np.int16) - with_lora).max() >= 2


def test_predict_is_the_velocity_the_pipeline_steps_with(tmp_path, monkeypatch):
    """One step of LTX2Pipeline (no guidance) from video latents x and audio noise a at its first sigma moves x by
    (sigma_1 - sigma_0) * predict(x, sigma_0) given the same audio; the training shift's mu is the pipeline's; the
    cached latents are the pipeline's VAE encoding, normalised as the pipeline normalises them."""
    from diffusers import LTX2Pipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    from toolkit.data.video import load_clip
    from toolkit.models.diffusion_base import Denoiser
    from toolkit.models.objectives import Noised

    adapter, dataset = adapter_for("quickstart_ltx2.yaml", tmp_path)
    text = adapter.embeddings_for(adapter.sample_prompts()[0])
    g = torch.Generator().manual_seed(0)
    x, audio = torch.randn(1, 8, 2, 8, 8, generator=g), torch.randn(1, 9, 4, generator=g)
    assert adapter.audio_tokens(2) == 9  # 9 frames at 24 fps: 0.375 s of 25 audio latents a second
    monkeypatch.setattr(adapter, "audio_noise", lambda b, f, device: audio)
    pipe, steps, seen = adapter.pipe, 50, []

    def first_step(pipeline, i, t, kwargs):
        seen.append(kwargs["latents"].clone())
        pipeline._interrupt = True
        return {}

    joined = torch.cat([text["prompt_embeds"], text["audio_prompt_embeds"]], dim=-1)
    with adapter._cached_connectors(text["prompt_embeds"].shape[-1]):
        pipe(prompt_embeds=joined, prompt_attention_mask=text["prompt_attention_mask"], guidance_scale=1.0,
             stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=1.0, audio_stg_scale=0.0,
             audio_modality_scale=1.0, audio_guidance_rescale=0.0, num_inference_steps=steps, width=64, height=64,
             num_frames=9, frame_rate=24.0, latents=LTX2Pipeline._pack_latents(x), audio_latents=audio.clone(),
             use_cross_timestep=False, output_type="latent", callback_on_step_end=first_step)
    sigmas = pipe.scheduler.sigmas
    transformer = pipe.transformer
    with torch.no_grad():
        velocity = adapter.predict(Denoiser(transformer, transformer.dtype, transformer.config),
                                   Noised(x, sigmas[:1], torch.zeros_like(x)), text, {})
    after = LTX2Pipeline._unpack_latents(seen[0], 2, 8, 8)
    torch.testing.assert_close(after, x + (sigmas[1] - sigmas[0]) * velocity, rtol=1e-5, atol=1e-6)
    config = pipe.scheduler.config
    mu = calculate_shift(2 * 8 * 8, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                         config.max_shift)
    assert adapter.sampler_for(x).mu == pytest.approx(mu)
    item = dataset.items[0]
    pixels = load_clip(item)[None]
    with torch.no_grad():
        encoded = pipe.vae.encode(pixels).latent_dist.mode()
    expected = LTX2Pipeline._normalize_latents(encoded, pipe.vae.latents_mean, pipe.vae.latents_std)
    torch.testing.assert_close(dataset.collate([0])["latents"], expected, rtol=1e-5, atol=1e-5)


def test_eval_loss_draws_the_audio_noise_from_its_own_generator(tmp_path):
    """The eval loss at a level is the same twice and leaves the training's random stream where it was."""
    adapter, dataset = adapter_for("quickstart_ltx2.yaml", tmp_path)
    batch = dataset.collate([0, 1])
    latents = batch["latents"]
    cond = adapter.conditioning(batch, adapter.trainable_modules())
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(123)
    with torch.no_grad():
        first = adapter.loss_at("transformer", batch, latents, cond, noise, 0.5)
        drawn = torch.rand(1)
        torch.manual_seed(123)
        again = adapter.loss_at("transformer", batch, latents, cond, noise, 0.5)
        other = adapter.loss_at("transformer", batch, latents, cond, noise, 0.25)
    assert torch.equal(first, again) and torch.equal(torch.rand(1), drawn)  # the global stream untouched
    assert first.shape == (2,) and torch.isfinite(first).all() and not torch.equal(first, other)


def test_resume_from_a_checkpoint_is_bit_identical(tmp_path, run_cli):
    common = ("sample.prompts=[]", "save.every=1")
    full = tmp_path / "full"
    assert run_cli(*diffusion_train_args("quickstart_ltx2.yaml", full, *common)) == 0
    resumed = tmp_path / "resumed"
    assert run_cli(*diffusion_train_args("quickstart_ltx2.yaml", resumed, *common,
                                         f"train.resume={full / 'checkpoints' / 'step-000001'}")) == 0
    assert [r["loss"] for r in read_metrics(resumed)] == [r["loss"] for r in read_metrics(full)][1:]
    a, b = (load_file(str(run / "final" / "pytorch_lora_weights.safetensors")) for run in (full, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_blocks_swapped_and_checkpointed_train_the_same_lora(tmp_path, run_cli, capsys):
    """model.block_swap=1 (one of tiny:ltx2's 2 blocks in pinned CPU memory) with both blocks checkpointed gives the
    same losses and LoRA, bit for bit, as the plain run."""
    out = {}
    for name, more in (("plain", []), ("swapped", ["model.block_swap=1", "train.gradient_checkpointing=2"])):
        assert run_cli(*diffusion_train_args("quickstart_ltx2.yaml", tmp_path / name, "sample.prompts=[]", *more)) == 0
        out[name] = load_file(tmp_path / name / "final" / "pytorch_lora_weights.safetensors")
    log = capsys.readouterr().err
    assert "model.block_swap=1: 1 of 2 blocks swapped" in log
    assert "blocks: transformer: 2 blocks, 2 gradient-checkpointed, 1 swapped" in log
    plain, swapped = ([r["loss"] for r in read_metrics(tmp_path / name)] for name in ("plain", "swapped"))
    assert len(plain) == 2 and plain == swapped
    assert out["plain"].keys() == out["swapped"].keys()
    assert all(torch.equal(out["plain"][k], out["swapped"][k]) for k in out["plain"])


def test_fp8_quantizes_the_blocks_linear_layers(tmp_path, run_cli, capsys):
    """model.quantize=fp8: the 2 blocks' linear layers (video and audio streams, 28 each) become fp8; the losses stay
    within fp8's error of the 16-bit run's and the LoRA file holds the same keys."""
    for name, extra in (("fp8", ["model.quantize=fp8"]), ("plain", ["model.quantize=none"])):
        assert run_cli(*diffusion_train_args("quickstart_ltx2.yaml", tmp_path / name, "sample.prompts=[]", *extra)) == 0
    err = capsys.readouterr().err
    assert "model: quantized 56 linear layers of the transformer to fp8 (toolkit)" in err
    fp8, plain = ([r["loss"] for r in read_metrics(tmp_path / n)] for n in ("fp8", "plain"))
    assert len(fp8) == 2 and fp8 != plain and fp8 == pytest.approx(plain, rel=0.05)
    files = [load_file(tmp_path / n / "final" / "pytorch_lora_weights.safetensors") for n in ("fp8", "plain")]
    assert files[0].keys() == files[1].keys()


@pytest.mark.parametrize("frames, message", [
    (13, "'data.num_frames' in command line: 13 is not 8k+1 (the VAE compresses time by 8); use 9 or 17"),
])
def test_num_frames_must_be_8k_plus_1(tmp_path, run_cli, capsys, frames, message):
    assert run_cli(*diffusion_train_args("quickstart_ltx2.yaml", tmp_path, f"data.num_frames={frames}")) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_clips_train_on_8k_plus_1_frames(tmp_path, capsys):
    """A 13-frame clip (4k+1, what the clip scan keeps of it) trains on 9 frames with data.num_frames=17; 17-frame
    clips on 17 (3 latent frames)."""
    from toolkit.tiny.fixtures import write_clips_dataset

    write_clips_dataset(tmp_path / "short", count=2, frames=13, stills=0)
    write_clips_dataset(tmp_path / "long", count=1, frames=17, stills=0)
    for clip in (tmp_path / "long").iterdir():
        clip.rename(tmp_path / "short" / f"long_{clip.name}")
    adapter, dataset = adapter_for("quickstart_ltx2.yaml", tmp_path / "run", f"data.path={tmp_path / 'short'}",
                                   "data.num_frames=17")
    frames = sorted(item.bucket[2] for item in dataset.items)
    assert frames == [9, 9, 17]
    assert "frames: 2 clips shorter than data.num_frames train on the largest 8k+1 frames" in capsys.readouterr().err
    latent_frames = sorted(dataset.collate([i])["latents"].shape[2] for i in range(3))
    assert latent_frames == [2, 2, 3]


# -- ComfyUI's own loader -----------------------------------------------------------------------------------------

COMFYUI_CHECK = r'''
import json, sys, types
import diffusers.loaders.peft  # noqa: F401  (before the torchvision stand-in: diffusers checks for the real one)
import torch
from safetensors.torch import load_file

base, lora_file, out = sys.argv[1:4]
vision = types.ModuleType("torchvision"); vision.transforms = types.ModuleType("torchvision.transforms")
sys.modules["torchvision"], sys.modules["torchvision.transforms"] = vision, vision.transforms
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.lora, comfy.model_base, comfy.ops
from comfy.ldm.lightricks.av_model import LTXAVModel

weights = load_file(base)  # the tiny transformer's weights, diffusers names
# ComfyUI's LTX-2 (audio-video) model at the tiny transformer's sizes: its own module names
model = LTXAVModel(in_channels=8, audio_in_channels=4, cross_attention_dim=16, audio_cross_attention_dim=8,
                   attention_head_dim=8, audio_attention_head_dim=4, num_attention_heads=2, audio_num_attention_heads=2,
                   caption_channels=32, num_layers=2, operations=comfy.ops.disable_weight_init)
state = {f"diffusion_model.{k}": v for k, v in model.state_dict().items()}
stub = comfy.model_base.LTXAV.__new__(comfy.model_base.LTXAV)
torch.nn.Module.__init__(stub)
stub.state_dict = lambda: state
stub.model_config = types.SimpleNamespace(unet_config={})
key_map = comfy.lora.model_lora_keys_unet(stub, {})
lora = load_file(lora_file)
patches = comfy.lora.load_lora(lora, key_map)
deltas = {}
for target, patch in patches.items():
    name = target[len("diffusion_model."):-len(".weight")]
    weight = weights[name + ".weight"].clone()
    assert weight.shape == state[target].shape, (name, weight.shape, state[target].shape)
    patched = comfy.lora.calculate_weight([(1.0, patch, 1.0, None, None)], weight.clone(), target)
    deltas[name] = (patched - weight).tolist()
json.dump({"loaded": len(patches), "keys": len(lora), "deltas": deltas}, open(out, "w"))
'''


def _comfyui_tree(dest) -> None:
    """ComfyUI's python files from the mirror's HEAD into `dest` (nothing copied into the repository)."""
    git = ["git", f"--git-dir={COMFYUI_MIRROR}"]
    names = subprocess.run([*git, "ls-tree", "-r", "--name-only", "HEAD", "comfy", "comfy_api", "comfy_execution",
                            "folder_paths.py", "comfyui_version.py"], capture_output=True, text=True, check=True)
    for name in names.stdout.split():
        if not name.endswith(".py"):
            continue
        blob = subprocess.run([*git, "cat-file", "blob", f"HEAD:{name}"], capture_output=True)
        if blob.returncode == 0:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(blob.stdout)


def test_comfyui_maps_the_file_onto_its_ltx2_model(tmp_path, run_cli):
    """ComfyUI's LoRA loader (comfy.lora.model_lora_keys_unet / load_lora / calculate_weight, from the ComfyUI
    mirror) on ComfyUI's own LTXAV model at the tiny sizes: every key of the file lands on a weight of the same shape,
    and each weight moves by exactly what diffusers' load_lora_weights + fuse_lora moves it by."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    if not Path(COMFYUI_MIRROR).is_dir():
        pytest.skip("no ComfyUI mirror on this machine")
    comfy = tmp_path / "comfyui"
    _comfyui_tree(comfy)
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_ltx2.yaml", out, "sample.prompts=[]", "network.alpha=4",
                                         "network.target_modules=all-linear")) == 0
    lora = out / "final" / "pytorch_lora_weights.safetensors"
    assert any(".audio_to_video_attn." in k for k in load_file(str(lora)))
    pipe = _pipeline()
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    save_file(before, str(tmp_path / "base.safetensors"))
    pipe.load_lora_weights(str(out / "final"))
    pipe.fuse_lora()
    modules = dict(pipe.transformer.named_modules())
    result = subprocess.run([sys.executable, "-c", COMFYUI_CHECK, str(tmp_path / "base.safetensors"), str(lora),
                             str(tmp_path / "comfy.json")], cwd=comfy, capture_output=True, text=True, timeout=600,
                            env={**__import__("os").environ, "PYTHONPATH": str(comfy)})
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads((tmp_path / "comfy.json").read_text())
    assert found["loaded"] == found["keys"] // 2 == 2 * 14  # every module of the file: A and B each
    for name, delta in found["deltas"].items():
        expected = modules[name].base_layer.weight.detach() - before[f"{name}.weight"]  # fused into the base layer
        assert expected.abs().max() > 0
        torch.testing.assert_close(torch.tensor(delta), expected, rtol=1e-4, atol=1e-7)
