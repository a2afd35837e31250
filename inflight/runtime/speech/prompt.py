"""A speech request's prompt as the talker reads it: embeddings, not token ids.

Each position sums a text row (a text token's projected embedding, or tts_pad / tts_bos /
tts_eos) and a codec row (the think / language tags, the voice, pad, bos). The prompt is the
role tokens, the tags under tts_pad, then either all of the text under codec pad rows
(`text_in_prompt`) or its first token only, the rest joining the first frames one row each
(the text rows a step adds to its frame's embedding; past them, tts_pad).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.model.families.qwen3_tts import Qwen3TTSForSpeech
from inflight.protocol.request import GenerationRequest
from inflight.runtime.speech.inputs import ROLE_TOKENS, TAIL_TOKENS, codec_tags, text_in_prompt


@dataclass
class SpeechPrompt:
    prefill: torch.Tensor  # [positions, hidden]
    text_rows: torch.Tensor  # [n, hidden]: the rows the first n frames add
    pad_row: torch.Tensor  # [hidden]: tts_pad, what later frames add


def build_prompt(
    model: Qwen3TTSForSpeech, request: GenerationRequest, voice_row: torch.Tensor | None
) -> SpeechPrompt:
    """`voice_row`: a cloned voice's x-vector (None: a preset voice's row, or no voice)."""
    speech, s = request.speech, model.speech
    assert speech is not None
    device = model.text_embedding.weight.device

    def ids(values: list[int] | tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    text = list(request.prompt_token_ids)
    t = s.text_ids
    bos, eos, pad = model.text_embeds(ids([t["tts_bos"], t["tts_eos"], t["tts_pad"]]))
    c = s.codec_ids
    tags, voice = codec_tags(s, request)
    rows = [model.codec_embeds(ids(tags))]
    if voice_row is not None:
        rows.append(voice_row.to(bos.dtype)[None])
    elif voice is not None:
        rows.append(model.codec_embeds(ids([voice])))
    rows.append(model.codec_embeds(ids([c["pad"], c["bos"]])))
    codec = torch.cat(rows)
    under = torch.cat((pad.expand(codec.shape[0] - 2, -1), bos[None])) + codec[:-1]
    parts = [model.text_embeds(ids(text[:ROLE_TOKENS])), under]
    if speech.instruction_token_ids:
        parts.insert(0, model.text_embeds(ids(speech.instruction_token_ids)))
    body = text[ROLE_TOKENS:-TAIL_TOKENS]
    if text_in_prompt(request, s.kind):
        words = torch.cat((model.text_embeds(ids(body)), eos[None]))
        parts.append(words + model.codec_embeds(ids([c["pad"]] * (len(body) + 1))))
        parts.append(pad[None] + model.codec_embeds(ids([c["bos"]])))
        text_rows = pad.new_zeros((0, pad.shape[-1]))
    else:
        parts.append(model.text_embeds(ids(body[:1])) + codec[-1:])
        text_rows = torch.cat((model.text_embeds(ids(body[1:])), eos[None]))
    return SpeechPrompt(torch.cat(parts), text_rows, pad)
