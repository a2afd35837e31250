"""How a linear layer runs its matmul: one method object per kind, and the choice of a method
for each layer of a model, made when the model is built.

Every method but one starts from a float weight parameter [out, in] that checkpoints load into;
once it is loaded, `process_weights_after_loading` turns it into the method's run form, and
`apply` runs that. The exception, StoredBlocksLinearMethod, builds its run form from the
checkpoint's stored blocks of the layer's sources instead (`loads_weight` False: no float weight
at all). A method keeps nothing per layer: one instance serves every layer it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from inflight.model.kernels.cpu import blocks, int8, q4
from inflight.model.kernels.cpu.decoder import KernelCall
from inflight.model.layers.linear import Fp8Rows, Linear, LinearMethod
from inflight.model.layers.platform import Platform

# The native kernel that runs a weight stored in a GGUF type as it was stored: Q4_1 is the
# 4-bit kernel's own block format (re-quantized from the loaded floats, which gives the stored
# blocks back up to float rounding); Q8_0, Q5_0 and the K-quants (Q4_K, Q5_K, Q6_K) run from
# their stored blocks, exactly (StoredBlocksLinearMethod: "blocks").
KERNEL_FOR_STORED_TYPE = {"Q4_1": "q4", **dict.fromkeys(blocks.BLOCK_TYPES, "blocks")}


class StoredBlocks(NamedTuple):
    """A checkpoint tensor as its file stores it: the GGML type name and the raw rows [N, bytes]
    (uint8), in the row order of the loaded float tensor."""

    type_name: str
    blocks: np.ndarray


def _take_weight(layer: Linear) -> torch.Tensor:
    """The loaded weight, which the layer stops holding: its run form replaces it."""
    weight = layer.weight.detach()
    del layer.weight
    layer.register_parameter("weight", None)
    return weight


class TorchLinearMethod(LinearMethod):
    """F.linear on the weight as loaded: CUDA, and wherever no faster path applies."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class InvariantLinearMethod(LinearMethod):
    """CUDA, batch-invariant mode: one Triton matmul tile shape for every row count
    (kernels/triton/matmul.py), where cuBLAS would pick its kernel by the step's size."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from inflight.model.kernels.triton.matmul import invariant_linear

        return invariant_linear(x, layer.weight, bias)


class PackedLinearMethod(LinearMethod):
    """CPU float32: the weight prepacked into oneDNN's blocked layout, which runs the small-batch
    matmuls of decoding about twice as fast as the plain layout."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.prepared = torch.ops.mkldnn._reorder_linear_weight(_take_weight(layer), None)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.numel() == x.shape[-1]:
            # A lone row runs as two: oneDNN gives one row a kernel of its own, which sums K in
            # another order (seen on AVX-512 past K = 1024), so a decode at batch 1, or the one
            # new token after a cached prefix, would miss the bits that row gets beside others.
            row = x if x.dim() == 2 else x.reshape(1, -1)
            pair = torch.cat((row, row))
            y = torch.ops.mkldnn._linear_pointwise(pair, layer.prepared, bias, "none", [], "")[:1]
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(x, layer.prepared, bias, "none", [], "")


class Int8LinearMethod(LinearMethod):
    """CPU float32: int8 weights and per-token int8 activations in blocks of 32 along K
    (kernels/cpu/int8.py), faster again than oneDNN. in_features must be a multiple of 32."""

    def __init__(self) -> None:
        # A missing compiler or CPU feature shows here (NativeBuildError), not mid-generation.
        int8.load_kernel()

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.prepared = int8.quantize_weight(_take_weight(layer))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8.int8_linear(x, layer.prepared, bias)

    def kernel_calls(self, layer: Linear) -> list[KernelCall]:
        return [blocks.kernel_call(layer.prepared, layer.bias)]


class Q4LinearMethod(LinearMethod):
    """CPU float32: 4-bit weights in GGUF's Q4_1 form, so that a Q4_1 checkpoint keeps its own
    weights, and per-token int8 activations (kernels/cpu/q4.py). in_features must be a multiple
    of 32."""

    def __init__(self) -> None:
        q4.load_kernel()

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.prepared = q4.quantize_q4(_take_weight(layer))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return q4.q4_linear(x, layer.prepared, bias)

    def kernel_calls(self, layer: Linear) -> list[KernelCall]:
        return [blocks.kernel_call(layer.prepared, layer.bias)]


