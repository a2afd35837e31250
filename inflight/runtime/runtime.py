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
from inflight.model.parallel import TensorParallel
from inflight.protocol.request import (
    MEDIA_FIELD,
    GenerationRequest,
    MediaItem,
    RequestFieldError,
    SamplingParams,
)
from inflight.protocol.stepped import AdmissionAnswer, ExecutionCapabilities
from inflight.runtime.config import RuntimeConfig
from inflight.runtime.device.draft_model import DraftModel
from inflight.runtime.device.encoder_cache import EncoderCache
from inflight.runtime.device.executor import Executor
from inflight.runtime.device.inputs import (
    AdapterInputs,
    ForwardInput,
    MediaInputs,
    RecurrentInputs,
)
from inflight.runtime.device.model_runner import ModelRunner, build_model_runner
from inflight.runtime.device.parallel import ParallelExecutor, Workers, rank_device
from inflight.runtime.device.sampler import Sampler
from inflight.runtime.host.adapters import AdapterRegistry
from inflight.runtime.host.blocking import BlockingRun
from inflight.runtime.host.context_cache import ContextCache
from inflight.runtime.host.decoding import Decoding, PlainDecoding
from inflight.runtime.host.features import RowFeature
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.media import MediaChecks, expand, keep_ratio, media_spec
from inflight.runtime.host.output_processor import OutputProcessor
from inflight.runtime.host.scheduler import PrefillPolicy, Scheduler
from inflight.runtime.host.session import GenerationSession
from inflight.runtime.host.slots import ResidentSlots
from inflight.runtime.host.speculative import SpeculativeDecoding
from inflight.runtime.host.structured import Constraints, GrammarCompiler
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
        self.workers: Workers | None = None
        runner = self._build_runner(num_blocks, show_progress)
        self.overlap = self.device.type == "cuda" if config.overlap is None else config.overlap
        self.media_inputs = media_inputs(model_config, self.checkpoint.processor_config)
        # The media the model takes, by kind.
        self.media = {kind: found.spec for kind, found in self.media_inputs.items()}
        # The per-row features this runtime serves: their hooks in admission and in taking
        # tokens in (host), their inputs to the forward pass (device).
        grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size)
        self.constraints = Constraints(grammars, config.max_batch_size)
        features: list[RowFeature] = [MediaChecks(self.media), self.constraints]
        inputs: list[ForwardInput] = []
        self.adapters: AdapterRegistry | None = None
        if config.max_loras:
            model = runner.model
            self.adapters = AdapterRegistry(
                config.max_loras,
                lambda path: load_lora_adapter(path, model_config, config.max_lora_rank),
                model.load_lora,
            )
            features.insert(0, self.adapters)
            inputs.append(AdapterInputs(model))
        self.encoder_cache: EncoderCache | None = None
        if self.media:
            self.encoder_cache = EncoderCache(config.encoder_cache_mb << 20)
            mrope = model_config.rope.mrope_section is not None
            encoders = runner.model.media_encoders()
            inputs.append(MediaInputs(encoders, self.encoder_cache, mrope, self.device))
        decoding: Decoding = PlainDecoding()
        self.speculator: SpeculativeDecoding | None = None
        if config.speculative is not None:
            drafter = None
            if config.speculative.method == "draft_model":
                drafter = self._build_draft_model(config.speculative.model, num_blocks)
            decoding = self.speculator = SpeculativeDecoding(config.speculative, drafter)
            features.append(self.speculator)
        prefill = PrefillPolicy()
        if runner.recurrent:
            # Chunks of a fixed size whatever the batch: a row's prefill is split the same way
            # alone and beside others, so its state (and output) is the same bits.
            chunk = config.max_num_tokens - config.max_batch_size
            if chunk < 1:
                raise ValueError(
                    f"a hybrid Mamba model needs max_num_tokens ({config.max_num_tokens}) above "
                    f"max_batch_size ({config.max_batch_size}): its prefill chunks are the "
                    "difference"
                )
            prefill = PrefillPolicy(chunk=chunk, shares_prefix=False)
            inputs.append(RecurrentInputs(self.device))
        self.scheduler = Scheduler(
            self.blocks,
            self.slots,
            self.context_cache,
            features,
            decoding,
            prefill,
            max_model_len=self.max_model_len,
            vocab_size=model_config.vocab_size,
            max_num_tokens=config.max_num_tokens,
            served_options=self._served_options,
        )
        self.outputs = OutputProcessor(
            self.scheduler,
            self.tokenizer,
            self.blocks,
            features,
            decoding,
            publish_blocks=self.context_cache is not None and prefill.shares_prefix,
        )
        executor = Executor if self.workers is None else ParallelExecutor
        extra = {} if self.workers is None else {"workers": self.workers}
        self.executor = executor(
            runner,
            Sampler(config.seed, self.device),
            self.constraints,
            inputs,
            max_batch_size=config.max_batch_size,
            pick_width=decoding.pick_width,
            **extra,
        )
        self._session: GenerationSession | None = None

    @property
    def _served_options(self) -> frozenset[str]:
        """The request options of the table this runtime serves: LoRA, when enabled."""
        return frozenset({"lora_name"}) if self.config.max_loras else frozenset()

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

    def _build_runner(self, num_blocks: int, show_progress: bool) -> ModelRunner:
        """The model runner; under tensor parallelism, with the worker ranks started and
        connected."""
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
        return runner

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
        if not self.config.in_flight_batching:
            return ExecutionCapabilities(
                stepped=True, seated_admission=False, max_batch_size=1, blocking_path=True
            )
        return ExecutionCapabilities(
            stepped=True,
            seated_admission=True,
            max_batch_size=self.slots.capacity,
            per_row_fields=PER_ROW_FIELDS | self._served_options,
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

    def check(self, request: GenerationRequest) -> GenerationRequest:
        """The request carrying its admission intent, checked against this runtime (ValueError
        naming the problem); one this runtime has checked already is returned as it is. Reads
        only what never changes after load, so any thread may call it."""
        intent = self.scheduler.intent(request)
        return request if intent is request.intent else replace(request, intent=intent)

    def new_session(self) -> GenerationSession | BlockingRun:
        """The execution for one batch (on the blocking path, of one request); a runtime runs
        one at a time."""
        if not self.config.in_flight_batching:
            return BlockingRun(self._new_session())
        return self._new_session()

    def _new_session(self) -> GenerationSession:
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
        """The blocking path: serve one request alone, on the caller's thread (a ValueError
        where it is refused)."""
        run = BlockingRun(self._new_session())
        admission = run.admit(request)
        if admission.answer is not AdmissionAnswer.ADMITTED:
            run.finish()
            raise ValueError(admission.reason)
        return run
