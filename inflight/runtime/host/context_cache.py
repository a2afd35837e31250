"""`ContextCache`: reuse of the KV of token prefixes another request already computed.

Full blocks are identified by a chain digest: each block's digest covers its parent's digest
and its own token ids (and the content keys of the media whose placeholders it holds), so
equal digests mean equal prefixes. A block is published (made
findable) only after the step that wrote it has run, so a request seated in the same tick never
sees it. A published block outlives its resident: it stays findable while free, until the pool
reuses it for other content (see `BlockPool`).

A prefix may be pinned (`pin`: a request with `save_system_prompt_kv_cache`, or a warm-up
prompt): its blocks are then held by the cache itself, a reference each, so the pool never
evicts them, until `unpin`. Pins are bounded (`max_pinned_blocks`). The pool is the stepping
thread's: `unpin`, which any thread may call, unpins at once and leaves the release of the
blocks to that thread's next admission (`apply_unpins`), where blocks are taken.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from inflight.protocol.request import MediaItem
from inflight.runtime.host.kv_cache import BlockPool


def root_digest(lora_name: str | None) -> bytes:
    """The parent of a sequence's first block: KV computed with an adapter is its own."""
    return b"" if lora_name is None else hashlib.sha256(b"lora:" + lora_name.encode()).digest()


