"""Speculative decoding inside in-flight batching, by prompt lookup and by a draft model: the
output is plain decoding's token for token (greedy and seeded), its distribution otherwise;
drafts are verified in the same ragged steps as plain and prefilling rows, rejected drafts give
their KV back."""

import math
from collections import Counter

import pytest

from inflight.model.checkpoints.loader import default_model_path
from inflight.protocol.deployment import DeploymentOptions, SpeculativeConfig
from inflight.protocol.outputs import FinishReason
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.protocol.stepped import ResidentRef
from inflight.runtime.host.residents import Resident, SequenceKV, SpeculativeState
from inflight.runtime.host.rows import SampledRow, ScheduledRow
from inflight.runtime.host.speculative import PromptLookup, SpeculativeDecoding, lookup_drafts
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks, run_staggered
from tiny_models import VOCAB

NGRAM = SpeculativeConfig(num_speculative_tokens=4)
CODE = (
    "Rename the variables of this code:\n"
    "def f(a, b):\n    c = a + b\n    d = c * 2\n    return d\n\n"
    "def g(x):\n    return f(x, x) + f(x, 1)\n\nThe code with new names:\n"
)


# -- the drafter and its configuration -----------------------------------------------------------


def test_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" occurs at 1 and 5 (the latest: followed by 7 8 5); "5 2 3" nowhere before.
    assert lookup_drafts(tokens, 3, 2, 3) == [7, 8, 5]
    assert lookup_drafts(tokens, 1, 2, 3) == [7]
    # A longer match wins over a later shorter one: "1 2 3" at 0 and 4, then "9" / "7".
    assert lookup_drafts([*tokens, 1, 2, 3], 2, 1, 3) == [7, 8]
    assert lookup_drafts([4, 5, 6], 2, 1, 3) == []
    # The drafts stop at the end of what is known.
    assert lookup_drafts([1, 2, 1, 2], 5, 2, 2) == [1, 2]


def test_lookup_drafts_past_the_tokens_still_on_the_device():
    """A row whose last pick (after the drafts it verifies) is on the device: the lookup runs
    over the known tokens and those drafts, and its first token stands for the one on the
    device; a row with nothing pending looks up its own tokens."""

    def Row(tokens, pending=0, unverified=()):  # noqa: N802 (stands for a resident)
        r = _resident(tokens)
        r.pending = pending
        r.features.speculative = SpeculativeState(unverified=unverified)
        return r

    lookup = PromptLookup(SpeculativeConfig(3, prompt_lookup_min=2, prompt_lookup_max=2))
    known = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    rows = [
        (Row(known), 3),  # "1 2" -> 3 4 5
        (Row(known, pending=1), 3),  # guess 3 on the device, then 4 5 6
        (Row(known, pending=3, unverified=(3, 4)), 3),  # "3 4" assumed -> guess 5, 6 7 1
        (Row(known, pending=1), 0),
    ]
    assert lookup.propose(rows) == [(3, 4, 5), (4, 5, 6), (6, 7, 1), ()]


