"""Qwen3-TTS (`Qwen3TTSForConditionalGeneration`, PyPI `qwen-tts`): text in, speech out.

The talker is a Qwen3 decoder over the codec vocabulary: its embedding table is the codec
embedding and its head predicts a frame's first code. What it reads at each position is not a
token's embedding but a sum the runtime builds: projected text rows (the text embedding and
`text_projection`) plus codec rows, a preset speaker's or a cloned voice's x-vector among them
at the prefill, and each generated frame's summed code embeddings with the next text row after
it. The code predictor (`speech/code_predictor.py`) fills a frame's other codebooks; the
speech tokenizer's decoder (`speech/codec_decoder.py`, from the checkpoint's `speech_tokenizer/`
directory) turns frames into 24 kHz audio; `base` models carry the speaker encoder
(`speech/speaker_encoder.py`) that clones a voice from reference audio.

The talker's M-RoPE gives a text-only sequence the same rotation in all three sections, which
is plain RoPE: positions here are 1-D.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from inflight.model.config import ModelConfig, SpeechConfig
from inflight.model.families.llama import AroundDecoder, LlamaForCausalLM, llama_from_hf
from inflight.model.layers.parallel import TensorParallel
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import LinearMethods
from inflight.model.registry import Family, register
from inflight.model.speech.code_predictor import CodePicker, CodePredictor
from inflight.model.speech.codec_decoder import CodecDecoder, CodecDecoderConfig, CodecStream
from inflight.model.speech.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig
from inflight.model.speech.talker import ProjectionMLP, decoder_name, take
from inflight.model.weights import copy_weights

KINDS = ("custom_voice", "voice_design", "base")
_TEXT_IDS = {
    "im_start": "im_start_token_id",
    "im_end": "im_end_token_id",
    "tts_pad": "tts_pad_token_id",
    "tts_bos": "tts_bos_token_id",
    "tts_eos": "tts_eos_token_id",
}
_CODEC_IDS = {
    "pad": "codec_pad_id",
    "bos": "codec_bos_id",
    "eos": "codec_eos_token_id",
    "think": "codec_think_id",
    "nothink": "codec_nothink_id",
    "think_bos": "codec_think_bos_id",
    "think_eos": "codec_think_eos_id",
}


def _decoder_config(cfg: dict[str, Any], what: str) -> ModelConfig:
    """A Qwen3-shaped decoder's ModelConfig, its M-RoPE read as the plain RoPE it is here."""
    scaling = dict(cfg.get("rope_scaling") or {})
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"{what}: unsupported rope_scaling {scaling}")
    plain = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")}
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    return llama_from_hf({**plain, "rope_theta": theta, "model_type": "qwen3"}, "qwen3")


def _from_hf(cfg: dict[str, Any]) -> ModelConfig:
    kind = cfg.get("tts_model_type")
    if kind not in KINDS:
        raise ValueError(f"Qwen3-TTS tts_model_type {kind!r} is not one of {', '.join(KINDS)}")
    if cfg.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
        raise ValueError(
            f"Qwen3-TTS speech tokenizer {cfg['tokenizer_type']!r} is not supported; "
            "supported: qwen3_tts_tokenizer_12hz"
        )
    tokenizer = cfg.get("speech_tokenizer_config")
    if tokenizer is None:
        raise ValueError("a Qwen3-TTS checkpoint needs its speech_tokenizer/config.json")
    talker = cfg["talker_config"]
    groups = talker["num_code_groups"]
    predictor = _decoder_config(
        {**talker["code_predictor_config"], "num_code_groups": groups}, "code_predictor_config"
    )
    speech = SpeechConfig(
        kind=kind,
        num_code_groups=groups,
        text_vocab_size=talker["text_vocab_size"],
        text_hidden_size=talker["text_hidden_size"],
        text_ids={name: int(cfg[key]) for name, key in _TEXT_IDS.items()},
        codec_ids={name: int(talker[key]) for name, key in _CODEC_IDS.items()},
        speakers={k.lower(): int(v) for k, v in (talker.get("spk_id") or {}).items()},
        languages={k.lower(): int(v) for k, v in (talker.get("codec_language_id") or {}).items()},
        dialects={
            k.lower(): v.lower() for k, v in (talker.get("spk_is_dialect") or {}).items() if v
        },
        code_predictor=predictor,
        codec_decoder=dict(tokenizer.get("decoder_config") or {}),
        speaker_encoder=dict(cfg.get("speaker_encoder_config") or {}) if kind == "base" else None,
        sample_rate=int(tokenizer.get("output_sample_rate", 24000)),
    )
    base = _decoder_config(talker, "talker_config")
    return replace(base, family="qwen3_tts", speech=speech)


