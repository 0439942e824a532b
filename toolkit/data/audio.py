"""A clip's soundtrack for the audio-video family (LTX-2): read with PyAV from the container, resampled by FFmpeg's
resampler (PyAV's AudioResampler) to the audio VAE's rate in stereo, cut to the time span of the clip's frames, and
turned into the log-mel spectrogram LTX-2's audio VAE encodes.

The spectrogram is LTX-2's (Lightricks' ltx-core AudioProcessor, which the LTX-2 trainer encodes audio with):
torchaudio's MelSpectrogram with n_fft = win_length = 1024, a periodic Hann window, centred frames with reflect
padding, magnitude (power 1), f_min 0, f_max half the sample rate, Slaney mel scale and norm, then
log(max(x, 1e-5)); the sample rate, hop and mel bins are the audio VAE's config. torchaudio is not a dependency
here: torch.stft and transformers' mel_filter_bank (the same Slaney filters) compute it.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from toolkit.data.video import CONTAINER_EXTS, ClipItem, _import_av, frame_indices

N_FFT = 1024  # LTX-2's STFT size (ltx-core's AudioProcessor)
LOG_FLOOR = 1e-5


@dataclass(frozen=True)
class MelSetup:
    """The audio VAE's spectrogram: its sample rate, hop and mel bins (AutoencoderKLLTX2Audio's config)."""

    sample_rate: int
    hop_length: int
    mel_bins: int
    n_fft: int = N_FFT

    def key_parts(self) -> tuple:
        return ("audio", self.sample_rate, self.hop_length, self.mel_bins, self.n_fft)


def has_soundtrack(path: Path) -> bool:
    """Whether the file is a container with an audio stream (gif, webp and images have none)."""
    if Path(path).suffix.lower() not in CONTAINER_EXTS:
        return False
    av = _import_av(Path(path))
    try:
        with av.open(str(path)) as container:
            return bool(container.streams.audio)
    except av.FFmpegError:
        return False


def frame_span(item: ClipItem) -> tuple[float, float]:
    """(start, duration) in seconds of the clip's frames in the video: from its first frame's time to the end of its
    last frame, at the video stream's average frame rate."""
    av = _import_av(item.path)
    with av.open(str(item.path)) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or Fraction(24)
    indices = list(item.frames) or frame_indices(item.frame_count, item.bucket[2])
    return float(indices[0] / rate), float((indices[-1] + 1 - indices[0]) / rate)


def read_soundtrack(path: Path, start: float, samples: int, sample_rate: int) -> torch.Tensor:
    """(2, samples) float32: the first audio stream from `start` seconds, resampled to `sample_rate` in stereo (a mono
    track on both channels), `samples` long; what the file holds less is silence."""
    av = _import_av(Path(path))
    resampler = av.AudioResampler(format="fltp", layout="stereo", rate=sample_rate)
    skip, chunks, have = round(start * sample_rate), [], 0
    with av.open(str(path)) as container:
        for frame in container.decode(container.streams.audio[0]):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray())
                have += chunks[-1].shape[1]
            if have >= skip + samples:
                break
        else:
            chunks += [out.to_ndarray() for out in resampler.resample(None)]  # flush FFmpeg's resampler
    audio = np.concatenate(chunks, axis=1)[:, skip:skip + samples] if chunks else np.zeros((2, 0), np.float32)
    waveform = torch.zeros(2, samples)
    waveform[:, :audio.shape[1]] = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    return waveform


def log_mel(waveform: torch.Tensor, setup: MelSetup) -> torch.Tensor:
    """(channels, samples) -> (channels, frames, mel_bins): LTX-2's log-mel spectrogram, frames = samples // hop + 1."""
    from transformers.audio_utils import mel_filter_bank

    window = torch.hann_window(setup.n_fft, dtype=torch.float32)
    spec = torch.stft(waveform.float(), setup.n_fft, hop_length=setup.hop_length, win_length=setup.n_fft,
                      window=window, center=True, pad_mode="reflect", return_complex=True).abs()
    filters = mel_filter_bank(num_frequency_bins=setup.n_fft // 2 + 1, num_mel_filters=setup.mel_bins,
                              min_frequency=0.0, max_frequency=setup.sample_rate / 2, sampling_rate=setup.sample_rate,
                              norm="slaney", mel_scale="slaney")
    mel = torch.einsum("cft,fm->ctm", spec, torch.from_numpy(filters).float())
    return torch.log(mel.clamp(min=LOG_FLOOR))
