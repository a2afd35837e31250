"""GenerationSession: ragged mixed steps, admission stages, eviction, batch invariance."""

import pytest

from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.outputs import FinishReason, materialize
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.protocol.stepped import AdmissionAnswer, ResidentRef, StaleResidentRef
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a short poem about the sea and the wind that blows over it at night:",
    "List three fruits:",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Translate to French: good morning, my friend. How are you today? I hope that",
]
MAX_TOKENS = [12, 20, 8, 16, 24, 10]
JOIN_AT_STEP = [0, 0, 2, 3, 7, 11]


def _run_alone(runtime, request):
    return runtime.handle_request(request).result()


def _run_staggered(runtime, requests, join_at):
    """Admit request i at step join_at[i]; step until every request has finished."""
    session = runtime.new_session()
    refs, outputs, step = {}, {}, 0
    pending = sorted(range(len(requests)), key=lambda i: join_at[i])
    while pending or session.residents():
        while pending and join_at[pending[0]] <= step:
            i = pending.pop(0)
            admission = session.admit(requests[i])
            assert admission.answer is AdmissionAnswer.ADMITTED, admission.reason
            refs[admission.ref] = i
        result = session.step()
        for ref, snapshot in result.finished.items():
            outputs[refs.pop(ref)] = materialize([snapshot])
        step += 1
    session.finish()
    return [outputs[i] for i in range(len(requests))]


def _requests(tokenizer, **params):
    return [
        GenerationRequest(
            tokenizer.encode(p), SamplingParams(max_tokens=n, ignore_eos=True, **params)
        )
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]


@pytest.mark.slow
def test_greedy_batched_equals_alone(smollm):
    requests = _requests(smollm.tokenizer, temperature=0)
    alone = [_run_alone(smollm, r) for r in requests]
    batched = _run_staggered(smollm, requests, JOIN_AT_STEP)
    for a, b in zip(alone, batched, strict=True):
        assert a.token_ids == b.token_ids
        assert a.text == b.text
    assert [len(o.token_ids) for o in batched] == MAX_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_quantized_greedy_batched_equals_alone(quantization):
    """The quantized kernels quantize each token's activations on their own: a row's tokens
    never depend on what it is batched with."""
    runtime = Runtime(None, DeploymentOptions(max_batch_size=8, quantization=quantization))
    requests = _requests(runtime.tokenizer, temperature=0)
    alone = [_run_alone(runtime, r) for r in requests]
    batched = _run_staggered(runtime, requests, JOIN_AT_STEP)
    for a, b in zip(alone, batched, strict=True):
        assert a.token_ids == b.token_ids
    assert_no_leaks(runtime)


@pytest.mark.slow
def test_seeded_sampling_batched_equals_alone(smollm):
    requests = [
        GenerationRequest(
            r.prompt_token_ids,
            SamplingParams(
                max_tokens=r.params.max_tokens,
                ignore_eos=True,
                temperature=0.9,
                top_p=0.95,
                top_k=50,
                seed=1000 + i,
            ),
        )
        for i, r in enumerate(_requests(smollm.tokenizer))
    ]
    alone = [_run_alone(smollm, r) for r in requests]
    batched = _run_staggered(smollm, requests, JOIN_AT_STEP)
    assert [a.token_ids for a in alone] == [b.token_ids for b in batched]


@pytest.fixture
def tiny(tiny_dirs):
    def make(**config):
        return Runtime(tiny_dirs["qwen3"], DeploymentOptions(**{"max_model_len": 256, **config}))

    return make


def _req(n_prompt, max_tokens=8, **params):
    return GenerationRequest(
        list(range(3, 3 + n_prompt)),
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params),
    )


def test_chunked_prefill_keeps_decoders_advancing(tiny):
    # Without the context cache, which would serve the second run the prompt the first computed.
    runtime = tiny(max_batch_size=4, max_num_tokens=16, enable_context_reuse=False)
    long_request = _req(150, max_tokens=4)
    alone = _run_alone(runtime, long_request)
    session = runtime.new_session()
    a = session.admit(_req(5, max_tokens=40)).ref
    b = session.admit(_req(7, max_tokens=40)).ref
    session.step()  # both prefill in one step and sample their first token
    long_ref = session.admit(long_request).ref
    produced = {a: 1, b: 1}
    prefill_ticks = 0
    long_tokens = []
    while long_ref in session.residents():
        result = session.step()
        for ref in (a, b):
            produced[ref] += len(result.deltas[ref].token_ids)
        long_work = [w for w in result.work if w.ref == long_ref]
        assert long_work and long_work[0].query_len <= 16 - 2
        if long_work[0].is_prefill:
            prefill_ticks += 1
        if long_ref in result.deltas:
            long_tokens += result.deltas[long_ref].token_ids
        # Every resident that was decoding gained exactly one token on every tick.
        assert produced[a] == produced[b] == result.step_id
    assert prefill_ticks == -(-150 // 14)
    assert tuple(long_tokens) == alone.token_ids
    session.abort()
    session.finish()
    assert_no_leaks(runtime)


def test_admission_no_capacity_changes_nothing(tiny):
    runtime = tiny(max_batch_size=2, num_kv_blocks=6, block_size=16)
    session = runtime.new_session()
    first = session.admit(_req(10, max_tokens=30))  # 39 tokens of KV: 3 blocks
    assert first.answer is AdmissionAnswer.ADMITTED
    before = (session.residents(), runtime.blocks.num_free, runtime.slots.num_free)
    short_blocks = session.admit(_req(40, max_tokens=30))  # 69 tokens: 5 blocks, 3 free
    assert short_blocks.answer is AdmissionAnswer.NO_CAPACITY
    assert (session.residents(), runtime.blocks.num_free, runtime.slots.num_free) == before
    second = session.admit(_req(5, max_tokens=4))
    assert second.answer is AdmissionAnswer.ADMITTED
    before = (session.residents(), runtime.blocks.num_free, runtime.slots.num_free)
    no_slot = session.admit(_req(2, max_tokens=2))
    assert no_slot.answer is AdmissionAnswer.NO_CAPACITY
    assert (session.residents(), runtime.blocks.num_free, runtime.slots.num_free) == before
    session.abort()
    session.finish()
    assert_no_leaks(runtime)


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        (GenerationRequest([], SamplingParams()), "prompt is empty"),
        (GenerationRequest(list(range(3, 300)), SamplingParams()), "max_model_len"),
        (GenerationRequest([5, 100000], SamplingParams()), "outside the vocabulary"),
        (GenerationRequest([5, 6], SamplingParams(max_tokens=255)), "max_tokens"),
        (GenerationRequest([5], SamplingParams(logit_bias={99999: 1.0})), "logit_bias"),
    ],
)
def test_admission_rejects_invalid_requests(tiny, request_, needle):
    runtime = tiny(max_batch_size=1)
    session = runtime.new_session()
    admission = session.admit(request_)
    assert admission.answer is AdmissionAnswer.REJECTED
    assert needle in admission.reason
    assert session.residents() == []
    session.finish()
    assert_no_leaks(runtime)


