"""Audio as the server sends it: 16-bit signed little-endian mono PCM, raw or with a RIFF
header (streamed: its sizes left at the maximum, as streaming encoders write them)."""

from __future__ import annotations

import struct

import numpy as np

STREAMED = 0xFFFFFFFF  # a streamed WAV's sizes: unknown


def pcm16(audio: bytes) -> bytes:
    """float32 little-endian samples as 16-bit signed little-endian PCM."""
    samples = np.frombuffer(audio, "<f4")
    return (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()


def wav_header(rate: int, size: int) -> bytes:
    """A mono 16-bit PCM RIFF header for `size` bytes of samples (`STREAMED`: unknown)."""
    riff = STREAMED if size == STREAMED else 36 + size
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", size)
    )
