"""A mixture-of-experts feed-forward (see `config.MoEConfig`): a router picks each token's
experts and weights, the experts run as one fused weight per layer, and a shared expert may run
on every token beside them.

Routing is per token and each token's expert outputs are summed in the order of the experts'
indices, so a token's result does not depend on which tokens share its step. The experts run
over the step's (token, expert) pairs sorted by expert: one matmul pair per expert that any
token chose. Each expert's two matmuls are `Linear` layers, which run the method the model's
quantization chooses for them (oneDNN-packed float, int8, 4-bit on the CPU; F.linear, FP8 on
CUDA), so a row's bits never depend on how many rows share its expert.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from inflight.model.config import MoEConfig
from inflight.model.kernels.cpu.decoder import MoEKernels
from inflight.model.layers.activation import SiluAndMul
from inflight.model.layers.linear import Linear
from inflight.model.layers.lora import LoRAMapping
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import LinearMethods, TorchLinearMethod

# A checkpoint tensor of one expert ("3.gate_proj.weight" under a layer's `experts.`): the
# expert, the part (Mixtral names gate, down and up w1, w2 and w3) and weight or bias.
_ONE_EXPERT = re.compile(r"^(\d+)\.(\w+)\.(weight|bias)$")
_PART_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x). torch's CPU sigmoid rounds the vectorized bulk of a tensor and its
    scalar tail differently, so a token's value would follow where the step put it; its exp
    computes the tail with the bulk's code."""
    return 1 / (1 + torch.exp(-x))


