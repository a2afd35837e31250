"""A block-diffusion model (a tiny random DiffusionGemma) served under in-flight batching,
against transformers' `generate()` under the same seed: alone, joining a batch mid-flight, its
prompt encoded in chunks, stopping inside a canvas; the KV after n canvases; cancellation
between and inside canvases; what it refuses."""

from __future__ import annotations

import threading

import pytest
import torch

from inflight import LLM
from inflight.engine.errors import RequestCancelled
from inflight.model.checkpoints.loader import open_checkpoint
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.options import check_runtime_serves
from inflight.protocol.request import (
    DiffusionParams,
    GenerationRequest,
    RequestFieldError,
    SamplingParams,
)
from inflight.protocol.stepped import AdmissionAnswer
from inflight.runtime.diffusion.runtime import DiffusionRuntime

from diffusion_reference import CANVAS, reference_generate, write_tiny_checkpoint

STEPS = 6
PROMPTS = [list(range(5, 15)), list(range(40, 62)), [9, 3, 77, 120, 5]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion")
    reference = write_tiny_checkpoint(path)
    return path, reference


@pytest.fixture(scope="module")
def llm(checkpoint):
    path, _ = checkpoint
    llm = LLM(str(path), enable_in_flight_batching=True, max_model_len=256, max_num_tokens=64)
    yield llm
    llm.close()


def ours(llm, prompt, seed, max_tokens=3 * CANVAS, **diffusion):
    params = SamplingParams(max_tokens=max_tokens, seed=seed)
    (out,) = llm.generate(
        {"prompt_token_ids": prompt},
        params,
        diffusion=DiffusionParams(max_denoising_steps=STEPS, **diffusion),
    )
    return out.outputs[0]


def theirs(reference, prompt, seed, max_tokens=3 * CANVAS, **gen):
    return reference_generate(
        reference, prompt, seed, max_new_tokens=max_tokens, max_denoising_steps=STEPS, **gen
    )


@pytest.mark.parametrize(
    "settings",
    [
        {},
        # Early ends (any mean entropy is confident: a canvas ends once its argmax holds) and
        # several positions accepted a step, on another schedule.
        {"confidence_threshold": 10.0, "entropy_bound": 12.0, "t_min": 0.2, "t_max": 1.5},
        {"stability_threshold": 2, "confidence_threshold": 10.0, "entropy_bound": 20.0},
    ],
)
def test_a_request_alone_is_transformers_generate_token_for_token(checkpoint, llm, settings):
    _, reference = checkpoint
    for prompt, seed in zip(PROMPTS, (1, 2, 3), strict=True):
        got = ours(llm, prompt, seed, **settings)
        sampler = {}
        if "entropy_bound" in settings:
            from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
                EntropyBoundSamplerConfig,
            )

            settings = dict(settings)
            sampler = {"sampler_config": EntropyBoundSamplerConfig(settings.pop("entropy_bound"))}
        want = theirs(reference, prompt, seed, eos_token_id=None, **sampler, **settings)
        assert list(got.token_ids) == want
        assert got.finish_reason == "length"


def test_joining_a_batch_mid_flight_changes_no_token(checkpoint, llm):
    _, reference = checkpoint
    long = llm.generate_stream(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(max_tokens=12 * CANVAS, seed=11),
        diffusion=DiffusionParams(max_denoising_steps=STEPS),
    )
    chunks = iter(long)
    first = next(chunks)
    assert len(first.token_ids) == CANVAS and not first.finished
    results = {}

    def join(i: int) -> None:
        results[i] = ours(llm, PROMPTS[i], 20 + i)

    threads = [threading.Thread(target=join, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    rest = [first, *chunks]
    for t in threads:
        t.join()
    assert all(len(c.token_ids) == CANVAS for c in rest)
    assert rest[-1].finished and rest[-1].finish_reason == "length"
    long_tokens = [t for c in rest for t in c.token_ids]
    assert long_tokens == theirs(reference, PROMPTS[0], 11, 12 * CANVAS, eos_token_id=None)
    for i in (1, 2):
        assert list(results[i].token_ids) == theirs(
            reference, PROMPTS[i], 20 + i, eos_token_id=None
        )


def test_a_stop_token_inside_a_canvas_ends_it_there_as_transformers_eos(checkpoint, llm):
    _, reference = checkpoint
    prompt, seed = PROMPTS[1], 5
    full = theirs(reference, prompt, seed, eos_token_id=None)
    stop = full[CANVAS + 3]  # inside the second canvas
    want = theirs(reference, prompt, seed, eos_token_id=stop)
    assert want == full[: full.index(stop) + 1]
    params = SamplingParams(max_tokens=3 * CANVAS, seed=seed, stop_token_ids=[stop])
    (out,) = llm.generate(
        {"prompt_token_ids": prompt}, params, diffusion=DiffusionParams(max_denoising_steps=STEPS)
    )
    got = out.outputs[0]
    assert list(got.token_ids) == want
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)


def test_a_stop_string_ends_the_text_inside_a_canvas(checkpoint, llm):
    plain = ours(llm, PROMPTS[0], 4)
    stop = plain.text[CANVAS : CANVAS + 3].strip() or plain.text[-3:]
    params = SamplingParams(max_tokens=3 * CANVAS, seed=4, stop=[stop])
    (out,) = llm.generate(
        {"prompt_token_ids": PROMPTS[0]},
        params,
        diffusion=DiffusionParams(max_denoising_steps=STEPS),
    )
    got = out.outputs[0]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert got.text == plain.text[: plain.text.index(stop)]
    assert list(got.token_ids) == list(plain.token_ids[: len(got.token_ids)])


def test_max_tokens_rounds_up_to_whole_canvases(llm):
    got = ours(llm, PROMPTS[2], 1, max_tokens=CANVAS + 2)
    assert len(got.token_ids) == 2 * CANVAS and got.finish_reason == "length"


def test_temperature_zero_takes_each_steps_argmax_whatever_the_seed(llm):
    outs = []
    for seed in (1, 2):
        params = SamplingParams(max_tokens=2 * CANVAS, seed=seed, temperature=0)
        (out,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)
        outs.append(list(out.outputs[0].token_ids))
    assert outs[0] == outs[1]


def runtime(path, **options) -> DiffusionRuntime:
    return DiffusionRuntime(open_checkpoint(path), DeploymentOptions(max_model_len=256, **options))


def request(rt, prompt, seed, max_tokens=3 * CANVAS) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, seed=seed)
    return rt.check(
        GenerationRequest(prompt, params, diffusion=DiffusionParams(max_denoising_steps=STEPS))
    )


