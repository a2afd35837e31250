"""Qwen3-Omni's spoken replies under in-flight batching, on a tiny random bundle against
transformers' `Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)` (thinker and
talker greedy): the reply's tokens, its codec frames token for token and its waveform within
1e-5, alone and joining a running batch of text and spoken requests; streamed audio; cancel,
failure, the text-only mode."""

import numpy as np
import pytest
from PIL import Image

from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.outputs import FinishReason, materialize
from inflight.protocol.request import AudioReply, GenerationRequest, SamplingParams
from inflight.protocol.stepped import AdmissionAnswer
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks, run_staggered
from omni_reference import (
    IDS,
    IM_END,
    IM_START,
    greedy_thinker,
    media_arguments,
    reference_reply,
    write_tiny_checkpoint,
)

NL = 212  # "\n" in the tiny tokenizer
MAX_TOKENS, FRAMES = 12, 30


def turn(role: str, *words: int) -> list[int]:
    return [IM_START, IDS[role], NL, *words, IM_END, NL]


def chat(*turns: list[int]) -> list[int]:
    return [token for t in turns for token in t] + [IM_START, IDS["assistant"], NL]


def picture() -> Image.Image:
    return Image.fromarray((np.random.default_rng(0).random((40, 50, 3)) * 255).astype(np.uint8))


def tone() -> np.ndarray:
    return (0.3 * np.sin(np.arange(20800) / 16000 * 2 * np.pi * 440)).astype(np.float32)


VISION = (IDS["<|vision_start|>"], IDS["<|image_pad|>"])
HEARING = (IDS["<|audio_start|>"], IDS["<|audio_pad|>"])
# Each prompt's tokens, and its media (the placeholders expanded when it is built).
PROMPTS = {
    "user": (chat(turn("user", 40, 50, 60, 70)), {}),
    "system_and_user": (chat(turn("system", 90, 91), turn("user", 41, 51)), {}),
    "two_turns": (
        chat(turn("user", 42, 43), turn("assistant", 77, 78, 79), turn("user", 44)),
        {},
    ),
    "image": (chat(turn("user", *VISION, 40, 50)), {"image": [picture()]}),
    "audio": (chat(turn("system", 90), turn("user", 45, *HEARING, 41)), {"audio": [tone()]}),
}
TEXT_ONLY = ("user", "system_and_user", "two_turns")


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    path = tmp_path_factory.mktemp("omni")
    return path, write_tiny_checkpoint(path)


@pytest.fixture(scope="module")
def runtime(omni):
    return Runtime(omni[0], DeploymentOptions(dtype="float32", quantization="none"))


@pytest.fixture(scope="module")
def built(runtime):
    """Each prompt's tokens and media items, its placeholders expanded."""
    return {
        name: runtime.input_processor.expand_media(ids, data, None)
        for name, (ids, data) in PROMPTS.items()
    }


@pytest.fixture(scope="module")
def references(omni, built):
    """Per prompt: the end token (a greedy token of the reply's, among its third to seventh,
    that does not come earlier, so the thinker stops on it) and transformers' spoken reply."""
    model = omni[1]
    out = {}
    for name, (prompt, media) in built.items():
        media_args = media_arguments(media)
        tokens = greedy_thinker(model, prompt, MAX_TOKENS, media_args)
        end = max(i for i in range(2, 7) if tokens[i] not in tokens[:i])
        reply = reference_reply(model, prompt, tokens[end], MAX_TOKENS, FRAMES, media_args)
        out[name] = (tokens[end], reply)
    return out


def spoken(prompt, eos, frames=FRAMES, voice="Ethan", media=()) -> GenerationRequest:
    return GenerationRequest(
        prompt,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[eos]),
        media=media,
        generate_audio=AudioReply(voice, temperature=0.0, max_frames=frames),
    )


def text(prompt, tokens=MAX_TOKENS, media=()) -> GenerationRequest:
    return GenerationRequest(
        prompt, SamplingParams(max_tokens=tokens, temperature=0.0), media=media
    )


