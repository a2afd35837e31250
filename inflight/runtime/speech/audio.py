"""A speech row's audio as its frames arrive.

The one-shot audio is the reference's chunked decode: windows of 300 frames, each decoded after
25 frames of context. The codec decoder is causal, so a window's samples can go out as its frames
come: a row keeps a decoder stream per window (`CodecDecoder.stream`: its convolutions' and
attention's state), started on the window's context, and pushes the frames not yet sent. The
stream concatenated is the one-shot audio, and each frame is decoded once.

The first frame's audio goes out at once (the time to first audio), then at doubling intervals
(2, 4, ... frames, at most 48: under 4 s of audio apart): a push costs the decoder's launches
whatever its length, which on a GPU is most of its cost.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inflight.model.speech.codec_decoder import CodecStream

CHUNK_FRAMES, LEFT_CONTEXT = 300, 25
FIRST_FRAMES, MAX_INTERVAL = 1, 48

# A decoder stream for a window, started on its context frames [groups, c] (None: none).
OpenStream = Callable[[torch.Tensor | None], CodecStream]


class AudioStream:
    def __init__(self, chunk: int = CHUNK_FRAMES, context: int = LEFT_CONTEXT) -> None:
        self.chunk, self.context = chunk, context
        self.frames: list[torch.Tensor] = []  # [groups] each
        self.emitted = 0  # frames whose samples went out
        self.stream: CodecStream | None = None  # the current window's
        self.interval = FIRST_FRAMES  # frames the next emission waits for

    def due(self, ended: bool) -> bool:
        """Whether the frames not yet sent make an emission now."""
        pending = len(self.frames) - self.emitted
        return pending > 0 and (ended or pending >= self.interval)

    def emit(self, open_stream: OpenStream) -> torch.Tensor:
        """The samples of the frames not yet sent."""
        parts, end = [], len(self.frames)
        while self.emitted < end:
            start = self.emitted // self.chunk * self.chunk
            if self.stream is None or self.emitted == start:  # a window begins
                context = min(self.context, start)
                head = self.frames[start - context : start]
                self.stream = open_stream(torch.stack(head, dim=1) if head else None)
            stop = min(end, start + self.chunk)
            parts.append(self.stream.push(torch.stack(self.frames[self.emitted : stop], dim=1)))
            self.emitted = stop
        self.interval = min(self.interval * 2, MAX_INTERVAL)
        return torch.cat(parts)
