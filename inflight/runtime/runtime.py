"""`Runtime`: a loaded model with its KV cache and resident slots, and the blocking path."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from inflight.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    TorchAttentionBackend,
    select_backend,
)
from inflight.model.checkpoints.loader import Checkpoint, build_model, open_checkpoint
from inflight.model.llama import LlamaForCausalLM
from inflight.runtime.batch_builder import RaggedBatch
from inflight.runtime.context_cache import ContextCache
from inflight.runtime.cuda_graphs import DecodeGraphs, DecodeInputs, graph_buckets
from inflight.runtime.kv_cache import BlockPool, allocate_kv_cache
from inflight.runtime.request import (
    UNSERVED_OPTIONS,
    GenerationRequest,
    PromptTooLongError,
    SamplingParams,
    unserved_options,
)
from inflight.runtime.sampler import Sampler
from inflight.runtime.session import AdmissionIntent, GenerationSession
from inflight.runtime.slots import ResidentSlots
from inflight.runtime.stepped import (
    AdmissionAnswer,
    CompletionOutput,
    ExecutionCapabilities,
    TokenDelta,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096

# Each resident carries its own SamplingParams: the sampler, detokenizer, stop checks and KV
# reservation all work per row, so no sampling parameter keeps two requests from sharing a step.
PER_ROW_FIELDS = frozenset(f"params.{f.name}" for f in fields(SamplingParams))


@dataclass(frozen=True)
class RuntimeConfig:
    """Capacity of a runtime.

    `max_batch_size` resident slots; sequences (prompt plus output) of at most `max_model_len`
    tokens (default: the model's context, capped at 4096); a KV cache of `num_kv_blocks` blocks of
    `block_size` tokens (default: enough for every slot to hold a full-length sequence); at most
    `max_num_tokens` tokens computed per step (decode rows plus prefill chunks).
    """

    max_batch_size: int = 8
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_tokens: int = 2048
    context_cache: bool = False  # reuse the KV of prompt prefixes computed before
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    # "int8": int8 weights (and per-token int8 activations) for the CPU float32 path's matmuls;
    # "q4": 4-bit weights (GGUF's Q4_1) for the decoder layers' matmuls and int8 for the head.
    quantization: str | None = None
    device: str | None = None  # default: cuda when available
    # "torch", "cpu" or "triton"; default: triton on CUDA, cpu (its native decode kernel) for
    # float32 on the CPU where it builds, else torch.
    attention_backend: str | None = None
    cuda_graphs: bool = True  # capture decode steps (CUDA with the triton backend only)
    # Complete each step while the device runs the next (default: on CUDA, off on the CPU).
    overlap: bool | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "block_size", "max_num_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 2):
                raise ValueError(f"{name} must be an integer >= 2, got {value!r}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least max_batch_size "
                f"({self.max_batch_size}): every resident decodes one token per step"
            )
        if self.attention_backend not in (None, "torch", "cpu", "triton"):
            raise ValueError(
                f"attention_backend must be torch, cpu or triton, got {self.attention_backend!r}"
            )
        if self.quantization not in (None, "int8", "q4"):
            raise ValueError(f"quantization must be int8, q4 or unset, got {self.quantization!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


class ModelRunner:
    """Runs the model over one ragged batch; keeps the hidden states the step asked for.

    Given graph inputs, decode-only steps replay captured CUDA graphs (see `cuda_graphs.py`).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        backend: AttentionBackend,
        graph_inputs: DecodeInputs | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.graphs: DecodeGraphs | None = None
        if graph_inputs is not None:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    self._forward, graph_inputs, graph_buckets(graph_inputs.input_ids.shape[0])
                )

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def execute(self, batch: RaggedBatch) -> torch.Tensor:
        """Final hidden states of the tokens in `batch.logits_indices`, in that order."""
        if self.graphs is not None:
            hidden = self.graphs.run(batch)
            if hidden is not None:
                return hidden
        self.backend.plan(batch.meta)
        return self._forward(batch.input_ids, batch.positions, batch.meta)[batch.logits_indices]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


