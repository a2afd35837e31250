"""The context cache: prefix reuse, visibility at commit, LRU eviction, per-request policies."""

import pytest

from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.protocol.stepped import AdmissionAnswer
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks

SYSTEM = "You are a careful assistant who answers questions about geography. " * 60


def _prefilled(session, ref):
    """Prompt tokens computed for `ref` until its first token, counted from the steps' work."""
    total = 0
    while True:
        result = session.step()
        total += sum(w.query_len for w in result.work if w.ref == ref and w.is_prefill)
        if ref in result.deltas:
            return total


@pytest.mark.slow
def test_shared_system_prompt_prefills_only_the_tail(smollm_cached, smollm):
    tok = smollm_cached.tokenizer
    system = tok.encode(SYSTEM)[:512]
    first = GenerationRequest(
        system + tok.encode(" Q: What is the capital of Peru?"),
        SamplingParams(max_tokens=8, temperature=0),
    )
    second_prompt = system + tok.encode(" Q: Name a river in Egypt.")
    second = GenerationRequest(second_prompt, SamplingParams(max_tokens=16, temperature=0))
    smollm_cached.handle_request(first).result()

    session = smollm_cached.new_session()
    ref = session.admit(second).ref
    prefilled = _prefilled(session, ref)
    while session.residents():
        session.step()
    session.finish()
    assert prefilled == len(second_prompt) - 512  # the 32 shared blocks came from the cache

    cached = smollm_cached.handle_request(second).result()
    plain = smollm.handle_request(second).result()  # the cache-off runtime, same weights
    assert cached.cached_tokens == 512 and plain.cached_tokens == 0
    assert cached.token_ids == plain.token_ids and cached.text == plain.text
    metrics = smollm_cached.context_cache.snapshot()
    assert metrics["hit_tokens"] >= 1024 and 0 < metrics["hit_ratio"] <= 1
    assert_no_leaks(smollm_cached)


@pytest.fixture
def tiny(tiny_dirs):
    def make(**config):
        cfg = {"max_model_len": 256, "enable_context_reuse": True, "block_size": 8, **config}
        return Runtime(tiny_dirs["qwen2"], DeploymentOptions(**cfg))

    return make


def _req(prompt, max_tokens=4, **params):
    return GenerationRequest(
        list(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params),
    )


def _admit_cached(session, runtime, request):
    """Admit through the three admission stages; the prompt tokens leased from the cache."""
    intent = session.build_admission_intent(request)
    reservation = session.reserve_admission(request, intent)
    session.seat(reservation)
    return reservation.cached_blocks * runtime.blocks.block_size


def test_a_block_is_visible_only_after_the_step_that_wrote_it(tiny):
    runtime = tiny(max_batch_size=3)
    prompt = list(range(10, 50))  # 40 tokens: four full blocks before the last token
    session = runtime.new_session()
    assert _admit_cached(session, runtime, _req(prompt)) == 0
    # Seated in the same tick: the founder's blocks are not written yet, so nothing is found.
    assert _admit_cached(session, runtime, _req(prompt)) == 0
    session.step()  # writes (and publishes) the prompt blocks
    assert _admit_cached(session, runtime, _req(prompt)) == 32
    session.abort()
    session.finish()
    assert_no_leaks(runtime)


def test_small_cache_evicts_lru_and_stays_correct(tiny):
    plain = tiny(max_batch_size=2, enable_context_reuse=False)
    cached = tiny(max_batch_size=2, num_kv_blocks=14)
    prefixes = [list(range(3 + 40 * k, 43 + 40 * k)) for k in range(4)]
    order = [0, 1, 0, 2, 3, 0, 1, 2, 3, 3, 0]
    for n, k in enumerate(order):
        request = _req(prefixes[k] + [200 + n], max_tokens=6)
        got = cached.handle_request(request).result()
        want = plain.handle_request(request).result()
        assert got.token_ids == want.token_ids
    metrics = cached.context_cache.snapshot()
    assert metrics["evictions"] > 0 and metrics["hit_tokens"] > 0
    assert_no_leaks(cached)


