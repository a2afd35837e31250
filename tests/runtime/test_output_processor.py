"""The output processor on its own (torch-free: no model, executor or session): residents
seated through the scheduler's admission stages, steps of hand-built rows and hand-picked
tokens taken in. What it puts in the step's result (chunks, terminal chunks, snapshots), whom
it evicts, and what it publishes to the context cache."""

import pytest
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from inflight.model.checkpoints.tokenizer import SpecialTokens, Tokenizer
from inflight.protocol.outputs import FinishReason
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.protocol.stepped import StepResult
from inflight.runtime.host.context_cache import ContextCache
from inflight.runtime.host.decoding import PlainDecoding
from inflight.runtime.host.features import RowFailure, RowFeature
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.output_processor import OutputProcessor
from inflight.runtime.host.rows import SampledRow, ScheduledRow, ScheduledStep, commit
from inflight.runtime.host.scheduler import PrefillPolicy, Scheduler
from inflight.runtime.host.slots import ResidentSlots

WORDS = ["<eos>", "one", "two", "three", "four", "five", "six", "END", "OF", "?"]
EOS, ONE, TWO, THREE, FOUR, FIVE, SIX, END, OF = range(9)
BLOCK = 4


def _tokenizer() -> Tokenizer:
    """Whole words, each a token; "<eos>" (id 0) a special token that ends generation."""
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, "?"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken("<eos>", special=True)])
    return Tokenizer(backend, SpecialTokens(eos_ids=[EOS]), None, byte_level=False)


class Parts:
    """A scheduler and an output processor over one block pool, as the runtime builds them
    (the same features in both), and the steps taken in."""

    def __init__(self, features=(), context_cache=False, blocks=32, slots=4) -> None:
        self.pool = BlockPool(blocks, BLOCK)
        self.slots = ResidentSlots(slots)
        self.cache = ContextCache(self.pool) if context_cache else None
        self.scheduler = Scheduler(
            self.pool,
            self.slots,
            self.cache,
            features,
            PlainDecoding(),
            PrefillPolicy(),
            max_model_len=64,
            vocab_size=len(WORDS),
            max_num_tokens=64,
        )
        self.outputs = OutputProcessor(
            self.scheduler,
            _tokenizer(),
            self.pool,
            features,
            PlainDecoding(),
            publish_blocks=context_cache,
        )
        self.step_id = 0

    def seat(self, prompt, **params):
        """A request's residents (one per sequence), seated and tracked."""
        request = GenerationRequest(prompt, SamplingParams(**params))
        reservation = self.scheduler.reserve(request, self.scheduler.check(request))
        assert reservation is not None
        residents = self.scheduler.seat(reservation)
        for r in residents:
            self.outputs.track(r)
        return residents

    def row(self, r, n=None):
        """The resident's next row, committed as the scheduler commits what it plans: the rest
        of its prompt (or `n` tokens of it), else one decode token."""
        if r.prefilling:
            end = r.prompt_len if n is None else r.computed + n
            row = ScheduledRow(r, r.prompt[r.computed : end], r.computed, end == r.prompt_len)
        else:
            row = ScheduledRow(r, (r.output[-1],), r.computed, True)
        commit(row)
        return row

    def complete(self, rows, tokens, scores=None, result=None) -> StepResult:
        """Take a step of `rows` in, its sampling rows picking `tokens` (ids, or SampledRows)."""
        self.step_id += 1
        result = result or StepResult(self.step_id)
        picks = [t if isinstance(t, SampledRow) else SampledRow(t) for t in tokens]
        self.outputs.complete(ScheduledStep(self.step_id, rows), picks, scores or {}, result)
        return result

    def generate(self, r, tokens) -> StepResult:
        """The prompt, then a decode step per token until the resident ends; the last step's
        result."""
        result = self.complete([self.row(r)], tokens[:1])
        for token in tokens[1:]:
            assert r.ref not in result.finished
            result = self.complete([self.row(r)], [token])
        return result

    def assert_all_free(self) -> None:
        assert not self.scheduler.residents
        assert self.pool.num_free == self.pool.num_blocks
        assert self.slots.num_free == self.slots.capacity


