"""The reference Qwen3-TTS: the `qwen-tts-compat` fork of the official package (installed with
`--no-deps` by the Makefile), made importable and correct on transformers 5.24, and tiny random
configs of its talker, code predictor, speaker encoder and 12 Hz decoder built here.

Why each part of the shim (see ../shared/reference/wave3-features.md §3.1):
- `qwen_tts/__init__` imports torchaudio, sox, onnxruntime, einops and soundfile for its 25 Hz
  tokenizer and its file I/O, none of which the 12 Hz models call (torchaudio has no wheel for
  this torch): the model files are imported here without it. They use librosa for one thing,
  the Slaney mel filterbank, which transformers' `mel_filter_bank` computes the same way.
- transformers 5.24 renames `past_key_values=` to `cache=` in every ModelOutput's __init__ and
  in generate()'s calls to forward(); the fork's outputs and forwards use the old name, and
  with only the first half mended the KV caches silently restart every step.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


def _module(name: str, path: list[str] | None = None, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    if path is not None:
        module.__path__ = path
    module.__dict__.update(attrs)
    return module


def _slaney_mel(*, sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None):
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=n_fft // 2 + 1,
        num_mel_filters=n_mels,
        min_frequency=fmin,
        max_frequency=sr / 2 if fmax is None else fmax,
        sampling_rate=sr,
        norm="slaney",
        mel_scale="slaney",
    )
    return np.ascontiguousarray(bank.T, dtype=np.float32)


def _import_modeling() -> tuple[types.ModuleType, types.ModuleType]:
    """The two model files, imported without the package's __init__ (which loads the 25 Hz
    tokenizer and its audio libraries) and with librosa standing in for the time of the import
    only: nothing else in this process sees the stand-ins."""
    # transformers probes which packages exist as it loads: before the stand-in below.
    import transformers.modeling_utils  # noqa: F401

    spec = importlib.util.find_spec("qwen_tts")
    assert spec is not None and spec.submodule_search_locations, "qwen-tts-compat is missing"
    root = list(spec.submodule_search_locations)[0]
    filters = _module("librosa.filters", mel=_slaney_mel)
    temporary = {
        "librosa": _module("librosa", [], filters=filters),
        "librosa.filters": filters,
    }
    packages = {
        "qwen_tts": _module("qwen_tts", [root]),
        "qwen_tts.inference": _module("qwen_tts.inference", [f"{root}/inference"]),
        # Only the tokenizer loader of from_pretrained uses it.
        "qwen_tts.inference.qwen3_tts_tokenizer": _module(
            "qwen_tts.inference.qwen3_tts_tokenizer", Qwen3TTSTokenizer=None
        ),
    }
    for name, module in packages.items():
        sys.modules.setdefault(name, module)
    saved = {name: sys.modules.get(name) for name in temporary}
    sys.modules.update(temporary)
    try:
        tts = importlib.import_module("qwen_tts.core.models.modeling_qwen3_tts")
        codec = importlib.import_module(
            "qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2"
        )
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return tts, codec


def _mend(mod: types.ModuleType) -> None:
    from transformers.utils import ModelOutput

    for name in ("Qwen3TTSTalkerOutputWithPast", "Qwen3TTSTalkerCodePredictorOutputWithPast"):
        old = getattr(mod, name)
        if "cache" in {f.name for f in dataclasses.fields(old)}:
            continue
        renamed = [
            (
                "cache" if f.name == "past_key_values" else f.name,
                f.type,
                dataclasses.field(default=None),
            )
            for f in dataclasses.fields(old)
        ]
        new = dataclasses.make_dataclass(name, renamed, bases=(ModelOutput,))
        new.past_key_values = property(lambda self: self.cache)
        setattr(mod, name, new)

    def renaming(forward):
        @functools.wraps(forward)  # generate() validates kwargs against the signature
        def wrapped(self, *args, **kwargs):
            if "cache" in kwargs:
                kwargs["past_key_values"] = kwargs.pop("cache")
            return forward(self, *args, **kwargs)

        wrapped.mended = True
        return wrapped

    for cls in (
        mod.Qwen3TTSTalkerForConditionalGeneration,
        mod.Qwen3TTSTalkerCodePredictorModelForConditionalGeneration,
    ):
        if not getattr(cls.forward, "mended", False):
            cls.forward = renaming(cls.forward)


@functools.cache
def reference() -> types.SimpleNamespace:
    """The fork's modules: `tts` (the talker model file), `codec` (the 12 Hz tokenizer's)."""
    tts, codec = _import_modeling()
    _mend(tts)
    return types.SimpleNamespace(tts=tts, codec=codec)


# The tiny tokenizer's (tiny_models.write_tokenizer with "assistant" a token of its own).
IM_START, IM_END = 1, 2
TTS_TOKENS = {"tts_pad_token_id": 21, "tts_bos_token_id": 22, "tts_eos_token_id": 23}


@dataclass(frozen=True)
class Shape:
    """A Qwen3-TTS's sizes: its talker's and code predictor's decoder layers, its codebooks
    (`codebook` codes each, `groups` a frame), its text embedding, its codec decoder."""

    talker: dict
    predictor: dict
    codebook: int
    groups: int
    text_vocab: int
    text_hidden: int
    decoder: dict


_TINY_LAYER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 512,
    "pad_token_id": None,
}
TINY = Shape(
    talker=_TINY_LAYER,
    predictor=_TINY_LAYER,
    codebook=64,
    groups=4,
    text_vocab=320,
    text_hidden=32,
    decoder={
        "codebook_size": 64,
        "codebook_dim": 32,
        "hidden_size": 32,
        "latent_dim": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_quantizers": 4,
        "decoder_dim": 32,
        "sliding_window": 72,
    },
)
CODEBOOK, GROUPS = TINY.codebook, TINY.groups


def tiny_config_dict(kind: str, shape: Shape = TINY) -> dict:
    """A `config.json` of a Qwen3-TTS of `tts_model_type` `kind` (tiny unless `shape`)."""
    c = shape.codebook
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tts_model_type": kind,
        "tts_model_size": "tiny",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "im_start_token_id": IM_START,
        "im_end_token_id": IM_END,
        **TTS_TOKENS,
        "speaker_encoder_config": {
            "mel_dim": 128,
            "enc_dim": shape.talker["hidden_size"],
            "enc_channels": [16, 16, 16, 16, 48],
            "enc_attention_channels": 8,
            "enc_se_channels": 8,
            "sample_rate": 24000,
        },
        "talker_config": {
            **shape.talker,
            "vocab_size": c + 1024,
            "text_vocab_size": shape.text_vocab,
            "text_hidden_size": shape.text_hidden,
            "num_code_groups": shape.groups,
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": [2, 1, 1],
                "interleaved": True,
            },
            "codec_pad_id": c + 100,
            "codec_bos_id": c + 101,
            "codec_eos_token_id": c + 102,
            "codec_think_id": c + 106,
            "codec_nothink_id": c + 107,
            "codec_think_bos_id": c + 108,
            "codec_think_eos_id": c + 109,
            "codec_language_id": {
                "english": c + 150,
                "chinese": c + 151,
                "beijing_dialect": c + 152,
            },
            "spk_id": {"vivian": c + 200, "dylan": c + 201},
            "spk_is_dialect": {"vivian": False, "dylan": "beijing_dialect"},
            "code_predictor_config": {
                **shape.predictor,
                "vocab_size": c,
                "num_code_groups": shape.groups,
            },
        },
    }


def tiny_decoder_config_dict(shape: Shape = TINY) -> dict:
    """The `decoder_config` of a 12 Hz speech tokenizer (tiny unless `shape`)."""
    return dict(shape.decoder)


def tiny_model(kind: str, seed: int = 0, shape: Shape = TINY):
    """The reference `Qwen3TTSForConditionalGeneration` with random weights."""
    ref = reference()
    torch.manual_seed(seed)
    config = ref.tts.Qwen3TTSConfig(**tiny_config_dict(kind, shape))
    return ref.tts.Qwen3TTSForConditionalGeneration(config).eval()


def tiny_decoder(seed: int = 0, shape: Shape = TINY):
    """The reference 12 Hz decoder with random weights, loud enough to compare (random init
    leaves its codebooks at zero, which decode to silence, and its output near 1e-8)."""
    ref = reference()
    cfg = ref.codec.Qwen3TTSTokenizerV2DecoderConfig(**tiny_decoder_config_dict(shape))
    torch.manual_seed(seed)
    decoder = ref.codec.Qwen3TTSTokenizerV2Decoder(cfg).eval()
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            if "embedding_sum" in name:
                p.normal_()
            elif p.dim() > 1:
                p.mul_(5)
    return decoder


def write_tiny_checkpoint(path: Path, kind: str, seed: int = 0, shape: Shape = TINY):
    """A tiny random Qwen3-TTS of `kind` written as the published layout (config.json,
    model.safetensors, the tokenizer, speech_tokenizer/ with its config and weights); returns
    the reference model and decoder holding the same weights."""
    from safetensors.torch import save_file

    from tiny_models import write_tokenizer

    model, decoder = tiny_model(kind, seed, shape), tiny_decoder(seed, shape)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(tiny_config_dict(kind, shape)))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    write_tokenizer(path, ("assistant",))
    codec = path / "speech_tokenizer"
    codec.mkdir(exist_ok=True)
    (codec / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_tts_tokenizer_12hz",
                "decoder_config": tiny_decoder_config_dict(shape),
                "output_sample_rate": 24000,
            }
        )
    )
    tensors = {f"decoder.{k}": v.contiguous() for k, v in decoder.state_dict().items()}
    tensors["encoder.unused.weight"] = torch.zeros(2)  # the Mimi encoder's: not read
    save_file(tensors, str(codec / "model.safetensors"))
    return model, decoder
