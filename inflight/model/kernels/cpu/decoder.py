"""ctypes bindings of decoder.c: a whole step of a Llama-family decoder in one call.

`build_step` builds a `DecoderStep` once per model and KV cache from the plain descriptions its
layers give of themselves (`LayerKernels`: their norms' weights, which kernel runs each linear
layer on which tensors, their LoRA slots, their KV cache, their experts); each call then fills
in the step's metadata. It holds the tensors it points at, so none is freed while it lives.

A mixture of experts' router runs in Python (the layer's own `route`), called back from
decoder.c: its logits are oneDNN's float matmul, which sums over K in blocks whose size follows
the shapes and the CPU, and its softmax is torch's vectorized exp, so no C of ours would give
their bits, and a step's routing must be the layers' exactly (a near-tie decided the other way
picks another expert). That costs some 25 to 50 us a layer, most of it the oneDNN call; the
experts run in C, each in its linear layers' native kernels.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inflight.model.kernels.cpu import native
from inflight.model.metadata import AttentionMetadata, KVCache

_SOURCE = Path(__file__).with_name("decoder.c")
_MAX_PARTS = 4  # decoder.c's MAX_PARTS
_p, _i64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class KernelCall:
    """One stretch of a linear layer's output rows and the native matmul that computes it:
    `kernel` takes (x, M, K, *tensors, N, bias, out, threads), as the q4, int8 and k8 kernels
    do."""

    kernel: ctypes._CFuncPtr
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None
    out_features: int


@dataclass(frozen=True)
class LoraFactors:
    """A linear layer's LoRA adapter slots, as layers/lora.py's LoRASlots holds them (decoder.c
    reads them in place, so adapters loaded later count): A [parts, slots, max_rank, in], B^T
    [slots, max_rank, out], int32 ranks [slots], int64 part starts [parts + 1]."""

    a: torch.Tensor
    bt: torch.Tensor
    ranks: np.ndarray
    starts: np.ndarray


@dataclass(frozen=True)
class LinearKernels:
    """A linear layer as decoder.c runs it: its matmul parts, and its LoRA slots if any."""

    calls: Sequence[KernelCall]
    lora: LoraFactors | None = None


# A mixture of experts' routing of its normed tokens x [T, hidden]: each token's top-k expert
# weights (float32) and indices (int64) [T, k], and its shared expert's gate [T, 1] (None:
# ungated).
Route = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class MoEKernels:
    """A mixture-of-experts feed-forward as decoder.c runs it: `route` (Python, called back),
    then each token's `top_k` experts, expert e's first linear layer `gate_up[e]` (gate rows,
    then up rows; silu(gate) * up follows) and its second `down[e]`."""

    route: Route
    top_k: int
    gate_up: Sequence[LinearKernels]
    down: Sequence[LinearKernels]


@dataclass(frozen=True)
class LayerKernels:
    """What decoder.c runs for one decoder layer (float32 weights and caches); `gate_up` and
    `down`: its MLP's, or with `moe` its shared expert's (None: it has none); `qk_norms`: the
    weights of the per-head q and k RMSNorms (Qwen3), if any; `window`: its attention window
    (None: full attention)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearKernels
    o: LinearKernels
    gate_up: LinearKernels | None
    down: LinearKernels | None
    kv_cache: KVCache
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    window: int | None = None
    moe: MoEKernels | None = None


