"""n > 1: one request, n sequences on the prompt's shared KV blocks, each sampled on its own."""

import pytest

from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.outputs import materialize
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.host.features import RowFailure, RowFeature
from inflight.runtime.host.output_processor import OutputProcessor
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks

PROMPT = list(range(5, 45))  # 40 tokens: blocks of 8 -> 4 full blocks shared (32 tokens)


@pytest.fixture(scope="module")
def runtime(tiny_dirs):
    config = DeploymentOptions(
        max_batch_size=6, max_model_len=256, block_size=8, enable_context_reuse=False
    )
    return Runtime(tiny_dirs["qwen3"], config)


def _run(runtime, **params):
    params = SamplingParams(max_tokens=12, ignore_eos=True, **params)
    return runtime.handle_request(GenerationRequest(PROMPT, params)).result()


def test_seeded_sequences_differ_and_a_rerun_repeats_them(runtime):
    first = _run(runtime, n=4, temperature=1.0, seed=11)
    again = _run(runtime, n=4, temperature=1.0, seed=11)
    assert [s.index for s in first.outputs] == [0, 1, 2, 3]
    assert len({s.token_ids for s in first.outputs}) == 4
    assert [s.token_ids for s in again.outputs] == [s.token_ids for s in first.outputs]
    # Sequence 0 draws as the request alone would.
    assert _run(runtime, temperature=1.0, seed=11).token_ids == first.outputs[0].token_ids
    assert first.prompt_tokens == len(PROMPT)
    assert_no_leaks(runtime)


def test_greedy_sequences_all_equal_the_single_run(runtime):
    single = _run(runtime, temperature=0)
    four = _run(runtime, n=4, temperature=0)
    assert [s.token_ids for s in four.outputs] == [single.token_ids] * 4
    assert [s.text for s in four.outputs] == [single.text] * 4


def test_the_prompt_blocks_are_allocated_once(runtime):
    """40 prompt + 12 output tokens: 7 blocks a sequence, the first 4 (tokens 0..31) shared, so
    n = 4 holds 7 + 3 * 3 blocks instead of 28; the prompt's shared part is prefilled once."""
    session = runtime.new_session()
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=12, n=4, temperature=0))
    refs = session.admit(request).refs
    assert len(refs) == 4
    assert runtime.blocks.num_blocks - runtime.blocks.num_free == 7 + 3 * 3
    prefilled = 0
    while session.residents():
        result = session.step()
        prefilled += sum(w.query_len for w in result.work if w.is_prefill)
    session.finish()
    assert prefilled == 40 + 3 * 8  # the first sequence's prompt, then each other's last 8
    assert_no_leaks(runtime)


def test_sequences_end_on_their_own_and_cancel_ends_them_all(runtime):
    session = runtime.new_session()
    params = SamplingParams(max_tokens=30, n=3, temperature=1.0, seed=3, stop_token_ids=[])
    refs = session.admit(GenerationRequest(PROMPT, params)).refs
    session.step()
    session.step()
    result = session.step(cancelled=refs)
    assert set(result.finished) == set(refs)
    assert {s.index for s in result.finished.values()} == {0, 1, 2}
    session.finish()
    assert_no_leaks(runtime)


def test_the_sequences_share_a_batch_with_others_unchanged(runtime):
    alone = _run(runtime, n=3, temperature=0.8, seed=5)
    other = GenerationRequest(list(range(60, 90)), SamplingParams(max_tokens=20, temperature=0))
    other_alone = runtime.handle_request(other).result()
    session = runtime.new_session()
    other_ref = session.admit(other).ref
    session.step()
    params = SamplingParams(max_tokens=12, ignore_eos=True, n=3, temperature=0.8, seed=5)
    refs = session.admit(GenerationRequest(PROMPT, params)).refs
    snapshots = {}
    while session.residents():
        snapshots.update(session.step().finished)
    session.finish()
    joined = materialize([snapshots[ref] for ref in refs])
    assert [s.token_ids for s in joined.outputs] == [s.token_ids for s in alone.outputs]
    assert materialize([snapshots[other_ref]]).token_ids == other_alone.token_ids
    assert_no_leaks(runtime)


def test_with_the_context_cache_the_shared_prompt_comes_from_it(tiny_dirs):
    cached = Runtime(
        tiny_dirs["qwen3"], DeploymentOptions(max_batch_size=6, max_model_len=256, block_size=8)
    )
    first = _run(cached, n=3, temperature=0.9, seed=2)
    second = _run(cached, n=3, temperature=0.9, seed=2)
    assert second.cached_tokens == 32 and first.cached_tokens == 0
    assert [s.token_ids for s in second.outputs] == [s.token_ids for s in first.outputs]
    assert_no_leaks(cached)


class _FailsSequenceOne(RowFeature):
    """A feature that cannot go on with sequence 1 once it holds three output tokens."""

    def accept(self, resident, token):
        if resident.index == 1 and len(resident.output) == 3:
            raise RowFailure("sequence 1's feature broke")
        return None


def test_a_failed_sequence_ends_its_whole_request_at_once(runtime, monkeypatch):
    """Sequence 1 of n = 3 fails at its third token: the whole request fails in that step, its
    siblings evicted with it (each naming the failed sequence), not run on to max_tokens."""
    outputs = runtime.outputs
    patched = OutputProcessor(
        runtime.scheduler,
        runtime.tokenizer,
        runtime.blocks,
        (*outputs.features, _FailsSequenceOne()),
        outputs.decoding,
        publish_blocks=runtime.context_cache is not None,
    )
    monkeypatch.setattr(runtime, "outputs", patched)
    session = runtime.new_session()
    params = SamplingParams(max_tokens=12, n=3, temperature=0, ignore_eos=True)
    refs = session.admit(GenerationRequest(PROMPT, params)).refs
    snapshots, evicted_by, steps = {}, {}, 0
    while session.residents():
        result = session.step()
        steps += 1
        snapshots.update(result.finished)
        evicted_by.update(dict.fromkeys(result.finished, steps))
    session.finish()
    assert set(snapshots) == set(refs)
    assert len(set(evicted_by.values())) == 1  # all three in one step
    assert steps <= 4  # the prefill, then 2 or 3 decode steps (not 11)
    output = materialize(list(snapshots.values()))
    assert [s.finish_reason for s in output.outputs] == ["error"] * 3
    # Sequence 0 prefills the shared prompt, so it samples a step ahead of its siblings.
    lengths = [len(s.token_ids) for s in output.outputs]
    assert all(got <= most for got, most in zip(lengths, [4, 3, 3], strict=True)), lengths
    errors = {s.index: s.error for s in snapshots.values()}
    assert errors[1] == "sequence 1's feature broke"
    assert errors[0] == errors[2] == "sequence 1 failed: sequence 1's feature broke"
    assert_no_leaks(runtime)
