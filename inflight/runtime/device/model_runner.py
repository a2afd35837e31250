"""`ModelRunner`: the model's forward passes over its KV cache, the part of a step that every
tensor-parallel rank runs.

It owns the model (or a rank's shard of it), its KV cache tensors, the attention backend, the
CUDA graphs of decode steps and a hybrid model's recurrent states. The `Executor` plans a step on
rank 0 and samples it there; a worker rank runs the same forward passes from the `StepPlan` rank
0 sends it (`follow`), so that every rank reaches the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inflight.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    TorchAttentionBackend,
    select_backend,
)
from inflight.model.checkpoints.loader import Checkpoint, build_model
from inflight.model.config import ModelConfig
from inflight.model.hybrid import HybridForCausalLM
from inflight.model.layers.lora import LoRAMapping
from inflight.model.llama import LlamaForCausalLM, MediaEmbeds
from inflight.model.mamba import MambaRows, MambaStates
from inflight.model.parallel import TensorParallel
from inflight.model.transfer import to_device
from inflight.runtime.config import RuntimeConfig
from inflight.runtime.device.batch_builder import RaggedBatch, RowInput, build_ragged_batch
from inflight.runtime.device.cuda_graphs import (
    DecodeGraphs,
    DecodeInputs,
    graph_buckets,
    graph_rows,
)

# Which hidden states one LM-head call takes: a packed range [start, end), or listed rows.
HeadRows = tuple[int, int] | list[int]


@dataclass
class StepPlan:
    """A step's forward pass as a worker rank runs it: the rows to pack (plain data), whether
    rank 0 then broadcasts the input ids (some are tokens sampled on its device), and the
    hidden rows of each LM-head call, in rank 0's order."""

    rows: list[RowInput]
    unfold: bool
    share_ids: bool
    heads: list[HeadRows]


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """One (key, value) pair per attention layer (a hybrid's Mamba layers keep no KV);
    `config`: the layers' shape on this rank."""
    shape = backend.kv_cache_shape(num_blocks, block_size, config.num_kv_heads, config.head_dim)
    layers = config.num_layers if config.mamba is None else config.mamba.num_attention_layers
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(layers)
    ]


def head_rows(hidden: torch.Tensor, rows: HeadRows) -> torch.Tensor:
    if isinstance(rows, tuple):
        return hidden[rows[0] : rows[1]]
    return hidden[to_device(rows, torch.int64, hidden.device)]


class ModelRunner:
    """Given graph inputs, decode-only steps replay captured CUDA graphs (see `cuda_graphs.py`)."""

    def __init__(
        self,
        model: LlamaForCausalLM | HybridForCausalLM,
        kv_caches: list[KVCache],
        backend: AttentionBackend,
        *,
        block_size: int,
        device: torch.device,
        graph_inputs: DecodeInputs | None = None,
        mamba_states: MambaStates | None = None,
        parallel: TensorParallel | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = device
        # A hybrid model's recurrent states: a resident's slot is its state slot.
        self.mamba_states = mamba_states
        self.parallel = parallel
        self.graphs: DecodeGraphs | None = None
        if graph_inputs is not None:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    self._forward, graph_inputs, graph_buckets(graph_inputs.input_ids.shape[0])
                )

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRAMapping | None = None,
        media: MediaEmbeds | None = None,
        mamba: MambaRows | None = None,
    ) -> torch.Tensor:
        if mamba is None:
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend, lora, media)
        return self.model(
            input_ids,
            positions,
            self.kv_caches,
            meta,
            self.backend,
            lora,
            media,
            mamba=mamba,
            states=self.mamba_states,
        )

    @torch.inference_mode()
    def execute(
        self,
        batch: RaggedBatch,
        lora_slots: list[int] | None = None,
        media: MediaEmbeds | None = None,
        mamba: MambaRows | None = None,
    ) -> torch.Tensor:
        """Final hidden states of the tokens in `batch.logits_indices`, in that order;
        `lora_slots`: each batch row's LoRA slot (-1: the base model), None where no row has
        one; `media`: packed tokens whose input is an encoder's output (such a step runs
        eagerly); `mamba`: each row's state slot (hybrid models)."""
        if self.graphs is not None and media is None:
            hidden = self.graphs.run(batch, lora_slots, mamba)
            if hidden is not None:
                return hidden
        self.backend.plan(batch.meta)
        lora = None
        if lora_slots is not None:
            rows = zip(lora_slots, batch.meta.query_lens_host, strict=True)
            lora = self.model.lora_mapping(list(rows))
        hidden = self._forward(batch.input_ids, batch.positions, batch.meta, lora, media, mamba)
        return hidden[batch.logits_indices]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def share_ids(self, batch: RaggedBatch) -> None:
        """Every rank takes rank 0's input ids (its tokens sampled on the device)."""
        assert self.parallel is not None
        self.parallel.broadcast(batch.input_ids)

    def follow(self, plan: StepPlan) -> None:
        """A worker rank's part of a step: the forward pass and LM-head calls rank 0 runs."""
        batch = build_ragged_batch(plan.rows, self.block_size, self.device, plan.unfold)
        if plan.share_ids:
            self.share_ids(batch)
        hidden = self.execute(batch)
        for rows in plan.heads:
            self.logits(head_rows(hidden, rows))


def build_model_runner(
    checkpoint: Checkpoint,
    config: RuntimeConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    num_blocks: int,
    *,
    parallel: TensorParallel | None = None,
    connect: Callable[[], None] | None = None,
    show_progress: bool = False,
) -> ModelRunner:
    """The runner of the model (this rank's shard of it under `parallel`). `connect` is called
    once the weights are loaded: there a tensor-parallel rank joins its group, before graphs
    are captured (a capture runs collectives)."""
    model_config = checkpoint.config
    model = build_model(
        checkpoint,
        dtype,
        device,
        max_model_len,
        show_progress,
        config.quantization,
        config.max_loras,
        config.max_lora_rank,
        parallel,
    )
    backend = select_backend(config.attention_backend, device, dtype, model_config.head_dim)
    graphs = (
        config.cuda_graphs
        and device.type == "cuda"
        and not isinstance(backend, TorchAttentionBackend)
    )
    hybrid = model_config.mamba is not None
    layers = model_config if parallel is None else parallel.local_config(model_config)
    kv_dtype = dtype
    if config.kv_cache_dtype == "fp8":
        if isinstance(backend, TorchAttentionBackend):  # the CPU's too
            raise ValueError(
                f"kv_cache_dtype='fp8' needs the triton attention backend (CUDA), got {device}"
            )
        kv_dtype = torch.float8_e4m3fn
    # With graphs, one extra block (never handed out) takes the writes of padding rows.
    kv = allocate_kv_cache(
        layers, num_blocks + (1 if graphs else 0), config.block_size, backend, kv_dtype, device
    )
    graph_inputs = None
    if graphs:
        graph_inputs = DecodeInputs(
            graph_rows(config.max_batch_size, config.max_num_tokens),
            -(-max_model_len // config.block_size),
            config.block_size,
            scratch_block=num_blocks,
            device=device,
            lora=model.max_loras > 0,
            # One state slot past the residents' takes the spare rows' state updates.
            scratch_state=config.max_batch_size if hybrid else None,
        )
    if connect is not None:
        connect()
    states = None
    if hybrid:
        slots = config.max_batch_size + (1 if graphs else 0)
        states = MambaStates.allocate(model_config, slots, dtype, device)
    return ModelRunner(
        model,
        kv,
        backend,
        block_size=config.block_size,
        device=device,
        graph_inputs=graph_inputs,
        mamba_states=states,
        parallel=parallel,
    )