def test_config_refuses_what_it_cannot_serve():
    assert SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    ) == SpeculativeConfig(3, prompt_lookup_max=4)
    with pytest.raises(ValueError, match=r"unknown keys \['draft'\]"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "draft": 1})
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram"})
    with pytest.raises(ValueError, match="speculative method must be 'ngram' or 'draft_model'"):
        SpeculativeConfig(3, method="medusa")
    with pytest.raises(ValueError, match="a draft model is given by `model`"):
        SpeculativeConfig(3, method="draft_model")
    with pytest.raises(ValueError, match="a draft model is given by `model`"):
        SpeculativeConfig(3, model="/some/where")
    assert SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 2}).method == (
        "draft_model"
    )
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in 1..16"):
        SpeculativeConfig(0)
    with pytest.raises(ValueError, match="need 1 <= prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig(3, prompt_lookup_min=4, prompt_lookup_max=2)


# -- exactness -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_runtimes():
    config = dict(max_batch_size=8, max_model_len=512, enable_context_reuse=False)
    return (
        Runtime(None, DeploymentOptions(**config)),
        Runtime(None, DeploymentOptions(**config, speculative_config=NGRAM)),
    )


@pytest.fixture(scope="module")
def overlapped_speculative():
    """Speculation with overlapped steps, as on CUDA: rows draft past the step in flight."""
    config = dict(max_batch_size=8, max_model_len=512, enable_context_reuse=False, overlap=True)
    return Runtime(None, DeploymentOptions(**config, speculative_config=NGRAM))


def _generate(runtime, prompt, **params):
    params.setdefault("max_tokens", 64)
    return runtime.handle_request(GenerationRequest(prompt, SamplingParams(**params))).result()


def test_greedy_output_is_plain_greedy_on_the_default_model(default_runtimes):
    plain, spec = default_runtimes
    prompt = plain.tokenizer.encode(CODE)
    before = spec.speculator.snapshot()
    want = _generate(plain, prompt, temperature=0, logprobs=2)
    got = _generate(spec, prompt, temperature=0, logprobs=2)
    after = spec.speculator.snapshot()
    assert got.token_ids == want.token_ids and got.text == want.text
    # The logprobs reported are the target's, whichever step computed them.
    assert got.logprobs == want.logprobs
    # Drafts were made and some accepted: the output did come through verification.
    assert after["accepted_tokens"] - before["accepted_tokens"] >= 8
    assert after["drafted_tokens"] > after["accepted_tokens"]
    assert_no_leaks(spec)


def test_stop_strings_and_max_tokens_end_inside_accepted_drafts(default_runtimes):
    plain, spec = default_runtimes
    prompt = plain.tokenizer.encode(CODE)
    full = _generate(plain, prompt, temperature=0).text
    # A stop string and a length budget that fall in the middle of the output.
    stop = full[len(full) // 2 : len(full) // 2 + 6]
    for params in (dict(stop=[stop]), dict(max_tokens=23), dict(stop=[stop], max_tokens=40)):
        want = _generate(plain, prompt, temperature=0, **params)
        got = _generate(spec, prompt, temperature=0, **params)
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
        )
    assert_no_leaks(spec)


def test_seeded_sampling_is_plain_sampling_token_for_token(default_runtimes):
    """At each position the sampler draws with that position's seeded noise, as plain decoding
    does: accepted drafts are the tokens plain sampling would have drawn."""
    plain, spec = default_runtimes
    prompt = plain.tokenizer.encode(CODE)
    for seed in (1, 2, 3):
        params = dict(temperature=1.0, top_p=0.9, seed=seed, max_tokens=48)
        assert _generate(spec, prompt, **params).token_ids == (
            _generate(plain, prompt, **params).token_ids
        )
    assert_no_leaks(spec)


def test_a_request_may_opt_out(default_runtimes):
    _, spec = default_runtimes
    prompt = spec.tokenizer.encode(CODE)
    before = spec.speculator.snapshot()["verifications"]
    _generate(spec, prompt, temperature=0, speculative=False)
    assert spec.speculator.snapshot()["verifications"] == before


def test_penalized_rows_are_not_drafted_and_decode_as_plainly(tiny_dirs, monkeypatch):
    """A penalty at a draft position would depend on the drafts before it: such rows decode
    without drafts (here beside a row that does draft, with overlapped steps) and give plain
    decoding's tokens."""
    config = dict(max_batch_size=4, max_model_len=256, enable_context_reuse=False, overlap=True)
    plain = Runtime(tiny_dirs["llama"], DeploymentOptions(**config))
    spec = Runtime(tiny_dirs["llama"], DeploymentOptions(**config, speculative_config=NGRAM))
    prompt = [5, 6, 7, 8] * 6
    penalties = dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2)
    penalized = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **penalties)
    drafting = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = plain.handle_request(GenerationRequest(prompt, penalized)).result()
    drafted: list[tuple[bool, int]] = []
    draft_length = spec.speculator.draft_length

    def watch(r, budget):
        length = draft_length(r, budget)
        drafted.append((r.request.params.penalized, length))
        return length

    monkeypatch.setattr(spec.speculator, "draft_length", watch)
    got = run_staggered(spec, [GenerationRequest(prompt, p) for p in (penalized, drafting)])
    assert got[0].token_ids == want.token_ids
    assert any(length for is_penalized, length in drafted if not is_penalized)
    assert not any(length for is_penalized, length in drafted if is_penalized)
    assert_no_leaks(spec)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_models_rejecting_most_drafts_still_decode_exactly(tiny_dirs, family):
    """Random weights reject nearly every draft: each rejection rolls the KV back, and the next
    step recomputes from there. A prompt holding most of the vocabulary and lookups of one token
    make a draft at almost every step."""
    config = dict(max_batch_size=4, max_model_len=512, block_size=8, enable_context_reuse=False)
    lookup = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    plain = Runtime(tiny_dirs[family], DeploymentOptions(**config))
    spec = Runtime(tiny_dirs[family], DeploymentOptions(**config, speculative_config=lookup))
    prompt = [(7 * i) % VOCAB for i in range(VOCAB)]
    for params in (
        dict(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
        dict(temperature=1, seed=3, max_tokens=40, ignore_eos=True),
    ):
        got, want = _generate(spec, prompt, **params), _generate(plain, prompt, **params)
        assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
    metrics = spec.speculator.snapshot()
    assert metrics["verifications"] >= 10
    assert metrics["drafted_tokens"] > 2 * metrics["accepted_tokens"]
    assert_no_leaks(spec)


@pytest.mark.parametrize("kind", ["mistral", "qwen3"])
def test_a_sliding_model_rolls_back_drafts_within_its_window(sliding_dirs, kind):
    """Every layer slides over 12 tokens (qwen3: every other one, its sliding layers' KV in
    the window group's pool), blocks of 4, steps overlapped: random weights
    reject nearly every draft, so rows roll their KV back to the first rejection (which the
    window still holds: blocks are given back only before the committed tokens' window), rows
    planned on drafts in flight are voided, and the blocks before the window go back as the
    sequence grows. The output is the plain runtime's, logprobs too; nothing leaks."""
    config = dict(max_model_len=512, block_size=4, quantization="none", enable_context_reuse=False)
    lookup = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    plain = Runtime(sliding_dirs[kind], DeploymentOptions(**config))
    spec = Runtime(
        sliding_dirs[kind],
        DeploymentOptions(**config, speculative_config=lookup, overlap=True),
    )
    assert (spec.scheduler.window or spec.scheduler.window_group).decode_tokens == 4
    prompt = [(7 * i) % VOCAB for i in range(VOCAB)]
    params = dict(temperature=0, max_tokens=160, ignore_eos=True, logprobs=1)
    got, want = _generate(spec, prompt, **params), _generate(plain, prompt, **params)
    assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
    metrics = spec.speculator.snapshot()
    assert metrics["drafted_tokens"] >= 20 and metrics["accepted_tokens"] < 5
    assert metrics["voided_rows"] == metrics["fallback_rows"] > 0
    assert_no_leaks(spec)


@pytest.fixture(scope="module")
def tiny_pair(tiny_dirs):
    """The tiny qwen3 plain, with itself as draft model, and with the tiny llama (random
    weights of another family, same vocabulary) as draft model."""
    config = dict(max_batch_size=4, max_model_len=256, block_size=8, enable_context_reuse=False)

    def drafted_by(family):
        spec = SpeculativeConfig(4, method="draft_model", model=str(tiny_dirs[family]))
        return Runtime(tiny_dirs["qwen3"], DeploymentOptions(**config, speculative_config=spec))

    plain = Runtime(tiny_dirs["qwen3"], DeploymentOptions(**config))
    return plain, drafted_by("qwen3"), drafted_by("llama")


def test_a_draft_model_drafts_and_only_accepted_drafts_stay(tiny_pair):
    """The target as its own draft: every draft is accepted (each step emits 1 + k tokens). A
    random draft of another family: nearly none is, and each rejection rewinds the draft's KV
    too. Greedy and seeded outputs are plain decoding's either way."""
    plain, itself, other = tiny_pair
    prompt = [5, 6, 7, 8, 9] * 8
    for params in (
        dict(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
        dict(temperature=1, seed=5, max_tokens=40, ignore_eos=True),
    ):
        want = _generate(plain, prompt, **params)
        for runtime in (itself, other):
            got = _generate(runtime, prompt, **params)
            assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
    greedy_self = itself.speculator.snapshot()
    assert greedy_self["accepted_tokens"] >= 30 and greedy_self["mean_accepted_length"] > 3
    rejected = other.speculator.snapshot()
    assert rejected["verifications"] >= 4
    assert rejected["accepted_tokens"] <= rejected["drafted_tokens"] // 4
    for runtime in (itself, other):
        assert_no_leaks(runtime)


def test_draft_model_rows_join_a_running_batch(tiny_dirs, tiny_pair):
    """Alone and with overlapped steps, where a draft model (which cannot draft past a token
    on the device) has the step in flight taken in first."""
    plain, itself, _ = tiny_pair
    spec = SpeculativeConfig(4, method="draft_model", model=str(tiny_dirs["llama"]))
    config = dict(max_batch_size=4, max_model_len=256, block_size=8, enable_context_reuse=False)
    overlapped = Runtime(
        tiny_dirs["qwen3"], DeploymentOptions(**config, overlap=True, speculative_config=spec)
    )
    requests = [
        GenerationRequest(
            [(3 * i + j) % VOCAB for j in range(20 + 7 * i)],
            SamplingParams(max_tokens=24 + 4 * i, temperature=0, ignore_eos=True),
        )
        for i in range(5)
    ]
    want = [o.token_ids for o in run_staggered(plain, requests)]
    for runtime in (itself, overlapped):
        assert [o.token_ids for o in run_staggered(runtime, requests)] == want
        assert runtime.speculator.snapshot()["verifications"] >= 10
        assert_no_leaks(runtime)


def test_the_default_model_drafting_for_itself(default_runtimes):
    """SmolLM2 as its own draft model: nearly every draft is accepted (the draft computes its
    tokens in other batch shapes, so a near-tie may differ), and the output, stop string and
    logprobs are plain decoding's."""
    plain, _ = default_runtimes
    spec = SpeculativeConfig(3, method="draft_model", model=str(default_model_path()))
    config = DeploymentOptions(
        max_batch_size=2, max_model_len=512, enable_context_reuse=False, speculative_config=spec
    )
    drafted = Runtime(None, config)
    prompt = plain.tokenizer.encode("Write a short story about a robot who learns to paint.")
    # EOS ignored: on some CPUs the bare prompt's greedy first token is EOS (a near-tie).
    base = dict(temperature=0, max_tokens=40, ignore_eos=True)
    full = _generate(plain, prompt, **base).text
    stop = full[20:26]
    assert stop.strip()
    for params in (dict(logprobs=1), dict(stop=[stop])):
        want = _generate(plain, prompt, **base, **params)
        got = _generate(drafted, prompt, **base, **params)
        assert (got.token_ids, got.text, got.logprobs) == (want.token_ids, want.text, want.logprobs)
    assert drafted.speculator.snapshot()["acceptance_rate"] > 0.8
    assert_no_leaks(drafted)


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_dirs):
    spec = SpeculativeConfig(2, method="draft_model", model=str(tiny_dirs["llama"]))
    with pytest.raises(ValueError, match=r"vocabulary \(320 tokens\) is not the target's"):
        Runtime(
            None, DeploymentOptions(max_batch_size=2, max_model_len=256, speculative_config=spec)
        )


def test_under_ifb_rows_that_verify_share_steps_with_joining_and_plain_rows(default_runtimes):
    plain, spec = default_runtimes
    tok = plain.tokenizer
    prompts = [
        tok.encode(CODE),
        tok.encode("Write a short poem about the sea."),
        tok.encode(CODE.replace("f(", "h(")),
        tok.encode("List three colours."),
    ]
    requests = [
        GenerationRequest(p, SamplingParams(max_tokens=40, temperature=0, logprobs=1))
        for p in prompts
    ]
    requests.append(
        GenerationRequest(prompts[0], SamplingParams(max_tokens=40, temperature=1, seed=7))
    )
    want = run_staggered(plain, requests)
    got = run_staggered(spec, requests)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]
    assert_no_leaks(spec)


