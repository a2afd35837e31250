"""What a speech model offers (torch-free). A speech request is a `GenerationRequest` with
`SpeechParams` (request.py); its audio travels in `StreamChunk.audio` (outputs.py)."""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass

# How a frame's first code is sampled unless a request says: the package's defaults (its
# generate_config.json's, where a checkpoint has none).
SPEECH_SAMPLING = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05}


@dataclass(frozen=True)
class SpeechFacts:
    """What a speech model offers, as callers and the server read it: its kind
    (custom_voice, voice_design, base), voices, languages, sample rate and frame rate."""

    kind: str
    voices: tuple[str, ...]
    languages: tuple[str, ...]
    sample_rate: int
    frames_per_second: float


@dataclass(frozen=True)
class SpeechOutput:
    """A speech request's outcome: `audio`, its float32 little-endian mono samples at
    `sample_rate`; `codes`, the frames they decode (one tuple of codebook codes each);
    `finish_reason` "stop" (the model ended) or "length" (max_tokens frames)."""

    audio: bytes
    sample_rate: int
    codes: tuple[tuple[int, ...], ...]
    finish_reason: str

    @property
    def num_samples(self) -> int:
        return len(self.audio) // 4

    @property
    def samples(self) -> array:
        """The samples as floats (`numpy.frombuffer(out.audio, numpy.float32)` as an array)."""
        values = array("f")
        values.frombytes(self.audio)
        if sys.byteorder == "big":
            values.byteswap()
        return values
