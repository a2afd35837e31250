"""Text to speech, stepped: a tiny random Qwen3-TTS of each kind served by `LLM.speech` and by
a `SpeechSession` driven by hand, checked against the reference package (`qwen-tts-compat`, see
speech_reference.py): greedy frames code for code, audio within 1e-5 of its decoder; rows that
join mid-flight, cancels and a failing decoder."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from inflight import LLM
from inflight.protocol.outputs import FinishReason
from inflight.protocol.request import RequestFieldError, SamplingParams
from inflight.runtime.speech.audio import AudioStream

from speech_reference import write_tiny_checkpoint

TEXT = "Hello world, this is a test."
GREEDY = dict(subtalker_sample=False)


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    """kind -> (checkpoint dir, reference model, reference decoder)."""
    root = tmp_path_factory.mktemp("tts")
    out = {}
    for kind in ("custom_voice", "voice_design", "base"):
        out[kind] = (root / kind, *write_tiny_checkpoint(root / kind, kind, seed=1))
    return out


@pytest.fixture(scope="module")
def voices(tts):
    """kind -> an in-flight-batching LLM of it (closed at the end)."""
    llms = {
        kind: LLM(str(path), enable_in_flight_batching=True, max_model_len=256, max_batch_size=4)
        for kind, (path, _, _) in tts.items()
    }
    yield llms
    for llm in llms.values():
        llm.close()


def reference_codes(model, ids, frames: int, **kwargs) -> torch.Tensor:
    """The reference's greedy frames [n, groups] (`frames` of them unless it ends first: its
    generate makes n - 1 frames of n talker tokens)."""
    with torch.no_grad():
        codes, _ = model.generate(
            input_ids=[torch.tensor([ids])],
            max_new_tokens=frames + 1,
            do_sample=False,
            subtalker_dosample=False,
            **kwargs,
        )
    return codes[0]


def audio(output) -> np.ndarray:
    return np.frombuffer(output.audio, np.float32)


def greedy(frames: int) -> SamplingParams:
    """Greedy first codes with the reference's default repetition penalty."""
    return SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=frames)


@pytest.mark.parametrize("text_in_prompt", [True, False])
def test_custom_voice_frames_and_audio_equal_the_reference(tts, voices, text_in_prompt):
    _, model, decoder = tts["custom_voice"]
    llm = voices["custom_voice"]
    options = dict(voice="vivian", language="english", text_in_prompt=text_in_prompt, **GREEDY)
    out = llm.speech(TEXT, greedy(24), **options)
    ids = llm.prepare_speech(TEXT, greedy(24), **options).prompt_token_ids
    expected = reference_codes(
        model,
        ids,
        24,
        languages=["english"],
        speakers=["vivian"],
        non_streaming_mode=text_in_prompt,
    )
    assert len(out.codes) == 24 and out.finish_reason == "length"
    assert torch.equal(torch.tensor(out.codes), expected)
    with torch.no_grad():
        wave = decoder.chunked_decode(expected.T[None]).reshape(-1).numpy()
    assert audio(out).shape == wave.shape == (24 * 1920,)
    assert out.num_samples == 24 * 1920 and list(out.samples[:5]) == audio(out)[:5].tolist()
    assert np.abs(audio(out) - wave).max() <= 1e-5
    assert out.sample_rate == 24000


def test_a_dialect_voice_and_instructions_equal_the_reference(tts, voices):
    _, model, _ = tts["custom_voice"]
    llm = voices["custom_voice"]
    options = dict(voice="Dylan", instructions="Speak slowly.", **GREEDY)
    out = llm.speech(TEXT, greedy(16), **options)
    request = llm.prepare_speech(TEXT, greedy(16), **options)
    expected = reference_codes(
        model,
        request.prompt_token_ids,
        16,
        instruct_ids=[torch.tensor([request.speech.instruction_token_ids])],
        languages=["auto"],
        speakers=["dylan"],
        non_streaming_mode=True,
    )
    assert torch.equal(torch.tensor(out.codes), expected)


def test_voice_design_equals_the_reference(tts, voices):
    _, model, _ = tts["voice_design"]
    llm = voices["voice_design"]
    options = dict(instructions="A deep, calm voice.", language="chinese", **GREEDY)
    out = llm.speech(TEXT, greedy(20), **options)
    request = llm.prepare_speech(TEXT, greedy(20), **options)
    expected = reference_codes(
        model,
        request.prompt_token_ids,
        20,
        instruct_ids=[torch.tensor([request.speech.instruction_token_ids])],
        languages=["chinese"],
        speakers=[None],
        non_streaming_mode=True,
    )
    assert torch.equal(torch.tensor(out.codes), expected)


