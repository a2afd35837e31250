"""`SpokenReplies`: chat replies spoken as they are written (`generate_audio`, Qwen3-Omni).

A request asking for audio is one resident with two parts: its thinker row, which the text
runtime steps as any other, and a talker row (`talker_loop.py`) that reads the reply as the
thinker writes it. As a per-row feature, it checks and reserves at admission (the voice, the
talker's KV blocks), and keeps the resident seated once its text has ended until its voice has
(`keeps`). After each step the session takes in, it takes the reply's new tokens (all but the
latest, which may turn out to be the one that stops it), runs one talker step over the rows
that can go on and adds their frames and audio to the step's chunks; a row whose voice ends
then ends its request.

The talker's prompt is built as transformers' `generate(return_audio=True)` builds it: the
prompt's user turns (text projected from the thinker's token embeddings), then the assistant
turn's first three tokens, four tts_pad rows, tts_bos and its next token, each under its codec
row (nothink, think_bos, think_eos, the voice, pad, bos). Frame f then reads the turn's token
4 + f projected, tts_eos after the last, tts_pad from there on. The token that stopped the
reply (an end or stop token) is not spoken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from inflight.model.families.qwen3_omni import Qwen3OmniForConditionalGeneration
from inflight.protocol.outputs import FinishReason, StreamChunk
from inflight.protocol.request import GenerationRequest, RequestFieldError
from inflight.protocol.stepped import StepResult
from inflight.runtime.host.features import RowFeature
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.media import mrope_positions, mrope_shift
from inflight.runtime.host.residents import Resident
from inflight.runtime.speech.sampling import Draw
from inflight.runtime.speech.talker_loop import TalkerLoop, TalkerRow

log = logging.getLogger(__name__)

# The assistant turn's tokens before its reply's first (<|im_start|>assistant\n), read as
# text only by the talker's prompt.
TURN_HEAD = 3
# Talker prompt rows of the assistant turn: its head, four tts_pad, tts_bos + its next token.
TURN_ROWS = TURN_HEAD + 6
CODE_PREDICTOR_TOP_K, CODE_PREDICTOR_TOP_P = 50, 0.8
# A voice this far ahead of real time yields its turn to the thinker's rows: a talker step
# costs a text step several times over, and audio faster than it is heard helps nobody.
LEAD_S = 1.0


@dataclass
class ReplyText:
    """The assistant turn's tokens as the talker reads them: known from the prompt, then as the
    thinker writes them, and whether the reply has ended."""

    rows: Callable[[list[int]], torch.Tensor]  # token ids -> projected rows [n, hidden]
    eos: torch.Tensor  # tts_eos's row
    pad: torch.Tensor  # tts_pad's row
    tokens: list[int] = field(default_factory=list)
    projected: list[torch.Tensor] = field(default_factory=list)  # rows of tokens[4:]
    ended: bool = False

    def push(self, tokens: list[int]) -> None:
        start = max(len(self.tokens), TURN_HEAD + 1)
        self.tokens += tokens
        if len(self.tokens) > start:
            self.projected += list(self.rows(self.tokens[start:]))

    def row(self, frame: int) -> torch.Tensor | None:
        if frame < len(self.projected):
            return self.projected[frame]
        if not self.ended:
            return None
        return self.eos if frame == len(self.projected) else self.pad


@dataclass(frozen=True)
class TalkerPlan:
    """What a spoken request's talker needs of its prompt, read once: where the assistant
    turn begins, the user-turn positions its prompt reads, the frames it may make."""

    turn: int
    user: list[int]
    frames: int

    @property
    def length(self) -> int:
        """The talker prompt's positions."""
        return len(self.user) + TURN_ROWS


@dataclass
class Voice:
    """A resident's spoken side: its talker row and reply text, and its audio so far."""

    talker: TalkerRow
    text: ReplyText
    user: list[int]  # the prompt's user-turn positions, which the talker's prompt reads
    speaker: int  # its voice's codec row
    taken: int = 0  # reply tokens in its text
    audio: bytearray = field(default_factory=bytearray)
    started: float | None = None  # when its first audio went out (monotonic seconds)
    ended: bool = False  # its voice has ended


