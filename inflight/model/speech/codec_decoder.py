"""The decoder of Qwen3-TTS's 12 Hz speech tokenizer, and Qwen3-Omni's Code2Wav: codec frames
(one code from each of the `num_quantizers` codebooks per frame) to a 24 kHz waveform,
`samples_per_frame` (1920) samples per frame.

The path: a front that turns each frame's codes into one vector (the speech tokenizer: a split
residual VQ, the first codebook and the rest each summed in their own space and projected to
`codebook_dim`, then a causal conv; Code2Wav: the mean of one embedding per codebook) -> a small
transformer with causal sliding-window attention -> transposed-conv upsampling with ConvNeXt
blocks -> a conv stack of upsampling blocks with SnakeBeta activations -> one channel, clamped
to [-1, 1]. The two differ only in the front, in the speech tokenizer's projections around the
transformer, and in how their upsampling blocks trim the transposed convs' outputs (see
`CodecDecoderConfig.pending_samples`); `CodecDecoderConfig.kind` says which one it is.

Everything is causal: a frame's samples depend only on it and the frames before it, so
decoding a prefix gives a prefix of the samples, and a streaming caller can decode a window
whose first frames serve only as left context (`decode_window`), or decode a window a few
frames at a time, each frame once (`stream`).

Streaming: the modules' forwards take an optional `State`, a dict that one stream owns, in
which each module that looks back keeps what its next call needs from the frames so far (the
causal convs their last inputs, the transposed convs their incomplete outputs, the attention
its keys and values, the transformer its position). Without one, a forward is a whole decode
from the window's start; the same code runs either way.

Parameters keep the names of the reference's modules (a speech tokenizer checkpoint's
`decoder.*`, an Omni checkpoint's `code2wav.*`, the prefix stripped), so its tensors load one
by one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.layers.norm import TorchRMSNorm
from inflight.model.layers.rotary import rotate
from inflight.model.weights import copy_weights

# The reference a config describes: Qwen3-TTS's speech tokenizer, or Qwen3-Omni's Code2Wav.
Kind: TypeAlias = Literal["speech_tokenizer", "code2wav"]


@dataclass(frozen=True)
class CodecDecoderConfig:
    """The decoder's shape. Defaults are the reference config classes' (the speech tokenizer's
    and Qwen3OmniMoeCode2WavConfig agree on every field both have), except `codebook_dim`
    (which the former lacks; 512 is the published checkpoint's) and `head_dim` (derived as
    hidden_size // num_attention_heads when a config omits it, as the references do).
    A checkpoint's config overrides some of them (copies of the published speech tokenizer
    give hidden_size 512, intermediate_size 1024, head_dim 64): build from it (`from_dict`,
    `from_code2wav`), not from defaults."""

    kind: Kind = "speech_tokenizer"
    codebook_size: int = 2048
    codebook_dim: int = 512  # the width the split VQ projects its two sums to (speech tokenizer)
    num_quantizers: int = 16  # code groups per frame; the first is the "semantic" one
    latent_dim: int = 1024  # the conv path's width around the transformer (Code2Wav: hidden_size)
    hidden_size: int = 1024  # the transformer's width
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 3072
    sliding_window: int = 72  # frames a query sees, itself included
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    hidden_act: str = "silu"
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)  # the conv decoder's blocks
    upsampling_ratios: tuple[int, ...] = (2, 2)  # the transposed convs after the transformer
    decoder_dim: int = 1536

    def __post_init__(self) -> None:
        if self.kind not in ("speech_tokenizer", "code2wav"):
            raise ValueError(f"unknown codec decoder kind {self.kind!r}")
        if self.kind == "speech_tokenizer" and self.num_quantizers < 2:
            raise ValueError("the split VQ needs at least 2 quantizers (1 semantic + the rest)")
        if self.kind == "code2wav" and self.latent_dim != self.hidden_size:
            # Code2Wav's transformer has no projections in or out of it.
            raise ValueError("a Code2Wav decoder's latent_dim must be its hidden_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (only 'silu')")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError("decoder_dim must halve evenly once per upsample rate")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CodecDecoderConfig:
        """From the `decoder_config` of a speech tokenizer's `config.json`; a missing key takes
        the default, and keys the decoder does not use are ignored."""
        if int(d.get("num_semantic_quantizers", 1)) != 1:
            raise ValueError("only one semantic quantizer is supported")
        return cls(**cls._read(d, skip=("kind",)))

    @classmethod
    def from_code2wav(cls, d: Mapping[str, Any]) -> CodecDecoderConfig:
        """From the `code2wav_config` of a Qwen3-Omni `config.json`; a missing key takes
        Qwen3OmniMoeCode2WavConfig's default, and keys the decoder does not use are ignored."""
        kwargs = cls._read(d, skip=("kind", "latent_dim", "codebook_dim"))
        hidden = kwargs.get("hidden_size", cls.hidden_size)
        return cls(kind="code2wav", latent_dim=hidden, **kwargs)

    @classmethod
    def _read(cls, d: Mapping[str, Any], skip: tuple[str, ...]) -> dict[str, Any]:
        """The fields that config dict `d` sets, but those named in `skip` (which are not that
        reference's to set), in this class's types, with `head_dim` derived when it is missing."""
        for key in ("rope_scaling", "rope_parameters"):
            rope = d.get(key) or {}
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise ValueError(f"unsupported {key} {rope!r}: the decoder uses plain RoPE")
        known = {f.name for f in fields(cls)} - set(skip)
        kwargs: dict[str, Any] = {k: v for k, v in d.items() if k in known and v is not None}
        if "rope_theta" not in kwargs and "rope_theta" in (d.get("rope_parameters") or {}):
            kwargs["rope_theta"] = d["rope_parameters"]["rope_theta"]
        for key in ("upsample_rates", "upsampling_ratios"):
            if key in kwargs:
                kwargs[key] = tuple(kwargs[key])
        if "head_dim" not in kwargs:
            hidden = kwargs.get("hidden_size", cls.hidden_size)
            kwargs["head_dim"] = hidden // kwargs.get(
                "num_attention_heads", cls.num_attention_heads
            )
        return kwargs

    @property
    def samples_per_frame(self) -> int:
        """Output samples per codec frame: every upsampling stage multiplies the length."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def pending_samples(self) -> int:
        """How many of n frames' n * samples_per_frame samples a decode of them holds back
        until more frames come: 0 for the speech tokenizer, 555 for Code2Wav at the real rates.
        Code2Wav's upsampling blocks cut `rate` samples off the front of their transposed
        convs' outputs as well as off the back, so every sample comes out that much later:
        n frames decode to n * samples_per_frame - pending_samples samples (the last ones
        waiting for frame n + 1, which a one-shot decode never has), a stream's first push
        after its context is this much short, and its later pushes are not."""
        pending = 0
        if self.kind == "code2wav":
            # The transposed convs before the blocks (kernel = stride) cut nothing; each block
            # upsamples what the blocks before it held back, and holds back `rate` more.
            for rate in self.upsample_rates:
                pending = pending * rate + rate
        return pending


# What a stream carries from one push to the next: each stateful module's own entry.
State: TypeAlias = dict[nn.Module, Any]


# --- convolutions -------------------------------------------------------------------------


class _CausalConv(nn.Module):
    """A stride-1 conv padded on the left only, so the length is kept and no output sees a
    later input. (The reference also computes a right padding for strided convs; it is zero
    at stride 1, the only stride this decoder uses.)"""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.left = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        # A stream's later calls are padded with the inputs the previous ones ended on.
        past = None if state is None else state.get(self)
        x = F.pad(x, (self.left, 0)) if past is None else torch.cat((past, x), dim=-1)
        if state is not None and self.left:
            # A copy: a view would keep the whole input alive until the next push.
            state[self] = x[..., x.shape[-1] - self.left :].clone()
        return self.conv(x)


class _CausalTransConv(nn.Module):
    """A transposed conv trimmed on the right to exactly `stride` outputs per input: the
    trimmed tail would change once the next input arrives. With `trim_front` (Code2Wav's
    upsampling blocks), as many outputs are cut off the front as well: the output is that much
    shorter than `stride` per input, each output standing that much later."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, trim_front: bool = False):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride
        self.front = self.trim if trim_front else 0

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        if state is None or not self.trim:
            y = self.conv(x)
            return y[..., self.front : y.shape[-1] - self.trim]
        # Streaming: the trimmed tail is the partial sums of outputs that the next inputs add
        # to. Carry it without the bias, add the previous tail in, and emit (adding the bias
        # once) only the outputs complete now: `stride` per input, as above, less the front
        # cut (which a short first push may leave partly to the next).
        y = F.conv_transpose1d(x, self.conv.weight, stride=self.conv.stride)
        past, front = state.get(self, (None, self.front))
        if past is not None:
            y[..., : self.trim] += past
        done = y.shape[-1] - self.trim
        cut = min(front, done)
        state[self] = (y[..., done:].clone(), front - cut)
        return y[..., cut:done] + self.conv.bias[:, None]