class Router(Linear):
    """Each token's `top_k` experts and their weights (float32) from its hidden state: the
    logits x · Wᵀ (+ bias, gpt-oss) in float, never quantized, then scored as
    `config.scoring` says; `e_score_correction_bias` is the sigmoid routers' selection bias."""

    def __init__(self, hidden: int, config: MoEConfig, methods: LinearMethods, prefix: str):
        super().__init__(
            hidden,
            config.num_experts,
            config.router_bias,
            methods.unquantized,
            (f"{prefix}.weight",),
        )
        self.config = config
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(config.num_experts)) if config.selection_bias else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert indices [T, k]) of tokens x [T, hidden]."""
        config, k = self.config, self.config.top_k
        logits = self(x).float()
        if config.scoring == "softmax":
            if config.renormalize:
                # The softmax over the chosen k: that of all experts, renormalized over them.
                top, ids = logits.topk(k, dim=-1)
                weights = top.softmax(dim=-1)
            else:
                weights, ids = logits.softmax(dim=-1).topk(k, dim=-1)
            return weights * config.scaling_factor, ids
        scores = _sigmoid(logits)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if config.num_groups > 1:
            # A group's score is the sum of its best two; only the best groups' experts count.
            groups = choice.view(-1, config.num_groups, config.num_experts // config.num_groups)
            best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)
            kept = best.topk(config.topk_groups, dim=-1).indices
            mask = torch.ones_like(best, dtype=torch.bool).scatter_(1, kept, False)
            choice = groups.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
        ids = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        if config.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * config.scaling_factor, ids


class Experts(nn.Module):
    """A layer's experts: expert e's first matmul `gate_up[e]` [2I, H] (gate rows, then up
    rows; up alone [I, H] for relu² experts) and `down[e]` [H, I], with biases where the
    experts have them. Checkpoints load them whole (`load`), in any of the layouts they come
    in."""

    def __init__(
        self,
        hidden: int,
        config: MoEConfig,
        platform: Platform,
        methods: LinearMethods,
        prefix: str,
    ) -> None:
        super().__init__()
        self.config = config
        inner = config.intermediate_size
        first = 2 * inner if config.gated else inner

        def linear(e: int, parts: tuple[str, ...], in_features: int, out_features: int) -> Linear:
            # Its sources named as a checkpoint with a tensor per expert and part names them
            # (a GGUF file's stacked experts are read under those names too).
            sources = tuple(f"{prefix}.{e}.{part}.weight" for part in parts)
            method = methods.choose(in_features, sources)
            return Linear(in_features, out_features, config.expert_bias, method, sources)

        first_parts = ("gate_proj", "up_proj") if config.gated else ("up_proj",)
        experts = range(config.num_experts)
        self.gate_up = nn.ModuleList(linear(e, first_parts, hidden, first) for e in experts)
        self.down = nn.ModuleList(linear(e, ("down_proj",), inner, hidden) for e in experts)
        self.act = SiluAndMul(platform) if config.activation == "silu" else None
        self.prefix = prefix
        self._loaded: set[tuple[str, int]] = set()
        # CUDA: every expert's first and second weight stacked [E, rows, cols] (and biases) for
        # the grouped kernel, which `finish_loading` builds where the experts run in float.
        self._stacked: tuple[torch.Tensor, ...] | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ over each token's k experts of weight x expert(x), for tokens x [T, hidden]."""
        if self._stacked is not None:
            return self._grouped(x, weights, ids)
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        tokens = order // k
        scale = weights.flatten()[order].to(x.dtype).unsqueeze(1)
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = slice(start, start + count)
            start += count
            h = self.activate(self.gate_up[expert](x[tokens[pairs]]))
            out.index_add_(0, tokens[pairs], self.down[expert](h) * scale[pairs])
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The CUDA path: both matmuls grouped over the pairs sorted by expert, no host sync."""
        from inflight.model.kernels.triton import moe

        assert self._stacked is not None
        return moe.fused_experts(x, weights, ids, *self._stacked, self.activate)

    def finish_loading(self) -> None:
        """Once the checkpoint is loaded and the layers' methods made their run forms: a
        ValueError naming what the checkpoint lacked; on CUDA, where every expert runs its
        float weights, those stacked for the grouped kernel (the experts' layers then hold
        views of them)."""
        missing = self.missing()
        if missing:
            raise ValueError(f"checkpoint lacks {self.prefix} tensors: {', '.join(missing[:3])}")
        layers = [*self.gate_up, *self.down]
        if layers[0].weight is None or layers[0].weight.device.type != "cuda":
            return
        if any(type(layer.method) is not TorchLinearMethod for layer in layers):
            return
        stacked: list[torch.Tensor | None] = []
        for group in (self.gate_up, self.down):
            for kind in ("weight", "bias"):
                if getattr(group[0], kind) is None:
                    stacked.append(None)
                    continue
                whole = torch.stack([getattr(layer, kind).detach() for layer in group])
                for e, layer in enumerate(group):
                    getattr(layer, kind).data = whole[e]
                stacked.append(whole)
        first, first_bias, second, second_bias = stacked
        assert first is not None and second is not None
        self._stacked = (first, second, first_bias, second_bias)

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """The experts' activation of their first matmul's rows [n, 2I or I] -> [n, I]."""
        config = self.config
        if self.act is not None:
            return self.act(h)
        if config.activation == "relu2":
            return torch.relu(h).square()
        if config.activation == "gelu_tanh":
            gate, up = h.chunk(2, dim=-1)
            return nn.functional.gelu(gate, approximate="tanh") * up
        gate, up = h.chunk(2, dim=-1)
        limit = config.swiglu_limit
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * gate * _sigmoid(gate * config.swiglu_alpha)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy in checkpoint tensor `name` (under the layer's `experts.`): a fused weight or
        bias of all experts (`gate_up_proj` [E, 2I, H], transformers 5's layout), the gate's or
        up's rows of all experts (`gate_proj` / `up_proj` [E, I, H], llama.cpp's), or one
        expert's part (`3.gate_proj.weight`, or Mixtral's `3.w1.weight`)."""
        one = _ONE_EXPERT.match(name)
        if one is not None:
            part, bias = _PART_NAMES.get(one[2], one[2]), one[3] == "bias"
            experts, tensors = [int(one[1])], [tensor]
            if experts[0] >= self.config.num_experts:
                raise ValueError(
                    f"expert tensor {name!r}: the layer has {self.config.num_experts} experts"
                )
        else:
            # transformers 5 names a fused bias `gate_up_proj_bias`; llama.cpp's names end in
            # `.weight` or `.bias`.
            stem, _, kind = name.partition(".")
            part = stem.removesuffix("_bias")
            bias = stem.endswith("_bias") or kind == "bias"
            experts = list(range(self.config.num_experts))
            if tensor.shape[0] != len(experts):
                raise ValueError(
                    f"checkpoint tensor {name!r} holds {tensor.shape[0]} experts, "
                    f"the layer {len(experts)}"
                )
            tensors = list(tensor)
        for expert, value in zip(experts, tensors, strict=True):
            dest, labels = self._destination(expert, part, bias)
            if dest is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the layer's experts")
            if dest.shape != value.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(value.shape)} an expert, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(value)
            self._loaded.update((label, expert) for label in labels)

    def _destination(
        self, expert: int, part: str, bias: bool
    ) -> tuple[torch.Tensor | None, tuple[str, ...]]:
        """Where `part` ("gate_up_proj", "gate_proj", "up_proj", "down_proj") of `expert` goes
        (its weight, or bias, or their gate's or up's rows), and what it fills."""
        first, second = self.gate_up[expert], self.down[expert]
        first, second = (first.bias, second.bias) if bias else (first.weight, second.weight)
        kind = " bias" if bias else ""
        if part == "down_proj":
            return second, ("down" + kind,)
        if first is None:  # no bias, or run from the stored blocks
            return None, ()
        if not self.config.gated:  # relu² experts: up is the whole first matmul
            return (first, ("up" + kind,)) if part in ("up_proj", "gate_up_proj") else (None, ())
        if part == "gate_up_proj":
            return first, ("gate" + kind, "up" + kind)
        if part in ("gate_proj", "up_proj"):
            inner = self.config.intermediate_size
            start = 0 if part == "gate_proj" else inner
            return first.narrow(0, start, inner), (part.removesuffix("_proj") + kind,)
        return None, ()

    def missing(self) -> list[str]:
        """What of the experts' weights no checkpoint tensor filled ("expert 3: gate"), but
        those of layers that run from the checkpoint's stored blocks."""
        labels = ["gate", "up", "down"] if self.config.gated else ["up", "down"]
        if self.config.expert_bias:
            labels += [f"{label} bias" for label in labels]
        missing = []
        for expert in range(self.config.num_experts):
            for label in labels:
                layer = self.down[expert] if label.startswith("down") else self.gate_up[expert]
                from_blocks = not layer.method.loads_weight and not label.endswith("bias")
                if (label, expert) not in self._loaded and not from_blocks:
                    missing.append(f"expert {expert}: {label}")
        return missing