class SpokenReplies(RowFeature):
    def __init__(
        self,
        model: Qwen3OmniForConditionalGeneration,
        loop: TalkerLoop,
        max_model_len: int,
        generator: torch.Generator,
    ) -> None:
        talker = model.talker
        assert talker is not None and model.config.talker is not None
        self.model = model
        self.talker = talker
        self.config = model.config.talker
        self.loop = loop
        self.blocks: BlockPool = loop.blocks
        self.max_model_len = max_model_len
        self.generator = generator  # draws the seed of a request that has none
        self.voices: dict[Resident, Voice] = {}
        ids = self.config.text_ids
        self._im_start, self._assistant, self._user_id = (
            ids["im_start"],
            ids["assistant"],
            ids["user"],
        )

    # -- admission ----------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        audio = request.generate_audio
        if audio is None:
            return
        if audio.voice.lower() not in self.config.speakers:
            raise RequestFieldError(
                f"unknown voice {audio.voice!r}; this model's voices: "
                f"{', '.join(sorted(self.config.speakers))}",
                "voice",
            )
        if request.params.n > 1:
            raise RequestFieldError("audio output is for one sequence: n must be 1", "n")
        if any(item.length < item.tokens for item in request.media):
            raise RequestFieldError(
                "audio output reads every image token: drop mm_processor_kwargs keep_ratio",
                "mm_processor_kwargs",
            )
        plan = self._plan(request)
        if plan.length >= self.max_model_len:
            raise RequestFieldError(
                f"the talker's prompt is {plan.length} positions; max_model_len is "
                f"{self.max_model_len}",
                "generate_audio",
            )
        if self.blocks.blocks_for(plan.length + plan.frames) > self.blocks.num_blocks:
            raise RequestFieldError(
                "the spoken reply needs more talker KV blocks than the cache holds; lower "
                "audio max_frames",
                "max_frames",
            )

    def reads_prompt(self, request: GenerationRequest) -> bool:
        """A spoken reply reads the thinker's hidden states of its prompt's media."""
        return request.generate_audio is not None and bool(request.media)

    def reserve(self, request: GenerationRequest, sequences: int) -> object | None:
        """The request's talker plan and the talker KV blocks held back for it."""
        if request.generate_audio is None:
            return True
        plan = self._plan(request)
        blocks = self.blocks.blocks_for(plan.length + plan.frames)
        return (plan, blocks) if self.blocks.reserve(blocks) else None

    def unreserve(self, request: GenerationRequest, sequences: int, held: object) -> None:
        if request.generate_audio is not None:
            assert isinstance(held, tuple)
            self.blocks.unreserve(held[1])

    @torch.inference_mode()
    def seat(self, resident: Resident, held: object) -> None:
        request = resident.request
        audio = request.generate_audio
        if audio is None:
            return
        assert isinstance(held, tuple)
        plan, blocks = held
        embed, project = self.model.embed_tokens, self.talker.text_projection
        device = self.loop.runner.device

        def rows(ids: list[int]) -> torch.Tensor:
            return project(embed(torch.tensor(ids, dtype=torch.long, device=device)))

        t = self.config.text_ids
        eos, pad = rows([t["tts_eos"], t["tts_pad"]])
        text = ReplyText(rows, eos, pad)
        text.push(list(request.prompt_token_ids[plan.turn :]))
        generator = torch.Generator(device)
        seed = request.params.seed
        if seed is None:
            seed = int(
                torch.randint(2**62, (1,), generator=self.generator, device=self.generator.device)
            )
        generator.manual_seed(seed)
        greedy = audio.temperature == 0
        talker = TalkerRow(
            slot=resident.ref.slot,
            blocks=[],
            held=blocks,
            max_frames=plan.frames,
            repetition_penalty=audio.repetition_penalty,
            ignore_eos=False,
            talk=Draw(audio.temperature, audio.top_k, audio.top_p, generator),
            predict=Draw(
                0.0 if greedy else 1.0, CODE_PREDICTOR_TOP_K, CODE_PREDICTOR_TOP_P, generator
            ),
            text=text,
        )
        self.loop.start(talker)
        speaker = self.config.speakers[audio.voice.lower()]
        voice = self.voices[resident] = Voice(talker, text, plan.user, speaker)
        resident.features.audio = voice.audio
        self._prompt_when_known(resident, voice)

    def evict(self, resident: Resident) -> None:
        voice = self.voices.pop(resident, None)
        if voice is not None:
            self.loop.release(voice.talker)

    # -- the reply as it is written -----------------------------------------------------------

    def keeps(
        self, resident: Resident, reason: FinishReason, stop_reason: str | int | None
    ) -> bool:
        voice = self.voices.get(resident)
        if voice is None or voice.ended:
            return False
        text = voice.text
        if not text.ended:
            # The token that stopped the reply (an end or stop token) is not spoken; one that
            # ends it by length, or ends a stop string, is.
            stopped_by_token = reason is FinishReason.STOP and not isinstance(stop_reason, str)
            self._take(resident, voice, len(resident.output) - stopped_by_token)
            text.ended = True
            self._prompt_when_known(resident, voice)
            if voice.talker.prefill is None:
                voice.ended = True  # nothing to say
                return False
        return True

    # -- the talker's step --------------------------------------------------------------------

    @torch.inference_mode()
    def step(
        self,
        result: StepResult,
        finish: Callable[[Resident, FinishReason, str | int | None, str], None],
        busy: bool = False,
    ) -> None:
        """One talker step over the voices that can go on: their frames and audio into the
        step's chunks; `finish(resident, reason, stop_reason, error)` ends a request whose
        voice ended after its text (as its text ended; as its voice did, where the reply was
        its prompt's), or failed (`error`). `busy`: the thinker has rows this step, and a voice
        far enough ahead of real time (`LEAD_S`) leaves it to them."""
        now = time.monotonic()
        for resident, voice in self.voices.items():
            if not voice.text.ended:
                # The latest token waits: it may turn out to be the one that stops the reply.
                self._take(resident, voice, len(resident.output) - 1)
            if not voice.ended:
                self._prompt_when_known(resident, voice)
        voices = {
            id(v.talker): (r, v)
            for r, v in self.voices.items()
            if not v.ended and not (busy and self._ahead(v, now))
        }
        if not voices:
            return
        try:
            planned, outputs = self.loop.step(v.talker for _, v in voices.values())
        except Exception as exc:  # noqa: BLE001 (the talker's failure is its voices' alone)
            log.exception("a talker step failed; its voices' requests fail")
            for resident, voice in voices.values():
                voice.ended = True
                self.loop.release(voice.talker)
                finish(resident, FinishReason.ERROR, None, f"the talker failed: {exc}")
            return
        sampling = [voices[id(p.row)] for p in planned if p.samples]
        for (resident, voice), out in zip(sampling, outputs, strict=True):
            chunk = result.deltas.get(resident.ref)
            if chunk is None:
                chunk = result.deltas[resident.ref] = StreamChunk(
                    prompt_tokens=resident.prompt_len, index=resident.index
                )
            chunk.codes += out.codes
            chunk.audio += out.audio
            voice.audio += out.audio
            if out.audio and voice.started is None:
                voice.started = now
            if out.finish is None:
                continue
            voice.ended = True
            self.loop.release(voice.talker)
            audio = resident.request.generate_audio
            if out.finish is FinishReason.ERROR:
                finish(resident, out.finish, None, out.error)
            elif audio is not None and audio.reply_in_prompt:
                finish(resident, out.finish, None, "")
            elif resident.ended is not None:
                finish(resident, *resident.ended, "")

    # -- parts --------------------------------------------------------------------------------

    def _ahead(self, voice: Voice, now: float) -> bool:
        """Whether the voice's listener has more than `LEAD_S` of its audio still to hear."""
        if voice.started is None:
            return False
        heard = now - voice.started
        return len(voice.audio) / 4 / self.config.sample_rate - heard > LEAD_S

    def _take(self, resident: Resident, voice: Voice, end: int) -> None:
        """The reply's tokens up to `end` into the voice's text; none where the reply is the
        prompt's."""
        audio = resident.request.generate_audio
        if end <= voice.taken or (audio is not None and audio.reply_in_prompt):
            return
        voice.text.push(resident.output[voice.taken : end])
        voice.taken = end

    def _prompt_when_known(self, resident: Resident, voice: Voice) -> None:
        """Build the talker's prompt once it is known: the assistant turn's token after its
        head, and (a prompt with media) the hidden states its prefill keeps, which it has once
        the reply's first token is out."""
        if voice.talker.prefill is not None or len(voice.text.tokens) <= TURN_HEAD:
            return
        if resident.request.media and not resident.output:
            return
        self._prompt(resident, voice)

    def _prompt(self, resident: Resident, voice: Voice) -> None:
        """The talker's prompt (`_prompt_when_known`)."""
        c, t = self.config.codec_ids, self.config.text_ids
        device = self.loop.runner.device
        text = voice.text
        head = text.rows(text.tokens[: TURN_HEAD + 1])
        pad, bos = text.rows([t["tts_pad"], t["tts_bos"]])
        codec = self.talker.codec_embeds(
            torch.tensor(
                [
                    c["nothink"],
                    c["think_bos"],
                    c["think_eos"],
                    voice.speaker,
                    c["pad"],
                    c["bos"],
                ],
                device=device,
            )
        )
        turn = torch.cat(
            (head[:TURN_HEAD], torch.stack((pad, pad, pad, pad, bos, head[TURN_HEAD])) + codec)
        )
        parts = [turn]
        if voice.user:
            parts.insert(0, self._user_rows(resident, voice))
        voice.talker.prefill = torch.cat(parts)

    def _user_rows(self, resident: Resident, voice: Voice) -> torch.Tensor:
        """The user turns as the talker reads them: text projected from the thinker's token
        embeddings; media from the thinker's hidden states entering layer
        `accept_hidden_layer`, projected (and at their M-RoPE positions, the talker's too)."""
        request, user = resident.request, voice.user
        prompt = request.prompt_token_ids
        at = {position: k for k, position in enumerate(user)}
        media = [item for item in request.media if item.offset in at]
        rows = voice.text.rows([prompt[p] for p in user])
        for kept in resident.features.kept_media:
            taken = [(at[p], p - kept.start) for p in range(kept.start, kept.end) if p in at]
            if taken:
                ks, js = zip(*taken, strict=True)
                rows[list(ks)] = self.talker.hidden_projection(kept.hidden()[list(js)])
        resident.features.kept_media = []
        if media:
            moved = [replace(item, offset=at[item.offset]) for item in media]
            length = len(user) + TURN_ROWS
            rope = np.tile(np.arange(length) + mrope_shift(moved, 0, length), (3, 1))
            for i, item in enumerate(moved):
                rope[:, item.offset : item.offset + item.length] = mrope_positions(moved, i)
            voice.talker.rope = rope
            voice.talker.rope_delta = sum(item.span - item.length for item in moved)
        return rows

    def _turn(self, request: GenerationRequest) -> int:
        """Where the prompt's last assistant turn begins (its <|im_start|>)."""
        prompt = request.prompt_token_ids
        for i in range(len(prompt) - 2, -1, -1):
            if prompt[i] == self._im_start and prompt[i + 1] == self._assistant:
                return i
        raise RequestFieldError(
            "audio output needs a chat prompt that ends in the assistant's turn "
            "(<|im_start|>assistant): use the chat API",
            "generate_audio",
        )

    def _plan(self, request: GenerationRequest) -> TalkerPlan:
        """The request's talker plan: the user turns are the prompt's positions whose turn's
        role (the token after the <|im_start|> before them) is the user's, before the
        assistant turn; the frames are as many as `max_frames` asks, within the talker's
        context."""
        audio = request.generate_audio
        assert audio is not None
        prompt = request.prompt_token_ids
        turn = self._turn(request)
        user, role = [], prompt[1] if len(prompt) > 1 else -1
        for i in range(turn):
            if prompt[i] == self._im_start:
                role = prompt[i + 1]
            if role == self._user_id:
                user.append(i)
        room = self.max_model_len - len(user) - TURN_ROWS
        frames = room if audio.max_frames is None else min(audio.max_frames, room)
        return TalkerPlan(turn, user, frames)
