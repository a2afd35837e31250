"""Spoken chat replies over the OpenAI API (a model that speaks, Qwen3-Omni):
`modalities: ["text", "audio"]` with `audio: {voice, format}` asks for the reply spoken.

The reply comes back as OpenAI returns one: `message.audio` (`id`, base64 `data` in the asked
format, `expires_at`, and the text as `transcript`; `content` is null), streamed as
`delta.audio` chunks (transcript text and audio data as they come, `id` and `expires_at` in the
last). Formats: `wav` (streamed: one RIFF header first, its sizes left at the maximum) and
`pcm16` (raw 16-bit little-endian mono at the model's rate); compressed ones need an encoder
this server does not carry. As OpenAI does, audio output refuses tools and logprobs.

A later turn may send an assistant message back as `audio: {id}` without its text: the
transcripts of the replies this server spoke are kept until they expire (`Transcripts`).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from inflight.protocol.outputs import CompletionOutput
from inflight.protocol.request import AudioReply, RequestFieldError
from inflight.protocol.speech import SpeechFacts
from inflight.server.audio_format import STREAMED, pcm16, wav_header
from inflight.server.errors import ServerError
from inflight.server.protocol import ChatCompletionRequest

FORMATS = ("wav", "pcm16")
# inflight's fields beside OpenAI's in `audio`: the talker's sampling and the audio's bound.
TALKER_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty", "max_frames")
# The HTTP fields a refusal of the request's `AudioReply` names.
AUDIO_PARAMS = {name: f"audio.{name}" for name in ("voice", *TALKER_FIELDS)}
EXPIRES_S = 3600  # how long a reply's audio id can be sent back
MAX_TRANSCRIPTS = 4096


@dataclass(frozen=True)
class ChatAudio:
    """A chat request's ask for its reply spoken: what the engine runs, in which format."""

    reply: AudioReply
    format: str


def chat_audio(body: ChatCompletionRequest, voices: SpeechFacts | None) -> ChatAudio | None:
    """The request's ask for audio (None: text only); a 400 naming the field that is wrong."""
    modalities = body.modalities or ["text"]
    unknown = sorted(set(modalities) - {"text", "audio"})
    if unknown:
        raise ServerError(400, f"unknown modalities {unknown}; known: text, audio", "modalities")
    if "audio" not in modalities:
        if body.audio is not None:
            raise ServerError(400, 'audio is read with modalities ["text", "audio"]', "modalities")
        return None
    if "text" not in modalities:
        raise ServerError(
            400, 'audio output is asked as modalities ["text", "audio"]', "modalities"
        )
    if voices is None:
        raise ServerError(
            400,
            "this model writes text only: audio output needs a model that speaks (Qwen3-Omni) "
            "served with its talker (not --no-speech)",
            "modalities",
        )
    if body.audio is None:
        raise ServerError(400, 'modalities ["text", "audio"] needs audio: {voice, format}', "audio")
    for field, asked in (
        ("tools", body.tools or body.functions),
        ("logprobs", body.logprobs),
    ):
        if asked:
            raise ServerError(400, f"audio output does not take {field}", field)
    fields = dict(body.audio)
    voice, fmt = fields.pop("voice", None), fields.pop("format", None)
    unknown = sorted(set(fields) - set(TALKER_FIELDS))
    if unknown:
        raise ServerError(
            400,
            f"unknown audio fields {unknown}; known: voice, format, {', '.join(TALKER_FIELDS)}",
            "audio",
        )
    if fmt not in FORMATS:
        raise ServerError(
            400,
            f"audio.format {fmt!r} is not served; served: {', '.join(FORMATS)} (compressed "
            "formats need an encoder this server does not carry)",
            "audio.format",
        )
    if isinstance(voice, dict):
        raise ServerError(400, "custom voice ids are not served: name a voice", "audio.voice")
    # Whether the model has the voice is the runtime's check (its refusal names `audio.voice`:
    # `AUDIO_PARAMS`).
    try:
        reply = AudioReply(voice, **fields)
    except RequestFieldError as exc:
        raise ServerError(400, str(exc), f"audio.{exc.field}") from exc
    return ChatAudio(reply, fmt)


class Transcripts:
    """The transcripts of spoken replies by audio id, until they expire (the oldest dropped
    past `MAX_TRANSCRIPTS`)."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def keep(self, audio_id: str, transcript: str, expires_at: int) -> None:
        self._kept[audio_id] = (transcript, expires_at)
        while len(self._kept) > MAX_TRANSCRIPTS:
            self._kept.popitem(last=False)

    def recall(self, audio_id: str) -> str | None:
        kept = self._kept.get(audio_id)
        if kept is None or kept[1] < time.time():
            self._kept.pop(audio_id, None)
            return None
        return kept[0]


class SpokenReply:
    """One reply's audio as the response carries it."""

    def __init__(self, ask: ChatAudio, rate: int, transcripts: Transcripts) -> None:
        self.format = ask.format
        self.rate = rate
        self.transcripts = transcripts
        self.id = f"audio_{uuid.uuid4().hex}"
        self.expires_at = int(time.time()) + EXPIRES_S
        self._header = ask.format == "wav"  # a stream's first audio carries it
        self._transcript: list[str] = []

    def whole(self, output: CompletionOutput, transcript: str) -> dict[str, Any]:
        pcm = pcm16(output.audio)
        if self.format == "wav":
            pcm = wav_header(self.rate, len(pcm)) + pcm
        self.transcripts.keep(self.id, transcript, self.expires_at)
        return {
            "id": self.id,
            "data": base64.b64encode(pcm).decode(),
            "expires_at": self.expires_at,
            "transcript": transcript,
        }

    def delta(self, audio: bytes, text: str) -> dict[str, Any] | None:
        """A stream chunk's `delta.audio` (None: nothing new)."""
        delta: dict[str, Any] = {}
        if text:
            delta["transcript"] = text
            self._transcript.append(text)
        if audio:
            pcm = pcm16(audio)
            if self._header:
                pcm, self._header = wav_header(self.rate, STREAMED) + pcm, False
            delta["data"] = base64.b64encode(pcm).decode()
        return delta or None

    def last(self) -> dict[str, Any]:
        """The stream's last audio delta: its id and expiry."""
        self.transcripts.keep(self.id, "".join(self._transcript), self.expires_at)
        return {"id": self.id, "expires_at": self.expires_at}


def audio_tokens(output: CompletionOutput, facts: SpeechFacts) -> int:
    """The frames of a reply's audio (OpenAI's audio tokens): each frame's samples but the
    last few, which no frame after completes."""
    samples = len(output.audio) // 4
    per_frame = round(facts.sample_rate / facts.frames_per_second)
    return -(-samples // per_frame)
