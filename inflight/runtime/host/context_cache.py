"""`ContextCache`: reuse of the KV of token prefixes another request already computed.

Full blocks are identified by a chain digest: each block's digest covers its parent's digest
and its own token ids (and the content keys of the media whose placeholders it holds), so
equal digests mean equal prefixes. A block is published (made
findable) only after the step that wrote it has run, so a request seated in the same tick never
sees it. A published block outlives its resident: it stays findable while free, until the pool
reuses it for other content (see `BlockPool`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
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


@dataclass
class ContextCacheMetrics:
    lookups: int = 0  # admissions that looked their prompt up
    lookup_tokens: int = 0  # prompt tokens those lookups covered
    hit_tokens: int = 0  # prompt tokens found in the cache (not recomputed)
    skipped_lookups: int = 0  # admissions not looked up: a hybrid Mamba model's (no state kept)


class ContextCache:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.metrics = ContextCacheMetrics()

    def match(
        self, prompt: Sequence[int], root: bytes = b"", media: Sequence[MediaItem] = ()
    ) -> tuple[list[int], list[bytes]]:
        """Published blocks holding the longest cached prefix of `prompt` (computed under the
        adapter whose `root_digest` is `root`, with the prompt's `media`), and their digests.

        The prompt's last token is never matched: its logits must be computed."""
        bs = self.pool.block_size
        blocks: list[int] = []
        digests: list[bytes] = []
        parent = root
        for i in range((len(prompt) - 1) // bs):
            start, end = i * bs, (i + 1) * bs
            digest = chain_digest(parent, prompt[start:end], media_keys(media, start, end))
            block = self.pool.lookup(digest)
            if block is None:
                break
            blocks.append(block)
            digests.append(digest)
            parent = digest
        return blocks, digests

    def record_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.metrics.lookups += 1
        self.metrics.lookup_tokens += prompt_tokens
        self.metrics.hit_tokens += hit_tokens

    def record_skipped(self) -> None:
        """An admission that asked for reuse but was not looked up (a hybrid Mamba model's)."""
        self.metrics.skipped_lookups += 1

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
        }
