"""A linear layer whose matmul is run by the quantization method it was built with, plus, in a
model built with LoRA slots, its adapters' low-rank side path."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from inflight.model.kernels.cpu.decoder import KernelCall, LinearKernels
from inflight.model.layers.lora import LoRAMapping, LoRASlots


class Fp8Rows(NamedTuple):
    """Activation rows already in an FP8 linear layer's input form, made by the kernel before
    it (a norm, SiLU-mul: `Linear.takes_fp8_rows`): the float8 rows [T, K], their float32
    scales [T, 1] (`quantization.fp8_rows`), and the activations' dtype, which the layer
    outputs."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


class LinearMethod:
    """How a linear layer runs its matmul; layers/quantization.py holds one subclass per kind."""

    # False: the method builds its run form from the checkpoint's stored blocks of the layer's
    # sources, and its layers hold no float weight for the checkpoint to load.
    loads_weight = True
    # True: `apply` also takes its input as `Fp8Rows`, quantized by the kernel that made it.
    takes_fp8_rows = False

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Turn the loaded weight into the form `apply` runs (once); the float weight as
        loaded needs nothing."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def kernel_calls(self, layer: Linear) -> list[KernelCall] | None:
        """The native matmuls `apply` runs, by stretch of output rows (for the CPU decoder step,
        kernels/cpu/decoder.py); None where it runs none."""
        return None


class Linear(nn.Module):
    """x @ weight^T (+ bias). `weight` [out, in] is the float parameter checkpoints load into
    (None where the method runs from the checkpoint's stored blocks instead);
    `process_weights_after_loading` then lets the method replace it by its run form
    (`prepared`), which `forward` runs. `sources`: the checkpoint tensors it loads, in the
    order of its output rows (a fused layer's parts), for methods that build their run form from
    the stored blocks. `lora_slots`: the adapters this layer can run, where the model has LoRA
    slots."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        method: LinearMethod,
        sources: tuple[str, ...] = (),
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.method = method
        self.sources = sources
        self.prepared: Any = None
        if method.loads_weight:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
        else:
            self.register_parameter("weight", None)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.lora_slots: LoRASlots | None = None

    def forward(self, x: torch.Tensor | Fp8Rows, lora: LoRAMapping | None = None) -> torch.Tensor:
        """x @ weight^T (+ bias), then the update of each adapter in `lora` on its tokens. x
        comes quantized (`Fp8Rows`) only where `takes_fp8_rows`."""
        y = self.method.apply(self, x, self.bias)
        if lora is not None:
            self.lora_slots.add(y, x, lora)
        return y

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether `forward` takes its input quantized (`Fp8Rows`): its method does,
        and no adapter's side path needs the float rows."""
        return self.method.takes_fp8_rows and self.lora_slots is None

    def native_kernels(self) -> LinearKernels | None:
        """This layer as the native CPU decoder step runs it (kernels/cpu/decoder.py): its
        method's native matmuls and its LoRA slots; None where its method runs none."""
        calls = self.method.kernel_calls(self)
        if calls is None:
            return None
        lora = None if self.lora_slots is None else self.lora_slots.native_factors()
        return LinearKernels(calls, lora)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, method={type(self.method).__name__}"
        )


def process_weights_after_loading(model: nn.Module) -> None:
    """Turn the weight of every Linear in `model` into its method's run form (once, after the
    weights are loaded)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)
