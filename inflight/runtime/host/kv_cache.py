"""`BlockPool`: the KV cache's blocks, handed out by number (torch-free; the tensors that hold
them are the executor's)."""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict


class FreeRuns:
    """A set of block numbers kept as sorted runs of consecutive numbers, so that a first fit
    costs a pass over the runs, not a sort of every free block (an H200's pool holds some
    65,000 blocks: sorting them took ~1 ms an admission)."""

    def __init__(self, count: int) -> None:
        self._starts = [0] if count else []
        self._ends = [count] if count else []  # exclusive
        self._size = count

    def __len__(self) -> int:
        return self._size

    def first_fit(self, count: int) -> list[int]:
        """Take `count` (<= len) blocks: the first `count` of the lowest run that holds them,
        else the lowest `count` blocks there are."""
        for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= count:
                self._take(i, start + count)
                return list(range(start, start + count))
        blocks: list[int] = []
        while len(blocks) < count:
            start, end = self._starts[0], self._ends[0]
            stop = min(end, start + count - len(blocks))
            blocks += range(start, stop)
            self._take(0, stop)
        return blocks

    def pop(self) -> int:
        """Take one block (the highest)."""
        block = self._ends[-1] - 1
        if block == self._starts[-1]:
            del self._starts[-1], self._ends[-1]
        else:
            self._ends[-1] = block
        self._size -= 1
        return block

    def add(self, block: int) -> None:
        """Return a block that is not in the set, joining the runs beside it."""
        i = bisect_right(self._starts, block)  # runs [0, i) start at or before it
        after = i < len(self._starts) and self._starts[i] == block + 1
        if i and self._ends[i - 1] == block:
            if after:
                self._ends[i - 1] = self._ends[i]
                del self._starts[i], self._ends[i]
            else:
                self._ends[i - 1] = block + 1
        elif after:
            self._starts[i] = block
        else:
            self._starts.insert(i, block)
            self._ends.insert(i, block + 1)
        self._size += 1

    def _take(self, i: int, stop: int) -> None:
        """Take run i's blocks before `stop`."""
        self._size -= stop - self._starts[i]
        if stop == self._ends[i]:
            del self._starts[i], self._ends[i]
        else:
            self._starts[i] = stop


class BlockPool:
    """Reference-counted KV blocks.

    A block in use has a reference count >= 1 (more than one when residents share a cached
    prefix). A block whose count drops to 0 becomes free; if it was published under a content
    digest (see `ContextCache`), it keeps the digest and stays findable until it is reused:
    such blocks are reused least-recently-freed first, after the blocks that hold nothing.
    Allocation prefers one contiguous run of blocks (first fit), which lets the CPU attention
    backend read a sequence's KV in place. Free blocks may be held back (`reserve`) for the
    later tokens of sequences that take their blocks as they grow (`kv_window.py`): only
    `allocate(..., reserved=True)` takes those.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._digest: list[bytes | None] = [None] * num_blocks
        self._empty = FreeRuns(num_blocks)  # free, holding nothing findable
        self._cached: OrderedDict[int, None] = OrderedDict()  # free, findable; oldest first
        self._published: dict[bytes, int] = {}
        self._reserved = 0  # free blocks held back
        self.evictions = 0  # cached blocks reused for other content

    @property
    def num_free(self) -> int:
        """Free blocks that are not held back."""
        return len(self._empty) + len(self._cached) - self._reserved

    @property
    def num_cached(self) -> int:
        """Blocks findable by digest (in use or free)."""
        return len(self._published)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int, reserved: bool = False) -> list[int] | None:
        """`count` blocks for new content, or None (and nothing taken) when fewer are free;
        `reserved`: from the blocks held back, which there must be, taken as they come (a
        sequence that grows a block at a time has no run to keep)."""
        if reserved:
            self.unreserve(count)
            blocks = [self._empty.pop() for _ in range(min(count, len(self._empty)))]
        elif count > self.num_free:
            return None
        else:  # the rest, where too few are empty, from the cached
            blocks = self._empty.first_fit(min(count, len(self._empty)))
        while len(blocks) < count:
            block, _ = self._cached.popitem(last=False)
            del self._published[self._digest[block]]
            self._digest[block] = None
            self.evictions += 1
            blocks.append(block)
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def reserve(self, count: int) -> bool:
        """Hold back `count` free blocks; False (holding none) where fewer are free."""
        if count > self.num_free:
            return False
        self._reserved += count
        return True

    def unreserve(self, count: int) -> None:
        """Stop holding back `count` blocks."""
        if count > self._reserved:
            raise RuntimeError(f"{count} KV blocks unreserved, {self._reserved} held back")
        self._reserved -= count

    def in_use(self, block: int) -> bool:
        return self._refs[block] > 0

    def lookup(self, digest: bytes) -> int | None:
        return self._published.get(digest)

    def lease(self, block: int) -> None:
        """Take one more reference to a published block (reviving it if it was free)."""
        if self._refs[block] == 0:
            del self._cached[block]
        self._refs[block] += 1

    def publish(self, block: int, digest: bytes) -> bool:
        """Make a block findable by its content digest; False if that content is already."""
        if digest in self._published or self._digest[block] is not None:
            return False
        self._published[digest] = block
        self._digest[block] = digest
        return True

    def release(self, blocks: list[int], keep_reserved: bool = False) -> None:
        """Drop one reference to each block; the last blocks of a sequence are reused first.
        `keep_reserved`: as many free blocks are then held back for the releaser (one still
        referenced elsewhere holds back another: the releaser's reservation covered it)."""
        for block in reversed(blocks):
            if self._refs[block] < 1:
                raise RuntimeError(f"KV block {block} released more often than taken")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._digest[block] is None:
                    self._empty.add(block)
                else:
                    self._cached[block] = None
        if keep_reserved and not self.reserve(len(blocks)):
            raise RuntimeError("KV blocks released to be held back, but too few are free")
