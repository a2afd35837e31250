"""The audio side of Qwen3-Omni's thinker: a Whisper-like encoder that downsamples log-mel
frames eightfold with three stride-2 2-D convolutions, runs a transformer over the result and
projects it into the decoder's width.

A clip's log-mel frames (`preparer`: Whisper's spectrogram of the clip as it is, never padded to
30 s) are cut into chunks of `2 * n_window` frames, each convolved on its own into at most 13
frames that carry sinusoidal positions counted from their chunk's start; attention stays within
windows of `n_window_infer // (2 * n_window)` chunks' frames, counted from the clip's start.
Every encoder frame is one audio token. Parameters keep Hugging Face names below
`audio_tower.` (a checkpoint's `thinker.audio_tower.…` with `thinker.` stripped). Its config
(`Qwen3OmniAudioConfig`) is read from a Qwen3-Omni config.json's `thinker_config` by
`qwen3_omni_audio_from_hf`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.encoders.audio_processor import SAMPLE_RATE, AudioProcessor, clip_samples
from inflight.model.encoders.base import NO_BOUNDS, Bounds, PreparedItem, content_key
from inflight.model.encoders.vision import activation
from inflight.model.weights import copy_weights

# Transformers counts this many tokens for every whole chunk of a clip, whatever n_window.
_CHUNK_TOKENS = 13
# Whisper's layer norms take torch's default epsilon: the config has none.
_LN_EPS = 1e-5
_MAX_TIMESCALE = 10000.0


def _conv_frames(frames: int) -> int:
    """What the three stride-2 convolutions (kernel 3, padding 1) leave of `frames`."""
    for _ in range(3):
        frames = -(-frames // 2)
    return frames


@dataclass(frozen=True)
class Qwen3OmniAudioConfig:
    """Qwen3-Omni's audio encoder (transformers' `Qwen3OmniMoeAudioEncoderConfig`), whose
    `output_dim`-wide tokens each take the place of one `audio_token_id` placeholder."""

    num_mel_bins: int
    hidden_size: int  # d_model
    num_layers: int
    num_heads: int
    intermediate_size: int  # the layers' MLP width
    downsample_hidden_size: int  # the convolutions' channels
    output_dim: int
    n_window: int  # half a chunk, in mel frames
    n_window_infer: int  # an attention window, in mel frames
    conv_chunksize: int  # chunks convolved at once (bounds the convolutions' memory)
    audio_token_id: int
    activation: str = "gelu"

    kind = "audio"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"audio d_model {self.hidden_size} is not a multiple of "
                f"encoder_attention_heads {self.num_heads}"
            )
        if self.hidden_size % 2 or self.hidden_size < 4:
            raise ValueError(
                f"audio d_model {self.hidden_size} must be even and at least 4 (half of it "
                "takes sines, half cosines)"
            )
        # Transformers' token count and the frames its encoder keeps assume 13 per chunk: any
        # other chunk size would disagree with its own convolutions.
        if _conv_frames(self.chunk_frames) != _CHUNK_TOKENS:
            raise ValueError(
                f"audio n_window {self.n_window}: chunks of {self.chunk_frames} mel frames "
                f"convolve to {_conv_frames(self.chunk_frames)} frames, transformers counts "
                f"{_CHUNK_TOKENS}"
            )
        if self.n_window_infer < self.chunk_frames:
            raise ValueError(
                f"audio n_window_infer {self.n_window_infer} is shorter than a chunk of "
                f"{self.chunk_frames} mel frames"
            )
        if self.conv_chunksize < 1:
            raise ValueError(f"audio conv_chunksize {self.conv_chunksize} must be positive")

    @property
    def chunk_frames(self) -> int:
        """Mel frames of one chunk, which the convolutions take on their own."""
        return 2 * self.n_window

    @property
    def window_tokens(self) -> int:
        """Encoder frames of one attention window (a clip's last window may be shorter)."""
        return _CHUNK_TOKENS * (self.n_window_infer // self.chunk_frames)

    bounds: ClassVar[Bounds] = NO_BOUNDS

    @property
    def placeholder(self) -> int:
        return self.audio_token_id

    def audio_tokens(self, frames: int) -> int:
        """The audio tokens of a clip of `frames` mel frames: 13 per whole chunk and what the
        convolutions leave of the partial last one."""
        whole, rest = divmod(frames, self.chunk_frames)
        return whole * _CHUNK_TOKENS + _conv_frames(rest)

    def build(self, text_hidden: int) -> Qwen3OmniAudioEncoder:
        if self.output_dim != text_hidden:
            raise ValueError(
                f"audio output_dim {self.output_dim} differs from the decoder's hidden size "
                f"{text_hidden}"
            )
        return Qwen3OmniAudioEncoder(self)

    def preparer(self, processor_config: dict[str, Any]) -> Callable[[Any], PreparedItem]:
        hop = processor_config.get("hop_length", 160)
        # The processor never pads a clip to Whisper's window (it pads a batch to its longest
        # clip, and one clip to itself), so whatever window the config names is accepted and
        # each clip is made one window exactly as long as itself.
        window = _Window(
            self.num_mel_bins, int(processor_config.get("chunk_length", 30) * SAMPLE_RATE) // hop
        )
        mel = AudioProcessor.from_config(processor_config, window)
        # Transformers' spectrogram reflects the clip at both ends, which takes more samples
        # than half an FFT.
        shortest = max(mel.hop_length, mel.n_fft // 2 + 1)

        def prepare(clip: Any) -> PreparedItem:
            samples = clip_samples(clip)
            if samples.ndim == 1 and samples.size < shortest:
                raise ValueError(
                    f"audio of {samples.size} samples is too short: at least {shortest} "
                    f"({shortest / SAMPLE_RATE * 1000:.1f} ms)"
                )
            data = replace(mel, window_samples=samples.size)(samples)[0]
            return PreparedItem(data, self.audio_tokens(data.shape[1]), content_key("audio", data))

        return prepare


@dataclass(frozen=True)
class _Window:
    """The window `AudioProcessor.from_config` checks a preprocessor config against."""

    num_mel_bins: int
    frames_per_window: int


# Qwen3OmniMoeAudioEncoderConfig's defaults, for what an audio_config leaves out, and the
# spellings its attribute_map also accepts.
_ENCODER_DEFAULTS = dict(
    num_mel_bins=128,
    encoder_layers=32,
    encoder_attention_heads=20,
    encoder_ffn_dim=5120,
    d_model=1280,
    activation_function="gelu",
    n_window=50,
    output_dim=3584,
    n_window_infer=800,
    conv_chunksize=500,
    downsample_hidden_size=480,
)
_ALIASES = {
    "num_hidden_layers": "encoder_layers",
    "hidden_size": "d_model",
    "num_attention_heads": "encoder_attention_heads",
    "intermediate_size": "encoder_ffn_dim",
}
_AUDIO_TOKEN_ID = 151646  # Qwen3OmniMoeThinkerConfig's default


def qwen3_omni_audio_from_hf(thinker_config: dict[str, Any]) -> Qwen3OmniAudioConfig:
    """The audio encoder of a Qwen3-Omni config.json's `thinker_config` dict (its
    `audio_config` and `audio_token_id`; what they leave out takes transformers' defaults)."""
    audio = dict(thinker_config.get("audio_config") or {})
    kind = audio.get("model_type", "qwen3_omni_moe_audio_encoder")
    if kind != "qwen3_omni_moe_audio_encoder":
        raise ValueError(
            f"unsupported audio encoder {kind!r}; supported: qwen3_omni_moe_audio_encoder"
        )
    for alias, name in _ALIASES.items():
        if alias in audio:
            audio.setdefault(name, audio[alias])
    audio = {**_ENCODER_DEFAULTS, **audio}
    return Qwen3OmniAudioConfig(
        num_mel_bins=audio["num_mel_bins"],
        hidden_size=audio["d_model"],
        num_layers=audio["encoder_layers"],
        num_heads=audio["encoder_attention_heads"],
        intermediate_size=audio["encoder_ffn_dim"],
        downsample_hidden_size=audio["downsample_hidden_size"],
        output_dim=audio["output_dim"],
        n_window=audio["n_window"],
        n_window_infer=audio["n_window_infer"],
        conv_chunksize=audio["conv_chunksize"],
        audio_token_id=int(thinker_config.get("audio_token_id", _AUDIO_TOKEN_ID)),
        activation=audio["activation_function"],
    )


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    """Positions [length, channels] float32: sines then cosines at geometrically spaced rates
    from 1 down to 1 / 10000. Computed on the CPU, as transformers computes its table."""
    half = channels // 2
    step = math.log(_MAX_TIMESCALE) / (half - 1)
    rates = torch.exp(-step * torch.arange(half, dtype=torch.float32))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * rates[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


@dataclass(frozen=True)
class _Layout:
    """How a batch of clips' chunks become their tokens, and which tokens attend together."""

    extents: torch.Tensor  # [chunks] the mel frames each chunk's convolutions see
    kept: torch.Tensor  # indices of the tokens into the chunks' flattened encoder frames
    windows: list[torch.Tensor]  # per window length, its windows' token indices [n, length]
    tokens: list[int]  # per clip


def _chunks(
    config: Qwen3OmniAudioConfig, items: list[np.ndarray], device: torch.device
) -> tuple[np.ndarray, _Layout]:
    """The clips' log-mel chunks [chunks, mel bins, chunk_frames] (a partial last chunk padded
    with zeros) and their layout."""
    size, per_window = config.chunk_frames, config.window_tokens
    chunks, extents, kept, tokens = [], [], [], []
    windows: dict[int, list[np.ndarray]] = {}
    chunk = token = 0
    for item in items:
        frames = item.shape[1]
        count = -(-frames // size)
        padded = np.zeros((config.num_mel_bins, count * size), np.float32)
        padded[:, :frames] = item
        chunks.append(padded.reshape(config.num_mel_bins, count, size).transpose(1, 0, 2))
        # Transformers pads a clip's chunks to its longest: a clip of a chunk or more convolves
        # a padded last chunk through, a shorter clip only its own frames.
        extents += [min(frames, size)] * count
        for i in range(count):
            length = min(size, frames - i * size)
            start = (chunk + i) * _CHUNK_TOKENS
            kept.append(np.arange(start, start + _conv_frames(length)))
        clip = config.audio_tokens(frames)
        for start in range(0, clip, per_window):
            length = min(per_window, clip - start)
            windows.setdefault(length, []).append(np.arange(token + start, token + start + length))
        tokens.append(clip)
        chunk += count
        token += clip

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, torch.int64)

    layout = _Layout(
        extents=to_device(np.array(extents)),
        kept=to_device(np.concatenate(kept)),
        windows=[to_device(np.stack(w)) for w in windows.values()],
        tokens=tokens,
    )
    return np.concatenate(chunks), layout


class _Attention(nn.Module):
    def __init__(self, config: Qwen3OmniAudioConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.scale = (hidden // config.num_heads) ** -0.5
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, windows: list[torch.Tensor]) -> torch.Tensor:
        tokens, hidden = x.shape
        q, k, v = (
            p(x).view(tokens, self.num_heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = torch.empty_like(q)
        # Windows of one length attend as one batch, each only within itself.
        for index in windows:
            qw, kw, vw = (t[index].transpose(1, 2) for t in (q, k, v))
            attended = F.scaled_dot_product_attention(qw, kw, vw, scale=self.scale)
            out[index] = attended.transpose(1, 2)
        return self.out_proj(out.view(tokens, hidden))


class _EncoderLayer(nn.Module):
    def __init__(self, config: Qwen3OmniAudioConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.self_attn_layer_norm = nn.LayerNorm(hidden, eps=_LN_EPS)
        self.self_attn = _Attention(config)
        self.final_layer_norm = nn.LayerNorm(hidden, eps=_LN_EPS)
        self.fc1 = nn.Linear(hidden, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, hidden)
        self.act = activation(config.activation)

    def forward(self, x: torch.Tensor, windows: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:
            # As transformers does: keeps half precision's overflow finite.
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class _AudioTower(nn.Module):
    def __init__(self, config: Qwen3OmniAudioConfig) -> None:
        super().__init__()
        self.config = config
        hidden, channels = config.hidden_size, config.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, channels, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(channels, channels, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(channels, channels, 3, 2, padding=1)
        self.conv_out = nn.Linear(channels * _conv_frames(config.num_mel_bins), hidden, bias=False)
        self.layers = nn.ModuleList(_EncoderLayer(config) for _ in range(config.num_layers))
        self.ln_post = nn.LayerNorm(hidden, eps=_LN_EPS)
        self.proj1 = nn.Linear(hidden, hidden)
        self.act = activation(config.activation)
        self.proj2 = nn.Linear(hidden, config.output_dim)

    def forward(self, mel: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """The tokens [tokens, output_dim] of chunks [chunks, mel bins, chunk_frames]."""
        frames = []
        step = self.config.conv_chunksize
        for chunks, extent in zip(mel.split(step), layout.extents.split(step), strict=True):
            x = F.gelu(self.conv2d1(chunks.unsqueeze(1)))
            for conv in (self.conv2d2, self.conv2d3):
                # Past a short clip's end, a convolution must read the zeros of its own
                # padding, not the previous convolution's output on the chunk's padding.
                extent = (extent + 1) // 2
                past = torch.arange(x.shape[-1], device=x.device) >= extent[:, None]
                x = F.gelu(conv(x.masked_fill(past[:, None, None, :], 0.0)))
            n, channels, bins, width = x.shape
            frames.append(self.conv_out(x.permute(0, 3, 1, 2).reshape(n, width, channels * bins)))
        x = torch.cat(frames)
        x = x + _sinusoids(x.shape[1], x.shape[2]).to(x.device, x.dtype)
        x = x.reshape(-1, x.shape[-1]).index_select(0, layout.kept)
        for layer in self.layers:
            x = layer(x, layout.windows)
        return self.proj2(self.act(self.proj1(self.ln_post(x))))


class Qwen3OmniAudioEncoder(nn.Module):
    def __init__(self, config: Qwen3OmniAudioConfig) -> None:
        super().__init__()
        self.config = config
        self.audio_tower = _AudioTower(config)

    @torch.inference_mode()
    def encode(self, items: list[np.ndarray]) -> list[torch.Tensor]:
        """The prompt embeddings [audio_tokens(frames), output_dim] of each clip's log-mel
        frames float32 [mel bins, frames], all clips in one encoder batch (no clip attends to
        another's tokens or convolves another's frames)."""
        bins = self.config.num_mel_bins
        for i, item in enumerate(items):
            if item.ndim != 2 or item.shape[0] != bins or not item.shape[1]:
                raise ValueError(
                    f"audio item {i}: log-mel frames must be [{bins}, frames], "
                    f"got {tuple(item.shape)}"
                )
        if not items:
            return []
        weight = self.audio_tower.conv2d1.weight
        chunks, layout = _chunks(self.config, items, weight.device)
        mel = torch.from_numpy(chunks).to(weight.device, weight.dtype)
        return list(self.audio_tower(mel, layout).split(layout.tokens))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (`audio_tower.…`: a checkpoint's
        `thinker.audio_tower.…` without `thinker.`); an unknown or missing one, or a shape that
        differs, is a ValueError."""
        copy_weights(self, weights, "audio encoder")
