"""Markers (tags) in text that arrives in pieces."""

from __future__ import annotations


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`: a stream holds
    them back until the next piece says whether the marker is there."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
