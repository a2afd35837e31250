"""Per-row sampling over synthetic logits."""

import math
import random
from collections import Counter

import pytest
import torch

from inflight.protocol.request import SamplingParams
from inflight.runtime.device import sampler as sampler_module
from inflight.runtime.device.sampler import (
    Sampler,
    select_mask_kernel,
    torch_apply_masks,
)
from inflight.runtime.host.rows import SamplingRow


def _row(position=0, **params):
    return SamplingRow(SamplingParams(**params), position)


def _logits(rows=1, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = _logits(3)
    out = Sampler(seed=1)(logits, [_row(temperature=0), _row(temperature=1.0), _row(temperature=0)])
    assert out[0].token_id == int(logits[0].argmax())
    assert out[2].token_id == int(logits[2].argmax())


def test_greedy_only_steps_pick_their_argmax_from_the_logits_as_given():
    # bf16 logits (ties among them), as a GPU's LM head gives them: the picks of a step whose
    # rows only take the argmax are those of the float32 path, which a logprobs row takes.
    logits = (_logits(16, 2000) * 20).to(torch.bfloat16)
    want = logits.float().argmax(-1).tolist()
    plain = Sampler(seed=1)(logits, [_row(temperature=0) for _ in range(16)])
    assert [o.token_id for o in plain] == want
    assert all(o.logprob is None for o in plain)
    mixed = Sampler(seed=1)(
        logits, [_row(temperature=0) for _ in range(15)] + [_row(temperature=0, logprobs=0)]
    )
    assert [o.token_id for o in mixed] == want
    assert mixed[-1].logprob is not None


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(2)
    for _ in range(20):
        out = Sampler()(logits, [_row(temperature=2.0, top_k=1), _row(temperature=2.0, top_p=1e-6)])
        assert [o.token_id for o in out] == logits.argmax(dim=-1).tolist()


def test_top_k_and_min_p_restrict_the_support():
    logits = _logits(1, vocab=100)
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = torch.softmax(logits[0], dim=-1)
    allowed_min_p = {i for i in range(100) if probs[i] >= 0.2 * probs.max()}
    sampler = Sampler(seed=3)
    for _ in range(200):
        assert sampler(logits, [_row(top_k=5)])[0].token_id in top5
        assert sampler(logits, [_row(min_p=0.2)])[0].token_id in allowed_min_p


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {Sampler(seed=s)(logits, [_row(top_p=0.8)])[0].token_id for s in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.8: the rest is cut


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(seed=0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sampler(torch.log(probs)[None], [_row()])[0].token_id] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_logit_bias_applies_to_its_row_only():
    logits = _logits(2)
    target = int(logits[0].argmin())
    out = Sampler()(logits, [_row(temperature=0, logit_bias={target: 100}), _row(temperature=0)])
    assert out[0].token_id == target
    assert out[1].token_id == int(logits[1].argmax())


def _penalized(logits, params, prompt, output):
    """vLLM's penalties, one token at a time: repetition over the prompt and output, then
    frequency (per occurrence) and presence (once) over the output."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, count in Counter(output).items():
        x[t] -= params.frequency_penalty * count + params.presence_penalty
    return x


def test_penalties_follow_the_formulas_per_row_and_leave_logprobs_raw():
    rng = random.Random(0)
    for trial in range(40):
        logits = _logits(4, vocab=30, seed=trial)
        rows = []
        for _ in range(4):
            params = SamplingParams(
                temperature=0,
                logprobs=1,
                repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.5]),
                frequency_penalty=rng.choice([0.0, 0.4, -0.6, 2.0]),
                presence_penalty=rng.choice([0.0, 0.5, -1.0]),
            )
            prompt = [rng.randrange(30) for _ in range(rng.randrange(6))]
            output = [rng.randrange(30) for _ in range(rng.randrange(8))]
            rows.append(SamplingRow(params, len(output), 0, prompt, output))
        out = Sampler()(logits, rows)
        for i, (row, got) in enumerate(zip(rows, out, strict=True)):
            want = _penalized(logits[i], row.params, row.prompt, row.output)
            assert got.token_id == int(want.argmax()), (trial, i)
            raw = torch.log_softmax(logits[i], dim=-1)
            assert got.logprob == pytest.approx(raw[got.token_id].item(), abs=1e-6)


def test_a_penalty_turns_the_pick_and_touches_only_its_row():
    logits = torch.tensor([[2.0, 1.9, 0.0, -3.0], [2.0, 1.9, 0.0, -3.0]])
    seen = dict(prompt=[0], output=[])
    repeated = SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.1), 0, 0, **seen)
    out = Sampler()(logits, [repeated, _row(temperature=0)])
    assert [o.token_id for o in out] == [1, 0]  # 2.0 / 1.1 < 1.9; the plain row keeps 0
    # Frequency counts the output only: the prompt's token 0 is not charged.
    frequent = SamplingParams(temperature=0, frequency_penalty=0.06)
    out = Sampler()(logits[:1], [SamplingRow(frequent, 2, 0, [0, 0, 0], [1, 1])])
    assert out[0].token_id == 0
    out = Sampler()(logits[:1], [SamplingRow(frequent, 2, 0, [], [0, 0])])
    assert out[0].token_id == 1  # 2.0 - 2 * 0.06 < 1.9


def test_seeded_row_draws_the_same_whatever_shares_the_step():
    logits = _logits(4)
    alone = Sampler()(logits[2:3], [_row(position=7, seed=42)])[0].token_id
    for other_seed in range(10):
        rows = [_row(), _row(seed=other_seed), _row(position=7, seed=42), _row(temperature=0)]
        assert Sampler()(logits, rows)[2].token_id == alone
    # A different position (the next output token) draws fresh noise.
    draws = {Sampler()(logits[2:3], [_row(position=p, seed=42)])[0].token_id for p in range(40)}
    assert len(draws) > 1


def test_a_seeded_filtered_row_draws_the_same_whatever_filters_share_the_step():
    # Other rows' top-k and top-p change how wide they look for candidates, not how this row does.
    logits = _logits(3, vocab=3000) * 0.3

    def seeded(seed):
        return _row(position=3, seed=seed, temperature=0.9, top_p=0.95)

    alone = [Sampler()(logits[1:2], [seeded(s)])[0].token_id for s in range(20)]
    assert len(set(alone)) > 1
    for first, last in ((_row(top_k=2500), _row(top_p=0.5)), (_row(top_k=3), _row(min_p=0.1))):
        for s in range(20):
            assert Sampler()(logits, [first, seeded(s), last])[1].token_id == alone[s]


def test_logprobs_are_raw_sorted_and_consistent():
    logits = _logits(2)
    out = Sampler()(logits, [_row(temperature=0.7, logprobs=5), _row(temperature=0)])
    ref = torch.log_softmax(logits[0], dim=-1)
    entry = out[0]
    assert math.isclose(entry.logprob, ref[entry.token_id].item(), abs_tol=1e-6)
    assert entry.top_ids == ref.topk(5).indices.tolist()
    assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
    assert all(lp <= 0 for lp in entry.top_logprobs)
    assert out[1].logprob is None and out[1].top_ids is None


def test_logprobs_zero_gives_only_the_chosen_token():
    out = Sampler()(_logits(1), [_row(temperature=0, logprobs=0)])
    assert out[0].logprob is not None and out[0].top_ids == []


def test_native_mask_kernel_matches_the_torch_formula():
    torch.manual_seed(3)
    vocab = 1000  # not a multiple of 32: the last word is partly past the vocabulary
    logits = torch.randn(6, vocab)
    packed = torch.randint(-(2**31), 2**31 - 1, (3, -(-vocab // 32)), dtype=torch.int32)
    packed[1] = -1  # a row that allows everything
    rows = torch.tensor([4, 0, 2])
    native, reference = logits.clone(), logits.clone()
    kernel = select_mask_kernel(torch.device("cpu"))
    assert kernel is not torch_apply_masks  # the native one builds here
    kernel(native, rows, packed)
    torch_apply_masks(reference, rows, packed)
    assert torch.equal(native, reference)
    assert torch.equal(native[[1, 3, 5]], logits[[1, 3, 5]]) and torch.equal(native[0], logits[0])


def test_masked_rows_sample_only_what_they_allow_and_report_raw_logprobs():
    torch.manual_seed(4)
    logits = torch.randn(2, 64)
    allowed = [5, 17, 40]
    packed = torch.zeros(1, 2, dtype=torch.int32)
    for t in allowed:
        packed[0, t // 32] |= 1 << (t % 32)
    sampler = Sampler(seed=0)
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=1), 0)] * 2
    picks = sampler.fetch(sampler.sample(logits, rows, ([1], packed)))
    assert picks[0].token_id == int(logits[0].argmax())  # the free row is untouched
    assert picks[1].token_id == max(allowed, key=lambda t: logits[1, t])
    raw = torch.log_softmax(logits[1], dim=-1)
    assert abs(picks[1].logprob - raw[picks[1].token_id].item()) < 1e-6
    drawn = Sampler(seed=1)
    hot = [SamplingRow(SamplingParams(temperature=5.0, seed=i), i) for i in range(2)]
    for _ in range(20):
        assert drawn.fetch(drawn.sample(logits, hot, ([1], packed)))[1].token_id in allowed


def _sorted_filter_keeps(logits, top_k, top_p, min_p):
    """The filters' definition over each whole row, sorted: the k most likely; over those,
    renormalized, each token while the mass before it is below top_p; each at least min_p times
    the likeliest; the likeliest always."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for i, row in enumerate(logits.double()):
        ordered, order = row.sort(descending=True)
        k = top_k[i] if top_k[i] > 0 else len(row)
        probs = torch.softmax(ordered[:k], dim=-1)
        kept = probs >= min_p[i] * probs[0]
        if top_p[i] < 1:  # 1 cuts nothing, however the sum rounds
            kept &= probs.cumsum(0) - probs < top_p[i]
        kept[0] = True
        keep[i, order[:k][kept]] = True
    return keep


@pytest.mark.parametrize("candidates", [1024, 8])
def test_filters_keep_what_a_sort_of_the_whole_row_keeps(monkeypatch, candidates):
    # With 8 candidates, most nuclei reach past them and their rows are sorted whole.
    monkeypatch.setattr(sampler_module, "_CANDIDATES", candidates)
    rng = random.Random(0)
    for trial in range(40):
        rows, vocab = rng.choice([(1, 50), (5, 300), (9, 2000)])
        logits = _logits(rows, vocab, seed=trial) * rng.choice([0.3, 1.0, 2.0])
        top_k = [rng.choice([0, 0, 1, 3, 40, vocab - 1, vocab]) for _ in range(rows)]
        top_p = [rng.choice([1.0, 1.0, 0.9, 0.5, 0.99, 1e-6]) for _ in range(rows)]
        min_p = [rng.choice([0.0, 0.0, 0.05, 0.5]) for _ in range(rows)]
        got = sampler_module._filter(logits, top_k, top_p, min_p) > float("-inf")
        assert torch.equal(got, _sorted_filter_keeps(logits, top_k, top_p, min_p)), trial


def test_a_draw_inverts_the_distribution_at_its_number():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25]])
    scaled = torch.log(probs)
    picks = {
        u: sampler_module._invert(scaled, torch.tensor([u], dtype=torch.float64)).item()
        for u in (0.0, 0.49, 0.5, 0.74, 0.75, 0.999, 1 - 2**-53)
    }
    assert picks == {0.0: 0, 0.49: 0, 0.5: 2, 0.74: 2, 0.75: 3, 0.999: 3, 1 - 2**-53: 3}
    # The last tokens of probability 0 are never picked, even at the top of [0, 1).
    tail = torch.log(torch.tensor([[0.3, 0.7, 0.0, 0.0]]))
    assert sampler_module._invert(tail, torch.tensor([1 - 2**-53], dtype=torch.float64)) == 1