def test_overlapped_steps_draft_past_the_step_in_flight_exactly(
    default_runtimes, overlapped_speculative, monkeypatch
):
    """With overlap on, every step stays overlapped: a row drafts while its last token (and
    the drafts it verifies) are still on the device, planned as if they are all accepted; a
    row planned on a draft that was then rejected is void, and the fallback row planned beside
    it for that rejection stands in its place. The output (with joiners, stop strings,
    logprobs and a seeded row) is plain decoding's, and nothing leaks."""
    plain, _ = default_runtimes
    spec = overlapped_speculative
    tok = plain.tokenizer
    full = _generate(plain, tok.encode(CODE), temperature=0).text
    prompts = [tok.encode(CODE), tok.encode("Why is the sky blue?"), tok.encode(CODE[30:])]
    requests = [
        GenerationRequest(p, SamplingParams(max_tokens=48, temperature=0, logprobs=1))
        for p in prompts
    ]
    requests.append(
        GenerationRequest(
            prompts[0], SamplingParams(max_tokens=48, temperature=0, stop=[full[40:46]])
        )
    )
    requests.append(
        GenerationRequest(prompts[2], SamplingParams(max_tokens=40, temperature=0.7, seed=3))
    )
    kinds = Counter()
    launch = spec.executor.launch

    def counting(step):
        # Rows verifying drafts after a token still on the device: drafted ahead.
        kinds["ahead"] += sum(bool(row.drafts) and row.device_token for row in step.rows)
        kinds["fallback"] += sum(row.fallback >= 0 for row in step.rows)
        return launch(step)

    monkeypatch.setattr(spec.executor, "launch", counting)
    want = run_staggered(plain, requests)
    before = spec.speculator.snapshot()
    got = run_staggered(spec, requests)
    after = spec.speculator.snapshot()
    assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in want]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert kinds["ahead"] >= 10, kinds
    assert after["accepted_tokens"] - before["accepted_tokens"] >= 20
    # Some drafts in flight were rejected, and the rows planned on them dropped; fallback
    # rows stood in for them (a fallback row for each draft in flight: most are dropped).
    voided = after["voided_rows"] - before["voided_rows"]
    assert voided > 0
    assert after["fallback_rows"] - before["fallback_rows"] == voided
    assert kinds["fallback"] > voided
    assert_no_leaks(spec)