def samples(output) -> np.ndarray:
    return np.frombuffer(output.outputs[0].audio, np.float32)


def assert_as_reference(output, reference) -> None:
    tokens, _, wav = reference
    assert list(output.outputs[0].token_ids) == tokens
    got = samples(output)
    assert got.shape == wav.shape
    assert np.abs(got - wav).max() <= 1e-5


@pytest.mark.parametrize("name", PROMPTS)
def test_a_spoken_reply_alone_is_transformers(runtime, built, references, name):
    """Text, image and audio in: the media's thinker hidden states projected into the
    talker's prompt, at the talker's M-RoPE positions."""
    eos, reference = references[name]
    prompt, media = built[name]
    (output,) = run_staggered(runtime, [spoken(prompt, eos, media=media)])
    assert output.outputs[0].finish_reason == "stop"
    assert_as_reference(output, reference)
    assert_no_leaks(runtime)


def test_frames_are_transformers_token_for_token(runtime, built, references):
    eos, (_, codes, _) = references["image"]
    session = runtime.new_session()
    prompt, media = built["image"]
    admission = session.admit(spoken(prompt, eos, media=media))
    frames = []
    while session.residents():
        chunk = session.step().deltas.get(admission.ref)
        if chunk is not None:
            frames += chunk.codes
    session.finish()
    assert frames == codes


def test_joining_a_running_batch_of_text_and_speech_changes_nothing(runtime, built, references):
    """Each spoken reply joins while text requests and other spoken replies run (one admitted
    every other step): each is as it is alone, and the text beside them is as it is alone."""
    names = list(PROMPTS)
    batch = [text(built["image"][0], 9, media=built["image"][1])]
    batch += [spoken(built[n][0], references[n][0], media=built[n][1]) for n in names]
    batch.append(text(built["two_turns"][0], 5))
    outputs = run_staggered(runtime, batch)
    for name, output in zip(names, outputs[1:-1], strict=True):
        assert_as_reference(output, references[name][1])
    alone = run_staggered(runtime, [batch[0], batch[-1]])
    assert [o.outputs[0].token_ids for o in (outputs[0], outputs[-1])] == [
        o.outputs[0].token_ids for o in alone
    ]
    assert not outputs[0].outputs[0].audio
    assert_no_leaks(runtime)


def test_streamed_audio_concatenated_is_the_whole(runtime, references):
    eos, (_, _, wav) = references["two_turns"]
    session = runtime.new_session()
    ref = session.admit(spoken(PROMPTS["two_turns"][0], eos)).ref
    audio, chunks, final = bytearray(), 0, None
    while session.residents():
        result = session.step()
        chunk = result.deltas.get(ref)
        if chunk is not None and chunk.audio:
            audio += chunk.audio
            chunks += 1
        if ref in result.finished:
            final = materialize([result.finished[ref]])
    session.finish()
    assert chunks > 1
    streamed = np.frombuffer(bytes(audio), np.float32)
    assert np.array_equal(streamed, samples(final))
    assert np.abs(streamed - wav).max() <= 1e-5


def test_the_voice_outlives_the_text_and_ends_the_request(runtime, references):
    """The text ends first (its stop token); the resident stays, in no more thinker rows, until
    its voice ends; the request then ends with the text's finish reason."""
    eos, _ = references["user"]
    session = runtime.new_session()
    ref = session.admit(spoken(PROMPTS["user"][0], eos)).ref
    text_done = finished = None
    steps = 0
    while session.residents():
        result = session.step()
        steps += 1
        resident = runtime.scheduler.residents.get(ref)
        if resident is not None and resident.ended is not None and text_done is None:
            text_done = steps
        if ref in result.finished:
            finished = (steps, result.finished[ref])
    session.finish()
    assert text_done is not None and finished[0] > text_done
    assert finished[1].finish_reason is FinishReason.STOP