class Qwen3TTSForSpeech(AroundDecoder):
    """The talker (a `LlamaForCausalLM` over the codec vocabulary, run by the runtime like any
    decoder) and the speech parts around it."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        platform: Platform,
        methods: LinearMethods,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        speech = config.speech
        assert speech is not None
        if parallel is not None:
            raise ValueError("Qwen3-TTS does not run under tensor parallelism")
        self.config = config
        self.speech = speech
        self.talker = LlamaForCausalLM(config, max_positions, platform, methods, max_loras)
        self.rotary = self.talker.rotary
        self.lora = self.talker.lora
        self.text_embedding = nn.Embedding(speech.text_vocab_size, speech.text_hidden_size)
        width = speech.text_hidden_size
        self.text_projection = ProjectionMLP(width, width, config.hidden_size)
        self.code_predictor = CodePredictor(
            speech.code_predictor, speech.num_code_groups, config.hidden_size
        )
        self.codec_decoder = CodecDecoder(CodecDecoderConfig.from_dict(speech.codec_decoder))
        self.speaker_encoder: SpeakerEncoder | None = None
        if speech.speaker_encoder is not None:
            encoder_config = SpeakerEncoderConfig.from_dict(speech.speaker_encoder)
            self.speaker_encoder = SpeakerEncoder(encoder_config)

    # -- the CausalLM contract: the talker's --------------------------------------------------

    def runs(self) -> LlamaForCausalLM:
        return self.talker

    # -- the speech parts ---------------------------------------------------------------------

    @torch.inference_mode()
    def text_embeds(self, ids: torch.Tensor) -> torch.Tensor:
        """Projected text rows [n, hidden] of text token ids [n]."""
        return self.text_projection(self.text_embedding(ids))

    @torch.inference_mode()
    def codec_embeds(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec rows [n, hidden] of codec ids [n] (the talker's embedding table)."""
        return self.talker.embed_tokens(ids)

    def predict_codes(
        self, hidden: torch.Tensor, first: torch.Tensor, pick: CodePicker
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' frames [rows, groups] from the talker's last hidden states [rows, hidden] and
        their first codes [rows], and the frames' embeddings [rows, hidden] (each frame's codes'
        rows summed: the talker's next input, less its text row)."""
        rest, embeds = self.code_predictor.predict(hidden, self.codec_embeds(first), pick)
        return torch.cat((first[:, None], rest), dim=1), embeds

    @torch.inference_mode()
    def speaker_embedding(self, samples: torch.Tensor, sample_rate: int) -> torch.Tensor:
        """A voice's x-vector [hidden] from reference audio (base models)."""
        if self.speaker_encoder is None:
            raise ValueError(f"a {self.speech.kind} model clones no voice")
        return self.speaker_encoder.embed(samples, sample_rate)

    def audio_stream(self, context: torch.Tensor | None) -> CodecStream:
        """A codec decoder stream started on `context` frames [groups, c] (None: none), which
        pushed frames give their samples."""
        return self.codec_decoder.stream(context)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The talker's tensors go to the decoder under their Llama names; the others to
        their parts. A tensor no part takes is a ValueError naming it."""
        rest: dict[str, torch.Tensor] = {}

        def talker() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if "rotary_emb" in name:
                    continue
                ours = (
                    decoder_name(name.removeprefix("talker."))
                    if name.startswith("talker.")
                    else None
                )
                if ours is None:
                    rest[name] = tensor
                else:
                    yield ours, tensor

        self.talker.load_weights(talker())
        text_embedding = take(rest, "talker.model.text_embedding.")
        copy_weights(self.text_embedding, text_embedding, "text embedding")
        copy_weights(self.text_projection, take(rest, "talker.text_projection."), "text projection")
        copy_weights(self.code_predictor, take(rest, "talker.code_predictor."), "code predictor")
        self.codec_decoder.load_weights(take(rest, "speech_tokenizer."))
        if self.speaker_encoder is not None:
            self.speaker_encoder.load_weights(take(rest, "speaker_encoder.", strip=False))
        if rest:
            raise ValueError(f"checkpoint tensor {next(iter(rest))!r} belongs to no part")


register(
    Family(
        "qwen3_tts",
        Qwen3TTSForSpeech,
        hf_architectures=("Qwen3TTSForConditionalGeneration",),
        from_hf=_from_hf,
    )
)
