"""Qwen3-TTS's speaker encoder, which turns a reference clip into the x-vector that voice cloning
conditions the talker on: 24 kHz samples -> a 128-bin log-mel spectrogram (Slaney mel scale and
area normalisation, as librosa's default filterbank) -> an ECAPA-TDNN (SE-Res2Net blocks, multi-
layer aggregation, attentive statistics pooling) -> one `enc_dim` vector.

Parameter names equal the reference `Qwen3TTSSpeakerEncoder`'s, so a checkpoint's
`speaker_encoder.*` tensors load with that prefix stripped.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import nn

from inflight.model.weights import copy_weights

# The reference fixes its STFT in `extract_speaker_embedding`, whatever the config says.
N_FFT = 1024
HOP_SIZE = 256
WIN_SIZE = 1024
FMIN = 0.0
FMAX = 12000.0
WEIGHT_PREFIX = "speaker_encoder."


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """`speaker_encoder_config` of a Qwen3-TTS `config.json`; the defaults are the real model's
    (the reference config's code defaults: enc_dim is 1024, whatever its docstring says)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    def __post_init__(self) -> None:
        lengths = {len(self.enc_channels), len(self.enc_kernel_sizes), len(self.enc_dilations)}
        if len(lengths) != 1 or len(self.enc_channels) < 2:
            raise ValueError(
                "speaker encoder: enc_channels, enc_kernel_sizes and enc_dilations must have "
                "one equal length of at least 2"
            )
        # Res2Net splits each block's channels into `scale` equal groups.
        if any(c % self.enc_res2net_scale for c in self.enc_channels[1:-1]):
            raise ValueError(
                f"speaker encoder: enc_channels {list(self.enc_channels)} are not all divisible "
                f"by enc_res2net_scale {self.enc_res2net_scale}"
            )
        # The aggregation layer takes the SE-Res2Net blocks' outputs side by side.
        if sum(self.enc_channels[1:-1]) != self.enc_channels[-1]:
            raise ValueError(
                f"speaker encoder: enc_channels {list(self.enc_channels)}: the last must be the "
                "sum of those between the first and it"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeakerEncoderConfig:
        """From the dict; a missing key takes the reference default, keys it does not know
        (`model_type`, `transformers_version`, ...) are ignored."""
        known = {f.name for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known}
        return cls(**values)

    @property
    def min_frames(self) -> int:
        """The fewest mel frames the TDNNs take: each pads its input by reflection ("same"
        padding), which needs more frames than the padding on either side."""
        return 1 + max(
            (d * (k - 1) + 1) // 2
            for k, d in zip(self.enc_kernel_sizes, self.enc_dilations, strict=True)
        )

    @property
    def min_samples(self) -> int:
        """The fewest samples that make `min_frames` frames (and can be reflect-padded)."""
        pad = (N_FFT - HOP_SIZE) // 2
        return max(pad + 1, (self.min_frames - 1) * HOP_SIZE + N_FFT - 2 * pad)


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above it."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz * 3.0 / 200.0
    log_part = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * 27.0 / np.log(6.4)
    return np.where(hz >= 1000.0, log_part, linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    linear = mel * 200.0 / 3.0
    log_part = 1000.0 * np.exp((mel - 15.0) * np.log(6.4) / 27.0)
    return np.where(mel >= 15.0, log_part, linear)


@functools.lru_cache(maxsize=8)
def mel_filterbank(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float
) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangular filters evenly spaced on the Slaney mel scale, each
    scaled to unit area (2 / its width in Hz): librosa's `filters.mel` defaults. Read-only."""
    bins = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    widths = np.diff(edges)
    offsets = edges[:, None] - bins[None, :]  # edge minus bin frequency
    rising = -offsets[:-2] / widths[:-1, None]
    falling = offsets[2:] / widths[1:, None]
    bank = np.maximum(0.0, np.minimum(rising, falling))
    bank *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    bank = bank.astype(np.float32)
    bank.flags.writeable = False  # cached: shared by every caller
    return bank


def mel_spectrogram(
    samples: torch.Tensor,
    *,
    sample_rate: int = 24000,
    n_mels: int = 128,
    n_fft: int = N_FFT,
    hop_size: int = HOP_SIZE,
    win_size: int = WIN_SIZE,
    fmin: float = FMIN,
    fmax: float = FMAX,
) -> torch.Tensor:
    """Log-mel spectrogram [B, n_mels, frames] of samples [T] or [B, T] (float32), as the
    reference computes it: reflect-pad (n_fft - hop) / 2 each side instead of centring, Hann
    window, magnitude sqrt(re^2 + im^2 + 1e-9), natural log floored at 1e-5."""
    if samples.dim() not in (1, 2):
        raise ValueError(f"mel_spectrogram takes samples [T] or [B, T], got {tuple(samples.shape)}")
    x = samples.to(torch.float32).reshape(-1, samples.shape[-1])
    pad = (n_fft - hop_size) // 2
    x = nn.functional.pad(x.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    window = torch.hann_window(win_size, device=x.device)
    spec = torch.stft(
        x,
        n_fft,
        hop_length=hop_size,
        win_length=win_size,
        window=window,
        center=False,
        return_complex=True,
    )
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    bank = torch.from_numpy(mel_filterbank(sample_rate, n_fft, n_mels, fmin, fmax).copy())
    mel = torch.matmul(bank.to(x.device), magnitude)
    return torch.log(torch.clamp(mel, min=1e-5))


class TimeDelayNetBlock(nn.Module):
    """A dilated 1-D convolution ("same" length, reflect-padded) and a ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(
            in_channels,
            out_channels,
            kernel_size,
            dilation=dilation,
            padding="same",
            padding_mode="reflect",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Splits the channels into `scale` groups: the first passes through, each later one goes
    through its own TDNN after adding the previous group's output (a growing receptive field)."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(
            TimeDelayNetBlock(width, width, kernel_size, dilation) for _ in range(scale - 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        for i, block in enumerate(self.blocks, start=1):
            out.append(block(parts[i] if i == 1 else parts[i] + out[-1]))
        return torch.cat(out, dim=1)


class SqueezeExcitationBlock(nn.Module):
    """Rescales each channel by a gate computed from the time-averaged channels."""

    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        # Kernel 1: "same" reflect padding pads nothing, a plain convolution is the same.
        self.conv1 = nn.Conv1d(channels, se_channels, 1)
        self.conv2 = nn.Conv1d(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.relu(self.conv1(x.mean(dim=2, keepdim=True)))
        return x * torch.sigmoid(self.conv2(gate))


class SqueezeExcitationRes2NetBlock(nn.Module):
    """TDNN -> Res2Net -> TDNN -> squeeze-excitation, plus the input (residual)."""

    def __init__(self, in_channels: int, out_channels: int, config: SpeakerEncoderConfig, i: int):
        super().__init__()
        kernel, dilation = config.enc_kernel_sizes[i], config.enc_dilations[i]
        self.tdnn1 = TimeDelayNetBlock(in_channels, out_channels, 1, 1)
        self.res2net_block = Res2NetBlock(out_channels, config.enc_res2net_scale, kernel, dilation)
        self.tdnn2 = TimeDelayNetBlock(out_channels, out_channels, 1, 1)
        self.se_block = SqueezeExcitationBlock(out_channels, config.enc_se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and standard deviation of x [B, C, L] over time, weighted by weights
    (summing to 1 over time); the variance is floored at 1e-12 so the sqrt stays finite."""
    mean = (weights * x).sum(dim=2)
    var = (weights * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2)
    return mean, torch.sqrt(var.clamp(min=1e-12))


class AttentiveStatisticsPooling(nn.Module):
    """Pools [B, C, L] to [B, 2C, 1]: the mean and std of each channel under a softmax over time
    that sees the frame together with the whole clip's mean and std."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        # Every frame is real (one clip per row), so the global statistics weigh all equally.
        mean, std = _weighted_stats(x, torch.full_like(x[:, :1], 1.0 / length))
        context = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], 1)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_stats(x, attention)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: log-mel frames [B, frames, mel_dim] -> speaker embeddings [B, enc_dim]."""

    def __init__(self, config: SpeakerEncoderConfig):
        super().__init__()
        self.config = config
        channels = config.enc_channels
        first = TimeDelayNetBlock(
            config.mel_dim, channels[0], config.enc_kernel_sizes[0], config.enc_dilations[0]
        )
        self.blocks = nn.ModuleList(
            [first]
            + [
                SqueezeExcitationRes2NetBlock(channels[i - 1], channels[i], config, i)
                for i in range(1, len(channels) - 1)
            ]
        )
        # Multi-layer feature aggregation: the SE-Res2Net blocks' outputs, concatenated.
        self.mfa = TimeDelayNetBlock(
            channels[-1], channels[-1], config.enc_kernel_sizes[-1], config.enc_dilations[-1]
        )
        self.asp = AttentiveStatisticsPooling(channels[-1], config.enc_attention_channels)
        self.fc = nn.Conv1d(channels[-1] * 2, config.enc_dim, 1)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = mels.transpose(1, 2)
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)

    @torch.inference_mode()
    def embed(self, samples: np.ndarray | torch.Tensor, sample_rate: int) -> torch.Tensor:
        """The x-vector [enc_dim] of one mono clip of `config.sample_rate` samples (float, in
        [-1, 1]); a ValueError for another rate or a clip too short to embed."""
        config = self.config
        if sample_rate != config.sample_rate:
            raise ValueError(
                f"the speaker encoder takes {config.sample_rate} Hz audio, got {sample_rate} Hz "
                "(resample the clip first)"
            )
        clip = torch.as_tensor(samples)
        if not clip.is_floating_point():
            raise ValueError(
                f"the speaker encoder takes float samples in [-1, 1], got {clip.dtype}"
            )
        if clip.dim() != 1:
            raise ValueError(
                f"the speaker encoder takes one mono clip [T], got {tuple(clip.shape)}"
            )
        if clip.numel() < config.min_samples:
            raise ValueError(
                f"the clip has {clip.numel()} samples, the speaker encoder needs at least "
                f"{config.min_samples} ({config.min_samples / config.sample_rate:.3f} s)"
            )
        param = next(self.parameters())
        mels = mel_spectrogram(
            clip.to(param.device), sample_rate=config.sample_rate, n_mels=config.mel_dim
        )
        return self(mels.transpose(1, 2).to(param.dtype))[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a checkpoint's `speaker_encoder.*` tensors in (other names are skipped); an
        unknown or missing one, or a shape that differs, is a ValueError naming it."""
        cut = len(WEIGHT_PREFIX)
        mine = ((name[cut:], t) for name, t in weights if name.startswith(WEIGHT_PREFIX))
        copy_weights(self, mine, "speaker encoder")
