"""Audio preprocessing for Voxtral, as transformers' VoxtralProcessor does it with its
WhisperFeatureExtractor: a clip is padded with silence to whole windows (30 s by default),
turned into one Whisper log-mel spectrogram, and cut into the windows the encoder takes.
Also `read_wav`, which decodes a PCM WAV file into the 16 kHz mono samples the processor takes,
and `clip_samples`, which takes them from the forms a caller hands a clip in. numpy and the
standard library only.
"""

from __future__ import annotations

import io
import math
import re
import struct
import wave
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

SAMPLE_RATE = 16000
# Mel filters span 0 Hz to the Nyquist frequency of 16 kHz audio.
_MAX_FREQUENCY = 8000.0
# Frames per FFT batch: bounds the memory a long clip's spectrogram takes.
_FFT_BATCH = 4096


class Frames(Protocol):
    """What the processor reads of its encoder's config (`audio.AudioConfig`)."""

    @property
    def num_mel_bins(self) -> int: ...

    @property
    def frames_per_window(self) -> int: ...


@dataclass(frozen=True)
class AudioProcessor:
    num_mel_bins: int
    n_fft: int
    hop_length: int
    window_samples: int  # samples per encoder window
    padding_value: float = 0.0

    @classmethod
    def from_config(cls, config: dict[str, Any], audio: Frames) -> AudioProcessor:
        """From a `preprocessor_config.json` dict ({} takes WhisperFeatureExtractor's defaults,
        with the encoder's mel bins)."""
        rate = config.get("sampling_rate", SAMPLE_RATE)
        if rate != SAMPLE_RATE:
            raise ValueError(f"preprocessor_config.json: sampling_rate {rate}, only 16000 is read")
        bins = config.get("feature_size", audio.num_mel_bins)
        if bins != audio.num_mel_bins:
            raise ValueError(
                f"preprocessor_config.json: feature_size {bins}, the encoder takes "
                f"{audio.num_mel_bins} mel bins"
            )
        if config.get("dither", 0.0):
            raise ValueError("preprocessor_config.json: dither (random noise) is not supported")
        hop, n_fft = config.get("hop_length", 160), config.get("n_fft", 400)
        # WhisperFeatureExtractor derives its window from chunk_length (a saved n_samples is
        # that product too, and is ignored as transformers ignores it).
        samples = config.get("chunk_length", 30) * rate
        if samples != int(samples) or samples % hop or samples // hop != audio.frames_per_window:
            raise ValueError(
                f"preprocessor_config.json: windows of {samples} samples at hop {hop} do not "
                f"make the {audio.frames_per_window} mel frames the encoder takes"
            )
        return cls(
            num_mel_bins=bins,
            n_fft=n_fft,
            hop_length=hop,
            window_samples=int(samples),
            padding_value=float(config.get("padding_value", 0.0)),
        )

    @property
    def frames_per_window(self) -> int:
        return self.window_samples // self.hop_length

    def __call__(self, waveform: np.ndarray) -> np.ndarray:
        """Log-mel windows float32 [windows, mel bins, frames_per_window] of mono samples at
        16 kHz; the last window is padded with silence."""
        samples = np.asarray(waveform)
        if samples.ndim != 1:
            raise ValueError(f"audio must be 1-D mono samples, got shape {samples.shape}")
        if not samples.size:
            raise ValueError("audio is empty")
        if not np.issubdtype(samples.dtype, np.floating):
            raise ValueError(f"audio samples must be floats in [-1, 1], got {samples.dtype}")
        if not np.isfinite(samples).all():
            raise ValueError("audio has non-finite samples (NaN or infinity)")
        windows = -(-samples.size // self.window_samples)
        padded = np.full(windows * self.window_samples, self.padding_value, np.float32)
        padded[: samples.size] = samples
        # One spectrogram over the whole clip: frames at window edges see the next window's
        # samples, and the floor below is relative to the clip's loudest point.
        mel = self._log_mel(padded)
        windowed = mel.reshape(self.num_mel_bins, windows, self.frames_per_window)
        return np.ascontiguousarray(windowed.transpose(1, 0, 2))

    def _log_mel(self, samples: np.ndarray) -> np.ndarray:
        """Whisper's log-mel spectrogram [mel bins, len // hop]: centered STFT frames
        (reflect-padded), periodic Hann window, power spectrum, Slaney mel filters, log10
        clamped at 1e-10, floored 8 below the maximum, then (x + 4) / 4."""
        signal = np.pad(samples, self.n_fft // 2, mode="reflect")
        count = samples.size // self.hop_length  # the STFT's last frame is dropped
        frames = sliding_window_view(signal, self.n_fft)[:: self.hop_length][:count]
        window = np.hanning(self.n_fft + 1)[:-1]
        log = np.empty((self.num_mel_bins, count), np.float32)
        # Computed in float64 a batch at a time: a long clip's frames would take gigabytes.
        for start in range(0, count, _FFT_BATCH):
            spectrum = np.fft.rfft(frames[start : start + _FFT_BATCH] * window)
            power = spectrum.real**2 + spectrum.imag**2
            mel = self._mel_filters @ power.T
            log[:, start : start + _FFT_BATCH] = np.log10(np.maximum(mel, 1e-10))
        log = np.maximum(log, log.max() - 8.0)
        return (log + 4.0) / 4.0

    @cached_property
    def _mel_filters(self) -> np.ndarray:
        """Slaney-normalized triangular filters on the Slaney mel scale [mel bins, FFT bins]."""
        bins = self.n_fft // 2 + 1
        edges = _mel_to_hz(np.linspace(0.0, _hz_to_mel(_MAX_FREQUENCY), self.num_mel_bins + 2))
        freqs = np.linspace(0, SAMPLE_RATE // 2, bins)
        lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
        rising = (freqs - lower) / (center - lower)
        falling = (upper - freqs) / (upper - center)
        triangles = np.maximum(0.0, np.minimum(rising, falling))
        # Each filter's area is the same whatever its width.
        return triangles * (2.0 / (upper - lower))


# The Slaney mel scale: linear below 1 kHz, logarithmic above.
_LINEAR_TOP_HZ, _LINEAR_TOP_MEL = 1000.0, 15.0
_LOG_STEP = math.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    if hz < _LINEAR_TOP_HZ:
        return 3.0 * hz / 200.0
    return _LINEAR_TOP_MEL + math.log(hz / _LINEAR_TOP_HZ) / _LOG_STEP


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    linear = 200.0 * mel / 3.0
    logarithmic = _LINEAR_TOP_HZ * np.exp(_LOG_STEP * (mel - _LINEAR_TOP_MEL))
    return np.where(mel < _LINEAR_TOP_MEL, linear, logarithmic)


# WAV format tags the standard library's `wave` cannot read.
_WAV_FORMATS = {
    2: "Microsoft ADPCM",
    3: "IEEE float",
    6: "A-law",
    7: "mu-law",
    17: "IMA ADPCM",
    85: "MP3",
    0xFFFE: "WAVE_FORMAT_EXTENSIBLE",
}
# Windowed-sinc resampling: zero crossings of the sinc kept on each side of an output sample.
_ZERO_CROSSINGS = 16
_RESAMPLE_BATCH = 16384


def read_wav(data: bytes, target: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples in [-1, 1] at `target` Hz (16 kHz: what the processor takes) from
    a WAV file's bytes: PCM of 8, 16, 24 or 32 bits, any channel count (averaged into one) and
    any sample rate (resampled, see `resample`). Compressed or float WAVs, which `wave` cannot
    read, are a ValueError."""
    try:
        with wave.open(io.BytesIO(data)) as f:
            channels, width, rate = f.getnchannels(), f.getsampwidth(), f.getframerate()
            raw = f.readframes(f.getnframes())
    except (wave.Error, EOFError, struct.error) as e:
        tag = re.fullmatch(r"unknown format: (\d+)", str(e))
        if tag:
            kind = _WAV_FORMATS.get(int(tag[1]), f"format tag {tag[1]}")
            raise ValueError(f"unsupported WAV encoding {kind}: only integer PCM is read") from None
        raise ValueError(f"not a readable WAV file ({e})") from None
    if rate <= 0:
        raise ValueError(f"WAV file has sample rate {rate}")
    if width > 4:
        raise ValueError(f"unsupported WAV sample width of {8 * width} bits: 8 to 32 are read")
    raw = raw[: len(raw) // (width * channels) * width * channels]  # a truncated last frame
    if not raw:
        raise ValueError("WAV file holds no samples")
    if width == 1:  # 8-bit WAV is unsigned
        ints = np.frombuffer(raw, np.uint8).astype(np.int32) - 128
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
    else:
        ints = np.frombuffer(raw, f"<i{width}")
    samples = ints.reshape(-1, channels).mean(axis=1) / float(1 << (8 * width - 1))
    if rate != target:
        samples = resample(samples, rate, target)
    return samples.astype(np.float32)


def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """`samples` at `rate` Hz resampled to `target` by windowed-sinc interpolation: each output
    sample is a Hann-windowed sinc of the input samples around its instant, low-passed at the
    lower of the two Nyquist frequencies (no aliasing when downsampling), `_ZERO_CROSSINGS`
    sinc lobes each side; the weights of each output phase are normalized to sum to 1."""
    g = math.gcd(rate, target)
    up, down = target // g, rate // g
    cutoff = 0.5 * min(1.0, up / down)  # in cycles per input sample
    half = math.ceil(_ZERO_CROSSINGS / (2 * cutoff))  # input samples each side
    offsets = np.arange(1 - half, half + 1)
    # An output sample lies a fraction `phase / up` past an input sample: one row per phase.
    distance = offsets[None, :] - np.arange(up)[:, None] / up
    taps = np.sinc(2 * cutoff * distance) * (0.5 + 0.5 * np.cos(np.pi * distance / half))
    taps /= taps.sum(axis=1, keepdims=True)
    padded = np.concatenate([np.zeros(half), samples, np.zeros(half + 1)])
    out = np.empty(-(-samples.size * up // down))
    for start in range(0, out.size, _RESAMPLE_BATCH):
        n = np.arange(start, min(start + _RESAMPLE_BATCH, out.size))
        base, phase = np.divmod(n * down, up)
        window = padded[base[:, None] + half + offsets]
        out[n] = np.einsum("ij,ij->i", window, taps[phase])
    return out


def clip_samples(clip: Any) -> np.ndarray:
    """Mono samples at 16 kHz from vLLM's audio forms: an array (16 kHz) or (array, rate)."""
    if isinstance(clip, tuple):
        if len(clip) != 2:
            raise ValueError("an audio clip is an array of samples or (samples, sampling rate)")
        samples, rate = clip
        if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
            raise ValueError(
                f"an audio clip's sampling rate must be a positive integer, got {rate!r}"
            )
        samples = np.asarray(samples, np.float32)
        return samples if rate == SAMPLE_RATE else resample(samples, rate).astype(np.float32)
    if not isinstance(clip, np.ndarray | list):
        raise ValueError(
            f"an audio clip must be an array of 16 kHz samples or (samples, sampling rate), "
            f"got {type(clip).__name__}"
        )
    return np.asarray(clip, np.float32)
