"""`SpeechRuntime`: a loaded text-to-speech model, its KV cache and resident slots, as the
request engine drives it (the `ExecutionFactory` a `Runtime` is for text): it checks speech
requests and opens one `SpeechSession` at a time."""

from __future__ import annotations

from collections.abc import Callable

import torch

from inflight.model.checkpoints.loader import Checkpoint
from inflight.model.families.qwen3_tts import Qwen3TTSForSpeech
from inflight.model.speech.speaker_encoder import SpeakerEncoderConfig
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest
from inflight.protocol.speech import SpeechFacts
from inflight.runtime.deployment import model_facts, resolve
from inflight.runtime.device.machine import probe_machine
from inflight.runtime.device.model_runner import build_model_runner
from inflight.runtime.device.sampler import seeded_generator
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.slots import ResidentSlots
from inflight.runtime.session_runtime import SessionRuntime
from inflight.runtime.speech.inputs import SpeechInputs
from inflight.runtime.speech.predictor_graphs import PredictorGraphs
from inflight.runtime.speech.session import MIN_FRAMES, SpeechSession
from inflight.runtime.speech.talker_loop import TalkerLoop, TalkerShape


class SpeechRuntime(SessionRuntime[SpeechSession]):
    """Built from the deployment plan as a text runtime is; the parts a text runtime has that
    speech has no use for (context cache, speculation, media) are None or empty."""

    model_kind = "a text-to-speech model"

    def __init__(
        self,
        checkpoint: Checkpoint,
        options: DeploymentOptions | None = None,
        show_progress: bool = False,
    ) -> None:
        options = options or DeploymentOptions()
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        config = checkpoint.config
        speech = config.speech
        assert speech is not None
        self.plan = plan = resolve(options, model_facts(config), probe_machine())
        self.device = torch.device(plan.device)
        self.dtype = getattr(torch, plan.dtype)
        self.max_model_len = plan.max_model_len
        self.blocks = BlockPool(plan.num_kv_blocks, plan.block_size)
        self.slots = ResidentSlots(plan.max_batch_size)
        self.context_cache = self.speculator = self.encoder_cache = None
        self.media: dict[str, object] = {}
        self.runner = build_model_runner(
            checkpoint, plan, self.dtype, self.device, show_progress=show_progress
        )
        model = self.runner.model
        assert isinstance(model, Qwen3TTSForSpeech)
        self.model = model
        self.facts = SpeechFacts(
            kind=speech.kind,
            voices=tuple(speech.speakers),
            languages=tuple(speech.languages),
            sample_rate=speech.sample_rate,
            frames_per_second=speech.sample_rate / model.codec_decoder.config.samples_per_frame,
        )
        self.generator = seeded_generator(self.device, options.seed)
        min_samples = 0
        if speech.speaker_encoder is not None:
            min_samples = SpeakerEncoderConfig.from_dict(speech.speaker_encoder).min_samples
        self.inputs = SpeechInputs(
            self.tokenizer,
            speech,
            self.facts,
            id(self),
            self.max_model_len,
            plan.block_size,
            min_samples,
        )
        # The code predictor's micro-loop replayed from CUDA graphs (the talker's decode steps
        # replay the model runner's).
        self.predictor_graphs = None
        if self.device.type == "cuda" and options.cuda_graphs:
            self.predictor_graphs = PredictorGraphs(
                model.predict_codes,
                config.hidden_size,
                self.dtype,
                speech.num_code_groups,
                speech.code_predictor.vocab_size,
                plan.max_batch_size,
                self.device,
            )
        shape = TalkerShape(
            vocab_size=config.vocab_size,
            eos=speech.codec_ids["eos"],
            num_code_groups=speech.num_code_groups,
            predictor_vocab=speech.code_predictor.vocab_size,
            min_frames=MIN_FRAMES,
        )
        self.loop = TalkerLoop(
            model,
            shape,
            self.runner,
            self.blocks,
            self.slots.capacity,
            max_num_tokens=plan.max_num_tokens,
            graphs=self.predictor_graphs,
        )

    def check(self, request: GenerationRequest) -> GenerationRequest:
        return self.inputs.check(request)

    def _open(self, on_finish: Callable[[], None]) -> SpeechSession:
        return SpeechSession(self.model, self.loop, self.slots, self.generator, on_finish=on_finish)