class StoredBlocksLinearMethod(LinearMethod):
    """CPU float32: GGUF weights run from the stored blocks of the layer's sources
    (`stored_blocks`, by checkpoint tensor name), never re-quantized (kernels/cpu/blocks.py):
    Q8_0 and Q5_0 in the int8 kernel, Q4_K in the 4-bit kernel, Q5_K and Q6_K in k8_matmul.c,
    with per-token int8 activations. Its layers hold no float weight: the loader skips their
    tensors. A fused layer's parts stored in types of one kernel (Q4_K_M's Q8_0 v_proj beside
    Q5_0 q/k) are stacked into one weight; each stretch of parts of another kernel runs in its
    own, into its slice of the output."""

    loads_weight = False

    def __init__(self, stored_blocks: Callable[[str], StoredBlocks], types: Iterable[str]) -> None:
        """`types`: the stored types it will meet, whose kernels are built now."""
        blocks.load_kernels(types)
        self.stored_blocks = stored_blocks

    def process_weights_after_loading(self, layer: Linear) -> None:
        if layer.weight is not None:  # a tied head holds the embedding's
            _take_weight(layer)
        runs: list[list[blocks.BlockWeight]] = []
        for source in layer.sources:
            stored = self.stored_blocks(source)
            weight = blocks.block_weight(stored.type_name, stored.blocks, layer.in_features)
            if runs and type(runs[-1][0]) is type(weight):
                runs[-1].append(weight)
            else:
                runs.append([weight])
        layer.prepared = tuple(blocks.concat_rows(run) for run in runs)
        rows = sum(w.out_features for w in layer.prepared)
        if rows != layer.out_features:
            raise ValueError(
                f"stored blocks of {layer.sources} hold {rows} rows, the layer {layer.out_features}"
            )

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if len(layer.prepared) == 1:
            return blocks.block_linear(x, layer.prepared[0], bias)
        parts = _parts(layer.prepared, bias)
        return torch.cat([blocks.block_linear(x, w, b) for w, b in parts], dim=-1)

    def kernel_calls(self, layer: Linear) -> list[KernelCall]:
        return [blocks.kernel_call(w, b) for w, b in _parts(layer.prepared, layer.bias)]


def _parts(
    weights: Sequence[blocks.BlockWeight], bias: torch.Tensor | None
) -> Iterator[tuple[blocks.BlockWeight, torch.Tensor | None]]:
    """Each weight of a layer's stretches of output rows, with its slice of the bias."""
    start = 0
    for weight in weights:
        end = start + weight.out_features
        yield weight, None if bias is None else bias[start:end]
        start = end


