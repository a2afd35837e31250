"""LoRA adapters in the runtime: rows of several adapters and the base in one step, each as it
runs alone and as transformers + peft compute it; slots swapped as adapters come and go; the
context cache keyed by adapter."""

import pytest
import torch

from inflight.engine import EngineConfig, RequestEngine
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks, run_staggered, with_eager_graphs
from tiny_models import make_lora_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def adapters(tiny_dirs, tmp_path_factory):
    """Three tiny adapters on the tiny Llama: name -> (path, peft reference)."""
    root = tmp_path_factory.mktemp("lora")
    configs = {
        "a": dict(r=8, lora_alpha=16, target_modules=TARGETS),
        "b": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "c": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    }
    return {
        name: (root / name, make_lora_adapter(tiny_dirs["llama"], root / name, seed, **config))
        for seed, (name, config) in enumerate(configs.items())
    }


def _runtime(tiny_dirs, adapters, max_loras=3, names="abc", **config):
    runtime = Runtime(
        tiny_dirs["llama"],
        DeploymentOptions(
            **{
                "max_batch_size": 6,
                "max_model_len": 256,
                "quantization": "none",
                "block_size": 8,
                "enable_lora": True,
                "max_loras": max_loras,
                **config,
            }
        ),
    )
    for name in names:
        runtime.register_lora(name, str(adapters[name][0]))
    return runtime


def _request(lora, max_tokens=16, prompt=PROMPT):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return GenerationRequest(list(prompt), params, lora_name=lora)


def _hf_greedy(model, ids, n):
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return tuple(seq[len(ids) :])


def test_each_adapter_greedy_equals_transformers_and_peft(tiny_dirs, adapters):
    runtime = _runtime(tiny_dirs, adapters, enable_context_reuse=False)
    base = runtime.handle_request(_request(None)).result().token_ids
    for name, (_, reference) in adapters.items():
        out = runtime.handle_request(_request(name)).result()
        assert out.token_ids == _hf_greedy(reference, PROMPT, 16), name
        assert out.token_ids != base
    assert_no_leaks(runtime)


def test_rows_of_three_adapters_and_the_base_share_steps(tiny_dirs, adapters):
    runtime = _runtime(tiny_dirs, adapters, enable_context_reuse=False)
    requests = [_request(lora, 10 + 3 * i) for i, lora in enumerate(["a", None, "b", "c", "a"])]
    alone = [runtime.handle_request(r).result().token_ids for r in requests]
    session = runtime.new_session()
    refs = {session.admit(r).ref: i for i, r in enumerate(requests)}
    outputs = {}
    mixed = 0
    while session.residents():
        result = session.step()
        mixed = max(mixed, len({refs[w.ref] for w in result.work}))
        for ref, snapshot in result.finished.items():
            outputs[refs[ref]] = tuple(snapshot.token_ids)
    session.finish()
    assert mixed == 5  # every row, of every adapter and the base, in the same steps
    assert [outputs[i] for i in range(5)] == alone
    assert_no_leaks(runtime)


def test_graphed_steps_give_each_token_its_rows_adapter(tiny_dirs, adapters):
    """With decode graphs (run eagerly on the CPU), prefills are packed as one row per token:
    each row's adapter follows its tokens, and the outputs are the eager runtime's."""
    requests = [_request(lora, 8 + 2 * i) for i, lora in enumerate(["a", None, "c", "b", "a"])]
    want = run_staggered(_runtime(tiny_dirs, adapters, enable_context_reuse=False), requests)
    graphed = with_eager_graphs(_runtime(tiny_dirs, adapters, enable_context_reuse=False))
    replays = []
    run = graphed.executor.runner.graphs.run
    graphed.executor.runner.graphs.run = lambda batch: (
        replays.append(batch.forward.lora) or run(batch)
    )
    got = run_staggered(graphed, requests)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # Prefills were replayed, their tokens on their adapters' slots (40 prompt tokens each).
    assert any(lora is not None and lora.num_tokens > 40 for lora in replays)
    assert_no_leaks(graphed)


