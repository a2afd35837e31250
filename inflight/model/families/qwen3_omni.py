"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`): a thinker that answers in text, and a
talker that may speak its answer.

The thinker is a Qwen3-MoE decoder with interleaved M-RoPE (`LlamaForCausalLM`); it is this
model as the runtime's model runner runs it. The talker (`speech/talker.py`: its decoder, the
projections into its width, the code predictor and Code2Wav) is built beside it unless the
config has no talker (`ModelConfig.talker` None: the checkpoint's `enable_audio_output` is
false, or a deployment that serves text only dropped it); a runtime runs it with a model
runner of its own. Checkpoint tensors are named `thinker.*`, `talker.*` and `code2wav.*`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from inflight.model.config import ModelConfig, MoEConfig, TalkerConfig
from inflight.model.encoders.qwen3_omni_audio import qwen3_omni_audio_from_hf
from inflight.model.encoders.qwen3_omni_vision import qwen3_omni_vision_from_hf
from inflight.model.families.llama import AroundDecoder, LlamaForCausalLM, llama_from_hf
from inflight.model.families.qwen_moe import sparse_layers
from inflight.model.layers.parallel import TensorParallel
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import LinearMethods
from inflight.model.registry import Family, register
from inflight.model.speech.talker import Talker

_TEXT_IDS = {
    "im_start": "im_start_token_id",
    "im_end": "im_end_token_id",
    "user": "user_token_id",
    "assistant": "assistant_token_id",
    "system": "system_token_id",
    "tts_pad": "tts_pad_token_id",
    "tts_bos": "tts_bos_token_id",
    "tts_eos": "tts_eos_token_id",
}
_MEDIA_IDS = {"audio": "audio_token_id", "image": "image_token_id", "video": "video_token_id"}
_CODEC_IDS = {
    "pad": "codec_pad_id",
    "bos": "codec_bos_id",
    "eos": "codec_eos_token_id",
    "nothink": "codec_nothink_id",
    "think_bos": "codec_think_bos_id",
    "think_eos": "codec_think_eos_id",
}


def _moe_decoder(cfg: dict[str, Any], shared: bool) -> ModelConfig:
    """A Qwen3-MoE decoder of the bundle, its M-RoPE interleaved; the talker's layers are all
    sparse, with a shared expert gated by a sigmoid."""
    base = llama_from_hf({**cfg, "model_type": "qwen3_moe"}, "qwen3")
    section = base.rope.mrope_section
    if section is None:
        raise ValueError("a Qwen3-Omni decoder config needs rope mrope_section")
    rope = replace(base.rope, mrope_interleaved=True)
    shared_size = cfg.get("shared_expert_intermediate_size", 0) if shared else 0
    moe = MoEConfig(
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        sparse_layers=tuple(range(cfg["num_hidden_layers"])) if shared else sparse_layers(cfg),
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        shared_intermediate_size=shared_size,
        shared_gate=bool(shared_size),
    )
    return replace(base, family="qwen3_omni", rope=rope, moe=moe)


def _talker_config(cfg: dict[str, Any], thinker: dict[str, Any]) -> TalkerConfig:
    talker = cfg["talker_config"]
    groups = talker["num_code_groups"]
    predictor = talker["code_predictor_config"]
    theta = (predictor.get("rope_parameters") or {}).get(
        "rope_theta", predictor.get("rope_theta", 10000.0)
    )
    plain = {k: v for k, v in predictor.items() if k not in ("rope_scaling", "rope_parameters")}
    code_predictor = llama_from_hf({**plain, "rope_theta": theta, "model_type": "qwen3"}, "qwen3")
    return TalkerConfig(
        decoder=_moe_decoder(talker["text_config"], shared=True),
        code_predictor=code_predictor,
        num_code_groups=groups,
        thinker_hidden_size=talker["thinker_hidden_size"],
        accept_hidden_layer=talker["accept_hidden_layer"],
        text_ids={name: int(cfg[key]) for name, key in _TEXT_IDS.items()},
        media_ids={name: int(thinker[key]) for name, key in _MEDIA_IDS.items()},
        codec_ids={name: int(talker[key]) for name, key in _CODEC_IDS.items()},
        speakers={k.lower(): int(v) for k, v in (talker.get("speaker_id") or {}).items()},
        code2wav=dict(cfg.get("code2wav_config") or {}),
    )