def test_an_x_vector_clone_equals_the_reference(tts, voices):
    _, model, _ = tts["base"]
    llm = voices["base"]
    clip = (0.1 * np.random.default_rng(0).standard_normal(24000)).astype(np.float32)
    out = llm.speech(TEXT, greedy(20), reference_audio=clip, language="english", **GREEDY)
    request = llm.prepare_speech(TEXT, greedy(20), reference_audio=clip, language="english")
    with torch.no_grad():
        embedding = model.extract_speaker_embedding(clip, 24000)
    prompt = {
        "ref_spk_embedding": [embedding],
        "x_vector_only_mode": [True],
        "icl_mode": [False],
        "ref_code": None,
    }
    expected = reference_codes(
        model,
        request.prompt_token_ids,
        20,
        languages=["english"],
        voice_clone_prompt=prompt,
        non_streaming_mode=False,
    )
    assert len(out.codes) > 1
    assert torch.equal(torch.tensor(out.codes), expected)


def test_streamed_audio_is_the_one_shot_audio(voices):
    llm = voices["custom_voice"]
    options = dict(voice="vivian", **GREEDY)
    whole = llm.speech(TEXT, greedy(30), **options)
    handle = llm.speech_stream(TEXT, greedy(30), **options)
    chunks = list(handle)
    # A frame a step, but a consumer that falls behind gets the steps' chunks merged
    # (RequestHandle): count frames, not chunks.
    ends = list(itertools.accumulate(len(c.codes) for c in chunks))
    assert all(c.codes for c in chunks) and ends[-1] == 30 and chunks[-1].finished
    # The first frame's audio at once, then at doubling intervals: after 1, 3, 7, 15 frames
    # and at the end (a chunk holds audio where its frames reach one of those).
    starts = [0, *ends[:-1]]
    points = [1, 3, 7, 15, 30]
    assert [bool(c.audio) for c in chunks] == [
        any(a < f <= b for f in points) for a, b in zip(starts, ends, strict=True)
    ]
    assert b"".join(c.audio for c in chunks) == whole.audio
    assert [code for c in chunks for code in c.codes] == list(whole.codes)


def test_a_stream_across_the_decoders_chunks_is_its_chunked_decode(tts):
    """Frames across several of the decoder's windows (here 12 frames after 5 of context, to
    stay small; the model's are 300 after 25): the stream is the reference's chunked decode."""
    _, _, decoder = tts["custom_voice"]
    from inflight.model.speech.codec_decoder import CodecDecoder, CodecDecoderConfig

    from speech_reference import tiny_decoder_config_dict

    ours = CodecDecoder(CodecDecoderConfig.from_dict(tiny_decoder_config_dict()))
    ours.load_weights((f"decoder.{k}", v) for k, v in decoder.state_dict().items())
    codes = torch.randint(0, 64, (4, 40), generator=torch.Generator().manual_seed(0))
    stream, parts = AudioStream(chunk=12, context=5), []
    for frame in codes.T:
        stream.frames.append(frame)
        if stream.due(ended=len(stream.frames) == codes.shape[1]):
            parts.append(stream.emit(ours.stream))
    with torch.no_grad():
        expected = decoder.chunked_decode(codes[None], 12, 5).reshape(-1)
    assert torch.cat(parts).shape == expected.shape
    assert (torch.cat(parts) - expected).abs().max() <= 1e-5


def test_reference_audio_may_be_a_wav_file_or_another_rate(voices):
    import io
    import wave

    llm = voices["base"]
    clip = (0.1 * np.random.default_rng(1).standard_normal(16000)).astype(np.float32)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
        f.writeframes((clip * 32767).astype("<i2").tobytes())
    from_wav = llm.prepare_speech(TEXT, reference_audio=buffer.getvalue())
    from_samples = llm.prepare_speech(TEXT, reference_audio=clip, reference_sample_rate=16000)
    for request in (from_wav, from_samples):
        assert request.speech.reference_sample_rate == 24000
        assert len(request.speech.reference_audio) == 24000
    assert (
        np.abs(from_wav.speech.reference_audio - from_samples.speech.reference_audio).max() < 1e-3
    )
    out = llm.speech(TEXT, greedy(5), reference_audio=buffer.getvalue())
    assert len(out.codes) >= 1


def session_of(llm):
    runtime = llm._live()
    return runtime, runtime.new_session()


def run(session, refs, cancel=()):
    """Step until `refs` all ended; each one's frames and finish reason."""
    frames = {ref: [] for ref in refs}
    ends = {}
    while any(ref not in ends for ref in refs):
        result = session.step(cancel)
        cancel = ()
        for ref, chunk in result.deltas.items():
            if ref in frames:
                frames[ref] += chunk.codes
        for ref, snapshot in result.finished.items():
            ends[ref] = snapshot.finish_reason
    return frames, ends