def chain_digest(parent: bytes, tokens: Sequence[int], media: bytes = b"") -> bytes:
    """`media`: the content keys of the media whose placeholders the block holds (their
    tokens are alike whatever the image)."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    h.update(media)
    return h.digest()


def media_keys(media: Sequence[MediaItem], start: int, end: int) -> bytes:
    """The keys of the media items with placeholders among prompt positions start .. end, each
    with the number of tokens it keeps (a pruned image's tokens are its own)."""
    return b"".join(
        m.key + m.length.to_bytes(4, "little")
        for m in media
        if m.offset < end and m.offset + m.length > start
    )


def prefix_digests(
    prompt: Sequence[int],
    blocks: int,
    block_size: int,
    root: bytes = b"",
    media: Sequence[MediaItem] = (),
) -> Iterator[bytes]:
    """The chain digests of the first `blocks` full blocks of `prompt`, one at a time (a
    lookup stops at its first miss)."""
    parent = root
    for i in range(blocks):
        start, end = i * block_size, (i + 1) * block_size
        parent = chain_digest(parent, prompt[start:end], media_keys(media, start, end))
        yield parent


def prefix_id(last_digest: bytes) -> str:
    """A pinned prefix's id: the first 16 hex digits of its last block's chain digest."""
    return last_digest.hex()[:16]


@dataclass
class ContextCacheMetrics:
    lookups: int = 0  # admissions that looked their prompt up
    lookup_tokens: int = 0  # prompt tokens those lookups covered
    hit_tokens: int = 0  # prompt tokens found in the cache (not recomputed)
    skipped_lookups: int = 0  # admissions not looked up: a hybrid Mamba model's (no state kept)
    pinned_hit_tokens: int = 0  # hit tokens held in pinned blocks


@dataclass
class PinnedPrefix:
    """A pinned prefix: its id (`prefix_id`), its blocks and their digests, its length in
    tokens, and the prompt tokens that later lookups found in its blocks."""

    id: str
    blocks: list[int]
    digests: list[bytes]
    tokens: int
    hit_tokens: int = 0


class ContextCache:
    def __init__(self, pool: BlockPool, max_pinned_blocks: int = 0) -> None:
        self.pool = pool
        self.metrics = ContextCacheMetrics()
        self.max_pinned_blocks = max_pinned_blocks
        self._pins: dict[str, PinnedPrefix] = {}
        self._pinned: dict[bytes, list[PinnedPrefix]] = {}  # a pinned block's digest: its pins
        self._released: list[list[int]] = []  # blocks of unpinned prefixes, still leased
        self._lock = threading.Lock()  # guards the pins against `unpin` from other threads

    def match(
        self, prompt: Sequence[int], root: bytes = b"", media: Sequence[MediaItem] = ()
    ) -> tuple[list[int], list[bytes]]:
        """Published blocks holding the longest cached prefix of `prompt` (computed under the
        adapter whose `root_digest` is `root`, with the prompt's `media`), and their digests.

        The prompt's last token is never matched: its logits must be computed."""
        bs = self.pool.block_size
        blocks: list[int] = []
        digests: list[bytes] = []
        for digest in prefix_digests(prompt, (len(prompt) - 1) // bs, bs, root, media):
            block = self.pool.lookup(digest)
            if block is None:
                break
            blocks.append(block)
            digests.append(digest)
        return blocks, digests

    def record_lookup(
        self, prompt_tokens: int, hit_tokens: int, digests: Sequence[bytes] = ()
    ) -> None:
        """A lookup that found `hit_tokens` of a prompt, in the blocks of `digests`."""
        self.metrics.lookups += 1
        self.metrics.lookup_tokens += prompt_tokens
        self.metrics.hit_tokens += hit_tokens
        bs = self.pool.block_size
        for digest in digests[: hit_tokens // bs]:
            pins = self._pinned.get(digest, ())
            for pin in pins:
                pin.hit_tokens += bs
            if pins:
                self.metrics.pinned_hit_tokens += bs

    def record_skipped(self) -> None:
        """An admission that asked for reuse but was not looked up (a hybrid Mamba model's)."""
        self.metrics.skipped_lookups += 1

    # -- pinned prefixes --------------------------------------------------------------------------

    @property
    def pinned_blocks(self) -> int:
        """Blocks held by pins (one that several pins hold counted once)."""
        return len(self._pinned)

    def pin(self, digests: Sequence[bytes]) -> PinnedPrefix | None:
        """Pin the published blocks of a prefix, given its blocks' chain digests (a prefix
        already pinned stays as it is: its pin is returned); None where a digest is no longer
        published (the prefix's KV is gone) or the pins would pass `max_pinned_blocks`."""
        pin_id = prefix_id(digests[-1])
        with self._lock:
            if pin_id in self._pins:
                return self._pins[pin_id]
        blocks = [self.pool.lookup(digest) for digest in digests]
        new = sum(1 for digest in digests if digest not in self._pinned)
        if None in blocks or self.pinned_blocks + new > self.max_pinned_blocks:
            return None
        pin = PinnedPrefix(
            pin_id,
            [block for block in blocks if block is not None],
            list(digests),
            len(digests) * self.pool.block_size,
        )
        for block in pin.blocks:
            self.pool.lease(block)
        with self._lock:
            self._pins[pin_id] = pin
            for digest in digests:
                self._pinned.setdefault(digest, []).append(pin)
        return pin

    def unpin(self, pin_id: str) -> None:
        """Let a pinned prefix go: no longer pinned, its blocks are released (cached, evictable
        again) at the next admission; a KeyError for an id that is not pinned. Any thread may
        call it."""
        with self._lock:
            pin = self._pins.pop(pin_id)
            for digest in pin.digests:
                holders = self._pinned[digest]
                holders.remove(pin)
                if not holders:
                    del self._pinned[digest]
            self._released.append(pin.blocks)

    def apply_unpins(self) -> None:
        """Release the blocks of the prefixes unpinned since the last call."""
        with self._lock:
            released, self._released = self._released, []
        for blocks in released:
            self.pool.release(blocks)

    def is_pinned(self, pin_id: str) -> bool:
        with self._lock:
            return pin_id in self._pins

    def pinned(self) -> list[PinnedPrefix]:
        with self._lock:
            return list(self._pins.values())

    def snapshot(self) -> dict[str, float]:
        m = self.metrics
        return {
            "lookups": m.lookups,
            "lookup_tokens": m.lookup_tokens,
            "hit_tokens": m.hit_tokens,
            "hit_ratio": m.hit_tokens / m.lookup_tokens if m.lookup_tokens else 0.0,
            "skipped_lookups": m.skipped_lookups,
            "evictions": self.pool.evictions,
            "cached_blocks": self.pool.num_cached,
            "pinned_prefixes": len(self.pinned()),
            "pinned_blocks": self.pinned_blocks,
            "pinned_hit_tokens": m.pinned_hit_tokens,
        }