def test_a_long_prompt_is_encoded_in_chunks_of_the_token_budget(checkpoint):
    path, reference = checkpoint
    rt = runtime(path, max_num_tokens=16)
    session = rt.new_session()
    prompt = list(range(3, 53))  # 50 tokens
    (ref,) = session.admit(request(rt, prompt, 9)).refs
    work, tokens = [], []
    while session.residents():
        result = session.step()
        work.append([(w.query_len, w.past_len) for w in result.work])
        tokens += result.deltas.get(ref, None).token_ids if ref in result.deltas else []
    # 16 + 16 + 16, then the last 2 beside the first canvas (8): 10 tokens.
    assert work[:4] == [[(16, 0)], [(16, 16)], [(16, 32)], [(2 + CANVAS, 48)]]
    # The sliding layers held a ring of 15 + 16 positions a resident (wrapped twice here).
    (k, _), full = rt.caches[0], rt.caches[-1][0]
    assert k.shape[0] == rt.slots.capacity * 31 and full.shape[0] == rt.blocks.num_blocks * 16
    assert tokens == theirs(reference, prompt, 9, eos_token_id=None)
    session.finish()


def test_the_kv_after_n_canvases_is_transformers_cache(checkpoint):
    path, reference = checkpoint
    rt = runtime(path)
    session = rt.new_session()
    prompt = PROMPTS[0]
    (ref,) = session.admit(request(rt, prompt, 3, 4 * CANVAS)).refs
    row = session.rows[ref]
    delivered = 0
    while delivered < 2:
        delivered += ref in session.step().deltas
    session.step()  # the second canvas encoded beside the third's first step
    torch.manual_seed(3)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=3 * CANVAS,
            max_denoising_steps=STEPS,
            eos_token_id=None,
        )
    assert row.encoded == out.cache.get_seq_length() == len(prompt) + 2 * CANVAS
    session.step(cancelled=[ref])
    session.finish()


def test_cancelling_inside_and_between_canvases_frees_everything(checkpoint):
    path, _ = checkpoint
    rt = runtime(path)
    blocks, slots = rt.blocks.num_free, rt.slots.num_free
    session = rt.new_session()
    (a,) = session.admit(request(rt, PROMPTS[0], 1)).refs
    (b,) = session.admit(request(rt, PROMPTS[1], 2)).refs
    assert rt.blocks.num_free < blocks
    session.step()  # both prompts encoded, both canvases at their first step
    result = session.step(cancelled=[a])  # inside a's canvas
    assert result.finished[a].finish_reason.value == "cancelled"
    while b not in result.deltas:
        result = session.step()
    assert session.rows[b].waiting  # between canvases: the canvas waits to be encoded
    result = session.step(cancelled=[b])
    assert result.finished[b].token_ids == list(result.finished[b].token_ids)
    assert len(result.finished[b].token_ids) == CANVAS
    assert not session.residents()
    assert (rt.blocks.num_free, rt.slots.num_free) == (blocks, slots)
    session.finish()


