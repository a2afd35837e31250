"""The audio side of Voxtral: a Whisper-style encoder and the projector that maps its frames
into the decoder's embedding width.

`AudioEncoder.encode` turns clips' log-mel windows [windows, mel bins, frames_per_window]
(`audio_processor.py`) into prompt embeddings, `tokens_per_window` per window, which the
decoder takes in place of the audio placeholder tokens. Each window is encoded on its own
(full attention within it); the projector stacks `intermediate_size // hidden_size`
consecutive encoder frames into one token.
Parameters keep Hugging Face names below `audio_tower.` and `multi_modal_projector.`. Its
config (`AudioConfig`) is read from a Voxtral `config.json` by `audio_from_hf`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.encoders.audio_processor import AudioProcessor, clip_samples
from inflight.model.encoders.base import NO_BOUNDS, Bounds, PreparedItem, content_key
from inflight.model.encoders.vision import activation
from inflight.model.weights import copy_weights


@dataclass(frozen=True)
class AudioConfig:
    """Voxtral's audio input: a Whisper-style encoder over log-mel windows of
    `frames_per_window` frames, which halves them to `max_source_positions` encoder frames;
    the projector stacks `intermediate_size // hidden_size` consecutive frames into one vector
    and maps it into the decoder's width, where it takes the place of one `audio_token_id`
    placeholder."""

    num_mel_bins: int
    hidden_size: int  # Whisper's d_model
    num_layers: int
    num_heads: int
    intermediate_size: int  # the layers' MLP width, and the width of a stack of frames
    max_source_positions: int
    audio_token_id: int
    activation: str = "gelu"
    projector_act: str = "gelu"

    kind = "audio"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"audio hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_heads}"
            )
        # Transformers flattens the whole batch before stacking: only whole stacks per window
        # keep one window's frames out of another's tokens.
        if (
            self.intermediate_size % self.hidden_size
            or self.max_source_positions % self.frames_per_token
        ):
            raise ValueError(
                f"audio intermediate_size {self.intermediate_size} must stack a whole number "
                f"of {self.hidden_size}-wide frames, dividing max_source_positions "
                f"{self.max_source_positions}"
            )

    @property
    def frames_per_token(self) -> int:
        """Encoder frames stacked into one audio token."""
        return self.intermediate_size // self.hidden_size

    @property
    def frames_per_window(self) -> int:
        """Mel frames one encoder window takes (its second convolution has stride 2)."""
        return 2 * self.max_source_positions

    @property
    def tokens_per_window(self) -> int:
        return self.max_source_positions * self.hidden_size // self.intermediate_size

    bounds: ClassVar[Bounds] = NO_BOUNDS

    @property
    def placeholder(self) -> int:
        return self.audio_token_id

    def build(self, text_hidden: int) -> AudioEncoder:
        return AudioEncoder(self, text_hidden)

    def preparer(self, processor_config: dict[str, Any]) -> Callable[[Any], PreparedItem]:
        mel = AudioProcessor.from_config(processor_config, self)
        per_window = self.tokens_per_window

        def prepare(clip: Any) -> PreparedItem:
            data = mel(clip_samples(clip))
            return PreparedItem(data, data.shape[0] * per_window, content_key("audio", data))

        return prepare


# VoxtralEncoderConfig's defaults (Voxtral Mini's encoder), for what an audio_config leaves
# out, and the Whisper spellings it also accepts.
_VOXTRAL_ENCODER = dict(
    num_mel_bins=128,
    hidden_size=1280,
    num_hidden_layers=32,
    num_attention_heads=20,
    intermediate_size=5120,
    max_source_positions=1500,
    activation_function="gelu",
)
_WHISPER_NAMES = {
    "d_model": "hidden_size",
    "encoder_layers": "num_hidden_layers",
    "encoder_attention_heads": "num_attention_heads",
    "encoder_ffn_dim": "intermediate_size",
}


def audio_from_hf(cfg: dict[str, Any]) -> AudioConfig:
    """The audio side of a `VoxtralForConditionalGeneration` config.json dict."""
    audio = dict(cfg.get("audio_config") or {})
    kind = audio.get("model_type", "voxtral_encoder")
    if kind != "voxtral_encoder":
        raise ValueError(f"unsupported audio encoder {kind!r}; supported: voxtral_encoder")
    for whisper, name in _WHISPER_NAMES.items():
        if whisper in audio:
            audio.setdefault(name, audio[whisper])
    audio = {**_VOXTRAL_ENCODER, **audio}
    token = cfg.get("audio_token_id")
    if token is None:
        raise ValueError("a Voxtral config.json needs audio_token_id")
    return AudioConfig(
        num_mel_bins=audio["num_mel_bins"],
        hidden_size=audio["hidden_size"],
        num_layers=audio["num_hidden_layers"],
        num_heads=audio["num_attention_heads"],
        intermediate_size=audio["intermediate_size"],
        max_source_positions=audio["max_source_positions"],
        audio_token_id=int(token),
        activation=audio["activation_function"],
        projector_act=cfg.get("projector_hidden_act", "gelu"),
    )


# Whisper's layer norms take torch's default epsilon: the config has none.
_LN_EPS = 1e-5


class _Positions(nn.Module):
    """Whisper's position table, kept in float32 whatever dtype the module is cast to, as
    transformers keeps it (`_keep_in_fp32_modules_strict`): the frames are summed with it in
    float32 and rounded once."""

    def __init__(self, positions: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(positions, hidden), requires_grad=False)

    @torch.no_grad()
    def _apply(self, fn, recurse=True):
        moved = fn(self.weight)
        if moved.dtype != torch.float32:
            # A cast: follow its device only, from the float32 values.
            moved = self.weight.to(moved.device, torch.float32)
        self.weight = nn.Parameter(moved, requires_grad=False)
        return self


class _Attention(nn.Module):
    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.scale = (hidden // config.num_heads) ** -0.5
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)  # Whisper's keys carry no bias
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, frames, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, frames, self.num_heads, -1).transpose(1, 2)

        # Queries are scaled before the product, as Whisper does (it rounds differently in
        # half precision).
        q = heads(self.q_proj(x) * self.scale)
        k, v = heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(n, frames, hidden))


class _EncoderLayer(nn.Module):
    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.self_attn_layer_norm = nn.LayerNorm(hidden, eps=_LN_EPS)
        self.self_attn = _Attention(config)
        self.final_layer_norm = nn.LayerNorm(hidden, eps=_LN_EPS)
        self.fc1 = nn.Linear(hidden, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, hidden)
        self.act = activation(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class _AudioTower(nn.Module):
    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.conv1 = nn.Conv1d(config.num_mel_bins, hidden, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(hidden, hidden, kernel_size=3, stride=2, padding=1)
        self.embed_positions = _Positions(config.max_source_positions, hidden)
        self.layers = nn.ModuleList(_EncoderLayer(config) for _ in range(config.num_layers))
        self.layer_norm = nn.LayerNorm(hidden, eps=_LN_EPS)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Encoder frames [N, max_source_positions, hidden] of windows [N, mel bins, frames]."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        x = (x + self.embed_positions.weight).to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class _Projector(nn.Module):
    def __init__(self, config: AudioConfig, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(config.intermediate_size, text_hidden, bias=False)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=False)
        self.act = activation(config.projector_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class AudioEncoder(nn.Module):
    def __init__(self, config: AudioConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = config
        self.audio_tower = _AudioTower(config)
        self.multi_modal_projector = _Projector(config, text_hidden)

    @torch.inference_mode()
    def encode(self, items: list[np.ndarray]) -> list[torch.Tensor]:
        """The prompt embeddings [windows * tokens_per_window, text hidden] of each clip's
        log-mel windows float32 [windows, mel bins, frames_per_window], all windows in one
        encoder batch."""
        config = self.config
        shape = (config.num_mel_bins, config.frames_per_window)
        for i, item in enumerate(items):
            if item.ndim != 3 or not item.shape[0] or tuple(item.shape[1:]) != shape:
                raise ValueError(
                    f"audio item {i}: log-mel windows must be [windows, {shape[0]}, "
                    f"{shape[1]}], got {tuple(item.shape)}"
                )
        if not items:
            return []
        weight = self.multi_modal_projector.linear_1.weight
        mel = torch.from_numpy(np.concatenate(items)).to(weight.device, weight.dtype)
        frames = self.audio_tower(mel)
        tokens = self.multi_modal_projector(frames.reshape(-1, config.intermediate_size))
        return list(tokens.split([len(item) * config.tokens_per_window for item in items]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (`audio_tower.…`, `multi_modal_projector.…`);
        an unknown or missing one, or a shape that differs, is a ValueError."""
        copy_weights(self, weights, "audio encoder")