class FailsSequence(RowFeature):
    """A feature that cannot go on with one sequence of a request (as a constraint whose
    matcher rejects a token)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def accept(self, resident, token):
        if resident.index == self.index:
            raise RowFailure(f"rejected token {token}")
        return None


def test_each_sampled_token_streams_in_its_residents_chunk():
    parts = Parts()
    (a,) = parts.seat([ONE, TWO], max_tokens=5)
    (b,) = parts.seat([THREE], max_tokens=5)
    rows = [parts.row(a), parts.row(b)]
    result = parts.complete(rows, [FOUR, FIVE])
    assert result.work == [row.work() for row in rows]
    chunk_a, chunk_b = result.deltas[a.ref], result.deltas[b.ref]
    assert (chunk_a.token_ids, chunk_a.text, chunk_a.prompt_tokens) == ([FOUR], " four", 2)
    assert (chunk_b.token_ids, chunk_b.text, chunk_b.prompt_tokens) == ([FIVE], " five", 1)
    assert not chunk_a.finished and not result.finished
    assert (a.output, a.pending, a.kv.committed) == ([FOUR], 0, 2)
    # A prefill chunk that samples nothing yields no chunk.
    (c,) = parts.seat([ONE, TWO, THREE], max_tokens=5)
    result = parts.complete([parts.row(a), parts.row(c, 2)], [SIX])
    assert list(result.deltas) == [a.ref] and c.kv.committed == 2 and not c.output


def test_eos_ends_a_sequence_with_stop_and_a_terminal_chunk():
    parts = Parts()
    (r,) = parts.seat([ONE, TWO], max_tokens=10)
    result = parts.generate(r, [FOUR, EOS])
    chunk, snapshot = result.deltas[r.ref], result.finished[r.ref]
    assert chunk.token_ids == [EOS] and chunk.text == ""
    assert (chunk.finished, chunk.finish_reason) == (True, "stop")
    assert (snapshot.finish_reason, snapshot.stop_reason) == (FinishReason.STOP, None)
    assert (snapshot.token_ids, snapshot.text) == ([FOUR, EOS], " four")
    parts.assert_all_free()  # evicted at the step that ended it
    # With ignore_eos, EOS is a token like any other.
    (r,) = parts.seat([ONE, TWO], max_tokens=3, ignore_eos=True)
    result = parts.generate(r, [EOS, EOS, FOUR])
    assert result.finished[r.ref].finish_reason is FinishReason.LENGTH
    assert result.finished[r.ref].token_ids == [EOS, EOS, FOUR]


def test_a_stop_token_ends_with_it_as_the_stop_reason():
    parts = Parts()
    (r,) = parts.seat([ONE], max_tokens=10, stop_token_ids=[SIX])
    result = parts.generate(r, [TWO, SIX])
    snapshot = result.finished[r.ref]
    assert (snapshot.finish_reason, snapshot.stop_reason) == (FinishReason.STOP, SIX)
    assert snapshot.token_ids == [TWO, SIX] and snapshot.text == " two"
    assert result.deltas[r.ref].finish_reason == "stop"
    parts.assert_all_free()


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_ends_and_is_trimmed(include):
    parts = Parts()
    (r,) = parts.seat([ONE], max_tokens=10, stop=["END OF"], include_stop_str_in_output=include)
    released = []
    result = parts.complete([parts.row(r)], [TWO])
    for token in (END, OF):
        released.append(result.deltas[r.ref].text)
        assert r.ref not in result.finished
        result = parts.complete([parts.row(r)], [token])
    released.append(result.deltas[r.ref].text)
    snapshot = result.finished[r.ref]
    assert (snapshot.finish_reason, snapshot.stop_reason) == (FinishReason.STOP, "END OF")
    assert snapshot.token_ids == [TWO, END, OF]
    assert (result.deltas[r.ref].finished, result.deltas[r.ref].finish_reason) == (True, "stop")
    # "END" could begin the stop string: held back, then released only with the stop string
    # included.
    assert released[:2] == [" two", " "]
    assert "".join(released) == snapshot.text == (" two END OF" if include else " two ")
    parts.assert_all_free()


def test_max_tokens_ends_with_length_at_the_last_token():
    parts = Parts()
    (r,) = parts.seat([ONE, TWO], max_tokens=3)
    result = parts.complete([parts.row(r)], [THREE])
    result = parts.complete([parts.row(r)], [FOUR])
    assert not result.finished and not result.deltas[r.ref].finished
    result = parts.complete([parts.row(r)], [FIVE])
    snapshot = result.finished[r.ref]
    assert (snapshot.finish_reason, snapshot.stop_reason) == (FinishReason.LENGTH, None)
    assert snapshot.token_ids == [THREE, FOUR, FIVE] and snapshot.text == " three four five"
    chunk = result.deltas[r.ref]
    assert (chunk.token_ids, chunk.finished, chunk.finish_reason) == ([FIVE], True, "length")
    parts.assert_all_free()


def test_a_failing_sequence_ends_its_siblings_in_the_same_step():
    parts = Parts(features=[FailsSequence(index=1)])
    first, failing, third = parts.seat([ONE, TWO, THREE], n=3, max_tokens=5)
    assert [r.index for r in (first, failing, third)] == [0, 1, 2]
    rows = [parts.row(r) for r in (first, failing, third)]
    result = parts.complete(rows, [FOUR, FIVE, SIX])
    assert set(result.finished) == {first.ref, failing.ref, third.ref}
    assert all(s.finish_reason is FinishReason.ERROR for s in result.finished.values())
    assert result.finished[failing.ref].error == "rejected token 5"
    for sibling in (first, third):
        assert result.finished[sibling.ref].error == "sequence 1 failed: rejected token 5"
    # The third's row is not taken in: its resident is gone. No chunk is terminal: the request
    # failed, it did not end.
    assert third.ref not in result.deltas and not third.output
    assert not any(chunk.finished for chunk in result.deltas.values())
    parts.assert_all_free()


def test_a_row_failed_outside_the_output_processor_ends_its_siblings():
    """As the session fails a resident whose row the executor could not run."""
    parts = Parts()
    residents = parts.seat([ONE, TWO], n=2, max_tokens=5)
    (other,) = parts.seat([THREE], max_tokens=5)
    result = StepResult(1)
    parts.outputs.finish(residents[1], FinishReason.ERROR, None, result, "its image failed")
    assert set(result.finished) == {r.ref for r in residents}
    assert result.finished[residents[0].ref].error == "sequence 1 failed: its image failed"
    assert not result.deltas  # no terminal chunk
    assert list(parts.scheduler.residents.values()) == [other]  # another request is untouched


def test_a_sequence_that_ends_on_its_own_leaves_its_siblings():
    parts = Parts()
    first, second = parts.seat([ONE, TWO], n=2, max_tokens=5)
    result = parts.complete([parts.row(first), parts.row(second)], [EOS, FOUR])
    assert list(result.finished) == [first.ref]
    assert result.deltas[first.ref].finish_reason == "stop"
    assert (result.deltas[second.ref].index, result.deltas[second.ref].token_ids) == (1, [FOUR])
    assert parts.scheduler.is_live(second)


def test_a_row_whose_resident_was_evicted_since_launch_is_skipped():
    parts = Parts()
    (r,) = parts.seat([ONE, TWO], max_tokens=5)
    row = parts.row(r)  # launched, then cancelled before it is taken in
    result = StepResult(1)
    parts.outputs.finish(r, FinishReason.CANCELLED, None, result)
    assert result.finished[r.ref].finish_reason is FinishReason.CANCELLED
    assert r.ref not in result.deltas  # a cancelled sequence gets no terminal chunk
    result = parts.complete([row], [FOUR])
    assert not result.deltas and not result.finished and not r.output
    parts.assert_all_free()


def test_logprobs_and_prompt_scores_are_recorded():
    parts = Parts()
    (r,) = parts.seat([ONE, TWO, THREE], max_tokens=1, logprobs=1, prompt_logprobs=1)
    scores = {
        0: [SampledRow(TWO, -1.5, [FOUR], [-0.5]), SampledRow(THREE, -0.25, [THREE], [-0.25])]
    }
    pick = SampledRow(FIVE, -0.75, [FIVE], [-0.75])
    result = parts.complete([parts.row(r)], [pick], scores)
    (entry,) = result.deltas[r.ref].logprobs
    assert (entry.token_id, entry.logprob, entry.token, entry.bytes) == (
        FIVE,
        -0.75,
        "five",
        b"five",
    )
    assert [(t.token_id, t.logprob) for t in entry.top] == [(FIVE, -0.75)]
    snapshot = result.finished[r.ref]
    assert snapshot.logprobs == [entry]
    first, *rest = snapshot.prompt_logprobs
    assert first is None  # nothing predicts the first prompt token
    assert [(e.token_id, e.logprob, e.token) for e in rest] == [
        (TWO, -1.5, "two"),
        (THREE, -0.25, "three"),
    ]
    assert [t.token for t in rest[0].top] == ["four"]


def test_full_blocks_are_published_once_the_step_that_wrote_them_is_taken_in():
    parts = Parts(context_cache=True)
    prompt = [ONE, TWO, THREE, FOUR, FIVE, SIX, ONE, TWO, THREE]  # two full blocks, and one more
    (r,) = parts.seat(prompt, max_tokens=8)
    row = parts.row(r)  # planned and launched: not findable yet
    assert parts.cache.match(prompt) == ([], [])
    parts.complete([row], [FOUR])
    blocks, digests = parts.cache.match(prompt)
    assert blocks == r.kv.blocks[:2] and digests == r.kv.digests
    # The third block fills with generated tokens: published too (cache_generated_tokens),
    # once the step that computes its last token is taken in.
    for token in (FIVE, SIX, ONE):
        assert len(r.kv.digests) == 2
        parts.complete([parts.row(r)], [token])
    assert len(r.kv.digests) == 3
    longer = [*prompt, FOUR, FIVE, SIX, ONE]
    assert parts.cache.match(longer)[0] == r.kv.blocks[:3]
    # A finished sequence's published blocks stay findable while free.
    parts.complete([parts.row(r)], [EOS])
    parts.assert_all_free()
    assert parts.cache.match(longer)[0] == r.kv.blocks[:3]


def test_without_the_context_cache_nothing_is_published():
    parts = Parts(context_cache=False)
    prompt = [ONE, TWO, THREE, FOUR, FIVE, SIX, ONE, TWO, THREE]
    (r,) = parts.seat(prompt, max_tokens=4, cache_generated_tokens=False)
    parts.complete([parts.row(r)], [FOUR])
    assert r.kv.committed == len(prompt) and r.kv.digests == []
    assert parts.pool.num_cached == 0


def test_generated_tokens_are_not_published_when_the_request_says_so():
    parts = Parts(context_cache=True)
    prompt = [ONE, TWO, THREE, FOUR, FIVE, SIX]
    (r,) = parts.seat(prompt, max_tokens=6, cache_generated_tokens=False)
    parts.generate(r, [ONE, TWO, THREE, FOUR])
    assert r.kv.committed == len(prompt) + 3
    assert len(r.kv.digests) == 1  # the prompt's one full block; the next holds output
    assert parts.pool.num_cached == 1