def test_request_larger_than_the_whole_cache_is_rejected(tiny):
    runtime = tiny(max_batch_size=1, num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="KV blocks"):
        runtime.handle_request(_req(40, max_tokens=10))
    assert_no_leaks(runtime)


def test_resident_refs_are_stable_and_epoched(tiny):
    runtime = tiny(max_batch_size=2)
    session = runtime.new_session()
    founder = session.admit(_req(4, max_tokens=1)).ref
    joiner = session.admit(_req(4, max_tokens=5)).ref
    assert (founder, joiner) == (ResidentRef(0, 1), ResidentRef(1, 1))
    result = session.step()
    assert founder in result.finished and joiner not in result.finished
    assert session.residents() == [joiner]
    again = session.admit(_req(4, max_tokens=5)).ref
    assert again == ResidentRef(0, 2)
    with pytest.raises(StaleResidentRef):
        session.step(cancelled=[founder])
    session.abort()
    session.finish()
    assert_no_leaks(runtime)


def test_cancel_evicts_at_that_step_and_frees_blocks(tiny):
    runtime = tiny(max_batch_size=2)
    session = runtime.new_session()
    keep = session.admit(_req(6, max_tokens=10)).ref
    drop = session.admit(_req(6, max_tokens=10)).ref
    session.step()
    session.step()
    result = session.step(cancelled=[drop])
    assert result.finished[drop].finish_reason is FinishReason.CANCELLED
    assert len(result.finished[drop].token_ids) == 2
    assert drop not in result.deltas and keep in result.deltas
    assert session.residents() == [keep]
    while session.residents():
        session.step()
    session.finish()
    assert_no_leaks(runtime)


def test_finish_refuses_live_residents_and_abort_evicts_all(tiny):
    runtime = tiny(max_batch_size=3)
    session = runtime.new_session()
    refs = [session.admit(_req(4 + i)).ref for i in range(3)]
    session.step()
    with pytest.raises(RuntimeError, match="residents"):
        session.finish()
    assert session.abort() == refs
    session.finish()
    with pytest.raises(RuntimeError):
        session.admit(_req(3))
    assert_no_leaks(runtime)


def test_one_session_at_a_time(tiny):
    runtime = tiny(max_batch_size=1)
    session = runtime.new_session()
    with pytest.raises(RuntimeError, match="already open"):
        runtime.new_session()
    session.finish()
    runtime.new_session().finish()


def test_eos_stop_token_and_length(tiny):
    runtime = tiny(max_batch_size=1)
    probe = runtime.handle_request(_req(8, max_tokens=6)).result()
    first, third = probe.token_ids[0], probe.token_ids[2]
    out = runtime.handle_request(
        GenerationRequest(
            list(range(3, 11)), SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[third])
        )
    ).result()
    assert out.finish_reason == "stop" and out.stop_reason == third
    assert out.token_ids == probe.token_ids[:3]
    assert probe.finish_reason == "length" and len(probe.token_ids) == 6
    assert first == probe.token_ids[0]
    assert_no_leaks(runtime)


def test_a_runtime_is_freed_as_soon_as_it_is_dropped(tiny):
    """No reference cycle keeps a runtime (and its device memory) alive until the cyclic
    collector runs: a benchmark that builds one model after another needs the first one gone."""
    import gc
    import weakref

    from inflight.engine import EngineConfig, RequestEngine

    gc.disable()
    try:
        runtime = tiny(max_batch_size=2)
        engine = RequestEngine(runtime, EngineConfig(max_batch_size=2))
        assert engine.submit(_req(4, max_tokens=3)).get(timeout=30).token_ids
        runtime.handle_request(_req(4, max_tokens=2)).result()
        engine.shutdown()
        alive = weakref.ref(runtime)
        del runtime, engine
        assert alive() is None
    finally:
        gc.enable()
