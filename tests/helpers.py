"""Assertions shared by the tests."""


def assert_no_leaks(runtime) -> None:
    """Every KV block and resident slot is free again (DESIGN invariant 11)."""
    assert runtime.blocks.num_free == runtime.blocks.num_blocks, "KV blocks leaked"
    assert runtime.slots.num_free == runtime.slots.capacity, "resident slots leaked"
