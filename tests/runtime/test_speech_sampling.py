"""Picking speech codes: greedy, top-k, top-p and temperature per row, each row's draw from its
own generator."""

from __future__ import annotations

import torch

from inflight.runtime.speech.sampling import Draw, Draws, penalize
from inflight.runtime.speech.sampling import pick_rows as pick_draws


def pick_rows(logits: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    rows = Draws(draws, logits.shape[-1], logits.device)
    noise = rows.noise(1, logits.shape[-1], logits.device)
    return pick_draws(logits, rows.sampling, None if noise is None else noise[:, 0])


def draw(temperature=1.0, top_k=0, top_p=1.0, seed=0) -> Draw:
    return Draw(temperature, top_k, top_p, torch.Generator().manual_seed(seed))


def test_greedy_rows_take_the_argmax_beside_sampled_ones():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    picked = pick_rows(logits, [draw(0), draw(1.0), draw(0)])
    assert picked[0] == logits[0].argmax() and picked[2] == logits[2].argmax()
    assert pick_rows(logits, [draw(0)] * 3).tolist() == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_only_the_likeliest_codes():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    seen_k, seen_p = set(), set()
    for seed in range(200):
        seen_k.add(int(pick_rows(logits, [draw(2.0, top_k=2, seed=seed)])))
        # softmax: 0.64, 0.24, 0.09, ...: top_p 0.8 keeps the first two.
        seen_p.add(int(pick_rows(logits, [draw(1.0, top_p=0.8, seed=seed)])))
    assert seen_k == {0, 1} and seen_p == {0, 1}
    assert int(pick_rows(logits, [draw(1.0, top_p=0.1)])) == 0  # the first always stays


def test_draws_follow_the_tempered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = torch.zeros(3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4000):
        counts[pick_rows(logits, [Draw(1.0, 0, 1.0, generator)])] += 1
    assert torch.allclose(counts / 4000, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_a_rows_draws_depend_on_its_own_generator_alone():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    alone = int(pick_rows(logits[:1], [draw(seed=5)]))
    beside = pick_rows(logits, [draw(seed=5), draw(seed=9)])
    assert int(beside[0]) == alone


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False], [False, False, True]])
    penalized = penalize(logits, seen, torch.tensor([2.0, 4.0]))
    assert penalized.tolist() == [[1.0, -4.0, 1.0], [2.0, -2.0, 0.25]]