def test_refused_lease_changes_nothing(tiny):
    runtime = tiny(max_batch_size=3, num_kv_blocks=12)
    prefix = list(range(10, 42))  # four full blocks
    runtime.handle_request(_req(prefix + [99], max_tokens=2)).result()
    session = runtime.new_session()
    hog = session.admit(_req(range(100, 156), max_tokens=1))  # 7 fresh blocks
    assert hog.answer is AdmissionAnswer.ADMITTED
    pool = runtime.blocks
    before = (pool.num_free, pool.num_cached, session.residents())
    # Needs 4 cached blocks (free, so reviving them takes them) + 5 fresh: more than is left.
    answer = session.admit(_req(prefix + list(range(60, 70)), max_tokens=30))
    assert answer.answer is AdmissionAnswer.NO_CAPACITY
    assert (pool.num_free, pool.num_cached, session.residents()) == before
    session.abort()
    session.finish()
    assert_no_leaks(runtime)


def test_per_request_policies(tiny):
    runtime = tiny(max_batch_size=1)
    prompt = list(range(10, 35))  # 25 tokens: 3 full blocks
    runtime.handle_request(_req(prompt, max_tokens=20, cache_generated_tokens=False)).result()
    assert runtime.blocks.num_cached == 3  # only the prompt's blocks were published
    bypass = runtime.handle_request(_req(prompt, reuse_context=False)).result()
    assert bypass.cached_tokens == 0
    lookups = runtime.context_cache.metrics.lookups
    reuse = runtime.handle_request(_req(prompt)).result()
    assert reuse.cached_tokens == 24 and runtime.context_cache.metrics.lookups == lookups + 1
    runtime.handle_request(_req(prompt, max_tokens=30)).result()
    assert runtime.blocks.num_cached > 3  # generated tokens' blocks are published by default
    assert_no_leaks(runtime)


def test_chunked_prefill_of_a_2000_token_prompt_keeps_decoders_going(tiny_dirs):
    config = DeploymentOptions(max_batch_size=3, max_model_len=2100, max_num_tokens=256)
    runtime = Runtime(tiny_dirs["qwen3"], config)
    session = runtime.new_session()
    a = session.admit(_req(range(3, 13), max_tokens=100)).ref
    b = session.admit(_req(range(20, 27), max_tokens=100)).ref
    session.step()
    long_ref = session.admit(_req([5 + i % 300 for i in range(2000)], max_tokens=2)).ref
    ticks, prefilled = 0, 0
    while prefilled < 2000:
        result = session.step()
        ticks += 1
        (chunk,) = [w for w in result.work if w.ref == long_ref]
        assert chunk.query_len <= 256 - 2  # the two decoders take their row first
        prefilled += chunk.query_len
        # Every tick, each decoding resident gained exactly one token.
        assert len(result.deltas[a].token_ids) == len(result.deltas[b].token_ids) == 1
    assert ticks == -(-2000 // 254)
    session.abort()
    session.finish()
    assert_no_leaks(runtime)


@pytest.mark.parametrize("kind", ["mistral", "qwen3"])
def test_a_sliding_model_leases_the_cached_blocks_of_its_window(sliding_dirs, kind):
    """Every layer slides over 12 tokens (qwen3: every other one, its sliding layers' KV in
    the window group's pool, its full layers' leased whole), blocks of 4. A prompt whose first
    56 tokens are cached (14 blocks) leases only the 3 blocks its first query's window reads
    (from token 44), and prefills its tail after them. The running sequence that wrote them
    still holds them, and gives them back as it decodes while the joiner holds them on. The
    tokens are the cache-off runtime's, and nothing leaks."""
    options = dict(max_model_len=256, block_size=4, quantization="none")
    plain = Runtime(sliding_dirs[kind], DeploymentOptions(**options))
    runtime = Runtime(sliding_dirs[kind], DeploymentOptions(**options, enable_context_reuse=True))
    first, second = _req(range(3, 63), max_tokens=30), _req([*range(3, 59), 7, 8, 9], 30)
    session = runtime.new_session()
    ref = session.admit(first).ref
    while ref not in session.step().deltas:  # its prompt computed and published
        pass
    joiner = session.admit(second).ref
    residents = runtime.scheduler.residents
    kv = residents[joiner].kv
    sliding = kv.window or kv
    assert (kv.cached_tokens, sliding.released, len(sliding.held)) == (56, 11, 3)
    assert set(sliding.held) <= set((residents[ref].kv.window or residents[ref].kv).held)
    if kind == "qwen3":
        assert kv.held[:14] == residents[ref].kv.held[:14]  # the full layers' prefix, leased
    outputs = {}
    while session.residents():
        for done, snapshot in session.step().finished.items():
            outputs[done] = tuple(snapshot.token_ids)
    session.finish()
    want = [plain.handle_request(request).result().token_ids for request in (first, second)]
    assert [outputs[ref], outputs[joiner]] == want
    assert_no_leaks(runtime)