@dataclass(frozen=True)
class StepShape:
    """The width of a decoder's layers: `heads` query and `kv_heads` KV heads of `head_dim`,
    its norms' epsilon and its attention's scale."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float


class _Part(ctypes.Structure):
    _fields_ = [
        ("kernel", _p),
        ("arity", _i64),
        ("weights", _p * 3),
        ("bias", _p),
        ("out_features", _i64),
    ]


class _Lora(ctypes.Structure):
    _fields_ = [
        ("a", _p),
        ("bt", _p),
        ("ranks", _p),
        ("starts", _p),
        ("slots", _i64),
        ("max_rank", _i64),
        ("parts", _i64),
    ]


class _Linear(ctypes.Structure):
    _fields_ = [
        ("parts", _i64),
        ("part", _Part * _MAX_PARTS),
        ("in_features", _i64),
        ("out_features", _i64),
        ("lora", _Lora),
    ]


class _Moe(ctypes.Structure):
    _fields_ = [("experts", _i64), ("top_k", _i64), ("gate_up", _p), ("down", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p),
        ("post_norm", _p),
        ("q_norm", _p),
        ("k_norm", _p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _p),
        ("v_cache", _p),
        ("kv_stride_h", _i64),
        ("window", _i64),
        ("moe", _p),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("rms_norm", _p),
        ("silu_mul", _p),
        ("rope", _p),
        ("store_kv", _p),
        ("attention", _p),
        ("lora_add", _p),
        ("token_slots", _p),
        *(
            (name, _i64)
            for name in ("layers", "tokens", "rows", "hidden", "heads", "kv_heads", "head_dim")
        ),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, _p) for name in ("qk", "attn", "h", "big", "act", "scratch")),
        ("cos_", _p),
        ("sin_", _p),
        ("slots", _p),
        ("block_tables", _p),
        ("query_start", _p),
        ("seq_lens", _p),
        *((name, _i64) for name in ("bt_stride", "block_size", "max_seq_len")),
        ("window_slots", _p),
        ("window_block_tables", _p),
        ("window_bt_stride", _i64),
        ("threads", _i64),
        ("route", _p),
        *((name, _p) for name in ("expert_in", "expert_out", "pair_weights")),
        *((name, _p) for name in ("pair_tokens", "expert_ends")),
    ]


# decoder.c's route_fn: (layer, &weights, &ids, &gate) -> status.
_ROUTE_FN = ctypes.CFUNCTYPE(ctypes.c_int, _i64, *(ctypes.POINTER(ctypes.c_void_p),) * 3)
_ROUTE_FAILED = 1


@functools.cache
def library() -> ctypes.CDLL:
    lib = native.build(_SOURCE, "the CPU decoder step")
    lib.decoder_step.argtypes = [ctypes.POINTER(_Step), ctypes.POINTER(_Layer), _p, _p]
    lib.decoder_step.restype = ctypes.c_int
    return lib


def _address(function: ctypes._CFuncPtr) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def _linear(layer: LinearKernels, in_features: int) -> _Linear:
    calls = layer.calls
    if not 1 <= len(calls) <= _MAX_PARTS:
        raise ValueError(f"a linear layer of {len(calls)} kernel parts (at most {_MAX_PARTS})")
    linear = _Linear(len(calls), in_features=in_features)
    linear.out_features = sum(call.out_features for call in calls)
    for part, call in zip(linear.part, calls, strict=False):
        if len(call.tensors) not in (2, 3):
            raise ValueError(f"a kernel of {len(call.tensors)} weight tensors")
        part.kernel = _address(call.kernel)
        part.arity = len(call.tensors)
        for i, tensor in enumerate(call.tensors):
            part.weights[i] = tensor.data_ptr()
        part.bias = None if call.bias is None else call.bias.data_ptr()
        part.out_features = call.out_features
    if layer.lora is not None:
        lora = layer.lora
        if not (lora.a.is_contiguous() and lora.bt.is_contiguous()):
            raise ValueError("the decoder step needs contiguous LoRA factors")
        parts, slots, max_rank, _ = lora.a.shape
        linear.lora = _Lora(
            lora.a.data_ptr(),
            lora.bt.data_ptr(),
            lora.ranks.ctypes.data,
            lora.starts.ctypes.data,
            slots,
            max_rank,
            parts,
        )
    return linear


def build_step(
    layers: Sequence[LayerKernels | None],
    shape: StepShape,
    ops: ctypes.CDLL,
    attention: ctypes.CDLL,
) -> DecoderStep | None:
    """The step over every layer of a decoder of `shape`, from each layer's description; None
    where a layer has none (it cannot run in the step) or decoder.c cannot be built here."""
    if any(layer is None for layer in layers):
        return None
    try:
        return DecoderStep(layers, shape, ops, attention)
    except native.NativeBuildError:
        return None


def _experts(moe: MoEKernels, hidden: int) -> tuple[_Moe, ctypes.Array, ctypes.Array]:
    """decoder.c's Moe of `moe`, and the arrays of its experts' linear layers it points at."""
    gate_up = (_Linear * len(moe.gate_up))(*(_linear(e, hidden) for e in moe.gate_up))
    down = (_Linear * len(moe.down))(
        *(_linear(e, first.out_features // 2) for e, first in zip(moe.down, gate_up, strict=True))
    )
    return (
        _Moe(len(gate_up), moe.top_k, ctypes.addressof(gate_up), ctypes.addressof(down)),
        gate_up,
        down,
    )


class DecoderStep:
    """Every layer of a decoder of `shape`; `ops` and `attention`: the libraries of
    kernels/cpu/ops.py and kernels/cpu/attention.py."""

    def __init__(
        self,
        layers: Sequence[LayerKernels],
        shape: StepShape,
        ops: ctypes.CDLL,
        attention: ctypes.CDLL,
    ) -> None:
        self._lib = library()
        hidden, heads, head_dim = shape.hidden, shape.heads, shape.head_dim
        self._layers = list(layers)  # held: the structs point into their tensors
        self._array = (_Layer * len(layers))()
        # Each mixture of experts' struct and experts' arrays, held for the layers pointing at
        # them; the linear layers, for the width of the step's buffers.
        self._experts: list[tuple[_Moe, ctypes.Array, ctypes.Array]] = []
        linears: list[_Linear] = []
        for entry, layer in zip(self._array, layers, strict=True):
            k_cache, v_cache = layer.kv_cache
            if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                raise ValueError("the decoder step needs contiguous KV caches")
            entry.input_norm = layer.input_norm.data_ptr()
            entry.post_norm = layer.post_norm.data_ptr()
            if layer.qk_norms is not None:
                entry.q_norm, entry.k_norm = (w.data_ptr() for w in layer.qk_norms)
            entry.qkv = _linear(layer.qkv, hidden)
            entry.o = _linear(layer.o, heads * head_dim)
            if layer.gate_up is not None and layer.down is not None:
                entry.gate_up = _linear(layer.gate_up, hidden)
                entry.down = _linear(layer.down, entry.gate_up.out_features // 2)
            elif layer.moe is None:
                raise ValueError("a decoder layer without experts needs its MLP")
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            entry.kv_stride_h = k_cache.stride(0)
            entry.window = layer.window or 0
            linears += [entry.qkv, entry.o, entry.gate_up, entry.down]
            if layer.moe is not None:
                moe = _experts(layer.moe, hidden)
                self._experts.append(moe)
                entry.moe = ctypes.addressof(moe[0])
                linears += [*moe[1], *moe[2]]
        # The widest input or output of a linear layer: the width of the step's work buffers.
        self._wide = max(max(linear.in_features, linear.out_features) for linear in linears)
        # The most pairs a token makes and the most experts a layer has: the sizes of the
        # mixtures' buffers.
        self._top_k = max((moe.top_k for moe, _, _ in self._experts), default=0)
        self._num_experts = max((moe.experts for moe, _, _ in self._experts), default=0)
        # What a call's routers take and give (see _route), and the error one raised.
        self._normed: torch.Tensor | None = None
        self._routed: tuple[torch.Tensor, ...] = ()
        self._error: BaseException | None = None
        self._callback = _ROUTE_FN(self._route)
        self._step = _Step(
            rms_norm=_address(ops.rms_norm),
            silu_mul=_address(ops.silu_mul),
            rope=_address(ops.rope),
            store_kv=_address(attention.store_kv),
            lora_add=_address(ops.lora_add),
            attention=_address(attention.paged_attention),
            layers=len(layers),
            hidden=hidden,
            heads=heads,
            kv_heads=shape.kv_heads,
            head_dim=head_dim,
            eps=shape.eps,
            scale=shape.scale,
            route=_address(self._callback),
        )

    def _route(
        self,
        layer: int,
        weights: ctypes._Pointer[ctypes.c_void_p],
        ids: ctypes._Pointer[ctypes.c_void_p],
        gate: ctypes._Pointer[ctypes.c_void_p],
    ) -> int:
        """decoder.c's route_fn: layer `layer`'s router on the step's normed tokens; what it
        gives is held until the next call."""
        try:
            moe = self._layers[layer].moe
            assert moe is not None and self._normed is not None
            chosen, experts, shared_gate = moe.route(self._normed)
            shape = (self._normed.shape[0], moe.top_k)
            if chosen.shape != shape or experts.shape != shape:
                raise ValueError(f"a router chose experts {tuple(experts.shape)}, not {shape}")
            routed = [chosen.to(torch.float32).contiguous(), experts.to(torch.int64).contiguous()]
            if shared_gate is not None:
                routed.append(shared_gate.to(torch.float32).reshape(shape[0]).contiguous())
            self._routed = tuple(routed)
            weights[0], ids[0] = routed[0].data_ptr(), routed[1].data_ptr()
            gate[0] = None if shared_gate is None else routed[2].data_ptr()
        except BaseException as exc:  # raised again once decoder_step returns
            self._error = exc
            return _ROUTE_FAILED
        return 0

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        token_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and the residual stream, from the embedded tokens x
        [T, hidden] (float32; written in place where contiguous) whose cos, sin [T, 1, head_dim]
        are their positions' angles; `token_slots`: [T] int32, each token's LoRA slot (-1: the
        base model alone)."""
        tokens = x.shape[0]
        x = x.contiguous()
        residual = torch.empty_like(x)
        step = self._step
        heads, kv_heads, dim = step.heads, step.kv_heads, step.head_dim
        # decoder.c's buffers (see its Step), held here while it writes them.
        qk = torch.empty(tokens * (heads + kv_heads) * dim)
        attn = torch.empty(tokens, heads, dim)
        h = torch.empty(tokens, step.hidden)
        big, act, scratch = torch.empty(3, tokens, self._wide)
        cos = cos.reshape(tokens, -1).contiguous()
        sin = sin.reshape(tokens, -1).contiguous()
        slots = meta.slot_mapping.contiguous()
        tables = meta.block_tables.contiguous()
        starts = meta.query_start_loc.contiguous()
        seq_lens = meta.seq_lens.contiguous()
        step.tokens, step.rows = tokens, len(meta.query_lens_host)
        step.qk, step.attn, step.h = qk.data_ptr(), attn.data_ptr(), h.data_ptr()
        step.big, step.act, step.scratch = big.data_ptr(), act.data_ptr(), scratch.data_ptr()
        if token_slots is not None:
            token_slots = token_slots.to(torch.int32).contiguous()
        step.token_slots = None if token_slots is None else token_slots.data_ptr()
        step.cos_, step.sin_ = cos.data_ptr(), sin.data_ptr()
        step.slots, step.block_tables = slots.data_ptr(), tables.data_ptr()
        step.query_start, step.seq_lens = starts.data_ptr(), seq_lens.data_ptr()
        step.bt_stride = tables.stride(0)
        # The sliding layers' view: its own where the window group keeps their KV apart.
        window = meta if meta.window is None else meta.window
        window_slots = window.slot_mapping.contiguous()
        window_tables = window.block_tables.contiguous()
        step.window_slots, step.window_block_tables = (
            window_slots.data_ptr(),
            window_tables.data_ptr(),
        )
        step.window_bt_stride = window_tables.stride(0)
        step.block_size, step.max_seq_len = meta.block_size, meta.max_seq_len
        step.threads = torch.get_num_threads()
        if self._experts:
            expert_rows = torch.empty(2, tokens, step.hidden)
            pair_weights = torch.empty(tokens * self._top_k)
            pair_tokens = torch.empty(tokens * self._top_k, dtype=torch.int64)
            expert_ends = torch.empty(self._num_experts, dtype=torch.int64)
            step.expert_in, step.expert_out = expert_rows[0].data_ptr(), expert_rows[1].data_ptr()
            step.pair_weights, step.pair_tokens = pair_weights.data_ptr(), pair_tokens.data_ptr()
            step.expert_ends = expert_ends.data_ptr()
            self._normed = h
        try:
            status = self._lib.decoder_step(
                ctypes.byref(step), self._array, x.data_ptr(), residual.data_ptr()
            )
        finally:
            self._normed, self._routed = None, ()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if status != 0:
            raise RuntimeError(f"the CPU decoder step failed with status {status}")
        return x, residual
