"""DiffusionGemma (`DiffusionGemmaForBlockDiffusion`): a language model that writes by block
diffusion, a canvas of `canvas_length` tokens at a time.

One stack of Gemma-4 layers runs two passes that share every weight:
- encode: causal over the tokens it is given (the prompt, later each finished canvas), writing
  their keys and values to the KV cache;
- denoise: a canvas (random ids at first, refined step by step) attending bidirectionally over
  [the KV cache | itself], writing nothing. Its input embeddings are self-conditioned on the
  previous step's predictions (`soft_embedding`).

A step (`CanvasBatch`) packs segments of both passes, of any sequences: each segment is a run
of one sequence's query tokens, after the positions its KV slots hold. Sliding layers read a
segment's last `window - 1` cached positions (as transformers' sliding cache keeps them);
within an encode segment each query sees the `window` positions up to its own.

Gemma-4's layers: sandwich norms around attention and the feed-forward; q/k norms and a
scale-free v norm; full-attention layers with their own head size and key/value heads, values
that are their keys before the key norm and rotation, and a partial ("proportional")
rotation; a dense MLP and a mixture of experts side by side, each normed; a scalar per layer;
embeddings scaled by sqrt(hidden); logits soft-capped. Images go through Gemma-4's vision tower
(`encoders/gemma4_vision.py`), their embeddings in place of their placeholder tokens' in the
encode pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from inflight.model.config import (
    DenoiseDefaults,
    DiffusionConfig,
    ModelConfig,
    MoEConfig,
    RopeConfig,
)
from inflight.model.contract import MediaEncoder
from inflight.model.encoders.gemma4_vision import gemma4_vision_from_hf
from inflight.model.layers.linear import Linear, process_weights_after_loading
from inflight.model.layers.moe import Experts
from inflight.model.layers.parallel import TensorParallel
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import LinearMethods
from inflight.model.metadata import KVCache
from inflight.model.registry import Family, register
from inflight.model.weights import copy_into

_DEFAULTS_KEYS = (
    "max_denoising_steps",
    "t_min",
    "t_max",
    "stability_threshold",
    "confidence_threshold",
)


def _from_hf(cfg: dict[str, Any]) -> ModelConfig:
    text = cfg["text_config"]
    if text.get("use_bidirectional_attention") not in (None, "vision"):
        raise ValueError(
            "DiffusionGemma with use_bidirectional_attention="
            f"{text['use_bidirectional_attention']!r} is not supported (its encoder is causal)"
        )
    if not text.get("num_experts"):
        raise ValueError("DiffusionGemma without experts (num_experts) is not supported")
    layers = text["num_hidden_layers"]
    kinds = text.get("layer_types") or [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
    ]
    kinds = [*kinds[:-1], "full_attention"]  # transformers forces the last layer full
    window = text.get("sliding_window", 512)
    head_dim = text.get("head_dim", 256)
    kv_heads = text.get("num_key_value_heads", 4)
    # The full layers' head: `per_layer_config` (as a saved config writes it) or the
    # constructor's keywords.
    full = next(
        (
            v
            for k, v in (text.get("per_layer_config") or {}).items()
            if kinds[int(k)] != "sliding_attention"
        ),
        {},
    )
    global_head_dim = full.get("head_dim", text.get("global_head_dim", 512))
    global_kv_heads = full.get(
        "num_key_value_heads", text.get("num_global_key_value_heads") or kv_heads
    )
    rope = text.get("rope_parameters") or {}
    sliding_rope = rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 1e4}
    full_rope = rope.get("full_attention") or {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1e6,
    }
    for kind, params in (("sliding", sliding_rope), ("full", full_rope)):
        if params.get("rope_type", "default") not in ("default", "proportional"):
            raise ValueError(f"DiffusionGemma {kind} layers' rope {params} is not supported")
        if params.get("factor", 1.0) != 1.0:
            raise ValueError(
                f"DiffusionGemma {kind} layers' rope scaling {params} is not supported"
            )
    if sliding_rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"DiffusionGemma sliding layers' partial rope {sliding_rope} is not supported"
        )
    if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(
            f"DiffusionGemma activation {text['hidden_activation']!r} is not supported"
        )
    gen = cfg.get("generation_config") or {}
    found = {k: gen[k] for k in _DEFAULTS_KEYS if gen.get(k) is not None}
    bound = (gen.get("sampler_config") or {}).get("entropy_bound")
    if bound is not None:
        found["entropy_bound"] = bound
    diffusion = DiffusionConfig(
        canvas_length=cfg.get("canvas_length", 256),
        global_head_dim=global_head_dim,
        global_kv_heads=global_kv_heads,
        global_rope_theta=float(full_rope.get("rope_theta", 1e6)),
        global_rotary_fraction=float(full_rope.get("partial_rotary_factor", 1.0)),
        logit_softcap=float(text.get("final_logit_softcapping") or 30.0),
        defaults=DenoiseDefaults(**found),
        media_bidirectional=text.get("use_bidirectional_attention") == "vision",
    )
    moe = MoEConfig(
        num_experts=text["num_experts"],
        top_k=text["top_k_experts"],
        intermediate_size=text["moe_intermediate_size"],
        sparse_layers=tuple(range(layers)),
        activation="gelu_tanh",
    )
    return ModelConfig(
        family="diffusion_gemma",
        vocab_size=text.get("vocab_size", 262144),
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_layers=layers,
        num_heads=text["num_attention_heads"],
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        max_position_embeddings=text.get("max_position_embeddings", 131072),
        rope=RopeConfig(theta=float(sliding_rope.get("rope_theta", 1e4))),
        tie_word_embeddings=True,
        qk_norm=True,
        layer_windows=tuple(window if k == "sliding_attention" else None for k in kinds),
        vision=gemma4_vision_from_hf(cfg),
        moe=moe,
        diffusion=diffusion,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma-4's RMSNorm: x · (mean(x²) + eps)^-½ (computed in float32 whatever x's dtype),
    times `weight` where it has one."""
    return nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


