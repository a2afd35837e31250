"""Speech requests in: the text and the instructions as the model reads them, and every check a
speech request gets before it is queued (torch-free). Each refusal is a `RequestFieldError`
naming the field, so the server answers 400 with it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from inflight.model.config import SpeechConfig
from inflight.model.encoders.audio_processor import read_wav, resample
from inflight.protocol.options import REQUEST_OPTIONS
from inflight.protocol.request import (
    AdmissionIntent,
    GenerationRequest,
    RequestFieldError,
    SamplingParams,
    SpeechParams,
    is_int,
)
from inflight.protocol.speech import SPEECH_SAMPLING, SpeechFacts
from inflight.protocol.tokenizer import Tokenizer

MAX_INPUT_CHARS = 4096  # OpenAI's limit on `input`
DEFAULT_MAX_FRAMES = 4096  # the package's max_new_tokens
# The text is read between these, by position: 3 tokens before it, 5 after.
ROLE, TAIL = "<|im_start|>assistant\n", "<|im_end|>\n<|im_start|>assistant\n"
ROLE_TOKENS, TAIL_TOKENS = 3, 5

# Sampling parameters a frame's first code is drawn with (ignore_eos: the end code masked, so
# the request makes max_tokens frames); the others mean nothing for speech.
SPEECH_PARAMS = frozenset(
    {"temperature", "top_p", "top_k", "repetition_penalty", "seed", "ignore_eos"}
)
# Harmless with any value: text-only switches.
IGNORED_PARAMS = frozenset(
    {
        "max_tokens",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "reuse_context",
        "cache_generated_tokens",
        "speculative",
    }
)


def text_in_prompt(request: GenerationRequest, kind: str) -> bool:
    """Whether all the text is in the prompt: as asked, else the package's default for the
    model's kind (custom and designed voices: yes; a cloned one: no)."""
    speech = request.speech
    assert speech is not None
    if speech.text_in_prompt is not None:
        return speech.text_in_prompt
    return kind != "base"


def codec_tags(s: SpeechConfig, request: GenerationRequest) -> tuple[list[int], int | None]:
    """The prompt's codec tags (think or not, the language's where there is one) and the
    preset voice's codec row (None: none). A dialect speaker speaking Chinese or "auto"
    takes its dialect's language."""
    speech = request.speech
    assert speech is not None
    voice = speech.voice.lower() if speech.voice else None
    language = speech.language.lower()
    c = s.codec_ids
    if voice in s.dialects and language in ("chinese", "auto"):
        language = s.dialects[voice]
    if language == "auto":
        tags = [c["nothink"], c["think_bos"], c["think_eos"]]
    else:
        tags = [c["think"], c["think_bos"], s.languages[language], c["think_eos"]]
    return tags, None if voice is None else s.speakers[voice]


def prompt_positions(s: SpeechConfig, request: GenerationRequest) -> int:
    """How many positions `prompt.build_prompt` makes of a request (without building it)."""
    speech = request.speech
    assert speech is not None
    tags, voice = codec_tags(s, request)
    voiced = voice is not None or speech.reference_audio is not None
    codec_rows = len(tags) + voiced + 2  # and pad, bos
    body = len(request.prompt_token_ids) - ROLE_TOKENS - TAIL_TOKENS
    text = body + 2 if text_in_prompt(request, s.kind) else 1
    return len(speech.instruction_token_ids) + ROLE_TOKENS + codec_rows - 1 + text


def check_text(text: object) -> None:
    """A RequestFieldError unless `text` is text to speak: not empty, within OpenAI's limit."""
    if not isinstance(text, str) or not text.strip():
        raise RequestFieldError("input must be non-empty text", "input")
    if len(text) > MAX_INPUT_CHARS:
        raise RequestFieldError(
            f"input is {len(text)} characters; at most {MAX_INPUT_CHARS} are taken", "input"
        )


