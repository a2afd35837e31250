"""`DiffusionRuntime`: a loaded block-diffusion model (DiffusionGemma), its KV cache and
resident slots, as the request engine drives it (the `ExecutionFactory` a `Runtime` is for an
autoregressive model): it checks requests and opens one `DiffusionSession` at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from inflight.model.checkpoints.loader import Checkpoint, build_model
from inflight.model.families.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest
from inflight.runtime.deployment import model_facts, resolve
from inflight.runtime.device.encoder_cache import EncoderCache
from inflight.runtime.device.machine import probe_machine
from inflight.runtime.device.sampler import seeded_generator
from inflight.runtime.diffusion.requests import DiffusionChecks
from inflight.runtime.diffusion.session import DiffusionCounters, DiffusionSession, WindowRing
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.slots import ResidentSlots
from inflight.runtime.inputs.chat_media import MediaLimits
from inflight.runtime.inputs.preprocessing import media_inputs
from inflight.runtime.inputs.processor import InputProcessor
from inflight.runtime.session_runtime import SessionRuntime


class DiffusionRuntime(SessionRuntime[DiffusionSession]):
    """Built from the deployment plan as a text runtime is; the parts a text runtime has that
    block diffusion has no use for (context cache, speculation, voices) are None or
    empty. Its sampling defaults are the model's denoising settings, not generation_config's
    temperature and filters (which a canvas does not take)."""

    model_kind = "a block-diffusion model"

    def __init__(
        self,
        checkpoint: Checkpoint,
        options: DeploymentOptions | None = None,
        show_progress: bool = False,
    ) -> None:
        options = options or DeploymentOptions()
        self.checkpoint = replace(checkpoint, sampling_defaults={})
        self.tokenizer = checkpoint.tokenizer
        config = checkpoint.config
        diffusion = config.diffusion
        assert diffusion is not None
        self.plan = plan = resolve(options, model_facts(config), probe_machine())
        canvas = diffusion.canvas_length
        if plan.max_num_tokens < canvas:
            raise ValueError(
                f"max_num_tokens ({plan.max_num_tokens}) must hold a canvas of {canvas} tokens "
                f"(the model's canvas_length); start with max_num_tokens >= {canvas}"
            )
        self.device = torch.device(plan.device)
        self.dtype = getattr(torch, plan.dtype)
        self.max_model_len = plan.max_model_len
        self.blocks = BlockPool(plan.num_kv_blocks, plan.block_size)
        self.slots = ResidentSlots(plan.max_batch_size)
        self.context_cache = self.speculator = None
        self.voice_facts = None
        prepared = media_inputs(config, checkpoint.processor_config)
        # The media the model takes, by kind.
        self.media = {kind: found.spec for kind, found in prepared.items()}
        self.encoder_cache = EncoderCache(options.encoder_cache_mb << 20) if self.media else None
        model = build_model(
            checkpoint,
            self.dtype,
            self.device,
            plan.max_model_len,
            show_progress,
            options.quantization,
        )
        assert isinstance(model, DiffusionGemmaForBlockDiffusion)
        self.model = model
        # The sliding layers keep a window of each resident's KV, in a ring of their own.
        window = max((w for w in config.layer_windows if w is not None), default=1)
        ring = min(window - 1 + plan.max_num_tokens, plan.max_model_len)
        self.ring = WindowRing(window, ring)
        self.caches = model.allocate_kv(
            plan.num_kv_blocks * plan.block_size,
            plan.max_batch_size * ring,
            self.dtype,
            self.device,
        )
        self.generator = seeded_generator(self.device, options.seed)
        self.checks = DiffusionChecks(
            checked_by=id(self),
            canvas=canvas,
            vocab_size=config.vocab_size,
            max_model_len=plan.max_model_len,
            block_size=plan.block_size,
            num_blocks=plan.num_kv_blocks,
            defaults=diffusion.defaults,
            media=self.media,
            whole_media_limit=plan.max_num_tokens if diffusion.media_bidirectional else None,
        )
        self.counters = DiffusionCounters()
        limits = options.limit_mm_per_prompt
        media_limits = MediaLimits(
            max_images=limits.get("image", MediaLimits.max_images),
            allow_fetch=options.allow_media_fetch,
        )
        self.input_processor = InputProcessor(
            self.tokenizer, prepared, media_limits, self.checks.checked
        )

    @property
    def canvas_length(self) -> int:
        return self.checks.canvas

    def check(self, request: GenerationRequest) -> GenerationRequest:
        return self.checks.checked(request)

    def _open(self, on_finish: Callable[[], None]) -> DiffusionSession:
        return DiffusionSession(
            self.model,
            self.caches,
            self.checks,
            self.blocks,
            self.slots,
            self.tokenizer,
            self.generator,
            self.plan.max_num_tokens,
            self.ring,
            self.counters,
            self.encoder_cache,
            on_finish=on_finish,
        )
