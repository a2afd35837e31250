"""A speech row's audio as its frames arrive.

The codec decoder is causal: the samples of the frames so far are final once decoded with the
left context the one-shot decode gives them. The one-shot decode is the reference's chunked
decode (windows of 300 frames, each after 25 frames of context), so an emission decodes the
window's frames from its start (with its context) to the last frame, and sends the samples not
yet sent: the stream concatenated is the one-shot audio.

Re-decoding a window's head costs, so emissions come at doubling intervals (the first frame at
once, then 2, 4, ... frames, at most 48: under 4 s of audio apart): about 4 frames decoded per
frame sent, where one emission a frame would decode ~150.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_FRAMES, LEFT_CONTEXT = 300, 25
FIRST_FRAMES, MAX_INTERVAL = 1, 48

# Decodes frames [groups, n] after their first `context`: (codes, context) -> samples.
Decode = Callable[[torch.Tensor, int], torch.Tensor]


class AudioStream:
    def __init__(
        self, samples_per_frame: int, chunk: int = CHUNK_FRAMES, context: int = LEFT_CONTEXT
    ) -> None:
        self.samples_per_frame = samples_per_frame
        self.chunk, self.context = chunk, context
        self.frames: list[torch.Tensor] = []  # [groups] each
        self.emitted = 0  # frames whose samples went out
        self.interval = FIRST_FRAMES  # frames the next emission waits for

    def due(self, ended: bool) -> bool:
        """Whether the frames not yet sent make an emission now."""
        pending = len(self.frames) - self.emitted
        return pending > 0 and (ended or pending >= self.interval)

    def emit(self, decode: Decode) -> torch.Tensor:
        """The samples of the frames not yet sent."""
        parts, end = [], len(self.frames)
        while self.emitted < end:
            start = self.emitted // self.chunk * self.chunk
            stop = min(end, start + self.chunk)
            context = min(self.context, start)
            codes = torch.stack(self.frames[start - context : stop], dim=1)
            samples = decode(codes, context)
            parts.append(samples[(self.emitted - start) * self.samples_per_frame :])
            self.emitted = stop
        self.interval = min(self.interval * 2, MAX_INTERVAL)
        return torch.cat(parts)