def test_more_adapters_than_slots_wait_and_swap_in(tiny_dirs, adapters):
    """Two slots for three adapters: the third waits (nothing taken) until a slot runs no
    resident, then replaces the least recently used adapter; outputs stay each adapter's own."""
    plain = _runtime(tiny_dirs, adapters, enable_context_reuse=False)
    want = {n: plain.handle_request(_request(n)).result().token_ids for n in ("a", "b", "c")}
    runtime = _runtime(tiny_dirs, adapters, max_loras=2, enable_context_reuse=False)
    session = runtime.new_session()
    first = session.admit(_request("a")).ref
    second = session.admit(_request("b", max_tokens=4)).ref
    before = (runtime.blocks.num_free, runtime.slots.num_free)
    waiting = session.admit(_request("c"))
    assert waiting.answer.value == "no_capacity"
    assert (runtime.blocks.num_free, runtime.slots.num_free) == before
    outputs = {}
    while second in session.residents():
        outputs.update(session.step().finished)
    third = session.admit(_request("c")).ref  # b's slot is idle now: c takes it
    while session.residents():
        outputs.update(session.step().finished)
    session.finish()
    assert tuple(outputs[first].token_ids) == want["a"]
    assert tuple(outputs[third].token_ids) == want["c"]
    assert tuple(outputs[second].token_ids) == want["b"][:4]
    assert_no_leaks(runtime)


def test_the_context_cache_keys_on_the_adapter(tiny_dirs, adapters):
    runtime = _runtime(tiny_dirs, adapters)
    assert runtime.handle_request(_request("a")).result().cached_tokens == 0
    assert runtime.handle_request(_request(None)).result().cached_tokens == 0
    assert runtime.handle_request(_request("b")).result().cached_tokens == 0
    again = runtime.handle_request(_request("a")).result()
    assert again.cached_tokens == 32
    assert again.token_ids == runtime.handle_request(_request("a")).result().token_ids
    assert_no_leaks(runtime)


def test_unknown_and_unloaded_adapters_are_refused_and_running_ones_finish(tiny_dirs, adapters):
    runtime = _runtime(tiny_dirs, adapters)
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'zzz'; served: \['a', 'b', 'c'\]"):
        runtime.check(_request("zzz"))
    engine = RequestEngine(runtime, EngineConfig(max_batch_size=4))
    running = engine.submit(_request("a", max_tokens=60))
    next(running)
    runtime.unregister_lora("a")
    assert len(running.get(timeout=60).token_ids) == 60
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        runtime.check(_request("a"))
    engine.shutdown()
    assert_no_leaks(runtime)


def test_the_engine_batches_adapters_together(tiny_dirs, adapters):
    runtime = _runtime(tiny_dirs, adapters, enable_context_reuse=False)
    want = [runtime.handle_request(_request(n, 12)).result().token_ids for n in "abc"]
    engine = RequestEngine(runtime, EngineConfig(max_batch_size=6))
    handles = [engine.submit(_request(n, 12)) for n in "abc"]
    assert [h.get(timeout=60).token_ids for h in handles] == want
    engine.shutdown()
    assert engine.metrics.admitted_mid_flight == 2 and engine.metrics.stalls_incompatible == 0


def test_a_bad_adapter_is_refused_at_load_with_its_reason(tiny_dirs, adapters, tmp_path):
    runtime = _runtime(tiny_dirs, adapters, names="ab", max_lora_rank=8)
    with pytest.raises(ValueError, match="rank r=16 is above max_lora_rank=8"):
        runtime.register_lora("big", str(adapters["c"][0]))
    with pytest.raises(ValueError, match="already served"):
        runtime.register_lora("a", str(adapters["a"][0]))
    qwen = make_lora_adapter(tiny_dirs["qwen3"], tmp_path / "q", 0, r=4, target_modules=["q_proj"])
    assert qwen is not None
    with pytest.raises(ValueError, match="shape"):
        runtime.register_lora("other-base", str(tmp_path / "q"))
    assert runtime.lora_names() == ["a", "b"]