class SparseMoeBlock(nn.Module):
    """A decoder layer's mixture-of-experts feed-forward: `gate` (the router), `experts`, and,
    where the config has one, `shared_expert` (an MLP the family builds, taking (x, lora)) with
    its sigmoid `shared_expert_gate`. With a `latent_size` (NemotronH) the experts run between
    `fc1_latent_proj` (down to it) and `fc2_latent_proj` (back); the router and the shared
    expert read x itself."""

    def __init__(
        self,
        hidden: int,
        config: MoEConfig,
        platform: Platform,
        methods: LinearMethods,
        prefix: str,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden, config, methods, f"{prefix}.gate")
        width = config.latent_size or hidden
        self.experts = Experts(width, config, platform, methods, f"{prefix}.experts")
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if config.latent_size:

            def linear(name: str, in_features: int, out_features: int) -> Linear:
                sources = (f"{prefix}.{name}.weight",)
                method = methods.choose(in_features, sources)
                return Linear(in_features, out_features, config.latent_bias, method, sources)

            self.fc1_latent_proj = linear("fc1_latent_proj", hidden, width)
            self.fc2_latent_proj = linear("fc2_latent_proj", width, hidden)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if config.shared_gate:
            sources = (f"{prefix}.shared_expert_gate.weight",)
            self.shared_expert_gate = Linear(hidden, 1, False, methods.unquantized, sources)

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        weights, ids, gate = self.route(x)
        if self.fc1_latent_proj is None:
            out = self.experts(x, weights, ids)
        else:
            out = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), weights, ids))
        if self.shared_expert is not None:
            shared = self.shared_expert(x, lora)
            if gate is not None:
                shared = gate * shared
            out = out + shared
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What tokens x [T, hidden] are weighed by: their experts' weights [T, k] float32 and
        indices [T, k] (the router's), and the shared expert's gate sigmoid(x · w) [T, 1]
        (None: ungated)."""
        weights, ids = self.gate.route(x)
        gate = None
        if self.shared_expert_gate is not None:
            gate = _sigmoid(self.shared_expert_gate(x))
        return weights, ids, gate

    def native_kernels(self) -> MoEKernels | None:
        """The routed experts as the native CPU decoder step runs them (kernels/cpu/decoder.py:
        `route` called back, each expert in its linear layers' native kernels; the family
        describes the shared expert); None outside what the step is checked against (the
        Llama family's mixtures: softmax routers without a bias, SwiGLU experts without biases
        or latent projections), or where an expert runs no native kernel."""
        config = self.gate.config
        if (
            config.scoring != "softmax"
            or self.gate.bias is not None
            or config.activation != "silu"
            or config.expert_bias
            or self.fc1_latent_proj is not None
        ):
            return None
        gate_up = [layer.native_kernels() for layer in self.experts.gate_up]
        down = [layer.native_kernels() for layer in self.experts.down]
        if any(kernels is None for kernels in (*gate_up, *down)):
            return None
        return MoEKernels(self.route, config.top_k, gate_up, down)


def load_expert_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
    marker: str,
    experts_of: Callable[[int], Experts | None],
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` but the tensors under a layer's `marker` ("layers.3.mlp.experts."), which
    that layer's experts (`experts_of(3)`) load in whatever layout they come; a ValueError for
    one of a layer that has none."""
    for name, tensor in weights:
        layer, found, rest = name.partition(marker)
        if not found:
            yield name, tensor
            continue
        experts = experts_of(int(layer.removeprefix("layers.")))
        if experts is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
        experts.load(rest, tensor)
