"""`KVWindow`: the KV blocks of a sequence whose every attention layer slides, or of its
sliding layers where others attend fully (their blocks then in a pool of their own: the
scheduler's window group) (torch-free).

A query at position p of such a model reads keys p - W + 1 .. p only (W: its layers' widest
window), so the blocks before the window of a sequence's next query are never read again.
Those go back to the pool as the sequence grows, and its new tokens take blocks as they need
them: a long sequence holds about W / block_size + 1 blocks however long it gets.

The next query of a sequence is at or after `committed` (the tokens whose KV completed steps
wrote: a speculative row's rejected drafts may roll `computed` back to there, never further),
so that is where its window starts. Releasing no earlier also keeps the context cache right:
the output processor publishes a full block once a completed step wrote it, so a block is
released only after it was published or never will be, and a published block that is
released keeps its digest and its content (the KV of the same tokens after the same prefix)
until the pool reuses it. A lookup leases the cached blocks in its first query's window only.

Admission reserves the most blocks a sequence can hold at once (`quota`), held back in the
pool (`BlockPool.reserve`) for its later tokens: it has computed at most two rows past
`committed` (the step in flight's, the one being planned), each of at most `chunk` tokens
(its prompt's chunks are cut to it), so its blocks span at most the window before
`committed` plus two chunks. A block it releases stays held back for it. It never counts on
blocks it shares: a block leased from the cache may outlive its release in the other
sequences holding it, so a sequence's reservation is its whole quota whatever it leased.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.residents import SequenceKV


@dataclass(frozen=True)
class KVWindow:
    """Sequences whose queries read at most the last `window` keys, over blocks of
    `block_size` tokens, and whose decode rows compute at most `decode_tokens` tokens (1 plus
    speculative drafts)."""

    window: int
    block_size: int
    decode_tokens: int = 1

    @property
    def chunk(self) -> int:
        """The most tokens a row computes in a step: half a window (so that a prompt's chunks
        overlap the step in flight without reserving two windows), at least a block and a
        decode row."""
        return max(self.window // 2, self.block_size, self.decode_tokens)

    @property
    def quota(self) -> int:
        """The most blocks a sequence holds at once: those from the window of its position
        `committed` up to `committed` plus two chunks, each end partway into a block."""
        return (self.window - 1 + 2 * self.chunk) // self.block_size + 2

    def sequence_blocks(self, tokens: int) -> int:
        """The blocks a sequence of `tokens` tokens reserves."""
        return min(-(-tokens // self.block_size), self.quota)

    def first_seen(self, committed: int) -> int:
        """The first block that a query at or after position `committed` reads."""
        return max(0, committed - self.window + 1) // self.block_size

    def release(self, kv: SequenceKV, pool: BlockPool, committed: int) -> None:
        """Give back the blocks before the window of the sequence's next query, at or after
        `committed` (held back for it)."""
        first = self.first_seen(committed)
        if first > kv.released:
            pool.release(kv.blocks[kv.released : first], keep_reserved=True)
            kv.reserved += first - kv.released
            kv.released = first

    def grow(self, kv: SequenceKV, tokens: int, pool: BlockPool) -> None:
        """Blocks for the sequence's first `tokens` tokens, from those held back for it."""
        missing = -(-tokens // self.block_size) - len(kv.blocks)
        if missing <= 0:
            return
        if missing > kv.reserved:
            raise RuntimeError(
                f"a sliding-window sequence needs {missing} more KV blocks; {kv.reserved} are "
                "held back for it"
            )
        kv.blocks += pool.allocate(missing, reserved=True)
        kv.reserved -= missing
        kv.table = np.asarray(kv.blocks, dtype=np.int64)