def test_cancel_during_verification_ends_the_request_at_once(default_runtimes):
    _, spec = default_runtimes
    session = spec.new_session()
    prompt = spec.tokenizer.encode(CODE)
    ref = session.admit(GenerationRequest(prompt, SamplingParams(max_tokens=64, temperature=0)))
    ref = ref.ref
    verifying = False
    for _ in range(40):
        result = session.step()
        verifying = any(w.drafts and not w.is_prefill for w in result.work)
        if verifying:
            break
    assert verifying, "no step verified drafts"
    result = session.step(cancelled=[ref])
    assert result.finished[ref].finish_reason is FinishReason.CANCELLED
    assert not session.residents()
    session.finish()
    assert_no_leaks(spec)


# -- the distribution at temperature 1 -----------------------------------------------------------

# Chi-square critical value for 4 degrees of freedom at p = 0.001.
_CHI2_4DF_P001 = 18.467


def _continuations(runtime, prompt, requests: int) -> Counter:
    """Unseeded 5-token continuations of `prompt`, 8 sequences per request."""
    params = SamplingParams(max_tokens=5, temperature=1.0, n=8, ignore_eos=True)
    counts: Counter = Counter()
    for _ in range(requests):
        result = runtime.handle_request(GenerationRequest(prompt, params)).result()
        counts.update(tuple(s.token_ids) for s in result.outputs)
    return counts