def test_cancel_mid_speech_frees_everything(runtime, references):
    eos, _ = references["system_and_user"]
    session = runtime.new_session()
    ref = session.admit(spoken(PROMPTS["system_and_user"][0], eos, frames=200)).ref
    other = session.admit(text(PROMPTS["user"][0])).ref
    heard = 0
    while heard < 2:
        chunk = session.step().deltas.get(ref)
        heard += chunk is not None and bool(chunk.audio)
    result = session.step(cancelled=[ref])
    assert result.finished[ref].finish_reason is FinishReason.CANCELLED
    while session.residents():
        session.step()
    session.finish()
    assert_no_leaks(runtime)
    assert other not in runtime.scheduler.residents


def test_a_code2wav_failure_fails_its_request_alone(runtime, references, monkeypatch):
    eos_a, reference_a = references["user"]
    eos_b, _ = references["two_turns"]
    session = runtime.new_session()
    a = session.admit(spoken(PROMPTS["user"][0], eos_a)).ref
    b = session.admit(spoken(PROMPTS["two_turns"][0], eos_b)).ref
    session.step()  # seats both

    def broken(open_stream):
        raise RuntimeError("decoder out of memory")

    target = runtime.voices.voices[runtime.scheduler.residents[b]]
    monkeypatch.setattr(target.talker.audio, "emit", broken)
    finished = {}
    while session.residents():
        finished.update(session.step().finished)
    session.finish()
    assert finished[b].finish_reason is FinishReason.ERROR
    assert "audio decoding failed: decoder out of memory" in finished[b].error
    assert_as_reference(materialize([finished[a]]), reference_a)
    assert_no_leaks(runtime)


def test_bad_asks_are_refused_naming_the_problem(runtime):
    with pytest.raises(ValueError, match="unknown voice 'alloy'.*chelsie, ethan"):
        runtime.check(spoken(PROMPTS["user"][0], 5, voice="alloy"))
    with pytest.raises(ValueError, match="ends in the assistant's turn"):
        runtime.check(spoken([IM_START, IDS["user"], NL, 40], 5))
    with pytest.raises(ValueError, match="one sequence"):
        request = spoken(PROMPTS["user"][0], 5)
        runtime.check(
            GenerationRequest(
                request.prompt_token_ids,
                SamplingParams(max_tokens=4, n=2),
                generate_audio=request.generate_audio,
            )
        )


def test_text_only_mode_leaves_the_talker_out_and_refuses_audio(omni, runtime):
    text_only = Runtime(omni[0], DeploymentOptions(dtype="float32", speech=False))
    assert text_only.voices is None and text_only.executor.runner.model.talker is None
    with pytest.raises(ValueError, match="speech output.*--no-speech"):
        text_only.check(spoken(PROMPTS["user"][0], 5))
    request = text(PROMPTS["two_turns"][0])
    assert [o.outputs[0].token_ids for o in run_staggered(text_only, [request])] == [
        o.outputs[0].token_ids for o in run_staggered(runtime, [request])
    ]


def test_overlapped_steps_speak_the_same(omni, references):
    overlapped = Runtime(omni[0], DeploymentOptions(dtype="float32", overlap=True))
    eos, reference = references["two_turns"]
    batch = [text(PROMPTS["user"][0]), spoken(PROMPTS["two_turns"][0], eos)]
    outputs = run_staggered(overlapped, batch)
    assert_as_reference(outputs[1], reference)
    assert_no_leaks(overlapped)


def test_an_admission_waits_for_talker_blocks(omni, references):
    """Spoken replies reserve the talker's KV for their frames: with room for one, the second
    waits (NO_CAPACITY, nothing taken) until the first has ended."""
    small = Runtime(
        omni[0],
        DeploymentOptions(dtype="float32", num_kv_blocks=6, block_size=16, max_model_len=96),
    )
    eos, _ = references["user"]
    session = small.new_session()
    first = session.admit(spoken(PROMPTS["user"][0], eos, frames=60))
    assert first.answer is AdmissionAnswer.ADMITTED
    second = session.admit(spoken(PROMPTS["user"][0], eos, frames=60))
    assert second.answer is AdmissionAnswer.NO_CAPACITY
    while session.residents():
        session.step()
    assert session.admit(spoken(PROMPTS["user"][0], eos, frames=60)).answer is (
        AdmissionAnswer.ADMITTED
    )
    while session.residents():
        session.step()
    session.finish()
    assert_no_leaks(small)


