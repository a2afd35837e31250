"""`BlockPool`: the KV cache's blocks, handed out by number (torch-free; the tensors that hold
them are the executor's)."""

from __future__ import annotations

from collections import OrderedDict


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
        self._empty: set[int] = set(range(num_blocks))  # free, holding nothing findable
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
        else:
            empty = sorted(self._empty)
            run = min(count, len(empty))
            blocks = next(
                (
                    empty[i : i + run]
                    for i in range(len(empty) - run + 1)
                    if run and empty[i + run - 1] - empty[i] == run - 1
                ),
                empty[:run],  # also where no block is empty (run 0): all come from the cached
            )
            self._empty.difference_update(blocks)
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