def _chi_square(a: Counter, b: Counter, bins: list[tuple]) -> float:
    """Two-sample chi-square statistic over `bins` plus one bin for everything else."""

    def binned(c: Counter) -> list[int]:
        kept = [c[k] for k in bins]
        return [*kept, sum(c.values()) - sum(kept)]

    rows = [binned(a), binned(b)]
    total = sum(map(sum, rows))
    stat = 0.0
    for j in range(len(bins) + 1):
        column = rows[0][j] + rows[1][j]
        for row in rows:
            expected = sum(row) * column / total
            stat += (row[j] - expected) ** 2 / expected
    return stat


def test_sampling_keeps_the_target_distribution(default_runtimes, monkeypatch):
    """A prompt whose continuation the drafter predicts and the model samples with a spread:
    the 5-token continuations of plain and speculative sampling (384 each) agree by a
    chi-square test at p = 0.001 over the four commonest continuations and the rest. A verifier
    that accepts every draft fails the same test on a third of the samples (128, less power
    than the test itself has): the test can tell."""
    plain, spec = default_runtimes
    prompt = plain.tokenizer.encode("red green blue, " * 10 + "red green")
    want = _continuations(plain, prompt, 48)
    before = spec.speculator.snapshot()
    got = _continuations(spec, prompt, 48)
    after = spec.speculator.snapshot()
    bins = [k for k, _ in want.most_common(4)]
    # The draft path carried a good part of the samples.
    assert after["accepted_tokens"] - before["accepted_tokens"] >= 100
    stat = _chi_square(want, got, bins)
    assert stat < _CHI2_4DF_P001, (stat, want.most_common(6), got.most_common(6))

    def accept_all(row, picks):
        row.resident.features.speculative.fallback = -1
        if not row.drafts:
            return picks, 0
        return [SampledRow(token_id=d) for d in row.drafts] + [picks[-1]], 0

    monkeypatch.setattr(spec.speculator, "take", accept_all)
    wrong = _continuations(spec, prompt, 16)
    stat = _chi_square(want, wrong, bins)
    assert math.isfinite(stat) and stat > _CHI2_4DF_P001, (stat, wrong.most_common(6))