class _Norm(nn.Module):
    """`rms_norm` with a weight of its own."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by the halves convention (cos, sin [T, D])."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


@dataclass
class CanvasBatch:
    """One forward of a block-diffusion model over packed segments (see the module's
    docstring). Per segment, on the host: `query_lens`, `starts` (its first query's position;
    queries follow one another), `denoise` (a canvas: bidirectional, writes no KV) and
    `past_slots` (the full layers' KV slot of each of its positions before `starts`, in
    order) and `window_past_slots` (the sliding layers' slots of at least its last window - 1
    positions before `starts`: their KV may be a ring that holds no more). On the device: `ids`
    [T] of the packed queries, `soft` [canvas tokens, hidden] the self-conditioning embeddings
    of the denoise segments' tokens in order (None: no denoise segment), `write_slots` and
    `window_write_slots` [encode tokens] where the encode segments' tokens write,
    `media` the packed positions [n] whose input is a media embedding and those embeddings
    [n, hidden] (an image's, in place of its placeholder tokens'), or None; `whole` (host)."""

    ids: torch.Tensor
    soft: torch.Tensor | None
    write_slots: torch.Tensor
    window_write_slots: torch.Tensor
    query_lens: list[int]
    starts: list[int]
    denoise: list[bool]
    past_slots: list[np.ndarray]
    window_past_slots: list[np.ndarray]
    media: tuple[torch.Tensor, torch.Tensor] | None = None
    # Per segment: runs [start, end) of its queries that attend to each other both ways (an
    # image's tokens in an encode segment, where the model says so).
    whole: list[list[tuple[int, int]]] | None = None


@dataclass
class _Layout:
    """What every layer of one attention kind reads of a batch: the past slots it gathers
    [B, P] and the mask [B, 1, Q, P + Q] over [past | the segment's own queries]."""

    past: torch.Tensor
    mask: torch.Tensor


@dataclass
class _Plan:
    """A batch as the layers run it: token positions, the packed <-> padded maps, the two
    attention layouts (by window: None is full), which tokens are encode ones, and each
    token's layer scalar choice."""

    positions: torch.Tensor  # [T]
    padded: torch.Tensor  # [T]: each token's row in [B * Q]
    batch: int
    width: int  # Q: the longest segment
    dense: bool  # every segment is Q long: packed is padded
    layouts: dict[int | None, _Layout]
    encode_tokens: torch.Tensor  # [encode tokens]: their packed indices
    denoise_tokens: torch.Tensor  # [canvas tokens]
    is_denoise: torch.Tensor  # [T, 1] bool
    writes: dict[int | None, torch.Tensor]  # by window: the encode tokens' slots


def _layout(batch: CanvasBatch, window: int | None, width: int, device: torch.device) -> _Layout:
    if window is None:
        pasts = batch.past_slots
    else:
        pasts = [s[max(0, len(s) - window + 1) :] for s in batch.window_past_slots]
    longest = max((len(p) for p in pasts), default=0)
    past = np.zeros((len(pasts), longest), np.int64)
    mask = np.zeros((len(pasts), width, longest + width), bool)
    q = np.arange(width)[:, None]
    for b, slots in enumerate(pasts):
        n, length = len(slots), batch.query_lens[b]
        past[b, :n] = slots
        if batch.denoise[b]:
            mask[b, :length, :n] = True
            mask[b, :length, longest : longest + length] = True
        else:
            # past position start - n + j is within reach of query i while i + n - j < window
            j = np.arange(n)[None, :]
            seen = np.ones((width, n), bool) if window is None else (q + n - j < window)
            mask[b, :, :n] = seen
            own = np.arange(width)[None, :]
            causal = own <= q
            if window is not None:
                causal &= q - own < window
            mask[b, :, longest:] = causal & (own < length)
            for start, end in batch.whole[b] if batch.whole else ():
                mask[b, start:end, longest + start : longest + end] = True
        mask[b, length:, :] = False
        # A padding query sees itself alone (a row of no keys would be NaN).
        mask[b, np.arange(length, width), longest + np.arange(length, width)] = True
    return _Layout(
        torch.from_numpy(past).to(device), torch.from_numpy(mask).to(device).unsqueeze(1)
    )


class _Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        methods: LinearMethods,
    ) -> None:
        super().__init__()
        diffusion = config.diffusion
        assert diffusion is not None
        self.window = config.window(layer)
        full = self.window is None
        self.head_dim = diffusion.global_head_dim if full else config.head_dim
        self.kv_heads = diffusion.global_kv_heads if full else config.num_kv_heads
        self.heads = config.num_heads
        self.eps = config.rms_norm_eps
        hidden, linear = config.hidden_size, methods.unquantized
        self.q_proj = Linear(hidden, self.heads * self.head_dim, False, linear)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, False, linear)
        # The full layers' values are their keys (`attention_k_eq_v`).
        self.v_proj = None if full else Linear(hidden, self.kv_heads * self.head_dim, False, linear)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, False, linear)
        self.q_norm = _Norm(self.head_dim, self.eps)
        self.k_norm = _Norm(self.head_dim, self.eps)

    def forward(
        self,
        x: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor],
        plan: _Plan,
        cache: KVCache,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        cos, sin = rotation
        q = self.q_norm(self.q_proj(x).view(tokens, self.heads, self.head_dim))
        q = _rotate(q, cos, sin)
        k = self.k_proj(x).view(tokens, self.kv_heads, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).view(tokens, self.kv_heads, -1)
        k = _rotate(self.k_norm(k), cos, sin)
        v = rms_norm(v, None, self.eps)
        k_cache, v_cache = cache
        layout = plan.layouts[self.window]
        # The encode tokens' keys join the cache first: a canvas of the same sequence in this
        # batch reads them as its past (their own segment reads them as its own keys).
        k_cache[plan.writes[self.window]] = k[plan.encode_tokens]
        v_cache[plan.writes[self.window]] = v[plan.encode_tokens]
        past_k, past_v = k_cache[layout.past], v_cache[layout.past]  # [B, P, kv, D]
        rows = plan.batch * plan.width
        own = []
        for t, heads in ((q, self.heads), (k, self.kv_heads), (v, self.kv_heads)):
            if not plan.dense:
                padded = t.new_zeros(rows, heads, self.head_dim)
                padded[plan.padded] = t
                t = padded
            own.append(t.view(plan.batch, plan.width, heads, self.head_dim))
        q_pad, k_own, v_own = own
        keys = torch.cat((past_k, k_own), dim=1).transpose(1, 2)
        values = torch.cat((past_v, v_own), dim=1).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys,
            values,
            attn_mask=layout.mask,
            scale=1.0,
            enable_gqa=self.heads != self.kv_heads,
        )
        out = out.transpose(1, 2).reshape(rows, self.heads * self.head_dim)
        return self.o_proj(out if plan.dense else out[plan.padded])