def test_admission_waits_for_blocks_and_slots(checkpoint):
    path, _ = checkpoint
    rt = runtime(path, max_batch_size=1)
    session = rt.new_session()
    assert session.admit(request(rt, PROMPTS[0], 1)).answer is AdmissionAnswer.ADMITTED
    assert session.admit(request(rt, PROMPTS[1], 1)).answer is AdmissionAnswer.NO_CAPACITY
    session.abort()
    session.finish()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_p": 0.9}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"logprobs": 2}, "logprobs"),
        ({"n": 2}, "n"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
        ({"logit_bias": {5: 1.0}}, "logit_bias"),
        ({"min_tokens": 3}, "min_tokens"),
    ],
)
def test_per_token_options_are_refused_by_name(llm, params, field):
    with pytest.raises(RequestFieldError, match="block-diffusion") as err:
        llm.prepare({"prompt_token_ids": PROMPTS[0]}, SamplingParams(**params))
    assert err.value.field == field


def test_options_it_does_not_serve_and_bad_settings_are_refused(llm):
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with pytest.raises(RequestFieldError, match="lora_name") as err:
        llm.prepare(prompt, lora_name="x")
    assert err.value.field == "lora_name"
    with pytest.raises(RequestFieldError, match="t_min") as err:
        llm.prepare(prompt, diffusion=DiffusionParams(t_min=0.9))  # above the default t_max
    with pytest.raises(RequestFieldError, match="max_denoising_steps"):
        DiffusionParams(max_denoising_steps=0)
    with pytest.raises(RequestFieldError, match="max_tokens"):
        llm.prepare(prompt, SamplingParams(max_tokens=400))
    # An autoregressive model's runtime refuses diffusion settings, naming what serves them.
    text_request = GenerationRequest([1, 2], diffusion=DiffusionParams())
    with pytest.raises(RequestFieldError, match="block-diffusion model") as err:
        check_runtime_serves(text_request, frozenset())
    assert err.value.field == "diffusion"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"enable_lora": True}, "LoRA is not served for a block-diffusion model"),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "speculative decoding",
        ),
        ({"quantization": "int8"}, "quantization='int8'"),
        ({"max_num_tokens": 4, "max_batch_size": 2}, "must hold a canvas"),
    ],
)
def test_deployments_it_cannot_serve_are_refused_at_load(checkpoint, options, match):
    path, _ = checkpoint
    with pytest.raises(ValueError, match=match):
        LLM(str(path), enable_in_flight_batching=True, **options)


def test_it_reports_its_canvas(llm):
    assert llm.canvas_length == CANVAS
    assert llm.in_flight_batching


def test_a_stream_closed_mid_canvas_is_cancelled_and_frees_its_kv(checkpoint, llm):
    free = llm._blocks.num_free, llm._slots.num_free
    other = llm.generate_stream(
        {"prompt_token_ids": PROMPTS[1]},
        SamplingParams(max_tokens=6 * CANVAS, seed=1),
        diffusion=DiffusionParams(max_denoising_steps=STEPS),
    )
    leaving = llm.generate_stream(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(max_tokens=20 * CANVAS, seed=2),
        diffusion=DiffusionParams(max_denoising_steps=STEPS),
    )
    next(iter(leaving))
    leaving.close()  # between its canvases or inside the next: the engine decides when
    chunks = list(other)
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 6 * CANVAS
    with pytest.raises(RequestCancelled):
        leaving.get()
    assert (llm._blocks.num_free, llm._slots.num_free) == free


def test_the_blocking_path_serves_it_one_request_at_a_time(checkpoint):
    path, reference = checkpoint
    with LLM(str(path), max_model_len=256) as blocking:
        assert not blocking.in_flight_batching
        got = ours(blocking, PROMPTS[2], 6)
    assert list(got.token_ids) == theirs(reference, PROMPTS[2], 6, eos_token_id=None)


def test_drafts_stream_each_step_of_a_canvas_and_change_no_token(checkpoint, llm):
    _, reference = checkpoint
    handle = llm.generate_stream(
        {"prompt_token_ids": PROMPTS[1]},
        SamplingParams(max_tokens=3 * CANVAS, seed=2),
        diffusion=DiffusionParams(max_denoising_steps=STEPS, stream_drafts=True),
    )
    chunks = list(handle)
    drafts = [c.draft for c in chunks if c.draft is not None]
    tokens = [t for c in chunks for t in c.token_ids]
    # Random weights settle no canvas early: every step but each canvas's last is a draft
    # (a consumer that falls behind gets the latest one, merged).
    assert 0 < len(drafts) <= 3 * (STEPS - 1)
    assert all(len(d) == CANVAS for d in drafts)
    assert tokens == theirs(reference, PROMPTS[1], 2, eos_token_id=None)


def test_merged_chunks_keep_the_latest_draft_until_tokens_come():
    from inflight.protocol.outputs import StreamChunk, merge_chunks

    (merged,) = merge_chunks([StreamChunk(draft=[1, 2]), StreamChunk(draft=[3, 4])])
    assert merged.draft == [3, 4] and merged.token_ids == []
    (merged,) = merge_chunks([StreamChunk(draft=[1, 2]), StreamChunk(token_ids=[5, 6])])
    assert merged.draft is None and merged.token_ids == [5, 6]