class SpeechInputs:
    """`speech`: the model's speech side; `facts`: its voices, languages and rates;
    `min_reference_samples`: the shortest reference clip its speaker encoder takes."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        speech: SpeechConfig,
        facts: SpeechFacts,
        runtime_id: int,
        max_model_len: int,
        block_size: int,
        min_reference_samples: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.speech = speech
        self.facts = facts
        self.runtime_id = runtime_id
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.min_reference_samples = min_reference_samples
        self._role = tokenizer.encode(ROLE, add_special_tokens=False)
        self._tail = tokenizer.encode(TAIL, add_special_tokens=False)
        if len(self._role) != ROLE_TOKENS or len(self._tail) != TAIL_TOKENS:
            raise ValueError(
                f"the tokenizer splits {ROLE!r} into {len(self._role)} tokens and {TAIL!r} into "
                f"{len(self._tail)}; a Qwen3-TTS checkpoint's makes {ROLE_TOKENS} and "
                f"{TAIL_TOKENS}"
            )

    def request(
        self,
        text: str,
        params: SamplingParams | None = None,
        *,
        voice: str | None = None,
        language: str | None = None,
        instructions: str | None = None,
        reference_audio: Sequence[float] | Any = None,
        reference_sample_rate: int = 24000,
        **speech: Any,
    ) -> GenerationRequest:
        """A checked speech request of `text` (`speech`: the other `SpeechParams` fields).
        `reference_audio`: samples at `reference_sample_rate` (resampled to the model's), or a
        WAV file's bytes."""
        check_text(text)
        ids = self.tokenizer.encode(ROLE + text + TAIL, add_special_tokens=False)
        if (
            ids[:ROLE_TOKENS] != self._role
            or ids[-TAIL_TOKENS:] != self._tail
            or len(ids) <= ROLE_TOKENS + TAIL_TOKENS
        ):
            raise RequestFieldError("input does not tokenize apart from its role markers", "input")
        instruction_ids: list[int] = []
        if instructions:
            instruction_ids = self.tokenizer.encode(
                f"<|im_start|>user\n{instructions}<|im_end|>\n", add_special_tokens=False
            )
        if reference_audio is not None:
            reference_audio = self._reference(reference_audio, reference_sample_rate)
            reference_sample_rate = self.facts.sample_rate
        if params is None:
            params = SamplingParams(**SPEECH_SAMPLING)
        known = {f for f in SpeechParams.__dataclass_fields__} - {"instruction_token_ids"}
        unknown = sorted(set(speech) - known)
        if unknown:
            raise RequestFieldError(f"unknown speech options {unknown}", unknown[0])
        options = SpeechParams(
            voice=voice,
            language=language or "auto",
            instruction_token_ids=tuple(instruction_ids),
            reference_audio=reference_audio,
            reference_sample_rate=reference_sample_rate,
            **speech,
        )
        return self.check(GenerationRequest(ids, params, speech=options))

    def check(self, request: GenerationRequest) -> GenerationRequest:
        """The request with its admission intent, or a RequestFieldError naming what is wrong."""
        if request.intent is not None and request.intent.checked_by == self.runtime_id:
            return request
        speech = request.speech
        if speech is None:
            raise RequestFieldError(
                "this is a text-to-speech model: send text to speak "
                "(LLM.speech, POST /v1/audio/speech)",
                "speech",
            )
        for option in REQUEST_OPTIONS:
            if option.field != "speech" and getattr(request, option.field) != option.default:
                raise RequestFieldError(
                    f"{option.what} is not served for a text-to-speech model", option.field
                )
        if request.media:
            raise RequestFieldError("a speech request takes no media in its prompt", "media")
        self._check_params(request.params)
        self._check_voice(speech)
        positions = prompt_positions(self.speech, request)
        room = self.max_model_len - positions
        asked = request.params.max_tokens
        if room < 1:
            raise RequestFieldError(
                f"the input makes a prompt of {positions} positions, where the model has "
                f"{self.max_model_len}: none are left to speak it. Please shorten the input.",
                "input",
            )
        if asked is not None and asked > room:
            raise RequestFieldError(
                f"the prompt takes {positions} of the model's {self.max_model_len} positions; "
                f"max_tokens (frames) may be at most {room}",
                "max_tokens",
            )
        frames = min(asked or DEFAULT_MAX_FRAMES, room)
        blocks = -(-(positions + frames) // self.block_size)
        intent = AdmissionIntent(self.runtime_id, frames, blocks, blocks)
        return replace(request, intent=intent)

    def _reference(self, audio: Any, rate: int) -> np.ndarray:
        """Reference audio as the speaker encoder takes it: a WAV file's bytes decoded, samples
        at another rate resampled."""
        target = self.facts.sample_rate
        try:
            if isinstance(audio, bytes | bytearray):
                return read_wav(bytes(audio), target)
            samples = np.asarray(audio, dtype=np.float32)
            if samples.ndim == 1 and samples.size and is_int(rate) and rate > 0 and rate != target:
                samples = resample(samples, rate, target).astype(np.float32)
            return samples
        except (TypeError, ValueError) as exc:
            raise RequestFieldError(f"reference audio: {exc}", "reference_audio") from None

    def _check_params(self, params: SamplingParams) -> None:
        plain = SamplingParams()
        for name in params.__dataclass_fields__:
            if name in SPEECH_PARAMS or name in IGNORED_PARAMS:
                continue
            if getattr(params, name) != getattr(plain, name):
                raise RequestFieldError(f"{name} is not served for speech", name)

    def _check_voice(self, speech: SpeechParams) -> None:
        kind, facts = self.facts.kind, self.facts
        if speech.language.lower() not in ("auto", *facts.languages):
            raise RequestFieldError(
                f"language {speech.language!r} is not one of this model's: "
                f"{', '.join(('auto', *facts.languages))}",
                "language",
            )
        if kind == "custom_voice":
            if speech.voice is None:
                raise RequestFieldError(
                    f"voice is required: one of {', '.join(facts.voices)}", "voice"
                )
            if speech.voice.lower() not in facts.voices:
                raise RequestFieldError(
                    f"voice {speech.voice!r} is not one of this model's: {', '.join(facts.voices)}",
                    "voice",
                )
        elif speech.voice is not None:
            what = "describe it in instructions" if kind == "voice_design" else "clone one"
            raise RequestFieldError(
                f"a {kind} model has no preset voices ({what}); leave voice out", "voice"
            )
        if kind == "voice_design" and not speech.instruction_token_ids:
            raise RequestFieldError(
                "a voice_design model needs instructions describing the voice", "instructions"
            )
        if kind != "base":
            if speech.reference_audio is not None:
                raise RequestFieldError(
                    f"voice cloning needs a base model; this one is {kind}", "reference_audio"
                )
            return
        self._check_reference(speech)

    def _check_reference(self, speech: SpeechParams) -> None:
        audio = speech.reference_audio
        if audio is None:
            raise RequestFieldError(
                "a base model clones a voice: send reference audio", "reference_audio"
            )
        rate = speech.reference_sample_rate
        if rate != self.facts.sample_rate:
            raise RequestFieldError(
                f"reference audio must be {self.facts.sample_rate} Hz mono, got {rate} Hz "
                "(LLM.speech resamples it)",
                "reference_audio",
            )
        try:
            samples = np.asarray(audio, dtype=np.float32)
        except (TypeError, ValueError):
            samples = np.zeros((0, 0), np.float32)
        if samples.ndim != 1:
            raise RequestFieldError(
                "reference audio must be one mono clip of float samples", "reference_audio"
            )
        count = samples.shape[0]
        if count < self.min_reference_samples:
            raise RequestFieldError(
                f"reference audio has {count} samples; the speaker encoder needs at least "
                f"{self.min_reference_samples}",
                "reference_audio",
            )
        if not np.isfinite(samples).all():
            raise RequestFieldError(
                "reference audio holds samples that are not finite", "reference_audio"
            )
