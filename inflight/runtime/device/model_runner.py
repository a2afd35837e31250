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
    TorchAttentionBackend,
    select_backend,
)
from inflight.model.checkpoints.loader import Checkpoint, build_model
from inflight.model.config import ModelConfig
from inflight.model.contract import CausalLM, ForwardBatch, MediaEmbeds, ModelCaches
from inflight.model.layers.mamba import MambaRows
from inflight.model.layers.parallel import TensorParallel
from inflight.model.metadata import KVCache
from inflight.model.transfer import to_device
from inflight.runtime.deployment import DeploymentPlan
from inflight.runtime.device.batch_builder import RaggedBatch, RowInput, build_ragged_batch
from inflight.runtime.device.cuda_graphs import (
    DecodeGraphs,
    DecodeInputs,
    graph_buckets,
    graph_rows,
)
from inflight.runtime.device.host_allocator import keep_freed_memory

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
    num_layers: int,
    num_blocks: int,
    block_size: int,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    window_blocks: int | None = None,
) -> list[KVCache]:
    """A (key, value) pair for each of `num_layers` attention layers; `config`: the layers'
    shape on this rank. With `window_blocks`, a sliding layer's caches hold that many blocks
    (the window group's pool)."""
    caches = []
    for layer in range(num_layers):
        blocks = num_blocks
        if window_blocks is not None and config.window(layer) is not None:
            blocks = window_blocks
        shape = backend.kv_cache_shape(blocks, block_size, config.num_kv_heads, config.head_dim)
        caches.append(
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
        )
    return caches


def head_rows(hidden: torch.Tensor, rows: HeadRows) -> torch.Tensor:
    if isinstance(rows, tuple):
        return hidden[rows[0] : rows[1]]
    return hidden[to_device(rows, torch.int64, hidden.device)]