class _SnakeBeta(nn.Module):
    """x + sin^2(a x) / b per channel, with a and b stored as logarithms."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class _ConvNeXt(nn.Module):
    """Causal depthwise conv, then a per-frame MLP over channels, scaled and added back."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = _CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        h = self.dwconv(x, state).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class _ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = _SnakeBeta(dim)
        self.conv1 = _CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = _SnakeBeta(dim)
        self.conv2 = _CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x), state)), state)


class _UpsampleBlock(nn.Module):
    """Halve the channels while upsampling by `rate`, then three dilated residual units."""

    def __init__(self, cin: int, rate: int, trim_front: bool):
        super().__init__()
        cout = cin // 2
        units = [_ResidualUnit(cout, dilation) for dilation in (1, 3, 9)]
        trans_conv = _CausalTransConv(cin, cout, 2 * rate, rate, trim_front)
        self.block = nn.ModuleList([_SnakeBeta(cin), trans_conv, *units])

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        snake, trans_conv, *units = self.block
        x = trans_conv(snake(x), state)
        for unit in units:
            x = unit(x, state)
        return x


# --- the split residual VQ ----------------------------------------------------------------


class _Codebook(nn.Module):
    """A codebook kept as EMA statistics: an entry is its summed vectors over its usage."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def table(self) -> torch.Tensor:
        # The clamp keeps entries that were (almost) never used finite.
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _ResidualVQ(nn.Module):
    """Sums one code per codebook in `dim` and projects the sum to `out_dim`."""

    def __init__(self, count: int, size: int, dim: int, out_dim: int):
        super().__init__()
        # Only the encoder uses input_proj; it is here because checkpoints hold it.
        self.input_proj = nn.Conv1d(out_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)
        # The nesting (vq.layers.i._codebook) only mirrors the checkpoint's names.
        self.vq = nn.Module()
        self.vq.layers = nn.ModuleList(
            nn.ModuleDict({"_codebook": _Codebook(size, dim)}) for _ in range(count)
        )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, count, n] codes -> [B, out_dim, n]."""
        total = 0
        for i, layer in enumerate(self.vq.layers):
            total = total + F.embedding(codes[:, i], layer["_codebook"].table())
        return self.output_proj(total.transpose(1, 2))