def test_a_row_joining_mid_flight_makes_the_frames_it_makes_alone(voices):
    llm = voices["custom_voice"]
    runtime, session = session_of(llm)
    try:
        sampled = SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=12, ignore_eos=True)
        joiner = llm.prepare_speech("A second, longer sentence.", sampled, voice="dylan")
        alone, _ = run(session, [session.admit(joiner).ref])
        first = llm.prepare_speech(TEXT, greedy(20), voice="vivian", **GREEDY)
        a = session.admit(first).ref
        for _ in range(5):
            session.step()
        b = session.admit(joiner).ref
        frames, ends = run(session, [a, b])
        assert list(alone.values())[0] == frames[b] and len(frames[b]) == 12
        assert ends[b] is FinishReason.LENGTH
        assert runtime.blocks.num_free == runtime.blocks.num_blocks
    finally:
        session.finish()


def test_cancel_mid_stream_frees_every_block_and_slot(voices):
    llm = voices["custom_voice"]
    runtime, session = session_of(llm)
    try:
        # EOS ignored: the code predictor samples its codebooks unseeded, so a random talker may
        # end the request by EOS within the first frames, before it is cancelled.
        params = dataclasses.replace(greedy(40), ignore_eos=True)
        request = llm.prepare_speech(TEXT, params, voice="vivian")
        ref = session.admit(request).ref
        assert runtime.blocks.num_free < runtime.blocks.num_blocks
        for _ in range(4):
            session.step()
        result = session.step([ref])
        assert result.finished[ref].finish_reason is FinishReason.CANCELLED
        assert session.residents() == []
        assert runtime.blocks.num_free == runtime.blocks.num_blocks
        assert runtime.slots.num_free == runtime.slots.capacity
    finally:
        session.finish()
    handle = llm.speech_stream(TEXT, greedy(200), voice="vivian")
    next(iter(handle))
    handle.close()
    assert llm.kv_cache_usage()[0] == 0 or _settles(llm)


def _settles(llm) -> bool:
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if llm.kv_cache_usage()[0] == 0 and llm.resident_slot_usage()[0] == 0:
            return True
        time.sleep(0.01)
    return False


def test_a_decoder_failure_fails_its_row_alone(voices):
    llm = voices["custom_voice"]
    runtime, session = session_of(llm)
    try:
        endless = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        a = session.admit(llm.prepare_speech(TEXT, endless, voice="vivian")).ref
        b = session.admit(llm.prepare_speech(TEXT, endless, voice="dylan")).ref

        def broken(decode):
            raise RuntimeError("codec decoder fault")

        session.rows[a].talker.audio.emit = broken
        frames, ends = run(session, [a, b])
        assert ends[a] is FinishReason.ERROR and ends[b] is FinishReason.LENGTH
        assert len(frames[b]) == 10
        assert runtime.blocks.num_free == runtime.blocks.num_blocks
    finally:
        session.finish()


def test_a_seeded_request_repeats_and_sampling_varies(voices):
    llm = voices["custom_voice"]
    seeded = SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=10)
    one = llm.speech(TEXT, seeded, voice="vivian")
    two = llm.speech(TEXT, seeded, voice="vivian")
    assert one.codes == two.codes
    other = llm.speech(TEXT, SamplingParams(temperature=0.9, seed=4, max_tokens=10), voice="vivian")
    assert other.codes != one.codes


@pytest.mark.parametrize(
    "kind, text, options, field",
    [
        ("custom_voice", "", {"voice": "vivian"}, "input"),
        ("custom_voice", "x" * 4097, {"voice": "vivian"}, "input"),
        ("custom_voice", TEXT, {"voice": "nobody"}, "voice"),
        ("custom_voice", TEXT, {}, "voice"),
        ("custom_voice", TEXT, {"voice": "vivian", "language": "klingon"}, "language"),
        (
            "custom_voice",
            TEXT,
            {"voice": "vivian", "reference_audio": [0.0] * 24000},
            "reference_audio",
        ),
        ("voice_design", TEXT, {"instructions": "calm", "voice": "vivian"}, "voice"),
        ("voice_design", TEXT, {}, "instructions"),
        ("base", TEXT, {}, "reference_audio"),
        ("base", TEXT, {"reference_audio": [0.0] * 100}, "reference_audio"),
        ("base", TEXT, {"reference_audio": b"RIFF-not-a-wav"}, "reference_audio"),
        ("base", TEXT, {"reference_audio": [float("nan")] * 24000}, "reference_audio"),
        ("custom_voice", TEXT, {"voice": "vivian", "subtalker_top_p": 0}, "subtalker_top_p"),
    ],
)
def test_bad_speech_requests_name_their_field(voices, kind, text, options, field):
    with pytest.raises(RequestFieldError) as error:
        voices[kind].prepare_speech(text, **options)
    assert error.value.field == field


