"""`Runtime`: a loaded model with its KV cache and resident slots; it opens one generation
session at a time, and serves the blocking path (`handle_request`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from inflight.model.checkpoints.loader import Checkpoint, open_checkpoint
from inflight.model.checkpoints.lora import load_lora_adapter
from inflight.model.families.qwen3_omni import Qwen3OmniForConditionalGeneration
from inflight.model.layers.parallel import TensorParallel
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import (
    GenerationRequest,
)
from inflight.protocol.speech import SpeechFacts
from inflight.protocol.stepped import ExecutionCapabilities
from inflight.runtime.deployment import (
    PER_ROW_FIELDS,
    ifb_unsupported_reason,
    model_facts,
    resolve,
)
from inflight.runtime.device.draft_model import DraftModel
from inflight.runtime.device.encoder_cache import EncoderCache
from inflight.runtime.device.executor import Executor
from inflight.runtime.device.inputs import (
    AdapterInputs,
    ForwardInput,
    MediaInputs,
    RecurrentInputs,
)
from inflight.runtime.device.machine import probe_machine
from inflight.runtime.device.model_runner import ModelRunner, build_model_runner, runner_for
from inflight.runtime.device.parallel import ParallelExecutor, Workers, rank_device
from inflight.runtime.device.sampler import Sampler, seeded_generator
from inflight.runtime.host.adapters import AdapterRegistry
from inflight.runtime.host.blocking import BlockingRun
from inflight.runtime.host.context_cache import ContextCache
from inflight.runtime.host.decoding import Decoding, PlainDecoding
from inflight.runtime.host.features import RowFeature
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.media import MediaChecks
from inflight.runtime.host.output_processor import OutputProcessor
from inflight.runtime.host.pinned import PinnedPrefixes
from inflight.runtime.host.scheduler import PrefillPolicy, Scheduler
from inflight.runtime.host.session import GenerationSession
from inflight.runtime.host.slots import ResidentSlots
from inflight.runtime.host.speculative import SpeculativeDecoding
from inflight.runtime.host.structured import Constraints, GrammarCompiler
from inflight.runtime.inputs.chat_media import MediaLimits
from inflight.runtime.inputs.preprocessing import media_inputs
from inflight.runtime.inputs.processor import InputProcessor
from inflight.runtime.speech.predictor_graphs import PredictorGraphs
from inflight.runtime.speech.replies import SpokenReplies
from inflight.runtime.speech.talker_loop import TalkerLoop, TalkerShape


class Runtime:
    """A loaded model and everything its steps run with, built from the deployment plan its
    options resolve to on this model and machine (`plan`; a ValueError names a combination it
    cannot serve, before any weight loads)."""

    def __init__(
        self,
        model: str | Path | Checkpoint | None = None,
        options: DeploymentOptions | None = None,
        show_progress: bool = False,
    ) -> None:
        options = options or DeploymentOptions()
        self.checkpoint = open_checkpoint(model)
        if not options.speech and self.checkpoint.config.talker is not None:
            # Text only: the talker is neither planned for nor loaded.
            config = replace(self.checkpoint.config, talker=None)
            self.checkpoint = replace(self.checkpoint, config=config)
        self.tokenizer = self.checkpoint.tokenizer
        model_config = self.checkpoint.config
        spec = options.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = open_checkpoint(spec.model)
        draft_facts = None if draft is None else model_facts(draft.config)
        self.plan = plan = resolve(options, model_facts(model_config), probe_machine(), draft_facts)
        self.device = torch.device(plan.device)
        self.parallel = None
        if options.tensor_parallel_size > 1:
            self.parallel = TensorParallel(0, options.tensor_parallel_size)
            self.device = rank_device(self.device, 0)
        self.dtype = getattr(torch, plan.dtype)
        self.max_model_len = plan.max_model_len
        self.blocks = BlockPool(plan.num_kv_blocks, plan.block_size)
        # The sliding layers' blocks, where only some layers slide (the plan's window group).
        self.window_blocks = None
        if plan.window_group is not None:
            self.window_blocks = BlockPool(plan.num_window_blocks, plan.block_size)
        self.slots = ResidentSlots(plan.max_batch_size)
        self.context_cache = None
        if options.enable_context_reuse:
            self.context_cache = ContextCache(self.blocks, plan.max_pinned_blocks)
        self.workers: Workers | None = None
        runner = self._build_runner(show_progress)
        self.overlap = plan.overlap
        prepared = media_inputs(model_config, self.checkpoint.processor_config)
        # The media the model takes, by kind.
        self.media = {kind: found.spec for kind, found in prepared.items()}
        # The per-row features this runtime serves: their hooks in admission and in taking
        # tokens in (host), their inputs to the forward pass (device).
        grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size)
        self.constraints = Constraints(grammars, plan.max_batch_size)
        features: list[RowFeature] = [MediaChecks(self.media), self.constraints]
        if "save_system_prompt_kv_cache" in plan.served_options:
            assert self.context_cache is not None
            features.append(PinnedPrefixes(self.context_cache))
        inputs: list[ForwardInput] = []
        self.adapters: AdapterRegistry | None = None
        if options.enable_lora:
            model = runner.model
            self.adapters = AdapterRegistry(
                options.max_loras,
                lambda path: load_lora_adapter(path, model_config, options.max_lora_rank),
                model.lora.load,
            )
            features.insert(0, self.adapters)
            inputs.append(AdapterInputs(model))
        self.encoder_cache: EncoderCache | None = None
        if plan.model.media:
            self.encoder_cache = EncoderCache(options.encoder_cache_mb << 20)
            encoders = runner.model.media_encoders()
            # A model that speaks keeps what its talker reads of a spoken reply's prompt media.
            talker = model_config.talker
            keep = talker.accept_hidden_layer if plan.speaks and talker is not None else None
            inputs.append(
                MediaInputs(encoders, self.encoder_cache, plan.model.mrope, self.device, keep)
            )
        # A model that speaks its replies: the talker beside the thinker (`speech/replies.py`).
        self.voices: SpokenReplies | None = None
        self.voice_facts: SpeechFacts | None = None  # its voices and rates, where it speaks
        if plan.speaks:
            self.voices = self._build_voices(runner)
            features.append(self.voices)
        decoding: Decoding = PlainDecoding()
        self.speculator: SpeculativeDecoding | None = None
        if spec is not None:
            drafter = None
            if draft is not None:
                drafter = self._build_draft_model(draft)
            decoding = self.speculator = SpeculativeDecoding(spec, drafter)
            features.append(self.speculator)
        # A hybrid's prefill chunks have a fixed size whatever the batch: a row's prefill is
        # split the same way alone and beside others, so its state (and output) is the same
        # bits; and no KV prefix holds its recurrent state.
        prefill = PrefillPolicy(plan.prefill_chunk, shares_prefix=not plan.model.recurrent)
        if plan.model.recurrent:
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
            max_num_tokens=plan.max_num_tokens,
            served_options=plan.served_options,
            window=plan.kv_window,
            window_group=plan.window_group,
            window_blocks=self.window_blocks,
        )
        self.outputs = OutputProcessor(
            self.scheduler,
            self.tokenizer,
            self.blocks,
            features,
            decoding,
            publish_blocks=self.context_cache is not None and prefill.shares_prefix,
            window_blocks=self.window_blocks,
        )
        executor = Executor if self.workers is None else ParallelExecutor
        extra = {} if self.workers is None else {"workers": self.workers}
        self.executor = executor(
            runner,
            Sampler(options.seed, self.device, eos=self.tokenizer.eos_token_ids),
            self.constraints,
            inputs,
            max_batch_size=plan.max_batch_size,
            pick_width=decoding.pick_width,
            **extra,
        )
        self._session: GenerationSession | None = None
        limits = options.limit_mm_per_prompt
        media_limits = MediaLimits(
            max_images=limits.get("image", MediaLimits.max_images),
            max_audios=limits.get("audio", MediaLimits.max_audios),
            allow_fetch=options.allow_media_fetch,
        )
        # Prompts in, requests carrying their checked admission intent out.
        # The scheduler's check, not this runtime's: a runtime -> processor -> runtime cycle
        # would keep its device memory alive until the cyclic collector runs.
        self.input_processor = InputProcessor(
            self.tokenizer, prepared, media_limits, self.scheduler.checked
        )

    def _build_voices(self, runner: ModelRunner) -> SpokenReplies:
        """The talker's runner (its own KV cache, as many blocks as the thinker's), loop and
        per-row feature."""
        model, plan = runner.model, self.plan
        assert isinstance(model, Qwen3OmniForConditionalGeneration)
        talker, config = model.talker, self.checkpoint.config.talker
        assert talker is not None and config is not None
        decoder = config.decoder
        talker_runner = runner_for(
            talker.decoder, decoder, plan, self.dtype, self.device, embeds=True
        )
        groups, vocab = config.num_code_groups, config.code_predictor.vocab_size
        graphs = None
        if plan.cuda_graphs:
            graphs = PredictorGraphs(
                talker.predict_codes,
                decoder.hidden_size,
                self.dtype,
                groups,
                vocab,
                plan.max_batch_size,
                self.device,
            )
        shape = TalkerShape(decoder.vocab_size, config.codec_ids["eos"], groups, vocab, 0)
        loop = TalkerLoop(
            talker,
            shape,
            talker_runner,
            BlockPool(plan.num_kv_blocks, plan.block_size),
            plan.max_batch_size,
            max_num_tokens=plan.max_num_tokens,
            graphs=graphs,
        )
        generator = seeded_generator(self.device, plan.options.seed)
        self.voice_facts = SpeechFacts(
            kind="reply",
            voices=tuple(sorted(config.speakers)),
            languages=(),
            sample_rate=config.sample_rate,
            frames_per_second=config.sample_rate / talker.samples_per_frame,
        )
        return SpokenReplies(model, loop, plan.max_model_len, generator)

    def _build_draft_model(self, checkpoint: Checkpoint) -> DraftModel:
        """The draft model of speculative decoding, its KV cache over the same block ids; eager
        and without adapters: its steps are a few rows' catch-up and single tokens."""
        options = replace(self.plan.options, cuda_graphs=False, enable_lora=False)
        plan = replace(self.plan, options=options, cuda_graphs=False)
        return DraftModel(build_model_runner(checkpoint, plan, self.dtype, self.device))

    def _build_runner(self, show_progress: bool) -> ModelRunner:
        """The model runner; under tensor parallelism, with the worker ranks started and
        connected."""
        plan, parallel = self.plan, self.parallel
        connect = None
        if parallel is not None:
            workers = self.workers = Workers(
                parallel.size, self.checkpoint, plan, self.dtype, self.device
            )

            def connect() -> None:
                workers.wait_loaded()
                workers.connect(parallel)

        try:
            runner = build_model_runner(
                self.checkpoint,
                plan,
                self.dtype,
                self.device,
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
        return ExecutionCapabilities(
            stepped=True,
            # A deployment one of whose features cannot run beside joiners batches one request
            # at a time (the blocking path); `LLM` refuses it in-flight batching at load.
            seated_admission=ifb_unsupported_reason(self.plan) is None,
            max_batch_size=self.slots.capacity,
            per_row_fields=PER_ROW_FIELDS | self.plan.served_options,
        )

    def register_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (ValueError naming what is wrong)."""
        if self.adapters is None:
            raise ValueError(
                "LoRA is off in this deployment: start with enable_lora=True (--enable-lora)"
            )
        self.adapters.register(name, path)

    def unregister_lora(self, name: str) -> None:
        """Stop serving an adapter (KeyError when unknown); running requests finish with it."""
        if self.adapters is None:
            raise KeyError(name)
        self.adapters.unregister(name)

    def lora_names(self) -> list[str]:
        return [] if self.adapters is None else self.adapters.names()

    def check(self, request: GenerationRequest) -> GenerationRequest:
        """The request carrying its admission intent, checked against this runtime (ValueError
        naming the problem); one this runtime has checked already is returned as it is. Reads
        only what never changes after load, so any thread may call it."""
        return self.scheduler.checked(request)

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
            voices=self.voices,
        )
        return self._session

    def _session_finished(self) -> None:
        """The open session finished (sessions call this once): another may open."""
        self._session = None

    def handle_request(self, request: GenerationRequest) -> BlockingRun:
        """The blocking path: serve one request alone, on the caller's thread."""
        return BlockingRun(self.new_session(), request)
