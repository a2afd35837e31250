"""Qwen3-Omni's talker: what turns a thinker's reply into speech.

The talker decoder is a mixture-of-experts Qwen3 decoder over the codec vocabulary (a
`LlamaForCausalLM` whose embedding table is the codec embedding and whose head predicts a
frame's first code), run by a model runner of its own over a KV cache of its own. Like
Qwen3-TTS's talker, what it reads at each position is a sum the runtime builds: the thinker's
token embeddings projected into its width (`text_projection`), the thinker's hidden states of a
prompt's media positions projected (`hidden_projection`), codec rows, and each generated
frame's summed code embeddings with the next reply token's projected row. The code predictor
fills a frame's other codebooks; Code2Wav turns frames into 24 kHz audio.

Parameter names are the checkpoint's after `talker.` (and `code2wav.` for the codec).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from inflight.model.config import TalkerConfig
from inflight.model.speech.code_predictor import CodePicker, CodePredictor
from inflight.model.speech.codec_decoder import CodecDecoder, CodecDecoderConfig, CodecStream
from inflight.model.weights import copy_weights


def decoder_name(name: str) -> str | None:
    """A talker tensor's name (after `talker.`) as its decoder loads it (its codec embedding
    the decoder's embedding table, its codec head the LM head); None for its other parts."""
    if name.startswith("model.codec_embedding."):
        return "model.embed_tokens." + name.rsplit(".", 1)[1]
    if name.startswith("codec_head."):
        return "lm_head." + name.rsplit(".", 1)[1]
    if name.startswith(("model.layers.", "model.norm.")):
        return name
    return None


def take(
    rest: dict[str, torch.Tensor], prefix: str, strip: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of `rest` under `prefix` (named without it, where `strip`), taken out."""
    names = [name for name in rest if name.startswith(prefix)]
    return [(name.removeprefix(prefix) if strip else name, rest.pop(name)) for name in names]


class ProjectionMLP(nn.Module):
    """Rows of one model's width into another's: two linear layers around a SiLU."""

    def __init__(self, size: int, intermediate: int, out: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(size, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    """`decoder`: the talker decoder, built by the family (a `LlamaForCausalLM` of
    `config.decoder`)."""

    def __init__(self, config: TalkerConfig, decoder: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.decoder = decoder
        shape = config.decoder
        width = (config.thinker_hidden_size, shape.intermediate_size, shape.hidden_size)
        self.text_projection = ProjectionMLP(*width)
        self.hidden_projection = ProjectionMLP(*width)
        self.code_predictor = CodePredictor(
            config.code_predictor, config.num_code_groups, shape.hidden_size
        )
        self.code2wav = CodecDecoder(CodecDecoderConfig.from_code2wav(config.code2wav))

    @property
    def samples_per_frame(self) -> int:
        return self.code2wav.samples_per_frame

    def codec_embeds(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec rows [n, hidden] of codec ids [n] (the talker's embedding table)."""
        return self.decoder.embed_tokens(ids)

    def predict_codes(
        self, hidden: torch.Tensor, first: torch.Tensor, pick: CodePicker
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' frames [rows, groups] from the talker's last hidden states [rows, hidden] and
        their first codes [rows], and the frames' summed code embeddings [rows, hidden]."""
        rest, embeds = self.code_predictor.predict(hidden, self.codec_embeds(first), pick)
        return torch.cat((first[:, None], rest), dim=1), embeds

    def audio_stream(self, context: torch.Tensor | None) -> CodecStream:
        """A Code2Wav stream started on `context` frames [groups, c] (None: none)."""
        return self.code2wav.stream(context)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensors named as the checkpoint names them after `talker.`, and Code2Wav's under
        `code2wav.`; one no part takes is a ValueError naming it."""
        rest: dict[str, torch.Tensor] = {}

        def decoder() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                ours = decoder_name(name)
                if ours is None:
                    rest[name] = tensor
                else:
                    yield ours, tensor

        self.decoder.load_weights(decoder())
        copy_weights(self.text_projection, take(rest, "text_projection."), "text projection")
        copy_weights(self.hidden_projection, take(rest, "hidden_projection."), "hidden projection")
        copy_weights(self.code_predictor, take(rest, "code_predictor."), "code predictor")
        self.code2wav.load_weights(take(rest, "code2wav.", strip=False))
        if rest:
            raise ValueError(f"checkpoint tensor 'talker.{next(iter(rest))}' belongs to no part")