def test_text_only_parameters_are_refused_by_name(voices):
    llm = voices["custom_voice"]
    for params, field in (
        (SamplingParams(logprobs=2), "logprobs"),
        (SamplingParams(n=2), "n"),
        (SamplingParams(stop=["x"]), "stop"),
    ):
        with pytest.raises(RequestFieldError) as error:
            llm.prepare_speech(TEXT, params, voice="vivian")
        assert error.value.field == field
    with pytest.raises(ValueError, match="text-to-speech model"):
        llm.generate("hello")


@pytest.mark.parametrize(
    "kind, options",
    [
        ("custom_voice", {"voice": "vivian"}),
        ("custom_voice", {"voice": "vivian", "language": "english", "text_in_prompt": False}),
        ("custom_voice", {"voice": "dylan", "instructions": "Slowly."}),
        ("voice_design", {"instructions": "A calm voice.", "language": "chinese"}),
        ("base", {"reference_audio": [0.01] * 24000}),
        ("base", {"reference_audio": [0.01] * 24000, "text_in_prompt": True}),
    ],
)
def test_the_checked_prompt_length_is_the_built_one(voices, kind, options):
    """Admission reserves blocks for the length the check computes without building."""
    from inflight.runtime.speech.inputs import prompt_positions
    from inflight.runtime.speech.prompt import build_prompt

    runtime = voices[kind]._live()
    request = runtime.inputs.request(TEXT, **options)
    voice_row = None
    if request.speech.reference_audio is not None:
        clip = torch.as_tensor(request.speech.reference_audio)
        voice_row = runtime.model.speaker_embedding(clip, 24000)
    built = build_prompt(runtime.model, request, voice_row).prefill.shape[0]
    assert prompt_positions(runtime.model.speech, request) == built


def test_the_blocking_path_speaks_the_same_frames(tts, voices):
    path = tts["custom_voice"][0]
    options = dict(voice="vivian", **GREEDY)
    with LLM(str(path), max_model_len=256) as blocking:
        assert not blocking.in_flight_batching
        alone = blocking.speech(TEXT, greedy(10), **options)
    assert alone.codes == voices["custom_voice"].speech(TEXT, greedy(10), **options).codes
    assert alone.audio == voices["custom_voice"].speech(TEXT, greedy(10), **options).audio


def test_decode_steps_replaying_graphs_make_the_eager_frames(tts, voices):
    """Decode-only steps of a speech model replay the decode graphs, reading each row's
    embedding from the graphs' buffer (here EagerGraphs: the same buffers and buckets on the
    CPU), with the frames of eager steps."""
    from helpers import with_eager_graphs

    path = tts["custom_voice"][0]
    options = dict(voice="vivian", **GREEDY)
    seeded = SamplingParams(temperature=0.9, seed=2, max_tokens=12, ignore_eos=True)
    expected = [
        voices["custom_voice"].speech(TEXT, p, **options).codes for p in (greedy(12), seeded)
    ]
    with LLM(str(path), enable_in_flight_batching=True, max_model_len=256, max_batch_size=4) as llm:
        graphs = with_eager_graphs(llm._live()).runner.graphs
        replays = []
        run = graphs.run
        graphs.run = lambda batch: replays.append(run(batch)) or replays[-1]
        got = [llm.speech(TEXT, p, **options).codes for p in (greedy(12), seeded)]
    assert got == expected
    assert sum(r is not None for r in replays) >= 20  # every decode step of both requests


@pytest.mark.parametrize(
    "options, refusal",
    [
        ({"enable_lora": True}, "LoRA is not served for a text-to-speech model"),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "speculative decoding is not served",
        ),
        ({"quantization": "int8"}, "quantization='int8' is not served .*'auto' or 'none'"),
        ({"tensor_parallel_size": 2}, "tensor parallelism is not served"),
    ],
)
def test_a_speech_deployment_refuses_what_it_cannot_serve(options, refusal):
    """The plan's rule, before any weight loads."""
    from inflight.protocol.deployment import DeploymentOptions
    from inflight.runtime.deployment import MachineFacts, ModelFacts, resolve

    facts = ModelFacts("qwen3_tts", 3072, 16, 8, 128, 3072, 32768, speech=True)
    with pytest.raises(ValueError, match=refusal):
        resolve(DeploymentOptions(**options), facts, MachineFacts())
    plan = resolve(DeploymentOptions(), facts, MachineFacts())
    assert "speech" in plan.features and plan.served_options == {"speech"}