def test_a_voice_ahead_of_its_listener_yields_to_text_rows(runtime, built, references, monkeypatch):
    """With the clock standing still, a voice more than LEAD_S of audio ahead makes no frames
    while text rows run, and goes on once they have ended; what it says is unchanged."""
    from inflight.runtime.speech import replies

    monkeypatch.setattr(replies.time, "monotonic", lambda: 0.0)
    eos, reference = references["user"]
    session = runtime.new_session()
    voice = session.admit(spoken(built["user"][0], eos)).ref
    talk = session.admit(text(built["two_turns"][0], 60)).ref
    audio, paused, finished = bytearray(), 0, {}
    while session.residents():
        result = session.step()
        chunk = result.deltas.get(voice)
        if chunk is not None:
            audio += chunk.audio
        texting = talk in result.deltas and talk not in result.finished
        if texting and len(audio) / 4 / 24000 > replies.LEAD_S:
            paused += chunk is None or not chunk.codes
        finished.update(result.finished)
    session.finish()
    assert paused > 0
    assert finished[voice].finish_reason is FinishReason.STOP
    assert_as_reference(materialize([finished[voice]]), reference)


def test_a_talker_failure_fails_its_voices_not_the_text_beside(runtime, built, monkeypatch):
    """A talker step that raises fails the requests whose voices it ran; the text request
    beside them finishes as it does alone, and nothing leaks."""
    from inflight.runtime.speech.talker_loop import TalkerLoop

    def broken(self, rows):
        raise RuntimeError("talker out of memory")

    session = runtime.new_session()
    voice = session.admit(spoken(built["user"][0], 5)).ref
    talk = session.admit(text(built["two_turns"][0], 20)).ref
    monkeypatch.setattr(TalkerLoop, "step", broken)
    finished = {}
    while session.residents():
        finished.update(session.step().finished)
    session.finish()
    assert finished[voice].finish_reason is FinishReason.ERROR
    assert "the talker failed: talker out of memory" in finished[voice].error
    (alone,) = run_staggered(runtime, [text(built["two_turns"][0], 20)])
    assert tuple(finished[talk].token_ids) == alone.outputs[0].token_ids
    assert_no_leaks(runtime)


def test_a_reply_begun_in_the_prompt_reads_the_prefills_media(omni, runtime):
    """The assistant's turn begun in the prompt (its token after the head known at admission):
    the talker's prompt still waits for the prefill's hidden states of the image, so its frames
    are transformers' until the frame that reads the reply's last token, which transformers
    replaces by tts_eos here (it moves tts_eos to where a reply starting at the turn's head
    would end)."""
    model = omni[1]
    prompt, media = runtime.input_processor.expand_media(
        chat(turn("user", *VISION, 40)) + [42, 43], {"image": [picture()]}, None
    )
    arguments = media_arguments(media)
    tokens = greedy_thinker(model, prompt, MAX_TOKENS, arguments)
    end = max(i for i in range(2, 7) if tokens[i] not in tokens[:i])
    reply, codes, _ = reference_reply(model, prompt, tokens[end], MAX_TOKENS, FRAMES, arguments)
    session = runtime.new_session()
    ref = session.admit(spoken(prompt, tokens[end], media=media)).ref
    frames = []
    while session.residents():
        chunk = session.step().deltas.get(ref)
        if chunk is not None:
            frames += chunk.codes
    session.finish()
    # Frame f reads the turn's token 4 + f: the reply's last spoken token is read at frame
    # len(reply) - 1 (the turn holds two tokens past its head).
    same = len(reply) - 1
    assert frames[:same] == codes[:same]
    assert_no_leaks(runtime)