class _Router(nn.Module):
    """Each token's experts: a scale-free RMSNorm of x times `scale` and hidden^-½, softmax
    over the experts' logits, the top k renormalized, times each chosen one's
    `per_expert_scale`."""

    def __init__(self, config: ModelConfig, moe: MoEConfig, methods: LinearMethods) -> None:
        super().__init__()
        self.proj = Linear(config.hidden_size, moe.num_experts, False, methods.unquantized)
        self.scale = nn.Parameter(torch.empty(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(moe.num_experts))
        self.top_k = moe.top_k
        self.eps = config.rms_norm_eps
        self.root = config.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = rms_norm(x, None, self.eps) * self.scale * self.root
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


# A layer's norms, as the checkpoint names them (and the layer its modules).
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_feedforward_layernorm_1",
    "post_feedforward_layernorm_2",
    "pre_feedforward_layernorm_2",
)


class _GatedMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int, methods: LinearMethods) -> None:
        super().__init__()
        linear = methods.unquantized
        self.gate_proj = Linear(hidden, inner, False, linear)
        self.up_proj = Linear(hidden, inner, False, linear)
        self.down_proj = Linear(inner, hidden, False, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = nn.functional.gelu(self.gate_proj(x), approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


class _SelfConditioning(_GatedMLP):
    """A canvas's input embeddings [n, hidden] joined by the previous step's predictions (their
    soft embeddings): the scale-free norm of embeddings + MLP(norm(soft))."""

    def __init__(self, hidden: int, inner: int, eps: float, methods: LinearMethods) -> None:
        super().__init__(hidden, inner, methods)
        self.pre_norm = _Norm(hidden, eps)
        self.eps = eps

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return rms_norm(embeds + super().forward(self.pre_norm(soft)), None, self.eps)


class _Layer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        platform: Platform,
        methods: LinearMethods,
    ) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        hidden = config.hidden_size
        self.self_attn = _Attention(config, layer, methods)
        self.mlp = _GatedMLP(hidden, config.intermediate_size, methods)
        self.router = _Router(config, moe, methods)
        self.experts = Experts(hidden, moe, platform, methods, f"layers.{layer}.experts")
        for name in LAYER_NORMS:
            setattr(self, name, _Norm(hidden, config.rms_norm_eps))
        # The two passes' scalars (transformers keeps one per pass): the denoise's, the encode's.
        self.layer_scalar = nn.Parameter(torch.empty(1))
        self.encoder_layer_scalar = nn.Parameter(torch.empty(1))

    def forward(
        self,
        x: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor],
        plan: _Plan,
        cache: KVCache,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rotation, plan, cache)
        x = x + self.post_attention_layernorm(h)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        weights, ids = self.router(x)
        sparse = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
        sparse = self.post_feedforward_layernorm_2(sparse)
        x = x + self.post_feedforward_layernorm(dense + sparse)
        scalar = torch.where(plan.is_denoise, self.layer_scalar, self.encoder_layer_scalar)
        return x * scalar.to(x.dtype)


