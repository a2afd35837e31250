"""A single GGUF file: model shape from its metadata, dequantized weights, and its tokenizer."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from inflight.model.checkpoints.tokenizer import SpecialTokens, Tokenizer
from inflight.model.config import ModelConfig, RopeConfig

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

QUANT_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32",
        "F16",
        "BF16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    )
)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "layers.N.").
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}

# How text is split before BPE, by `tokenizer.ggml.pre` (the pre-tokenizer llama.cpp applies).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt-2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
}

_CONTROL, _USER_DEFINED = 3, 4


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    """The gguf package's reader of a file, kept for a process that opens the same file again
    (a second LLM, a test session): parsing the metadata takes it seconds (SmolLM2's 98K
    vocabulary and merge strings, ~5 s here), and a reader is read-only (memory-mapped).
    Keyed by modification time and size, so a file rewritten in place is read anew."""
    return GGUFReader(path)


class GGUFCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        stat = path.stat()
        self.reader = _reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        self.arch = self._str("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {self.arch!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        self.tensor_names = {t.name for t in self.reader.tensors}

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _str(self, key: str) -> str:
        value = self._field(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path} lacks metadata key {key!r}")
        return value

    def config(self) -> ModelConfig:
        a = self.arch
        hidden = self._field(f"{a}.embedding_length")
        heads = self._field(f"{a}.attention.head_count")
        tokens = self._field("tokenizer.ggml.tokens") or []
        scaling = self._field(f"{a}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ValueError(f"unsupported GGUF rope scaling type {scaling!r}")
        freq_factors = None
        if "rope_freqs.weight" in self.tensor_names:
            freq_factors = tuple(float(x) for x in self._tensor("rope_freqs.weight"))
        return ModelConfig(
            family=ARCHITECTURES[a],
            vocab_size=self._field(f"{a}.vocab_size") or len(tokens),
            hidden_size=hidden,
            intermediate_size=self._field(f"{a}.feed_forward_length"),
            num_layers=self._field(f"{a}.block_count"),
            num_heads=heads,
            num_kv_heads=self._field(f"{a}.attention.head_count_kv") or heads,
            head_dim=self._field(f"{a}.attention.key_length") or hidden // heads,
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=self._field(f"{a}.context_length", 4096),
            rope=RopeConfig(
                theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
                type="linear" if scaling == "linear" else "default",
                factor=float(self._field(f"{a}.rope.scaling.factor", 1.0)),
                freq_factors=freq_factors,
            ),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            qkv_bias="blk.0.attn_q.bias" in self.tensor_names,
            o_bias="blk.0.attn_output.bias" in self.tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in self.tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensor_names,
        )

    def _tensor(self, name: str) -> np.ndarray:
        tensor = next(t for t in self.reader.tensors if t.name == name)
        return self._dequantize(tensor)

    @staticmethod
    def _dequantize(tensor: Any) -> np.ndarray:
        if tensor.tensor_type not in QUANT_TYPES:
            raise ValueError(
                f"unsupported GGUF quantization {tensor.tensor_type.name} (tensor {tensor.name}); "
                f"supported: {', '.join(sorted(q.name for q in QUANT_TYPES))}"
            )
        values = dequantize(tensor.data, tensor.tensor_type)
        shape = [int(d) for d in reversed(tensor.shape)]
        return np.array(values, dtype=np.float32).reshape(shape)  # a copy: the file is read-only

    def _hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name of a tensor of this file; None for `rope_freqs`, which is folded
        into the rope config."""
        base, _, suffix = gguf_name.rpartition(".")
        if base == "rope_freqs":
            return None
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_TENSORS:
            return f"layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{suffix}"
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file {self.path}")

    def stored_types(self) -> dict[str, str]:
        """The GGML type each tensor is stored in ("Q4_1", "Q8_0", "F32", ...), by Hugging Face
        name; from the file's header, without reading weights."""
        return {
            name: tensor.tensor_type.name
            for tensor in self.reader.tensors
            if (name := self._hf_name(tensor.name)) is not None
        }

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face-named float32 tensors, with llama.cpp's q/k row permutation undone."""
        config = self.config()
        for tensor in self.reader.tensors:
            name = self._hf_name(tensor.name)
            if name is None:
                continue
            values = self._dequantize(tensor)
            kind = tensor.name.rpartition(".")[0].split(".")[-1]
            if self.arch == "llama" and kind in ("attn_q", "attn_k"):
                heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
                values = _unpermute(values, heads)
            yield name, torch.from_numpy(values)

    def tokenizer(self) -> Tokenizer:
        kind = self._field("tokenizer.ggml.model")
        tokens: list[str] = self._field("tokenizer.ggml.tokens")
        types = self._field("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            backend = self._byte_level_bpe(tokens)
            add_bos_default = False
        elif kind == "llama":
            backend = self._sentencepiece_bpe(tokens)
            add_bos_default = True
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2, llama")
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _USER_DEFINED
            ]
        )

        def token(key: str) -> str | None:
            index = self._field(f"tokenizer.ggml.{key}")
            return None if index is None else tokens[index]

        bos = token("bos_token_id")
        if self._field("tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tokens.index(bos))],
            )
        eos_ids = [
            index
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (index := self._field(f"tokenizer.ggml.{key}")) is not None
        ]
        return Tokenizer(
            backend,
            SpecialTokens(bos=bos, eos=token("eos_token_id"), eos_ids=list(dict.fromkeys(eos_ids))),
            chat_template=self._field("tokenizer.chat_template"),
            byte_level=kind == "gpt2",
        )

    def _byte_level_bpe(self, tokens: list[str]) -> BackendTokenizer:
        pre = self._field("tokenizer.ggml.pre", "default")
        if pre not in _PRE_SPLITS:
            raise ValueError(
                f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(_PRE_SPLITS)}"
            )
        merges = [tuple(m.split(" ", 1)) for m in self._field("tokenizer.ggml.merges")]
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = BackendTokenizer(
            models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"))
        )
        splits = [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated")
            for pattern in _PRE_SPLITS[pre]
        ]
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()
        return backend

    def _sentencepiece_bpe(self, tokens: list[str]) -> BackendTokenizer:
        scores = self._field("tokenizer.ggml.scores") or [0.0] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        # A SentencePiece BPE vocabulary lists no merges: a token t = l + r with both halves in the
        # vocabulary is a merge, and merges apply in the order of the merged token's score.
        candidates = []
        for merged, score in zip(tokens, scores, strict=True):
            for cut in range(1, len(merged)):
                left, right = merged[:cut], merged[cut:]
                if left in vocab and right in vocab:
                    candidates.append((-score, vocab[left], vocab[right], left, right))
        merges = [(left, right) for *_, left, right in sorted(candidates)]
        unk = self._field("tokenizer.ggml.unknown_token_id")
        backend = BackendTokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                unk_token=None if unk is None else tokens[unk],
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        prefix = self._field("tokenizer.ggml.add_space_prefix", True)
        steps = [normalizers.Prepend("\u2581")] if prefix else []
        backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
        decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            decode.append(decoders.Strip(" ", 1, 0))
        backend.decoder = decoders.Sequence(decode)
        return backend


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's rotary halves (rows of q/k, or a bias)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
