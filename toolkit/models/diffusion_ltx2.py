"""The `ltx2` family (Lightricks/LTX-2, diffusers LTX2Pipeline): PEFT LoRA on LTX-2's audio-video transformer
(LTX2VideoTransformer3DModel), text-to-video: the video branch, and the audio branch on clips with a soundtrack.

- Clips (toolkit.data.video, as the Wan families) are encoded by the LTX-2 video VAE (time / 8, space / 32) and
  normalised as the pipeline's _normalize_latents does: (x - latents_mean) * scaling_factor / latents_std. The
  VAE compresses time by 8, so clips train on 8k+1 frames (data.num_frames must be 8k+1; a shorter clip trains on
  the largest 8k+1 it holds; images are 1-frame clips), and bucket sides must be multiples of the VAE's spatial
  factor. Latents enter the transformer as the pipeline packs them (_pack_latents: one token per latent pixel).
- Text: Gemma 3's hidden states of every layer (the pipeline's encode_prompt, left padding, max_text_tokens = the
  pipeline's 1024) go through the pipeline's text connectors, which give the video and the audio stream each their
  own text tokens and a mask; the connectors' outputs are what is cached, so both Gemma 3 and the connectors are
  freed after caching. Samples hand the cached tokens to LTX2Pipeline through a stand-in for its connectors
  (CachedConnectors), so they are what training saw.
- Timesteps: logit-normal sigmas with the pipeline's resolution-dependent shift (mu from the number of video tokens,
  between the scheduler's base_shift and max_shift, applied as exp(mu)); the transformer takes 1000 * sigma.
- Audio (data.audio: auto, required, off), as Lightricks' LTX-2 trainer trains audio and video together: a clip's
  soundtrack (toolkit/data/audio.py: PyAV, resampled to the audio VAE's rate, cut from the clip's first frame,
  LTX-2's log-mel spectrogram) is encoded by the audio VAE (mode), packed and normalised as the pipeline's
  prepare_audio_latents does, and cached with the clip's latents; its length is the pipeline's for the clip's frames
  at train.frame_rate (audio_tokens). It is noised at the video's sigma (one shared timestep, as the LTX-2 trainer
  does), the audio branch predicts its velocity (noise - latents), and the step's loss is the video loss plus
  train.audio_loss_weight times the audio loss. A clip without a soundtrack (and an image), or every clip with
  data.audio=off, gets today's video-only step: the audio stream pure noise at sigma 1 (its length as above), so
  the video tokens attend to audio that says nothing, its prediction outside the loss. The eval loss is the video's.
- LoRA targets: the video stream's self-attention, text cross-attention and feed-forward layers of every block,
  and when audio trains (a soundtrack in the data, data.audio not off) the audio stream's; all-linear adds the
  audio-to-video cross-attention (video queries) and, when audio trains, the video-to-audio one. The file has the
  original LTX-2 names under `diffusion_model.`, the scale folded into lora_A (lora_export.ltx2_keys): ComfyUI reads
  them, and LTX2Pipeline.load_lora_weights converts them.
- Low memory: model.quantize=fp8 quantizes the blocks' linear layers, model.block_swap streams whole blocks
  (LTX2VideoTransformerBlock; diffusers lists them as the model's _repeated_blocks, which the adapter names as its
  _no_split_modules, the list the toolkit's block code reads).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from toolkit.data.audio import MelSetup, has_soundtrack
from toolkit.data.augment import View
from toolkit.data.datasets import dataset_settings
from toolkit.errors import UserError
from toolkit.models.diffusion_base import Denoiser, DiffusionAdapter
from toolkit.models.diffusion_flow import FlowMatching
from toolkit.models.flow_matching import SigmaSampler, flux_mu
from toolkit.models.lora import target_modules
from toolkit.models.lora_export import ltx2_keys
from toolkit.models.objectives import Noised, per_sample_mse

_BLOCK = r"transformer_blocks\.\d+\."
_PROJECTIONS = r"\.(to_q|to_k|to_v|to_out\.0)"
_FEED_FORWARD = _BLOCK + r"ff\.net\.(0\.proj|2)"
LTX2_TARGETS = f"{_BLOCK}(attn1|attn2){_PROJECTIONS}|{_FEED_FORWARD}"
LTX2_ALL_LINEAR = f"{_BLOCK}(attn1|attn2|audio_to_video_attn){_PROJECTIONS}|{_FEED_FORWARD}"
_AUDIO_FEED_FORWARD = _BLOCK + r"(audio_)?ff\.net\.(0\.proj|2)"
LTX2_AUDIO_TARGETS = f"{_BLOCK}(audio_)?(attn1|attn2){_PROJECTIONS}|{_AUDIO_FEED_FORWARD}"  # both streams
LTX2_AUDIO_ALL_LINEAR = (f"{_BLOCK}((audio_)?(attn1|attn2)|audio_to_video_attn|video_to_audio_attn){_PROJECTIONS}"
                         f"|{_AUDIO_FEED_FORWARD}")
AUDIO_SIGMA = 1.0  # the untrained audio stream: pure noise


def audio_mode(data) -> str:
    """data.audio as auto, off or required (YAML reads a bare `off` as false)."""
    value = data.get("audio", "off")
    return "off" if value is False or value == "off" else str(value)


class CachedConnectors(torch.nn.Module):
    """Stands in for LTX2Pipeline's `connectors` while sampling: the pipeline passes the prompt tokens it was given
    (the cached video and audio tokens side by side, see LTX2Adapter.generate) and gets them back split, with the
    cached mask. The pipeline concatenates negative and positive prompts before calling it; so does the split."""

    def __init__(self, video_width: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.video_width = video_width
        self.device, self.dtype = device, dtype  # what the pipeline asks of its components

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor, padding_side: str = "left", **_) -> tuple:
        return embeds[..., :self.video_width], embeds[..., self.video_width:], mask


class LTX2Adapter(FlowMatching, DiffusionAdapter):
    text_encoder_names = ("text_encoder", "connectors")  # both only make the cached text tokens
    text_keys = ("prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask")
    max_text_tokens = 1024  # the pipeline's default: the connectors' registers fill the padding up to it
    transformer_key_style = staticmethod(ltx2_keys)
    audio_generator: torch.Generator | None = None  # the eval loss's audio noise (loss_at); None: the training streams
    trains_audio = False  # set by setup_training: data.audio is not off and the data has a soundtrack
    audio_loss: torch.Tensor | None = None  # the step's per-sample audio loss, left by predict for loss()

    def pipeline_class(self):
        from diffusers import LTX2Pipeline

        return LTX2Pipeline

    def lora_target_modules(self) -> list[str] | str:
        if self.trains_audio:
            return target_modules(self.cfg.network.target_modules, LTX2_AUDIO_TARGETS, LTX2_AUDIO_ALL_LINEAR)
        return target_modules(self.cfg.network.target_modules, LTX2_TARGETS, LTX2_ALL_LINEAR)

    def audio_in_data(self) -> bool:
        """Whether the audio branch trains: some dataset has data.audio=required, or auto and a video with a soundtrack
        in its folder."""
        for dataset in dataset_settings(self.cfg.data):
            mode, root = audio_mode(dataset.section), dataset.section.get("path")
            if mode == "required":
                return True
            folder = Path(root) if root else None
            if mode == "auto" and folder and folder.is_dir() and any(map(has_soundtrack, sorted(folder.iterdir()))):
                return True
        return False

    def setup_training(self) -> None:
        transformer = self.pipe.transformer
        transformer._no_split_modules = list(transformer._repeated_blocks)  # the blocks the toolkit's block code finds
        super().setup_training()
        config = self.pipe.scheduler.config
        self.shift_range = (config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                            config.get("base_shift", 0.95), config.get("max_shift", 2.05))
        self.dynamic_shift = self.cfg.train.flow_shift == "auto" and config.get("use_dynamic_shifting", False)
        self.shift = self.configured_shift(config.get("shift", 1.0))
        # LTX-2.3 (cross-attention modulation) reads the other stream's sigma in its audio-video cross-attention
        self.cross_timestep = bool(transformer.config.cross_attn_mod or transformer.config.audio_cross_attn_mod)
        vae = self.pipe.vae
        self.time_factor, self.space_factor = vae.temporal_compression_ratio, vae.spatial_compression_ratio
        audio = self.pipe.audio_vae.config
        self.mel = MelSetup(audio.sample_rate, audio.mel_hop_length, audio.mel_bins)
        self.trains_audio = self.audio_in_data()
        self.log(f"flow matching: {self.timestep_sampling} sigmas, "
                 + ("shifted by the number of video tokens (the scheduler's dynamic shift)" if self.dynamic_shift
                    else f"shifted by {self.shift:g}")
                 + ("; LTX-2: the video and audio branches train (audio on clips with a soundtrack, at the video's "
                    f"sigma, weight {self.cfg.train.audio_loss_weight:g})" if self.trains_audio else
                    "; LTX-2: the video branch trains, the audio stream is pure noise at sigma 1"))

    def sampler_for(self, latents: torch.Tensor) -> SigmaSampler:
        """The pipeline's shift: mu from the video tokens (frames x height x width of the packed latents)."""
        if not self.dynamic_shift:
            return self.sigma_sampler(shift=self.shift)
        config = self.pipe.transformer.config
        tokens = (latents.shape[2] // config.patch_size_t) * (latents.shape[3] // config.patch_size) * (
            latents.shape[4] // config.patch_size)
        return self.sigma_sampler(mu=flux_mu(tokens, *self.shift_range))

    # -- data ------------------------------------------------------------------------------
    def scan(self, data, log) -> list:
        """The clips as the Wan families scan them, each trained on its largest 8k+1 frames (the VAE's time / 8)."""
        from toolkit.data.video import scan_clips

        t, s = self.time_factor, self.space_factor
        scanned = scan_clips(data, log, time_compression=t)
        items = [dataclasses.replace(item, bucket=(*item.bucket[:2], (item.bucket[2] - 1) // t * t + 1))
                 for item in scanned]
        shortened = sum(a.bucket[2] != b.bucket[2] for a, b in zip(scanned, items))
        if shortened:
            log(f"frames: {shortened} clip{'s' if shortened > 1 else ''} shorter than data.num_frames train on the "
                f"largest {t}k+1 frames they hold, not the 4k+1 above")
        uneven = sorted({item.bucket[:2] for item in items if item.bucket[0] % s or item.bucket[1] % s})
        if uneven:
            w, h = uneven[0]
            raise UserError(f"data.bucket_step: the bucket {w}x{h} is not a multiple of {s} px (the LTX-2 VAE's "
                            f"spatial factor)\n  fix: set data.bucket_step to {s} or a multiple of it")
        return self.with_soundtracks(data, items, log) if self.trains_audio else items

    def with_soundtracks(self, data, items: list, log) -> list:
        """The items marked with whether their file has a soundtrack (data.audio auto), or a UserError naming the
        first file without one (required)."""
        mode = audio_mode(data)
        if mode == "off":
            return items
        found = {path: has_soundtrack(path) for path in dict.fromkeys(item.path for item in items)}
        silent = [path for path, sound in found.items() if not sound]
        if mode == "required" and silent:
            more = f" (and {len(silent) - 1} more)" if len(silent) > 1 else ""
            raise UserError(f"data.audio: {silent[0]} has no soundtrack{more}, and data.audio is required\n"
                            "  fix: give it an audio stream (mp4/mkv/webm/mov), remove it, or set data.audio: auto "
                            "(clips without sound train the video alone)")
        # a 1-frame clip (a video that short) has no audio latent beyond the causal VAE's first: video alone
        items = [dataclasses.replace(item, soundtrack=found[item.path] and item.bucket[2] > 1) for item in items]
        sound = sum(item.soundtrack for item in items)
        log(f"audio (data.audio={mode}): {sound} clip{'s' if sound != 1 else ''} with a soundtrack train the "
            f"audio branch too, {len(items) - sound} without one the video alone")
        return items

    def load_item(self, item, view: View) -> dict[str, torch.Tensor]:
        from toolkit.data.video import load_clip

        loaded = {"pixels": load_clip(item, view), "crop": torch.tensor(view.top_left)}
        if self.trains_audio:
            loaded["audio_mel"] = self.soundtrack_mel(item)
            loaded["has_audio"] = torch.tensor(float(item.soundtrack))
        return loaded

    def soundtrack_mel(self, item) -> torch.Tensor:
        """The clip's soundtrack as LTX-2's log-mel spectrogram (2, mel frames, mel bins): from its first frame's
        time, as long as its frames last, fitted to the pipeline's audio length for its frames (audio_tokens): cut,
        or padded with silence. A clip without one: zeros (never in the loss)."""
        from toolkit.data.audio import frame_span, log_mel, read_soundtrack

        tokens = self.audio_tokens((item.bucket[2] - 1) // self.time_factor + 1)
        samples = (tokens - 1) * self.pipe.audio_vae_temporal_compression_ratio * self.mel.hop_length  # causal VAE
        if not item.soundtrack:
            return torch.zeros(2, samples // self.mel.hop_length + 1, self.mel.mel_bins)
        start, duration = frame_span(item)
        waveform = read_soundtrack(item.path, start, min(samples, round(duration * self.mel.sample_rate)),
                                   self.mel.sample_rate)
        return log_mel(torch.nn.functional.pad(waveform, (0, samples - waveform.shape[1])), self.mel)

    def encode_view(self, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoded = super().encode_view(loaded)
        if "audio_mel" in loaded:
            encoded["audio_latents"] = self.encode_audio(loaded["audio_mel"][None], loaded["has_audio"][None])[0]
            encoded["has_audio"] = loaded["has_audio"]
        return encoded

    def latent_key_parts(self, item) -> tuple:
        """With audio: the spectrogram's settings and the frame rate that sets the audio's length."""
        return (*self.mel.key_parts(), float(self.cfg.train.frame_rate)) if self.trains_audio else ()

    def encode_audio(self, mel: torch.Tensor, has_audio: torch.Tensor) -> torch.Tensor:
        """Log-mel spectrograms [B, 2, T, mel] to the audio latents the transformer takes [B, L, C * mel / 4]: the
        audio VAE's mode, packed and normalised as LTX2Pipeline.prepare_audio_latents does; zeros where a clip has no
        soundtrack."""
        from diffusers import LTX2Pipeline

        vae = self.pipe.audio_vae.to(self.runtime.device)
        with torch.no_grad():
            latents = vae.encode(mel.to(self.runtime.device, vae.dtype)).latent_dist.mode()
        packed = LTX2Pipeline._normalize_audio_latents(LTX2Pipeline._pack_audio_latents(latents), vae.latents_mean,
                                                       vae.latents_std)
        return packed * has_audio.to(packed).view(-1, 1, 1)

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
        return (latents - mean) * vae.config.scaling_factor / std

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """The connectors' video and audio text tokens [B, 1024, width] and their mask [B, 1024] (1 = attended)."""
        pipe = self.pipe
        embeds, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, device=self.runtime.device,
                                                max_sequence_length=self.max_text_tokens)
        video, audio, mask = pipe.connectors(embeds.to(pipe.connectors.dtype), mask,
                                             padding_side=pipe.tokenizer.padding_side)
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": mask}

    # -- loss ------------------------------------------------------------------------------
    def audio_tokens(self, latent_frames: int) -> int:
        """The audio stream's length for a clip of `latent_frames`, as the pipeline computes it from the duration."""
        pipe = self.pipe
        frames = (latent_frames - 1) * self.time_factor + 1
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return max(1, round(frames / self.cfg.train.frame_rate * per_second))

    def audio_noise(self, batch: int, latent_frames: int, device: torch.device) -> torch.Tensor:
        """Pure noise for the untrained audio stream, packed as the pipeline packs audio latents [B, L, C * mel]."""
        config, pipe = self.pipe.audio_vae.config, self.pipe
        width = config.latent_channels * (config.mel_bins // pipe.audio_vae_mel_compression_ratio)
        shape = (batch, self.audio_tokens(latent_frames), width)
        if self.audio_generator is not None:
            return torch.randn(shape, generator=self.audio_generator).to(device)
        return torch.randn(shape, device=device)

    def loss_at(self, name: str, batch: dict[str, Any], latents: torch.Tensor, cond: dict[str, torch.Tensor],
                noise: torch.Tensor, level: float) -> torch.Tensor:
        """The eval loss (diffusion_eval.py): the audio stream's noise too is drawn from a generator seeded by eval.seed
        and the level, so that evaluating touches none of the training's random streams."""
        self.audio_generator = torch.Generator("cpu").manual_seed(int(self.cfg.eval.seed) * 1000 + round(level * 999))
        try:
            return super().loss_at(name, batch, latents, cond, noise, level)
        finally:
            self.audio_generator = None

    def loss(self, batch: dict[str, Any], modules) -> torch.Tensor:
        """The video loss plus train.audio_loss_weight times the audio loss of the clips with a soundtrack (predict
        leaves it in audio_loss)."""
        self.audio_loss = None
        total = super().loss(batch, modules)
        audio, self.audio_loss = self.audio_loss, None
        if audio is None:
            return total
        if "loss_weight" in batch:
            audio = audio * self.to_device(batch["loss_weight"])
        return total + self.cfg.train.audio_loss_weight * audio.sum()

    def predict(self, denoiser: Denoiser, noised: Noised, cond: dict[str, torch.Tensor],
                batch: dict[str, Any]) -> torch.Tensor:
        """The transformer on the packed video latents at timestep 1000 * sigma, the audio stream at the same sigma
        for clips with a soundtrack (training), else pure noise at sigma 1; the video velocity comes back unpacked.
        The audio branch's loss against its velocity (noise - latents) is left in audio_loss for loss()."""
        from diffusers import LTX2Pipeline

        b, _, f, h, w = noised.noisy.shape
        dtype, device, config = denoiser.dtype, noised.noisy.device, denoiser.config
        p, pt = config.patch_size, config.patch_size_t
        timestep = (noised.t * 1000).to(dtype)
        audio_timestep = torch.full_like(timestep, AUDIO_SIGMA * 1000)
        sounding = self.trains_audio and "has_audio" in batch and self.audio_generator is None
        if sounding:
            clean = (self.to_device(batch["audio_latents"]) if "audio_latents" in batch else
                     self.encode_audio(batch["audio_mel"], batch["has_audio"])).float()
            has = self.to_device(batch["has_audio"]).float().view(-1, 1, 1)
            noise = torch.randn_like(clean)
            sigma = noised.t.float().view(-1, 1, 1) * has + (1 - has) * AUDIO_SIGMA  # no soundtrack: pure noise
            audio = (1 - sigma) * clean + sigma * noise
            audio_timestep = (sigma.view(-1) * 1000).to(dtype)
        else:
            audio = self.audio_noise(b, f, device)
        mask = cond["prompt_attention_mask"]
        video, audio_velocity = denoiser.forward(
            hidden_states=LTX2Pipeline._pack_latents(noised.noisy.to(dtype), p, pt),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            audio_encoder_hidden_states=cond["audio_prompt_embeds"].to(dtype), timestep=timestep,
            audio_timestep=audio_timestep, sigma=timestep, audio_sigma=audio_timestep, encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask, num_frames=f // pt, height=h // p, width=w // p,
            fps=float(self.cfg.train.frame_rate), audio_num_frames=audio.shape[1],
            use_cross_timestep=self.cross_timestep, return_dict=False)
        if sounding and self.audio_loss is None:  # the step's own prediction (not output preservation's)
            self.audio_loss = per_sample_mse(audio_velocity, noise - clean) * has.view(-1)
        return LTX2Pipeline._unpack_latents(video, f // pt, h // p, w // p, p, pt)

    # -- sampling --------------------------------------------------------------------------
    @contextmanager
    def _cached_connectors(self, width: int):
        saved = self.pipe.connectors
        self.pipe.connectors = CachedConnectors(width, self.runtime.device, self.pipe.transformer.dtype)
        try:
            yield
        finally:
            self.pipe.connectors = saved

    def generate(self, prompt: str, seed: int) -> list:
        """LTX2Pipeline from the cached text tokens (video and audio side by side, split again by CachedConnectors),
        at sample.fps; the audio it makes along is not written."""
        text, negative = self.embeddings_for(prompt), self.embeddings_for(self.cfg.sample.negative_prompt)

        def joined(t):
            return torch.cat([t["prompt_embeds"], t["audio_prompt_embeds"].to(t["prompt_embeds"].dtype)], dim=-1)

        frames = self.cfg.sample.num_frames or self.cfg.data.num_frames
        with self._cached_connectors(text["prompt_embeds"].shape[-1]):
            out = self.pipeline_call(seed, prompt_embeds=joined(text),
                                     prompt_attention_mask=text["prompt_attention_mask"],
                                     negative_prompt_embeds=joined(negative),
                                     negative_prompt_attention_mask=negative["prompt_attention_mask"],
                                     num_frames=frames, frame_rate=float(self.cfg.sample.fps),
                                     use_cross_timestep=self.cross_timestep, max_sequence_length=self.max_text_tokens,
                                     output_type="pil")
        return list(out.frames[0])