def _from_hf(cfg: dict[str, Any]) -> ModelConfig:
    thinker = cfg["thinker_config"]
    text = dict(thinker["text_config"])
    text.setdefault("tie_word_embeddings", thinker.get("tie_word_embeddings", False))
    config = replace(
        _moe_decoder(text, shared=False),
        vision=qwen3_omni_vision_from_hf(thinker),
        audio=qwen3_omni_audio_from_hf(thinker),
    )
    talker = None
    if cfg.get("enable_audio_output", True):
        talker = _talker_config(cfg, thinker)
    return replace(config, talker=talker)


class Qwen3OmniForConditionalGeneration(AroundDecoder):
    """The thinker (the CausalLM the runtime's model runner runs) and, where the config has
    one, the talker beside it."""

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
        self.config = config
        self.thinker = LlamaForCausalLM(
            config, max_positions, platform, methods, max_loras, max_lora_rank, parallel
        )
        self.rotary = self.thinker.rotary
        self.lora = self.thinker.lora
        self.talker: Talker | None = None
        if config.talker is not None:
            if parallel is not None:
                raise ValueError(
                    "Qwen3-Omni's talker does not run under tensor parallelism: serve text "
                    "only (--no-speech)"
                )
            decoder = LlamaForCausalLM(config.talker.decoder, max_positions, platform, methods)
            self.talker = Talker(config.talker, decoder)

    def runs(self) -> LlamaForCausalLM:
        return self.thinker

    def media_encoders(self) -> dict[str, nn.Module]:
        """The thinker's encoders, each item's output [tokens, (1 + k) * hidden]: an image's
        embeddings and its k DeepStack features side by side, a clip's embeddings and zeros
        (one width, so one step packs both)."""
        encoders = self.thinker.media_encoders()
        vision = self.config.vision
        deep = len(vision.deepstack_visual_indexes) if vision is not None else 0
        if not deep:
            return encoders
        hidden = self.config.hidden_size
        return {
            kind: _SideBySide(encoder, deep, hidden, images=kind == "image")
            for kind, encoder in encoders.items()
        }

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The thinker's token embeddings [n, hidden] of ids [n] (what the talker projects)."""
        return self.thinker.embed_tokens(ids)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`thinker.*` to the thinker, `talker.*` and `code2wav.*` to the talker (skipped,
        knowingly, where the model serves text only)."""
        talker: list[tuple[str, torch.Tensor]] = []

        def thinker() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("thinker."):
                    yield name.removeprefix("thinker."), tensor
                elif name.startswith("talker."):
                    talker.append((name.removeprefix("talker."), tensor))
                elif name.startswith("code2wav."):
                    talker.append((name, tensor))
                else:
                    raise ValueError(f"checkpoint tensor {name!r} belongs to no part of the model")

        self.thinker.load_weights(thinker())
        if self.talker is not None:
            self.talker.load_weights(talker)


class _SideBySide(nn.Module):
    def __init__(self, encoder: nn.Module, deep: int, hidden: int, images: bool) -> None:
        super().__init__()
        self.encoder, self.deep, self.hidden, self.images = encoder, deep, hidden, images

    def encode(self, items: list[object]) -> list[torch.Tensor]:
        if self.images:
            return [
                torch.cat((embeds, features.transpose(0, 1).flatten(1)), dim=1)
                for embeds, features in self.encoder.encode_deepstack(items)
            ]
        return [
            torch.cat((embeds, embeds.new_zeros(embeds.shape[0], self.deep * self.hidden)), 1)
            for embeds in self.encoder.encode(items)
        ]


register(
    Family(
        "qwen3_omni",
        Qwen3OmniForConditionalGeneration,
        hf_architectures=("Qwen3OmniMoeForConditionalGeneration",),
        from_hf=_from_hf,
    )
)