def _resident(prompt, max_tokens=64) -> Resident:
    """A resident of `prompt` (no model behind it), computed up to its last token."""
    r = Resident(ResidentRef(0, 1), GenerationRequest(prompt), 0, SequenceKV([], None), max_tokens)
    r.computed = len(prompt)
    return r


def test_backoff_after_rejections():
    """A row whose drafts are all rejected waits 2, 4, 8 ... steps (up to 32) before drafting
    again; an accepted draft resets it."""
    speculative = SpeculativeDecoding(NGRAM)
    r = _resident([1, 2, 3])
    speculative.seat(r, True)
    state = r.features.speculative

    def verify(accepted: int) -> None:
        """A row of 4 drafts whose first `accepted` picks equal them."""
        row = ScheduledRow(r, (3, 5, 6, 7, 8), r.computed - 5, True, drafts=(5, 6, 7, 8))
        picks = [SampledRow(d) for d in row.drafts[:accepted]]
        speculative.take(row, picks + [SampledRow(0)] * (5 - accepted))

    waits = []
    for _ in range(6):
        verify(0)
        waits.append(state.wait)
    assert waits == [2, 4, 8, 16, 32, 32]
    verify(1)
    assert state.backoff == 0
    snapshot = speculative.snapshot()
    assert snapshot["drafted_tokens"] == 28 and snapshot["accepted_tokens"] == 1
    assert snapshot["verifications"] == 7
    assert snapshot["mean_accepted_length"] == pytest.approx(1 + 1 / 7)