def test_sampled_rows_over_a_large_vocabulary_follow_their_filtered_distribution():
    # 10,000 draws of a row over 50,000 tokens, with top-p: each kept token's share within
    # 4 standard deviations of its probability, nothing outside the nucleus.
    logits = _logits(1, 50_000, seed=5) * 0.5
    logits[0, :4] = torch.tensor([12.0, 11.5, 11.0, 10.0])
    keep = _sorted_filter_keeps(logits / 0.8, [0], [0.9], [0.0])[0]
    probs = torch.softmax((logits[0] / 0.8).masked_fill(~keep, float("-inf")).double(), dim=-1)
    sampler, rows = Sampler(seed=11), [_row(temperature=0.8, top_p=0.9)] * 100
    counts = Counter(o.token_id for _ in range(100) for o in sampler(logits.expand(100, -1), rows))
    assert set(counts) <= set(keep.nonzero().flatten().tolist())
    for t in range(4):
        p = probs[t].item()
        assert abs(counts[t] / 10_000 - p) <= 4 * math.sqrt(p * (1 - p) / 10_000)


def test_min_tokens_rules_out_eos_and_stop_ids_below_it_only():
    eos, stop = 7, 11
    logits = _logits(4)
    logits[:, eos] = logits[:, stop] = 50.0  # each row would end here
    sampler = Sampler(seed=0, eos=[eos])
    rows = [
        _row(0, temperature=0, min_tokens=2, stop_token_ids=[stop]),
        _row(1, temperature=1.0, min_tokens=2, stop_token_ids=[stop]),
        _row(2, temperature=0, min_tokens=2, stop_token_ids=[stop]),  # at min_tokens: free
        _row(0, temperature=0, min_tokens=2, ignore_eos=True),  # EOS stays open
    ]
    out = sampler(logits, rows)
    assert out[0].token_id not in (eos, stop) and out[1].token_id not in (eos, stop)
    rest = logits[0].clone()
    rest[[eos, stop]] = -math.inf
    assert out[0].token_id == int(rest.argmax())  # the best of the rest
    assert out[2].token_id in (eos, stop) and out[3].token_id == eos
    # Logprobs stay those of the raw distribution.
    (raw,) = sampler(
        logits[:1], [_row(0, temperature=0, min_tokens=2, logprobs=1, stop_token_ids=[stop])]
    )
    assert raw.top_ids[0] in (eos, stop)
