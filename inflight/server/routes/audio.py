"""The OpenAI speech API on a text-to-speech model, or on a model that speaks its replies (which
reads the input as its reply): `POST /v1/audio/speech` (whole, streamed as audio bytes, or as
server-sent events) and `GET /v1/audio/voices`.

Audio is 16-bit signed little-endian mono at the model's rate (24 kHz): `pcm` raw, `wav` with
a RIFF header (streamed: its sizes left at the maximum, as streaming encoders write them).
Compressed formats need an encoder this server does not carry: a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import AliasChoices, Field

from inflight.protocol.request import RequestFieldError, SamplingParams
from inflight.protocol.speech import SPEECH_SAMPLING, SpeechFacts
from inflight.server.audio_format import STREAMED, pcm16, wav_header
from inflight.server.client import Run
from inflight.server.errors import ServerError, openai_error_payload
from inflight.server.protocol import Strict, TopP
from inflight.server.routes import READ
from inflight.server.routes.openai import IGNORED_HEADER, SSE_HEADERS
from inflight.server.state import State, not_served

router = APIRouter()

FORMATS = ("wav", "pcm")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
TASKS = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}


class VoiceId(Strict):
    id: str


class SpeechRequest(Strict):
    """OpenAI's fields, and vLLM-Omni's for Qwen3-TTS (`task_type`, `language`, `ref_audio`,
    `max_new_tokens`, `speaker` for `voice`, `stream` for server-sent events), and the sampling
    of the talker and its code predictor."""

    input: str
    model: str | None = None
    voice: str | VoiceId | None = Field(
        default=None, validation_alias=AliasChoices("voice", "speaker")
    )
    instructions: str | None = None
    response_format: str = "wav"
    speed: float | None = None
    stream_format: Literal["sse", "audio"] | None = None
    stream: bool = False  # vLLM-Omni's: server-sent events unless stream_format says otherwise
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = None
    language: str | None = None
    ref_audio: str | None = None  # a base model's voice to clone: a base64 WAV or a data URL
    max_new_tokens: int | None = Field(default=None, ge=1)  # frames, 12.5 a second
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: TopP | None = None
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    subtalker_dosample: bool | None = None
    subtalker_temperature: float | None = Field(default=None, gt=0, le=2)
    subtalker_top_k: int | None = Field(default=None, ge=0)
    subtalker_top_p: TopP | None = None


@router.api_route("/v1/audio/voices", methods=READ)
async def voices(state: State) -> dict[str, Any]:
    """The model's preset voices (a custom-voice model's; none for the others) and languages."""
    facts = _speech(state)
    return {
        "voices": list(facts.voices),
        "languages": ["auto", *facts.languages],
        "task_type": next((t for t, kind in TASKS.items() if kind == facts.kind), None),
        "sample_rate": facts.sample_rate,
    }


@router.post("/v1/audio/speech")
async def speech(body: SpeechRequest, request: Request, state: State) -> Response:
    facts = _speech(state)
    names = state.settings.model_names
    if body.model is not None and body.model not in names:
        raise not_served(body.model, list(names))
    if body.response_format not in FORMATS:
        raise ServerError(
            400,
            f"response_format {body.response_format!r} is not available here: this server "
            f"encodes {', '.join(FORMATS)}",
            "response_format",
        )
    if body.speed not in (None, 1.0):
        raise ServerError(400, "speed: this model speaks at one rate; send speed 1.0", "speed")
    if body.task_type is not None and TASKS[body.task_type] != facts.kind:
        raise ServerError(
            400, f"task_type {body.task_type!r}: this model is {facts.kind}", "task_type"
        )
    voice = body.voice.id if isinstance(body.voice, VoiceId) else body.voice
    ignored = []
    if voice is not None and facts.kind not in ("custom_voice", "reply"):
        voice, ignored = None, ["voice"]  # OpenAI's clients always send one
    client = state.client
    options: dict[str, Any] = {
        "voice": voice,
        "language": body.language,
        "instructions": body.instructions,
        "reference_audio": _wav(body.ref_audio) if body.ref_audio is not None else None,
    }
    sub = {
        "subtalker_sample": body.subtalker_dosample,
        "subtalker_temperature": body.subtalker_temperature,
        "subtalker_top_k": body.subtalker_top_k,
        "subtalker_top_p": body.subtalker_top_p,
    }
    options.update({k: v for k, v in sub.items() if v is not None})
    try:
        # Off the event loop: a clone's reference audio is decoded and resampled here.
        prepared = await asyncio.to_thread(
            client.llm.prepare_speech, body.input, _params(body), **options
        )
    except RequestFieldError as exc:
        raise ServerError(400, str(exc), _FIELDS.get(exc.field, exc.field)) from exc
    except ValueError as exc:
        raise ServerError(400, str(exc)) from exc
    headers = {IGNORED_HEADER: ", ".join(ignored)} if ignored else {}
    media_type, rate = MEDIA_TYPES[body.response_format], facts.sample_rate
    stream_format = body.stream_format or ("sse" if body.stream else None)
    if stream_format is not None:
        run = client.run(prepared)
        await run.start()
        if stream_format == "sse":
            events = _events(run, body.response_format, rate, len(prepared.prompt_token_ids))
            headers.update(SSE_HEADERS)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        chunks = _audio(run, body.response_format, rate)
        return StreamingResponse(chunks, media_type=media_type, headers=headers)
    samples = bytearray()
    await client.generate(
        prepared, request.is_disconnected, lambda chunk: samples.extend(chunk.audio)
    )
    pcm = pcm16(bytes(samples))
    if body.response_format == "wav":
        pcm = wav_header(rate, len(pcm)) + pcm
    return Response(pcm, media_type=media_type, headers=headers)


# The HTTP field a refusal of a request field names.
_FIELDS = {"reference_audio": "ref_audio", "max_tokens": "max_new_tokens"}


def _speech(state: State) -> SpeechFacts:
    """A text-to-speech model's facts, or those of a model that speaks its replies (it reads
    the input as its reply)."""
    llm = state.client.llm
    facts = llm.speech_facts or llm.voice_facts
    if facts is None:
        raise ServerError(
            400,
            "this model writes text: serve a text-to-speech model (Qwen3-TTS) or one that "
            "speaks (Qwen3-Omni) for speech",
            "model",
        )
    return facts


def _params(body: SpeechRequest) -> SamplingParams | None:
    given = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
        "max_tokens": body.max_new_tokens,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    return SamplingParams(**{**SPEECH_SAMPLING, **given})


def _wav(data: str) -> bytes:
    """A WAV file's bytes from base64 or a data URL."""
    if data.startswith("data:"):
        header, _, data = data.partition(",")
        if not header.endswith(";base64"):
            raise ServerError(400, "ref_audio: a data URL must be base64", "ref_audio")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ServerError(400, f"ref_audio is not valid base64: {exc}", "ref_audio") from exc


async def _audio(run: Run, response_format: str, rate: int) -> AsyncIterator[bytes]:
    if response_format == "wav":
        yield wav_header(rate, STREAMED)
    async for chunk in run:
        if chunk.audio:
            yield pcm16(chunk.audio)


async def _events(
    run: Run, response_format: str, rate: int, input_tokens: int
) -> AsyncIterator[str]:
    """`speech.audio.delta` events (base64 audio) and a closing `speech.audio.done` with the
    usage: input tokens of text, output tokens the frames."""
    frames = 0
    header = response_format == "wav"
    try:
        async for chunk in run:
            frames += len(chunk.codes)
            if not chunk.audio:
                continue
            audio = pcm16(chunk.audio)
            if header:
                audio, header = wav_header(rate, STREAMED) + audio, False
            event = {"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode()}
            yield f"data: {json.dumps(event)}\n\n"
    except ServerError as exc:
        yield f"data: {json.dumps(openai_error_payload(exc))}\n\n"
        return
    usage = {"input_tokens": input_tokens, "output_tokens": frames}
    usage["total_tokens"] = input_tokens + frames
    yield f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n"
