"""LTX-2's audio branch on tiny:ltx2: mp4 clips with a sine-tone soundtrack (PyAV) train the video and audio branches
through the entry point; only the audio changing changes the loss (and with data.audio=off it does not); the LoRA
has the audio stream's layers, LTX2Pipeline.load_lora_weights loads them and they change the audio the pipeline
makes; resume bit-identical; data.audio=required names a clip without sound; the spectrogram is transformers' own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import adapter_for, diffusion_train_args, mean_loss, read_metrics
from test_ltx2 import PROMPT, _pipeline, _trained
from toolkit.tiny.fixtures import write_sound_clip

pytestmark = pytest.mark.usefixtures("own_data_caches")


def _sound_clips(root: Path, tones=(440.0, 660.0), colours=("red", "blue")) -> Path:
    """Two 9-frame 64x64 mp4 clips at 24 fps, each with a tone (None: no audio stream)."""
    for tone, colour in zip(tones, colours):
        write_sound_clip(root / f"{colour}.mp4", tone_hz=tone, colour=colour)
    return root


def _run(out: Path, data: Path, *extra: str) -> list[str]:
    return diffusion_train_args("quickstart_ltx2.yaml", out, f"data.path={data}", "sample.prompts=[]", *extra)


def test_clips_with_sound_train_both_branches_and_the_lora_loads_in_ltx2_pipeline(tmp_path, run_cli, capsys):
    out = tmp_path / "run"
    assert run_cli(*_run(out, _sound_clips(tmp_path / "clips"), "network.alpha=4", "save.every=2")) == 0
    log = capsys.readouterr().err
    assert "LTX-2: the video and audio branches train (audio on clips with a soundtrack, at the video's sigma" in log
    assert "audio (data.audio=auto): 2 clips with a soundtrack train the audio branch too, 0 without one" in log
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 2 and all(np.isfinite(losses))
    weights = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    modules = {k.rsplit(".lora_", 1)[0] for k in weights}
    # each of the 2 blocks: both streams' self-attention and text cross-attention (q, k, v, out) and feed-forward
    assert len(modules) == 2 * 20 and len(weights) == 2 * len(modules)
    assert "diffusion_model.transformer_blocks.1.audio_attn1.to_q" in modules
    assert "diffusion_model.transformer_blocks.0.audio_ff.net.2" in modules
    assert weights["diffusion_model.transformer_blocks.0.audio_ff.net.2.lora_B.weight"].shape == (8, 8)

    # The trained PEFT model against a fresh pipeline that loaded the file: the audio stream's output too.
    from test_ltx2 import _transformer_inputs

    adapter = _trained(out)
    pipe = _pipeline()
    inputs = _transformer_inputs(pipe)
    with torch.no_grad():
        _, base_audio = pipe.transformer(**inputs)
        pipe.load_lora_weights(str(out / "final"))
        loaded_video, loaded_audio = pipe.transformer(**inputs)
        trained_video, trained_audio = adapter.pipe.transformer(**inputs)
    assert (trained_audio - base_audio).abs().max() > 1e-3
    torch.testing.assert_close(loaded_audio, trained_audio, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loaded_video, trained_video, rtol=1e-5, atol=1e-6)

    # The audio LTX2Pipeline makes (audio VAE and vocoder) changes with the LoRA.
    call = dict(prompt=PROMPT, num_inference_steps=2, guidance_scale=1.0, width=64, height=64, num_frames=9,
                frame_rate=24.0, use_cross_timestep=False, output_type="np")
    with torch.no_grad():
        with_lora = pipe(**call, generator=torch.Generator("cpu").manual_seed(1)).audio
        pipe.disable_lora()
        without = pipe(**call, generator=torch.Generator("cpu").manual_seed(1)).audio
    with_lora, without = (torch.as_tensor(np.asarray(a, dtype=np.float32)) for a in (with_lora, without))
    assert with_lora.shape == without.shape and with_lora.numel() > 0
    assert (with_lora - without).abs().max() > 1e-4


def _first_loss(tmp_path: Path, data: Path, *extra: str):
    adapter, dataset = adapter_for("quickstart_ltx2.yaml", tmp_path, f"data.path={data}", *extra)
    batch = dataset.collate([0, 1])
    torch.manual_seed(7)
    with torch.no_grad():
        return mean_loss(adapter, batch).item(), batch


@pytest.mark.parametrize("audio, changes", [("auto", True), ("off", False)])
def test_only_the_soundtrack_changing_changes_the_loss_unless_audio_is_off(tmp_path, audio, changes):
    """The same frames with a 440 Hz or an 880 Hz tone: the same video latents; the loss differs with data.audio=auto
    (the audio loss, and the video attending to the audio), and is the same, bit for bit, with off."""
    a = _sound_clips(tmp_path / "a", tones=(440.0, 440.0))
    b = _sound_clips(tmp_path / "b", tones=(880.0, 440.0))  # red: 880 Hz, blue as in a
    loss_a, batch_a = _first_loss(tmp_path / "run_a", a, f"data.audio={audio}")
    loss_b, batch_b = _first_loss(tmp_path / "run_b", b, f"data.audio={audio}")
    assert torch.equal(batch_a["latents"], batch_b["latents"])
    assert ("audio_latents" in batch_a) == changes
    if changes:
        assert batch_a["has_audio"].tolist() == [1.0, 1.0]
        blue, red = 0, 1  # the clips in name order; red's tone differs
        assert not torch.equal(batch_a["audio_latents"][red], batch_b["audio_latents"][red])
        assert torch.equal(batch_a["audio_latents"][blue], batch_b["audio_latents"][blue])
        assert abs(loss_a - loss_b) > 1e-4
    else:
        assert loss_a == loss_b


def test_audio_loss_weight_scales_the_audio_term(tmp_path):
    """train.audio_loss_weight=0 gives the video loss alone; the loss at weight 2 is the video loss + 2 x audio."""
    clips = _sound_clips(tmp_path / "clips")
    losses = {w: _first_loss(tmp_path / f"w{w}", clips, f"train.audio_loss_weight={w}")[0] for w in (0, 1, 2)}
    audio = losses[1] - losses[0]
    assert audio > 0 and losses[2] == pytest.approx(losses[0] + 2 * audio, rel=1e-5)


def test_clips_without_sound_keep_the_video_only_step(tmp_path, capsys):
    """auto with one clip silent: that clip's audio latents are zeros and outside the loss (has_audio 0); a dataset
    without any soundtrack trains as before: no audio keys, the video-only LoRA targets."""
    clips = _sound_clips(tmp_path / "mixed", tones=(440.0, None))
    adapter, dataset = adapter_for("quickstart_ltx2.yaml", tmp_path / "run", f"data.path={clips}")
    assert "audio (data.audio=auto): 1 clip with a soundtrack train the audio branch too, 1 without one" in \
        capsys.readouterr().err
    batch = dataset.collate([0, 1])
    has = dict(zip((item.path.name for item in dataset.items), batch["has_audio"].tolist()))
    assert has == {"blue.mp4": 0.0, "red.mp4": 1.0}
    silent = [i for i, item in enumerate(dataset.items) if item.path.name == "blue.mp4"][0]
    assert not batch["audio_latents"][silent].any() and batch["audio_latents"][1 - silent].abs().sum() > 0
    losses = []
    for latents in (batch["audio_latents"][silent], torch.randn(batch["audio_latents"].shape[1:])):
        batch["audio_latents"][silent] = latents  # the silent clip's audio is pure noise whatever its latents say
        torch.manual_seed(3)
        with torch.no_grad():
            losses.append(mean_loss(adapter, batch).item())
    assert losses[0] == losses[1]
    silent_only = _sound_clips(tmp_path / "silent", tones=(None, None))
    adapter, dataset = adapter_for("quickstart_ltx2.yaml", tmp_path / "run2", f"data.path={silent_only}")
    assert not adapter.trains_audio and "has_audio" not in dataset.collate([0, 1])
    assert not any("audio" in name for name, _ in adapter.pipe.transformer.named_modules() if "lora_A" in name)


def test_required_names_the_clip_without_sound(tmp_path, run_cli, capsys):
    clips = _sound_clips(tmp_path / "clips", tones=(440.0, None))
    assert run_cli(*_run(tmp_path / "run", clips, "data.audio=required")) == 2
    err = capsys.readouterr().err
    assert f"data.audio: {clips / 'blue.mp4'} has no soundtrack, and data.audio is required" in err
    assert "fix: " in err and "Traceback" not in err


def test_resume_with_audio_is_bit_identical(tmp_path, run_cli):
    clips = _sound_clips(tmp_path / "clips")
    full = tmp_path / "full"
    assert run_cli(*_run(full, clips, "save.every=1")) == 0
    resumed = tmp_path / "resumed"
    assert run_cli(*_run(resumed, clips, "save.every=1", f"train.resume={full / 'checkpoints' / 'step-000001'}")) == 0
    assert [r["loss"] for r in read_metrics(resumed)] == [r["loss"] for r in read_metrics(full)][1:]
    a, b = (load_file(str(run / "final" / "pytorch_lora_weights.safetensors")) for run in (full, resumed))
    assert any("audio_attn" in k for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_audio_cache_key_follows_the_audio_settings(tmp_path, capsys):
    """The clips' cached entries are used again with the same settings and encoded again when the audio's length
    (train.frame_rate) or data.audio changes."""
    clips = _sound_clips(tmp_path / "clips")
    said = []
    for n, extra in enumerate([(), (), ("train.frame_rate=12",), ("data.audio=off",)]):
        adapter_for("quickstart_ltx2.yaml", tmp_path / f"run{n}", f"data.path={clips}", *extra)
        said.append([line for line in capsys.readouterr().err.splitlines() if line.startswith("latents:")][-1])
    assert said == ["latents: 0 cached, 2 encoded", "latents: 2 cached, 0 encoded", "latents: 0 cached, 2 encoded",
                    "latents: 0 cached, 2 encoded"]


def test_soundtrack_and_spectrogram(tmp_path):
    """The soundtrack read from the mp4 is the tone (its spectrum peaks at 440 Hz), cut from the clip's first frame;
    LTX-2's log-mel is transformers' spectrogram() with the same settings (Slaney mel, magnitude, centred)."""
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    from toolkit.data.audio import MelSetup, frame_span, log_mel, read_soundtrack
    from toolkit.data.video import ClipItem

    path = write_sound_clip(tmp_path / "tone.mp4", tone_hz=440.0)
    item = ClipItem(path, "", (64, 64), 9, (64, 64, 9), "x", frames=tuple(range(3, 9)))
    assert frame_span(item) == (pytest.approx(3 / 24), pytest.approx(6 / 24))
    wave = read_soundtrack(path, 0.0, 8000, 16000)
    assert wave.shape == (2, 8000) and torch.equal(wave[0], wave[1])  # mono on both channels
    spectrum = torch.fft.rfft(wave[0, 2000:]).abs()
    assert abs(spectrum.argmax().item() * 16000 / 6000 - 440) < 16000 / 6000
    setup = MelSetup(16000, 160, 8)
    mel = log_mel(wave, setup)
    assert mel.shape == (2, 8000 // 160 + 1, 8)
    filters = mel_filter_bank(num_frequency_bins=513, num_mel_filters=8, min_frequency=0.0, max_frequency=8000.0,
                              sampling_rate=16000, norm="slaney", mel_scale="slaney")
    expected = spectrogram(wave[0].numpy(), window_function(1024, "hann"), frame_length=1024, hop_length=160,
                           power=1.0, center=True, pad_mode="reflect", mel_filters=filters, mel_floor=1e-5,
                           log_mel="log")
    torch.testing.assert_close(mel[0], torch.from_numpy(expected.T).float(), rtol=1e-4, atol=1e-3)


def test_comfyui_maps_the_audio_branch_onto_its_ltx2_model(tmp_path, run_cli):
    """ComfyUI's LoRA loader on its own LTXAV model (test_ltx2's check): every module of an all-linear file trained
    with sound, both streams and both audio-video cross-attentions, lands on a weight of the same shape and moves it
    by what diffusers' load_lora_weights + fuse_lora moves it by."""
    import json
    import subprocess
    import sys

    from safetensors.torch import save_file

    from test_ltx2 import COMFYUI_CHECK, COMFYUI_MIRROR, _comfyui_tree

    if not Path(COMFYUI_MIRROR).is_dir():
        pytest.skip("no ComfyUI mirror on this machine")
    comfy = tmp_path / "comfyui"
    _comfyui_tree(comfy)
    out = tmp_path / "run"
    assert run_cli(*_run(out, _sound_clips(tmp_path / "clips"), "network.alpha=4",
                         "network.target_modules=all-linear")) == 0
    lora = out / "final" / "pytorch_lora_weights.safetensors"
    names = {k.rsplit(".lora_", 1)[0].split(".", 3)[-1] for k in load_file(str(lora))}
    assert {"audio_attn1.to_q", "audio_attn2.to_k", "video_to_audio_attn.to_v", "audio_ff.net.0.proj"} <= names
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
    assert found["loaded"] == found["keys"] // 2 == 2 * 28  # 6 attentions x 4 projections + 2 feed-forwards x 2
    for name, delta in found["deltas"].items():
        expected = modules[name].base_layer.weight.detach() - before[f"{name}.weight"]
        assert expected.abs().max() > 0
        torch.testing.assert_close(torch.tensor(delta), expected, rtol=1e-4, atol=1e-7)


def test_uncached_latents_encode_the_soundtrack_in_the_step(tmp_path):
    """data.cache_latents=false: the batch carries the spectrogram and the step encodes it; the loss is the cached
    run's."""
    clips = _sound_clips(tmp_path / "clips")
    cached, _ = _first_loss(tmp_path / "cached", clips)
    uncached, batch = _first_loss(tmp_path / "uncached", clips, "data.cache_latents=false")
    assert "audio_latents" not in batch and batch["audio_mel"].shape == (2, 2, 33, 8)
    assert uncached == pytest.approx(cached, rel=1e-5)
