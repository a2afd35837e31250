"""`BlockPool`: contiguous first-fit allocation, then reuse of cached blocks oldest first; free
blocks held back for sequences that take their blocks as they grow."""

import random

import pytest

from inflight.runtime.host.kv_cache import BlockPool, FreeRuns


def test_allocation_prefers_one_contiguous_run_of_empty_blocks():
    pool = BlockPool(8, 4)
    first = pool.allocate(2)
    assert (first, pool.allocate(1)) == ([0, 1], [2])
    pool.release(first)
    assert pool.allocate(3) == [3, 4, 5]  # the first run of 3, not blocks 0, 1, 3
    assert pool.allocate(4) == [0, 1, 6, 7]  # no run of 4: the first empty ones


def test_free_runs_take_blocks_as_a_first_fit_over_the_sorted_free_blocks():
    """Random takes and returns against the plain rule: the first `count` consecutive numbers
    in the sorted free blocks, else the lowest `count` of them; `pop` takes the highest."""
    rng = random.Random(0)
    for size in (1, 7, 64, 300):
        runs, model = FreeRuns(size), list(range(size))
        for _ in range(2000):
            taken = sorted(set(range(size)) - set(model))
            if taken and rng.random() < 0.5:
                block = rng.choice(taken)
                runs.add(block)
                model = sorted([*model, block])
            elif model and rng.random() < 0.2:
                assert runs.pop() == model.pop()
            else:
                count = rng.randint(0, len(model))
                fit = (
                    next(
                        (
                            model[i : i + count]
                            for i in range(len(model) - count + 1)
                            if model[i + count - 1] - model[i] == count - 1
                        ),
                        model[:count],
                    )
                    if count
                    else []
                )
                assert runs.first_fit(count) == fit
                chosen = set(fit)
                model = [b for b in model if b not in chosen]
            assert len(runs) == len(model)


def test_when_only_cached_blocks_are_free_the_oldest_are_reused():
    """Found by bench/chaos.py: with the context cache holding every free block (none empty),
    allocation indexed an empty list and failed the admission."""
    pool = BlockPool(4, 4)
    blocks = pool.allocate(4)
    for block in blocks:
        assert pool.publish(block, bytes([block]))
    pool.release(blocks[:2])
    pool.release(blocks[2:])
    assert pool.num_free == 4 and pool.num_cached == 4
    # Released last blocks first within each call: 1, 0, then 3, 2.
    assert pool.allocate(3) == [1, 0, 3]
    assert pool.evictions == 3 and pool.lookup(bytes([2])) == 2
    assert pool.allocate(0) == []
    assert pool.allocate(2) is None  # one free: nothing taken
    assert pool.num_free == 1


def test_held_back_blocks_go_only_to_reserved_allocations():
    pool = BlockPool(6, 4)
    assert pool.reserve(4) and pool.num_free == 2
    assert not pool.reserve(3) and pool.num_free == 2  # too few free: none held back
    assert pool.allocate(3) is None
    taken = pool.allocate(3, reserved=True)
    assert len(taken) == 3 and pool.num_free == 2
    pool.release(taken[:2], keep_reserved=True)  # given back, held back for the releaser
    assert pool.num_free == 2
    pool.release(taken[2:])
    assert pool.num_free == 3
    pool.unreserve(3)
    assert pool.num_free == 6
    with pytest.raises(RuntimeError, match="1 KV blocks unreserved, 0 held back"):
        pool.unreserve(1)


def test_releasing_a_block_another_holds_still_holds_one_back():
    """A block leased from the cache by another sequence outlives this release: the releaser
    is held back another free block (its reservation counted it whatever it leased)."""
    pool = BlockPool(4, 4)
    [block] = pool.allocate(1)
    assert pool.publish(block, b"prefix")
    pool.lease(block)
    pool.release([block], keep_reserved=True)
    assert pool.in_use(block) and pool.num_free == 2
