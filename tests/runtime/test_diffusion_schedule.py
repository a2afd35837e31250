"""The block-diffusion step plan (torch-free): residents in seated order within the token
budget, a canvas counted whole, an encode's last chunk joined by the canvas it frees."""

from __future__ import annotations

from inflight.runtime.diffusion.schedule import Segment, plan_segments


def test_denoising_residents_take_a_canvas_each_while_it_fits():
    assert plan_segments([0, 0, 0], canvas=8, budget=20) == [
        Segment(0, 0, True),
        Segment(1, 0, True),
    ]


def test_a_prompt_is_chunked_and_its_last_chunk_starts_the_canvas():
    assert plan_segments([40], canvas=8, budget=16) == [Segment(0, 16, False)]
    assert plan_segments([10], canvas=8, budget=16) == [Segment(0, 10, False)]
    assert plan_segments([8], canvas=8, budget=16) == [Segment(0, 8, True)]


def test_later_residents_take_what_is_left_in_seated_order():
    # The first denoises (8), the second encodes 6 of its 30, nothing is left for the third.
    assert plan_segments([0, 30, 5], canvas=8, budget=14) == [
        Segment(0, 0, True),
        Segment(1, 6, False),
    ]
    # A canvas that does not fit does not stop a smaller encode behind it.
    assert plan_segments([0, 3], canvas=8, budget=5) == [Segment(1, 3, False)]


def test_a_chunk_holds_a_run_marked_whole_or_ends_before_it():
    # An image at 10..30 of a 40-token prompt, a budget of 16: the chunk ends before it.
    assert plan_segments([40], canvas=8, budget=16, whole=[[(10, 30)]]) == [Segment(0, 10, False)]
    # At the run's start with room for all of it: taken whole, and what follows it.
    assert plan_segments([30], canvas=8, budget=24, whole=[[(0, 20)]]) == [Segment(0, 24, False)]
    # At its start without room: it waits.
    assert plan_segments([30, 0], canvas=8, budget=16, whole=[[(0, 20)], []]) == [
        Segment(1, 0, True)
    ]