class ModelRunner:
    """Given graph inputs, decode-only steps replay captured CUDA graphs (see `cuda_graphs.py`).
    `caches`: the model's KV caches and, for a hybrid, its recurrent states (a resident's slot
    is its state slot). `unfolds`: whether a step's short prefill chunks may replay a graph as
    decode rows (not in batch-invariant mode: the decode kernel sums a query's keys in another
    order than the prefill kernel, so a prompt's bits would hang on its step's company)."""

    def __init__(
        self,
        model: CausalLM,
        caches: ModelCaches,
        *,
        block_size: int,
        device: torch.device,
        graph_inputs: DecodeInputs | None = None,
        parallel: TensorParallel | None = None,
        unfolds: bool = True,
    ) -> None:
        self.model = model
        self.unfolds = unfolds
        self.caches = caches
        self.block_size = block_size
        self.device = device
        self.parallel = parallel
        self.graphs: DecodeGraphs | None = None
        if graph_inputs is not None:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    self._planned_forward,
                    graph_inputs,
                    graph_buckets(graph_inputs.input_ids.shape[0]),
                )

    @property
    def recurrent(self) -> bool:
        """Whether the model's sequences carry recurrent state beside their KV."""
        return self.caches.states is not None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward pass over its caches: hidden states of every packed token."""
        return self.model(batch, self.caches)

    def _planned_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """A decode graph's forward: the backend's step plan is captured with it, so its device
        part (the decode rows' order) is replayed with every step."""
        self.caches.backend.plan(batch.attention)
        return self.forward(batch)

    @torch.inference_mode()
    def execute(self, batch: RaggedBatch) -> torch.Tensor:
        """Final hidden states of the tokens in `batch.logits_indices`, in that order. Decode-only
        steps replay a CUDA graph where one fits (a step with media embeddings runs eagerly, but
        for a model that reads an embedding at every position)."""
        if self.graphs is not None:
            hidden = self.graphs.run(batch)
            if hidden is not None:
                return hidden
        self.caches.backend.plan(batch.forward.attention)
        return self.forward(batch.forward)[batch.logits_indices]

    @torch.inference_mode()
    def warm_up(self, max_num_tokens: int, max_model_len: int) -> None:
        """One eager forward pass of a full step's prefill (min(max_num_tokens, max_model_len)
        tokens) and its LM head, written to the decode graphs' scratch block and state slot,
        which no resident owns: the first compiles of the prefill path's kernels (Triton's,
        cuBLAS's loads) and the allocator's growth to a full step happen here, not in the first
        request's step (on an H200 with Triton's disk cache cold, the Llama-3.1-8B shape's first
        8,192-token step took 1.14 s, the next ones 0.2 s). Only a runner with decode graphs
        needs it (their capture never reaches the eager path). Every rank of a tensor-parallel
        group runs it."""
        if self.graphs is None:
            raise RuntimeError("the warm-up writes the decode graphs' scratch block: none here")
        scratch = self.graphs.inputs
        tokens = min(max_num_tokens, max_model_len)
        blocks = -(-tokens // self.block_size)
        window = scratch.window_scratch_block
        row = RowInput(
            [0] * tokens,
            0,
            [scratch.scratch_block] * blocks,
            samples=True,
            window_table=None if window is None else [window] * blocks,
        )
        batch = build_ragged_batch([row], self.block_size, self.device)
        if scratch.scratch_state is not None:
            batch.forward.recurrent = MambaRows.build([scratch.scratch_state], [True], self.device)
        if scratch.embeds is not None:
            width, dtype = scratch.embeds.shape[1], scratch.embeds.dtype
            batch.forward.media = MediaEmbeds(
                torch.arange(tokens, device=self.device),
                torch.zeros(tokens, width, dtype=dtype, device=self.device),
            )
        self.logits(self.execute(batch))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def share_ids(self, batch: RaggedBatch) -> None:
        """Every rank takes rank 0's input ids (its tokens sampled on the device)."""
        assert self.parallel is not None
        self.parallel.broadcast(batch.forward.input_ids)

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
    plan: DeploymentPlan,
    dtype: torch.dtype,
    device: torch.device,
    *,
    parallel: TensorParallel | None = None,
    connect: Callable[[], None] | None = None,
    show_progress: bool = False,
) -> ModelRunner:
    """The runner of the model as `plan` has it (this rank's shard of it under `parallel`).
    `connect` is called once the weights are loaded: there a tensor-parallel rank joins its
    group, before graphs are captured (a capture runs collectives)."""
    options = plan.options
    if device.type == "cpu":
        keep_freed_memory()  # before the load, whose freed memory then serves the steps
    model = build_model(
        checkpoint,
        dtype,
        device,
        plan.max_model_len,
        show_progress,
        options.quantization,
        options.max_loras if options.enable_lora else 0,
        options.max_lora_rank,
        parallel,
        options.batch_invariant,
    )
    return runner_for(
        model,
        checkpoint.config,
        plan,
        dtype,
        device,
        parallel=parallel,
        connect=connect,
        embeds=plan.model.speech,
    )


def runner_for(
    model: CausalLM,
    model_config: ModelConfig,
    plan: DeploymentPlan,
    dtype: torch.dtype,
    device: torch.device,
    *,
    parallel: TensorParallel | None = None,
    connect: Callable[[], None] | None = None,
    embeds: bool = False,
) -> ModelRunner:
    """The runner of a built model of `model_config`'s shape, its KV cache as `plan` sizes it;
    `embeds`: every position's input is an embedding (a talker's), which decode graphs read
    from a buffer of their own."""
    options = plan.options
    backend = select_backend(
        options.attention_backend, device, dtype, model_config.head_dim, options.batch_invariant
    )
    graphs = plan.cuda_graphs and not isinstance(backend, TorchAttentionBackend)
    layers = model_config if parallel is None else parallel.local_config(model_config)
    kv_dtype = torch.float8_e4m3fn if options.kv_cache_dtype == "fp8" else dtype
    num_blocks = plan.num_kv_blocks
    window_blocks = plan.num_window_blocks if plan.window_group is not None else None
    # With graphs, one extra block (never handed out) takes the writes of padding rows.
    spare = 1 if graphs else 0
    kv = allocate_kv_cache(
        layers,
        model.num_attention_layers,
        num_blocks + spare,
        plan.block_size,
        backend,
        kv_dtype,
        device,
        None if window_blocks is None else window_blocks + spare,
    )
    # Batch-invariant mode packs no prefill as decode rows: its graphs need only the residents'.
    unfolds = not options.batch_invariant
    graph_inputs = None
    if graphs:
        graph_inputs = DecodeInputs(
            graph_rows(plan.max_batch_size, plan.max_num_tokens)
            if unfolds
            else plan.max_batch_size,
            -(-plan.max_model_len // plan.block_size),
            plan.block_size,
            scratch_block=num_blocks,
            window_scratch_block=window_blocks,
            device=device,
            lora=model.max_loras > 0,
            # One state slot past the residents' takes the spare rows' state updates.
            scratch_state=plan.max_batch_size if plan.model.recurrent else None,
            embeds=(model_config.hidden_size, dtype) if embeds else None,
        )
    if connect is not None:
        connect()
    states = model.allocate_states(plan.max_batch_size + (1 if graphs else 0), dtype, device)
    runner = ModelRunner(
        model,
        ModelCaches(kv, backend, states),
        block_size=plan.block_size,
        device=device,
        graph_inputs=graph_inputs,
        parallel=parallel,
        unfolds=unfolds,
    )
    if graph_inputs is not None:
        runner.warm_up(plan.max_num_tokens, plan.max_model_len)
    return runner