class _SplitVQ(nn.Module):
    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        c = config
        self.rvq_first = _ResidualVQ(1, c.codebook_size, c.codebook_dim // 2, c.codebook_dim)
        self.rvq_rest = _ResidualVQ(
            c.num_quantizers - 1, c.codebook_size, c.codebook_dim // 2, c.codebook_dim
        )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


# --- the transformer ----------------------------------------------------------------------


class _LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class _Attention(nn.Module):
    def __init__(self, c: CodecDecoderConfig):
        super().__init__()
        heads, kv, d, bias = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.attention_bias,
        )
        self.q_proj = nn.Linear(c.hidden_size, heads * d, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, kv * d, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, kv * d, bias=bias)
        self.o_proj = nn.Linear(heads * d, c.hidden_size, bias=bias)
        self.head_dim, self.groups = d, heads // kv
        self.keep = c.sliding_window - 1  # earlier keys a query sees at most

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        state: State | None = None,
    ) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(b, n, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        q, k = rotate(q, (cos, sin)), rotate(k, (cos, sin))
        if state is not None:
            # Streaming: the previous pushes' keys and values go first (the mask says which
            # each query sees); keep the last `keep`, the most that a later query sees.
            if (past := state.get(self)) is not None:
                k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
            start = max(0, k.shape[2] - self.keep)
            state[self] = (k[:, :, start:], v[:, :, start:])
        if self.groups > 1:
            k = k.repeat_interleave(self.groups, dim=1)
            v = v.repeat_interleave(self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class _MLP(nn.Module):
    def __init__(self, c: CodecDecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: CodecDecoderConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = TorchRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = TorchRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn_layer_scale = _LayerScale(c.hidden_size)
        self.mlp_layer_scale = _LayerScale(c.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        state: State | None = None,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask, state)
        x = x + self.self_attn_layer_scale(h)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class _Transformer(nn.Module):
    """[B, n, latent_dim] -> [B, n, latent_dim]; positions count from 0 at the first frame
    (of the stream, when streaming: its state holds the next position)."""

    def __init__(self, c: CodecDecoderConfig):
        super().__init__()
        self.config = c
        # Code2Wav's transformer works at the conv path's width, with no projections.
        projected = c.kind == "speech_tokenizer"
        self.input_proj = nn.Linear(c.latent_dim, c.hidden_size) if projected else nn.Identity()
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = TorchRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.output_proj = nn.Linear(c.hidden_size, c.latent_dim) if projected else nn.Identity()

    def _rope(self, start: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed per call (in float32, then cast) rather than kept as a buffer: a buffer
        # would not survive building on the meta device and loading a checkpoint.
        d = self.config.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=like.device).float() / d
        inv_freq = 1.0 / self.config.rope_theta**exponents
        positions = torch.arange(start, start + n, device=like.device).float()
        angles = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        n, window = x.shape[1], self.config.sliding_window
        start = 0 if state is None else state.get(self, 0)
        cos, sin = self._rope(start, n, x)
        # Query i sees keys i - window + 1 .. i; when streaming, the keys start with the ones
        # each attention kept from the previous pushes (`_Attention.keep` of them at most).
        kept = min(start, window - 1)
        queries = torch.arange(start, start + n, device=x.device)
        keys = torch.arange(start - kept, start + n, device=x.device)
        behind = queries[:, None] - keys[None, :]
        mask = (behind >= 0) & (behind < window)
        if state is not None:
            state[self] = start + n
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, state)
        return self.output_proj(self.norm(h))


# --- the decoder --------------------------------------------------------------------------


class CodecDecoder(nn.Module):
    """Codec frames [B, num_quantizers, n] -> waveform [B, n * samples_per_frame -
    pending_samples] in [-1, 1]."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        c = self.config = config
        if c.kind == "code2wav":
            # One table for all the codebooks: codebook i's rows follow the first i codebooks'.
            self.code_embedding = nn.Embedding(c.codebook_size * c.num_quantizers, c.hidden_size)
        else:
            self.quantizer = _SplitVQ(c)
            self.pre_conv = _CausalConv(c.codebook_dim, c.latent_dim, 3)
        self.pre_transformer = _Transformer(c)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [_CausalTransConv(c.latent_dim, c.latent_dim, r, r), _ConvNeXt(c.latent_dim)]
            )
            for r in c.upsampling_ratios
        )
        trim_front = c.kind == "code2wav"
        blocks = [
            _UpsampleBlock(c.decoder_dim // 2**i, r, trim_front)
            for i, r in enumerate(c.upsample_rates)
        ]
        out_dim = c.decoder_dim // 2 ** len(c.upsample_rates)
        self.decoder = nn.ModuleList(
            [
                _CausalConv(c.latent_dim, c.decoder_dim, 7),
                *blocks,
                _SnakeBeta(out_dim),
                _CausalConv(out_dim, 1, 7),
            ]
        )

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    @property
    def pending_samples(self) -> int:
        return self.config.pending_samples

    def forward(self, codes: torch.Tensor, state: State | None = None) -> torch.Tensor:
        """LongTensor [B, num_quantizers, n] -> [B, n * samples_per_frame - pending_samples]
        (parameter dtype). With a `state`, the frames continue the ones decoded with it before,
        and the samples are those they complete (see `stream`)."""
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(
                f"expected codes [batch, {self.config.num_quantizers}, frames], "
                f"got {tuple(codes.shape)}"
            )
        h = self.pre_transformer(self._embed(codes, state), state).transpose(1, 2)
        for trans_conv, convnext in self.upsample:
            h = convnext(trans_conv(h, state), state)
        first, *blocks, snake, last = self.decoder
        h = first(h, state)
        for block in blocks:
            h = block(h, state)
        h = last(snake(h), state)
        return h.clamp(-1.0, 1.0).squeeze(1)

    def _embed(self, codes: torch.Tensor, state: State | None) -> torch.Tensor:
        """Codes [B, num_quantizers, n] -> the transformer's input [B, n, latent_dim]."""
        c = self.config
        if c.kind == "code2wav":
            offsets = torch.arange(c.num_quantizers, device=codes.device)[:, None]
            return self.code_embedding(codes + offsets * c.codebook_size).mean(1)
        return self.pre_conv(self.quantizer(codes), state).transpose(1, 2)

    @torch.no_grad()
    def decode_window(self, codes: torch.Tensor, context: int) -> torch.Tensor:
        """Decode frames [num_quantizers, n] whose first `context` only give left context:
        the window's decode less its first context * samples_per_frame samples, [(n - context)
        * samples_per_frame - pending_samples] (the piece of the reference's `chunked_decode`
        for this window). Without autograd: this is the streaming caller's entry point.

        For Code2Wav that is short of the n - context frames' samples: the window's decode
        holds its last `pending_samples` back, and the next window, whose context ends with
        these frames, drops them with its context. So windows decoded one after another lose
        `pending_samples` at each boundary, as `chunked_decode` does; one stream over all the
        frames loses none."""
        if not 0 <= context <= codes.shape[-1]:
            raise ValueError(f"context {context} is outside the window's {codes.shape[-1]} frames")
        return self(codes[None])[0, context * self.samples_per_frame :]

    def stream(self, context: torch.Tensor | None = None) -> CodecStream:
        """A new streaming decode of one window, whose first frames are `context`
        [num_quantizers, c] (left context only: decoded, their samples dropped as
        `decode_window` drops them)."""
        return CodecStream(self, context)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a checkpoint's decoder tensors in: a speech tokenizer's `decoder.*`, or a
        Qwen3-Omni checkpoint's `code2wav.*` (other names, such as the encoder's or the
        thinker's, are skipped); a missing or unknown decoder tensor, or a shape that differs,
        is a ValueError naming it."""
        if self.config.kind == "code2wav":
            prefix, what = "code2wav.", "Code2Wav decoder"
        else:
            prefix, what = "decoder.", "speech tokenizer decoder"
        ours = ((k[len(prefix) :], v) for k, v in weights if k.startswith(prefix))
        copy_weights(self, ours, what)


class CodecStream:
    """One window decoded as its frames arrive, each frame once: the pushes' samples
    concatenated are `decode_window` of the context and all the frames pushed (up to rounding),
    and no later push changes a sample that an earlier one returned.
    Its state is its own (one stream a speech row), so streams over one decoder interleave."""

    def __init__(self, decoder: CodecDecoder, context: torch.Tensor | None = None) -> None:
        self.decoder = decoder
        self.state: State = {}
        # Samples still to drop: the context's, as decode_window drops them. A Code2Wav decode
        # holds the last `pending_samples` of them back, so the next push drops those.
        self._drop = 0
        if context is not None and context.shape[-1]:
            self._drop = context.shape[-1] * decoder.samples_per_frame
            self.push(context)

    @torch.inference_mode()
    def push(self, codes: torch.Tensor) -> torch.Tensor:
        """The next frames [num_quantizers, m] -> the samples they complete: [m *
        samples_per_frame], less `pending_samples` at the first push after the context (each
        push's last `pending_samples` wait for the next frames and open the next push)."""
        if codes.dim() != 2:
            raise ValueError(f"expected codes [groups, frames], got {tuple(codes.shape)}")
        if not codes.shape[-1]:  # the convs cannot take an empty input
            param = next(self.decoder.parameters())
            return torch.empty(0, dtype=param.dtype, device=param.device)
        samples = self.decoder(codes[None], self.state)[0]
        drop = min(self._drop, samples.shape[0])
        self._drop -= drop
        return samples[drop:]
