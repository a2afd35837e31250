"""`Runtime`: a loaded model with its KV cache and resident slots; it opens one generation
session at a time, and serves the blocking path (`handle_request`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from inflight.model.checkpoints.loader import Checkpoint, open_checkpoint
from inflight.model.checkpoints.lora import load_lora_adapter
from inflight.model.layers.parallel import TensorParallel
from inflight.protocol.request import (
    MEDIA_FIELD,
    GenerationRequest,
    MediaItem,
    RequestFieldError,
    SamplingParams,
)
from inflight.protocol.stepped import ExecutionCapabilities
from inflight.runtime.config import RuntimeConfig
from inflight.runtime.device.draft_model import DraftModel
from inflight.runtime.device.encoder_cache import EncoderCache
from inflight.runtime.device.executor import Executor
from inflight.runtime.device.model_runner import build_model_runner
from inflight.runtime.device.parallel import Workers, rank_device
from inflight.runtime.device.sampler import Sampler
from inflight.runtime.host.adapters import AdapterRegistry
from inflight.runtime.host.blocking import BlockingRun
from inflight.runtime.host.context_cache import ContextCache
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.media import expand, keep_ratio, media_spec
from inflight.runtime.host.output_processor import OutputProcessor
from inflight.runtime.host.scheduler import AdmissionIntent, Scheduler
from inflight.runtime.host.session import GenerationSession
from inflight.runtime.host.slots import ResidentSlots
from inflight.runtime.host.speculative import Speculator, pick_width
from inflight.runtime.host.structured import GrammarCompiler
from inflight.runtime.inputs.preprocessing import media_inputs

DEFAULT_MAX_MODEL_LEN = 4096

# Each resident carries its own SamplingParams: the sampler, detokenizer, stop checks and KV
# reservation all work per row, so no sampling parameter keeps two requests from sharing a step.
PER_ROW_FIELDS = frozenset(f"params.{f.name}" for f in fields(SamplingParams))


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
        self.parallel = None
        if config.tensor_parallel_size > 1:
            size = config.tensor_parallel_size
            if self.device.type == "cuda" and torch.cuda.device_count() < size:
                raise ValueError(
                    f"tensor_parallel_size={size} needs {size} GPUs (one per rank); "
                    f"{torch.cuda.device_count()} are visible"
                )
            self.parallel = TensorParallel(0, size)
            self.device = rank_device(self.device, 0)
        dtype_name = config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = getattr(torch, dtype_name)
        self.checkpoint = open_checkpoint(model)
        self.tokenizer = self.checkpoint.tokenizer
        model_config = self.checkpoint.config
        if config.max_model_len and config.max_model_len > model_config.max_context:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's context "
                f"({model_config.max_context})"
            )
        self.max_model_len = min(
            config.max_model_len or DEFAULT_MAX_MODEL_LEN, model_config.max_context
        )
        if model_config.mamba is not None and config.speculative is not None:
            raise ValueError(
                "speculative decoding is not served for hybrid Mamba models: a rejected draft "
                "would need its sequence's recurrent state rolled back"
            )
        num_blocks = config.num_kv_blocks or config.max_batch_size * -(
            -self.max_model_len // config.block_size
        )
        self.blocks = BlockPool(num_blocks, config.block_size)
        self.slots = ResidentSlots(config.max_batch_size)
        self.context_cache = ContextCache(self.blocks) if config.context_cache else None
        self.grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size)
        self.workers: Workers | None = None
        self.executor = self._build_executor(num_blocks, show_progress)
        self.adapters: AdapterRegistry | None = None
        if config.max_loras:
            model = self.executor.runner.model
            self.adapters = AdapterRegistry(
                config.max_loras,
                lambda path: load_lora_adapter(path, model_config, config.max_lora_rank),
                model.lora.load,
            )
        self.overlap = self.device.type == "cuda" if config.overlap is None else config.overlap
        self.media_inputs = media_inputs(model_config, self.checkpoint.processor_config)
        # The media the model takes, by kind.
        self.media = {kind: found.spec for kind, found in self.media_inputs.items()}
        self.speculator = None
        if config.speculative is not None:
            drafter = None
            if config.speculative.method == "draft_model":
                drafter = self._build_draft_model(config.speculative.model, num_blocks)
            self.speculator = Speculator(config.speculative, drafter)
        self.scheduler = Scheduler(
            self.blocks,
            self.slots,
            self.context_cache,
            self.grammars,
            self.adapters,
            self.speculator,
            max_model_len=self.max_model_len,
            vocab_size=model_config.vocab_size,
            max_num_tokens=config.max_num_tokens,
            media=self.media,
            recurrent=model_config.mamba is not None,
        )
        self.outputs = OutputProcessor(
            self.scheduler,
            self.tokenizer,
            self.blocks,
            self.grammars,
            # A hybrid's blocks are never looked up (no state at their ends): not published.
            publish_blocks=config.context_cache and model_config.mamba is None,
            speculator=self.speculator,
        )
        self._session: GenerationSession | None = None

    def _build_draft_model(self, path: str | None, num_blocks: int) -> DraftModel:
        """The draft model of speculative decoding, its KV cache over the same block ids."""
        config, target = self.config, self.checkpoint.config
        checkpoint = open_checkpoint(path)
        if checkpoint.config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({checkpoint.config.vocab_size} tokens) is not "
                f"the target's ({target.vocab_size})"
            )
        # Eager and without adapters: its steps are a few rows' catch-up and single tokens.
        eager = replace(config, cuda_graphs=False, max_loras=0)
        return DraftModel(
            build_model_runner(
                checkpoint, eager, self.dtype, self.device, self.max_model_len, num_blocks
            )
        )

    def _build_executor(self, num_blocks: int, show_progress: bool) -> Executor:
        config, model_config, parallel = self.config, self.checkpoint.config, self.parallel
        connect = None
        if parallel is not None:
            parallel.check(model_config)  # before any worker starts
            workers = self.workers = Workers(
                parallel.size,
                self.checkpoint,
                config,
                self.dtype,
                self.device,
                self.max_model_len,
                num_blocks,
            )

            def connect() -> None:
                workers.wait_loaded()
                workers.connect(parallel)

        try:
            runner = build_model_runner(
                self.checkpoint,
                config,
                self.dtype,
                self.device,
                self.max_model_len,
                num_blocks,
                parallel=parallel,
                connect=connect,
                show_progress=show_progress,
            )
            if self.workers is not None:
                self.workers.wait_ready()
        except BaseException:
            self.close()
            raise
        return Executor(
            runner,
            Sampler(config.seed, self.device),
            self.grammars,
            max_batch_size=config.max_batch_size,
            pick_width=pick_width(config.speculative),
            encoder_cache=(
                EncoderCache(config.encoder_cache_mb << 20)
                if model_config.vision or model_config.audio
                else None
            ),
            workers=self.workers,
        )

    def close(self) -> None:
        """Stop the worker ranks of a tensor-parallel runtime (nothing to do otherwise)."""
        if self.workers is not None:
            self.workers.close()

    @property
    def fault(self) -> str | None:
        """Why a tensor-parallel runtime lost its ranks (it serves no more), or None."""
        return self.executor.fault

    @property
    def model_name(self) -> str:
        return self.checkpoint.name

    @property
    def capabilities(self) -> ExecutionCapabilities:
        return ExecutionCapabilities(
            stepped=True,
            seated_admission=True,
            max_batch_size=self.slots.capacity,
            per_row_fields=PER_ROW_FIELDS | self.scheduler.row_fields,
        )

    def register_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (ValueError naming what is wrong)."""
        if self.adapters is None:
            raise ValueError("LoRA is off: build the runtime with max_loras > 0")
        self.adapters.register(name, path)

    def unregister_lora(self, name: str) -> None:
        """Stop serving an adapter (KeyError when unknown); running requests finish with it."""
        if self.adapters is None:
            raise KeyError(name)
        self.adapters.unregister(name)

    def lora_names(self) -> list[str]:
        return [] if self.adapters is None else self.adapters.names()

    def media_placeholder(self, kind: str) -> int:
        """The token that stands for one `kind` item in a prompt (RequestFieldError when the
        model takes none)."""
        return media_spec(self.media, kind).placeholder

    def expand_media(
        self,
        prompt: Sequence[int],
        data: Mapping[str, Any],
        processor_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MediaItem]]:
        """A tokenized prompt with its placeholders expanded for `data` (vLLM's
        `multi_modal_data`: {"image": a PIL image or a list of them, "audio": an array of 16 kHz
        samples, (samples, sampling rate), or a list of those; one per placeholder of the kind,
        in order}), and its media, preprocessed; `processor_kwargs` (vLLM's
        `mm_processor_kwargs`): {"keep_ratio": r} keeps that share of each image's tokens
        (`model.vision.prune_image_tokens`). A RequestFieldError names what is wrong."""
        ratio = keep_ratio(processor_kwargs)
        groups = []
        for kind, given in data.items():
            spec = media_spec(self.media, kind)
            items = list(given) if isinstance(given, list) else [given]
            try:
                prepared = [self.media_inputs[kind].prepare(item) for item in items]
            except (ValueError, OSError) as exc:
                raise RequestFieldError(f"cannot read an {kind}: {exc}", MEDIA_FIELD) from exc
            groups.append((spec, prepared))
        return expand(prompt, groups, ratio)

    def check_request(self, request: GenerationRequest) -> AdmissionIntent:
        """Validate a request against this runtime (ValueError naming the problem) and size what
        it needs. Reads only what never changes after load, so any thread may call it."""
        return self.scheduler.check(request)

    def new_session(self) -> GenerationSession:
        """The execution for one batch; a runtime runs one at a time."""
        if self._session is not None:
            raise RuntimeError("a generation session is already open on this runtime")
        if self.fault is not None:
            raise RuntimeError(self.fault)
        # A bound method, not a closure over the session: a session -> closure -> session cycle
        # would keep the runtime (and its device memory) alive until the cyclic collector runs.
        self._session = GenerationSession(
            self.scheduler,
            self.executor,
            self.outputs,
            overlap=self.overlap,
            on_finish=self._session_finished,
        )
        return self._session

    def _session_finished(self) -> None:
        """The open session finished (sessions call this once): another may open."""
        self._session = None

    def handle_request(self, request: GenerationRequest) -> BlockingRun:
        """The blocking path: serve one request alone, on the caller's thread."""
        return BlockingRun(self.new_session(), request)