class DiffusionGemmaForBlockDiffusion(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        platform: Platform,
        methods: LinearMethods,
    ) -> None:
        super().__init__()
        diffusion = config.diffusion
        assert diffusion is not None
        self.config = config
        self.diffusion = diffusion
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            _Layer(config, i, platform, methods) for i in range(config.num_layers)
        )
        self.norm = _Norm(hidden, config.rms_norm_eps)
        self.self_conditioning = _SelfConditioning(
            hidden, config.intermediate_size, config.rms_norm_eps, methods
        )
        self.encoders = nn.ModuleDict({e.kind: e.build(hidden) for e in config.encoders})
        self._inv_freq: dict[tuple[int | None, torch.device], torch.Tensor] = {}
        self._embed_scale: torch.Tensor | None = None

    def media_encoders(self) -> dict[str, MediaEncoder]:
        return dict(self.encoders.items())  # type: ignore[arg-type]

    # -- the KV cache ---------------------------------------------------------------------------

    def allocate_kv(
        self, slots: int, window_slots: int, dtype: torch.dtype, device: torch.device
    ) -> list[KVCache]:
        """Each layer's key and value tensors [its slots, its kv heads, its head size]: `slots`
        for the full layers, `window_slots` for the sliding ones."""
        caches = []
        for layer in self.layers:
            attn = layer.self_attn
            rows = slots if attn.window is None else window_slots
            shape = (rows, attn.kv_heads, attn.head_dim)
            caches.append(
                (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
            )
        return caches

    # -- the forward ----------------------------------------------------------------------------

    def embed_scale(self) -> torch.Tensor:
        """sqrt(hidden) in the embedding's dtype (rounded as transformers rounds it), made once
        the weights are where they run."""
        if self._embed_scale is None:
            weight = self.embed_tokens.weight
            scale = torch.tensor(self.config.hidden_size**0.5).to(weight.dtype)
            self._embed_scale = scale.to(weight.device)
        return self._embed_scale

    def soft_embedding(self, logits: torch.Tensor) -> torch.Tensor:
        """A step's predictions [n, vocab] (the temperature-scaled logits) as the next step's
        self-conditioning: softmax · embedding table · sqrt(hidden), [n, hidden]."""
        weight = self.embed_tokens.weight
        probs = logits.to(weight.dtype).softmax(dim=-1, dtype=torch.float32).to(weight.dtype)
        return (probs @ weight) * self.embed_scale()

    def forward(self, batch: CanvasBatch, caches: list[KVCache]) -> torch.Tensor:
        """The final hidden states [canvas tokens, hidden] of the denoise segments' tokens in
        order; the encode segments' keys and values are written to `caches`."""
        plan = self._plan(batch)
        x = self.embed_tokens(batch.ids) * self.embed_scale()
        if batch.media is not None:
            rows, embeds = batch.media
            x[rows] = embeds.to(x.dtype)
        if batch.soft is not None:
            canvas = plan.denoise_tokens
            x[canvas] = self.self_conditioning(x[canvas], batch.soft)
        rotations = {
            window: self._rotation(window, plan.positions, x.dtype) for window in plan.layouts
        }
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, rotations[layer.self_attn.window], plan, cache)
        return self.norm(x[plan.denoise_tokens])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, soft-capped: cap · tanh(logits / cap)."""
        cap = self.diffusion.logit_softcap
        logits = (hidden @ self.embed_tokens.weight.T).float()
        return torch.tanh(logits / cap) * cap

    def _plan(self, batch: CanvasBatch) -> _Plan:
        device = batch.ids.device
        width = max(batch.query_lens)
        positions, padded, encode, denoise = [], [], [], []
        offset = 0
        for b, (length, start) in enumerate(zip(batch.query_lens, batch.starts, strict=True)):
            positions.append(np.arange(start, start + length))
            padded.append(b * width + np.arange(length))
            (denoise if batch.denoise[b] else encode).append(np.arange(offset, offset + length))
            offset += length
        windows = {self.config.window(i) for i in range(self.config.num_layers)}

        def tensor(parts: list[np.ndarray]) -> torch.Tensor:
            joined = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            return torch.from_numpy(joined.astype(np.int64)).to(device)

        denoise_tokens = tensor(denoise)
        is_denoise = torch.zeros(offset, 1, dtype=torch.bool, device=device)
        is_denoise[denoise_tokens] = True
        return _Plan(
            positions=tensor(positions),
            padded=tensor(padded),
            batch=len(batch.query_lens),
            width=width,
            dense=all(length == width for length in batch.query_lens),
            layouts={w: _layout(batch, w, width, device) for w in windows},
            encode_tokens=tensor(encode),
            denoise_tokens=denoise_tokens,
            is_denoise=is_denoise,
            writes={
                w: batch.write_slots if w is None else batch.window_write_slots for w in windows
            },
        )

    def _rotation(
        self, window: int | None, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, D] of the layers of this window: the sliding layers' whole head at
        the decoder's theta; the full layers' first fraction of it (the rest unrotated)."""
        key = (window, positions.device)
        inv_freq = self._inv_freq.get(key)
        if inv_freq is None:
            d = self.diffusion
            if window is None:
                dim, theta = d.global_head_dim, d.global_rope_theta
                angles = int(d.global_rotary_fraction * dim // 2)
            else:
                dim, theta = self.config.head_dim, self.config.rope.theta
                angles = dim // 2
            exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim
            inv_freq = torch.zeros(dim // 2)
            inv_freq[:angles] = 1.0 / theta**exponents
            inv_freq = self._inv_freq[key] = inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    # -- weights --------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's tensors under transformers' names: the decoder's (`model.decoder.`,
        which the encoder shares, so the encoder's copies are skipped but its layer scalars),
        the vision tower's and projection's (to the image encoder); a missing or unknown one is
        a ValueError naming it."""
        params = {n: p for n, p in self.named_parameters() if not n.startswith("encoders.")}
        loaded: set[str] = set()
        media: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for name, tensor in weights:
                if name.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.")):
                    media.append((name, tensor))
                    continue
                if name == "lm_head.weight":
                    continue  # tied to the embedding
                target = name.removeprefix("model.decoder.")
                if name.startswith("model.encoder.language_model."):
                    if not name.endswith(".layer_scalar"):
                        continue  # the decoder's
                    target = name.removeprefix("model.encoder.language_model.")
                    target = target.replace("layer_scalar", "encoder_layer_scalar")
                layer, experts, part = target.partition(".experts.")
                if experts:
                    self.layers[int(layer.removeprefix("layers."))].experts.load(part, tensor)
                    continue
                if target == name or target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in DiffusionGemma")
                copy_into(params[target], tensor, name)
                loaded.add(target)
        missing = sorted(n for n in set(params) - loaded if ".experts." not in n)
        if missing:
            raise ValueError(f"checkpoint lacks DiffusionGemma tensors {missing[:5]}")
        if "image" in self.encoders:
            self.encoders["image"].load_weights(media)
        process_weights_after_loading(self)
        for layer in self.layers:
            layer.experts.finish_loading()


def _build(
    config: ModelConfig,
    max_positions: int,
    platform: Platform,
    methods: LinearMethods,
    max_loras: int,
    max_lora_rank: int,
    parallel: TensorParallel | None,
) -> DiffusionGemmaForBlockDiffusion:
    if parallel is not None:
        raise ValueError("tensor parallelism is not supported for DiffusionGemma")
    if max_loras:
        raise ValueError("LoRA is not supported for DiffusionGemma")
    return DiffusionGemmaForBlockDiffusion(config, platform, methods)


register(
    Family(
        name="diffusion_gemma",
        model=_build,  # type: ignore[arg-type]
        hf_architectures=("DiffusionGemmaForBlockDiffusion",),
        from_hf=_from_hf,
    )
)