# The largest magnitude float8_e4m3fn holds.
FP8_MAX = 448.0


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` in float8 (e4m3) scaled to its largest magnitude, and the float32 scales
    [rows, 1] that bring it back (an all-zero row gets scale 1)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # Times the reciprocal, which torch's CUDA division by a number computes anyway (its CPU
    # one divides): the same scale on both, and in the Triton kernels. The values are then
    # multiplied by the scale's reciprocal (rounded once, per row), where a division of each
    # cost the Triton kernels ~18 % of their time (bench/RESULTS.md, session 31).
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), 1.0)
    inverse = 1.0 / scale
    return (x.float() * inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class Fp8LinearMethod(LinearMethod):
    """FP8 (e4m3) weights with a scale per output channel, and activations quantized per token
    at run time: one FP8 tensor-core matmul with rowwise scales that halves the weights' bytes.
    For CUDA devices with FP8 tensor cores (Hopper, Ada), where one Triton kernel quantizes the
    activations and calls of a few rows (decode steps; `fp8_matmul.takes`) take the few-rows
    kernel, which streams the weights at bandwidth where cuBLASLt does not; calls of the row
    counts where cuBLASLt's rowwise GEMM is slow (`fp8_tensorwise.takes`) its tensorwise GEMM
    with the scales applied after; the others `torch._scaled_mm` with rowwise scales. The
    formula runs on the CPU too, which the tests use. It also takes its input already
    quantized (`Fp8Rows`), where the kernel before it did that."""

    takes_fp8_rows = True

    def __init__(self, platform: Platform) -> None:
        self.quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = fp8_rows
        self.few_rows: Callable[..., torch.Tensor] | None = None
        self.few_rows_takes: Callable[[int, int], bool] = lambda rows, n: False
        self.tensorwise: Callable[..., torch.Tensor] | None = None
        self.tensorwise_takes: Callable[[int, int, int], bool] = lambda rows, n, k: False
        if platform.device.type == "cuda":
            from inflight.model.kernels.triton import fp8_matmul, fp8_tensorwise
            from inflight.model.kernels.triton import ops as triton_ops
            from inflight.model.kernels.triton.plan import multiprocessors

            self.quantize_rows = functools.partial(triton_ops.fp8_rows, fp8_max=FP8_MAX)
            self.few_rows = fp8_matmul.fp8_few_rows_linear
            sms = multiprocessors(platform.device)
            self.few_rows_takes = lambda rows, n: fp8_matmul.takes(rows, n, sms)
            self.tensorwise = functools.partial(
                fp8_tensorwise.fp8_tensorwise_linear,
                one=torch.ones((), device=platform.device),
            )
            self.tensorwise_takes = fp8_tensorwise.takes

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.prepared = fp8_rows(_take_weight(layer))

    def apply(
        self, layer: Linear, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None
    ) -> torch.Tensor:
        weight, weight_scale = layer.prepared
        if isinstance(x, Fp8Rows):
            (xq, x_scale, dtype), shape = x, x.values.shape
        else:
            dtype, shape = x.dtype, x.shape
            xq, x_scale = self.quantize_rows(x.reshape(-1, shape[-1]))
        rows, (n, k) = xq.shape[0], weight.shape
        if self.few_rows is not None and self.few_rows_takes(rows, n):
            y = self.few_rows(xq, x_scale, weight, weight_scale, bias, dtype)
        elif self.tensorwise is not None and self.tensorwise_takes(rows, n, k):
            y = self.tensorwise(xq, x_scale, weight, weight_scale, bias, dtype)
        else:
            y = torch._scaled_mm(
                xq,
                weight.t(),
                scale_a=x_scale,
                scale_b=weight_scale.t(),
                bias=bias,
                out_dtype=dtype,
            )
        return y.reshape(*shape[:-1], y.shape[-1])


# The CPU kernels' methods, by kind (FP8's takes the platform it quantizes activations on).
QUANTIZED_METHODS: dict[str, type[LinearMethod]] = {"int8": Int8LinearMethod, "q4": Q4LinearMethod}


def unquantized_method(platform: Platform) -> LinearMethod:
    """The float method of `platform`: oneDNN-packed on the CPU float32 path, the
    batch-invariant Triton matmul on CUDA in that mode, else F.linear."""
    if platform.batch_invariant and platform.device.type == "cuda":
        return InvariantLinearMethod()
    return PackedLinearMethod() if platform.onednn else TorchLinearMethod()


@dataclass(frozen=True)
class LinearMethods:
    """The method of each linear layer of a model, by what the layer computes and loads.

    mode "none": `unquantized` everywhere. "int8", "q4": that kernel wherever in_features is a
    multiple of 32 (else `unquantized`), except that under "q4" the head is int8: its errors
    reach the logits undamped. "fp8": FP8 for the decoder layers (in_features a multiple of
    32 likewise), the head in float. "auto": the kernel that runs the stored type (`stored_types`,
    by checkpoint tensor name) of the tensors a layer loads, when they all share one (the types
    run from their stored blocks count as one, "blocks"); else, or where `kernels` lacks it,
    `unquantized`. `kernels` holds the quantized methods the mode can pick, by kind.
    """

    unquantized: LinearMethod
    mode: str = "none"
    kernels: Mapping[str, LinearMethod] = field(default_factory=dict)
    stored_types: Mapping[str, str] = field(default_factory=dict)

    def choose(self, in_features: int, sources: Sequence[str], head: bool = False) -> LinearMethod:
        """The method of a linear layer loaded from the checkpoint tensors `sources` (the parts
        of a fused layer; the embedding for a tied head); `head`: it computes the logits."""
        kind = self._kind(sources, head)
        if kind is None or kind not in self.kernels or in_features % int8.BLOCK:
            return self.unquantized
        return self.kernels[kind]

    def _kind(self, sources: Sequence[str], head: bool) -> str | None:
        if self.mode == "auto":
            kinds = {KERNEL_FOR_STORED_TYPE.get(self.stored_types.get(s, "")) for s in sources}
            return kinds.pop() if len(kinds) == 1 else None
        if self.mode == "q4" and head:
            return "int8"
        if self.mode == "fp8" and head:
            return None
        return None if self.mode == "none" else self.mode