class Runtime:
    def __init__(
        self,
        model: str | Path | Checkpoint | None = None,
        config: RuntimeConfig | None = None,
        show_progress: bool = False,
    ) -> None:
        config = config or RuntimeConfig()
        self.config = config
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        dtype_name = config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = getattr(torch, dtype_name)
        self.checkpoint = open_checkpoint(model)
        self.tokenizer = self.checkpoint.tokenizer
        model_config = self.checkpoint.config
        self.max_model_len = min(
            config.max_model_len or DEFAULT_MAX_MODEL_LEN, model_config.max_context
        )
        if config.max_model_len and config.max_model_len > model_config.max_context:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's context "
                f"({model_config.max_context})"
            )
        self.max_num_tokens = config.max_num_tokens
        self.vocab_size = model_config.vocab_size
        num_blocks = config.num_kv_blocks or config.max_batch_size * -(
            -self.max_model_len // config.block_size
        )
        model_nn = build_model(
            self.checkpoint,
            self.dtype,
            self.device,
            self.max_model_len,
            show_progress,
            config.quantization,
        )
        backend = select_backend(
            config.attention_backend, self.device, self.dtype, self.checkpoint.config.head_dim
        )
        graphs = (
            config.cuda_graphs
            and self.device.type == "cuda"
            and not isinstance(backend, TorchAttentionBackend)
        )
        # With graphs, one extra block (never handed out) takes the writes of padding rows.
        kv = allocate_kv_cache(
            model_config,
            num_blocks + (1 if graphs else 0),
            config.block_size,
            backend,
            self.dtype,
            self.device,
        )
        graph_inputs = None
        if graphs:
            graph_inputs = DecodeInputs(
                config.max_batch_size,
                -(-self.max_model_len // config.block_size),
                config.block_size,
                scratch_block=num_blocks,
                device=self.device,
            )
        self.runner = ModelRunner(model_nn, kv, backend, graph_inputs)
        self.blocks = BlockPool(num_blocks, config.block_size)
        self.context_cache = ContextCache(self.blocks) if config.context_cache else None
        self.slots = ResidentSlots(config.max_batch_size)
        self.sampler = Sampler(config.seed, self.device)
        self.overlap = self.device.type == "cuda" if config.overlap is None else config.overlap
        # Each slot's latest sampled token, where the next step reads it without a host trip.
        self.last_tokens = torch.zeros(config.max_batch_size, dtype=torch.int64, device=self.device)
        self._session: GenerationSession | None = None

    @property
    def model_name(self) -> str:
        return self.checkpoint.name

    @property
    def capabilities(self) -> ExecutionCapabilities:
        return ExecutionCapabilities(
            stepped=True,
            seated_admission=True,
            max_batch_size=self.slots.capacity,
            per_row_fields=PER_ROW_FIELDS,
        )

    def check_request(self, request: GenerationRequest) -> AdmissionIntent:
        """Validate a request against this runtime (ValueError naming the problem) and size what
        it needs. Reads only what never changes after load, so any thread may call it."""
        unserved = unserved_options(request)
        if unserved:
            raise ValueError(
                f"{UNSERVED_OPTIONS[unserved[0]]} is not supported by this runtime yet"
            )
        prompt, params = request.prompt_token_ids, request.params
        vocab = self.vocab_size
        limit = self.max_model_len
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        if len(prompt) >= limit:
            raise PromptTooLongError(
                f"prompt is {len(prompt)} tokens; max_model_len is {limit}, which leaves room "
                f"for prompts of at most {limit - 1} tokens"
            )
        for name, ids in (
            ("logit_bias", params.logit_bias.keys()),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name} token id {bad} is outside the vocabulary (size {vocab})")
        room = limit - len(prompt)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({limit})"
            )
        max_new = room if params.max_tokens is None else params.max_tokens
        # KV for every token, the last output token's too: with overlap, the step launched
        # before the request is seen to finish still feeds that token back.
        blocks = self.blocks.blocks_for(len(prompt) + max_new)
        if blocks > self.blocks.num_blocks:
            raise ValueError(
                f"request needs {blocks} KV blocks but the whole cache holds "
                f"{self.blocks.num_blocks}; lower max_tokens or raise the KV cache size"
            )
        return AdmissionIntent(request, max_new, blocks)

    def new_session(self) -> GenerationSession:
        """The execution for one batch; a runtime runs one at a time."""
        if self._session is not None:
            raise RuntimeError("a generation session is already open on this runtime")
        self._session = GenerationSession(self)
        return self._session

    def session_closed(self, session: GenerationSession) -> None:
        if self._session is session:
            self._session = None

    def handle_request(self, request: GenerationRequest) -> BlockingRun:
        """The blocking path: serve one request alone, on the caller's thread."""
        return BlockingRun(self, request)


class BlockingRun:
    """Iterate for the request's token deltas; `output` is set before the last one is yielded.

    The request is admitted on construction, so a rejected one raises ValueError at once. Stopping
    early (closing the iterator, or `close()`) cancels the request and frees what it held.
    """

    def __init__(self, runtime: Runtime, request: GenerationRequest) -> None:
        self._session = runtime.new_session()
        admission = self._session.admit(request)
        if admission.answer is not AdmissionAnswer.ADMITTED:
            self._session.finish()
            raise ValueError(admission.reason)
        self._ref = admission.ref
        self.output: CompletionOutput | None = None

    def __iter__(self) -> Iterator[TokenDelta]:
        try:
            while self.output is None:
                result = self._session.step()
                if self._ref in result.finished:
                    self.output = self._session.materialize(result.finished[self._ref])
                if self._ref in result.deltas:
                    yield result.deltas[self._ref]
        finally:
            self.close()

    def close(self) -> None:
        if self.output is None:
            self._session.abort()
        self._session.finish()

    def result(self) -> CompletionOutput:
        for _ in self:
            pass
        assert self.output is not None
        return self.output
