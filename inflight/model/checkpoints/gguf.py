"""A single GGUF file: model shape from its metadata, dequantized weights, and its tokenizer."""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from inflight.model.checkpoints.tokenizer import SpecialTokens, Tokenizer
from inflight.model.config import (
    MAMBA_CHUNK_SIZES,
    NEMOTRON_H_TIME_STEP_MIN,
    MambaConfig,
    ModelConfig,
    RopeConfig,
    hybrid_config,
)
from inflight.model.layers.quantization import StoredBlocks

# llama.cpp's architecture name -> our family. `granitehybrid` is what llama.cpp's converter
# makes of BambaForCausalLM (and of IBM's Granite 4.0-H, whose multipliers and experts are
# refused below).
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "nemotron_h": "nemotron_h",
    "granitehybrid": "bamba",
}
HYBRID_ARCHITECTURES = ("nemotron_h", "granitehybrid")

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

# A hybrid layer's tensors (after "blk.N.") -> HybridForCausalLM's parameters (after "layers.N.").
# The Mamba2 mixer's A, D and dt bias are stored without a ".weight"/".bias" of their own.
_HYBRID_LAYER_TENSORS = {
    "attn_norm.weight": "norm.weight",
    "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D",
    "ssm_dt.bias": "mixer.dt_bias",
    **{
        f"{gguf}.{suffix}": f"mixer.{ours}.{suffix}"
        for gguf, ours in (
            ("ssm_in", "in_proj"),
            ("ssm_conv1d", "conv1d"),
            ("ssm_norm", "norm"),
            ("ssm_out", "out_proj"),
            ("attn_q", "q_proj"),
            ("attn_k", "k_proj"),
            ("attn_v", "v_proj"),
            ("attn_output", "o_proj"),
        )
        for suffix in ("weight", "bias")
    },
}
# The MLPs: Bamba's follows every layer's mixer (SwiGLU, its own norm); NemotronH's (relu², no
# gate) is a layer's mixer.
_HYBRID_MLP_TENSORS = {
    "bamba": {
        "ffn_norm": "mlp_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    "nemotron_h": {"ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj"},
}
# Granite's multipliers, as llama.cpp's converter writes transformers' embedding_multiplier,
# residual_multiplier and logits_scaling (llama.cpp skips a product whose key is absent or 0).
# Bamba has none, nor does our hybrid model.
_GRANITE_SCALES = ("embedding_scale", "residual_scale", "logit_scale")

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
        self.arch = self._required("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {self.arch!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        self.tensor_names = {t.name for t in self.reader.tensors}

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _required(self, key: str) -> Any:
        value = self._field(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path} lacks metadata key {key!r}")
        return value

    def config(self) -> ModelConfig:
        if self.arch in HYBRID_ARCHITECTURES:
            return self._hybrid_config()
        a = self.arch
        hidden = self._field(f"{a}.embedding_length")
        heads = self._field(f"{a}.attention.head_count")
        return ModelConfig(
            family=ARCHITECTURES[a],
            vocab_size=self._vocab_size(),
            hidden_size=hidden,
            intermediate_size=self._field(f"{a}.feed_forward_length"),
            num_layers=self._field(f"{a}.block_count"),
            num_heads=heads,
            num_kv_heads=self._field(f"{a}.attention.head_count_kv") or heads,
            head_dim=self._field(f"{a}.attention.key_length") or hidden // heads,
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=self._field(f"{a}.context_length", 4096),
            rope=self._rope(),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            qkv_bias="blk.0.attn_q.bias" in self.tensor_names,
            o_bias="blk.0.attn_output.bias" in self.tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in self.tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensor_names,
        )

    def _vocab_size(self) -> int:
        return self._field(f"{self.arch}.vocab_size") or len(
            self._field("tokenizer.ggml.tokens") or []
        )

    def _rope(self) -> RopeConfig:
        a = self.arch
        scaling = self._field(f"{a}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ValueError(f"unsupported GGUF rope scaling type {scaling!r}")
        freq_factors = None
        if "rope_freqs.weight" in self.tensor_names:
            freq_factors = tuple(float(x) for x in self._tensor("rope_freqs.weight"))
        return RopeConfig(
            theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            type="linear" if scaling == "linear" else "default",
            factor=float(self._field(f"{a}.rope.scaling.factor", 1.0)),
            freq_factors=freq_factors,
        )

    def _per_layer(self, key: str, layers: int) -> list[int]:
        """A per-layer metadata value: llama.cpp writes an array where layers differ."""
        value = self._required(key)
        values = list(value) if isinstance(value, list) else [value] * layers
        if len(values) != layers:
            raise ValueError(f"GGUF {key} lists {len(values)} layers, block_count {layers}")
        return values

    @staticmethod
    def _one_size(key: str, values: list[int]) -> int:
        """The one nonzero value of a per-layer array (0: none); layers of one kind that differ
        in size are not supported."""
        sizes = set(values) - {0}
        if len(sizes) > 1:
            raise ValueError(f"GGUF {key} differs across layers {sorted(sizes)}: not supported")
        return sizes.pop() if sizes else 0

    def _has_bias(self, kind: str) -> bool:
        """Whether any layer's `kind` tensor has a bias (a hybrid's layer 0 may lack `kind`)."""
        return any(name.endswith(f".{kind}.bias") for name in self.tensor_names)

    def _hybrid_config(self) -> ModelConfig:
        """A NemotronH or Bamba config from llama.cpp's metadata. A layer's kind is what llama.cpp
        makes of it: recurrent where it has no KV heads (and, NemotronH, no FFN); NemotronH's
        layers with an FFN are MLPs."""
        a, family = self.arch, ARCHITECTURES[self.arch]
        self._refuse_experts()
        layers = self._required(f"{a}.block_count")
        hidden = self._required(f"{a}.embedding_length")
        kv_key, ffn_key = f"{a}.attention.head_count_kv", f"{a}.feed_forward_length"
        kv, ffn = self._per_layer(kv_key, layers), self._per_layer(ffn_key, layers)
        if family == "nemotron_h":
            kinds = [
                "mlp" if f else "attention" if k else "mamba" for k, f in zip(kv, ffn, strict=True)
            ]
        else:
            kinds = ["attention" if k else "mamba" for k in kv]
        heads_key = f"{a}.attention.head_count"
        heads = self._one_size(heads_key, self._per_layer(heads_key, layers))
        kv_heads = self._one_size(kv_key, kv) or heads
        head_dim = self._field(f"{a}.attention.key_length") or hidden // heads
        self._refuse_granite_scales(head_dim)
        n_heads = self._required(f"{a}.ssm.time_step_rank")  # the converter writes the head count
        inner = self._required(f"{a}.ssm.inner_size")
        if inner % n_heads:
            raise ValueError(
                f"GGUF {a}.ssm.inner_size {inner} is no multiple of its {n_heads} heads"
            )
        # One epsilon for every norm, the mixer's too. llama.cpp reads the RMS key, which the
        # converter writes from rms_norm_eps; NemotronH's configs may name it layer_norm_epsilon
        # only, which the converter writes as the plain key.
        eps = float(
            self._field(
                f"{a}.attention.layer_norm_rms_epsilon",
                self._field(f"{a}.attention.layer_norm_epsilon", 1e-5),
            )
        )
        partial_rotary_factor = 0.0  # NemotronH's attention has no RoPE
        # Granite runs RoPE where rope.scaling.finetuned says so (llama.cpp's default: it does),
        # on the leading rope.dimension_count values of a head: the converter writes Bamba's
        # attn_rotary_emb there, half a head.
        if family == "bamba" and self._field(f"{a}.rope.scaling.finetuned", True):
            partial_rotary_factor = self._field(f"{a}.rope.dimension_count", head_dim) / head_dim
        mamba = MambaConfig(
            layer_types=tuple(kinds),
            n_heads=n_heads,
            head_dim=inner // n_heads,
            n_groups=self._required(f"{a}.ssm.group_count"),
            d_state=self._required(f"{a}.ssm.state_size"),
            d_conv=self._required(f"{a}.ssm.conv_kernel"),
            # GGUF keeps no scan block length: transformers' default of the family.
            chunk_size=MAMBA_CHUNK_SIZES[family],
            conv_bias=self._has_bias("ssm_conv1d"),
            proj_bias=self._has_bias("ssm_in"),
            norm_eps=eps,
            # As transformers, not llama.cpp: ggml's ssm_scan takes softplus(dt + dt_bias) as it
            # is, transformers' NemotronH clamps it from below at time_step_min, which the
            # converter does not write (its default then, as for a config.json without it).
            time_step_limit=(
                NEMOTRON_H_TIME_STEP_MIN if family == "nemotron_h" else 0.0,
                float("inf"),
            ),
            partial_rotary_factor=partial_rotary_factor,
        )
        config = ModelConfig(
            family=family,
            vocab_size=self._vocab_size(),
            hidden_size=hidden,
            intermediate_size=self._one_size(ffn_key, ffn),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            max_position_embeddings=self._field(f"{a}.context_length", 4096),
            rope=self._rope(),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            qkv_bias=self._has_bias("attn_q"),
            o_bias=self._has_bias("attn_output"),
            mlp_bias=self._has_bias("ffn_up"),
        )
        return hybrid_config(config, mamba)

    def _refuse_experts(self) -> None:
        experts = sorted(n for n in self.tensor_names if _is_expert_tensor(n))
        count = self._field(f"{self.arch}.expert_count", 0)
        if count or experts:
            found = (
                f"e.g. tensor {experts[0]!r}" if experts else f"{self.arch}.expert_count {count}"
            )
            raise ValueError(
                f"GGUF file {self.path} has mixture-of-experts layers ({found}): not supported"
            )

    def _refuse_granite_scales(self, head_dim: int) -> None:
        a = self.arch
        for name in _GRANITE_SCALES:
            value = self._field(f"{a}.{name}")
            if value not in (None, 0.0, 1.0):
                raise ValueError(
                    f"GGUF {a}.{name} is {value}: Granite's multipliers are not supported "
                    "(neither Bamba nor NemotronH has one)"
                )
        # llama.cpp's attention scale replaces 1/sqrt(head_dim) where set and nonzero.
        scale = self._field(f"{a}.attention.scale")
        if scale and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
            raise ValueError(
                f"GGUF {a}.attention.scale is {scale}, not 1/sqrt(head_dim): Granite's "
                "attention_multiplier is not supported (neither Bamba nor NemotronH has one)"
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
        into the rope config. A hybrid's tensors take HybridForCausalLM's parameter names."""
        if self.arch in HYBRID_ARCHITECTURES:
            return self._hybrid_name(gguf_name)
        base, _, suffix = gguf_name.rpartition(".")
        if base == "rope_freqs":
            return None
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_TENSORS:
            return f"layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{suffix}"
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file {self.path}")

    def _hybrid_name(self, gguf_name: str) -> str:
        """HybridForCausalLM's parameter (before fusing): transformers' names below NemotronH's
        layers, hybrid.py's renaming of Bamba's modules. The model loads these as they are, and
        LinearMethods looks a layer's stored type up by them."""
        base, _, suffix = gguf_name.rpartition(".")
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{suffix}"
        parts = gguf_name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            layer, rest = parts[1:]
            if rest in _HYBRID_LAYER_TENSORS:
                return f"layers.{layer}.{_HYBRID_LAYER_TENSORS[rest]}"
            kind, _, suffix = rest.partition(".")
            mlp = _HYBRID_MLP_TENSORS[ARCHITECTURES[self.arch]]
            if kind in mlp and suffix in ("weight", "bias"):
                return f"layers.{layer}.{mlp[kind]}.{suffix}"
        raise ValueError(f"unexpected tensor {gguf_name!r} in {self.arch} GGUF file {self.path}")

    def stored_types(self) -> dict[str, str]:
        """The GGML type each tensor is stored in ("Q4_1", "Q8_0", "F32", ...), by Hugging Face
        name; from the file's header, without reading weights."""
        return {
            name: tensor.tensor_type.name
            for tensor in self.reader.tensors
            if (name := self._hf_name(tensor.name)) is not None
        }

    def weights(self, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """Float32 tensors by Hugging Face name (`_hf_name`), with llama.cpp's transforms undone:
        the q/k row permutation and, of hybrids, the Mamba2 reshapes; those named in `skip`
        (read as stored blocks instead) neither dequantized nor yielded."""
        config = self.config()
        hybrid = config.mamba is not None
        for tensor in self.reader.tensors:
            name = self._hf_name(tensor.name)
            if name is None or name in skip:
                continue
            values = self._unpermuted(tensor, self._dequantize(tensor), config)
            if hybrid:
                values = _undo_mamba2_layout(_layer_kind(tensor.name), values)
            yield name, torch.from_numpy(values)

    def _unpermuted(self, tensor: Any, rows: np.ndarray, config: ModelConfig) -> np.ndarray:
        """`rows` of `tensor` (its values, or its raw blocks) with llama.cpp's q/k permutation
        undone where the converter applied it: llama's, and both hybrids' attention layers (its
        GraniteHybridModel, NemotronHModel's base, hands those to LlamaModel's conversion)."""
        kind = _layer_kind(tensor.name)
        permuted = self.arch == "llama" or config.mamba is not None
        if permuted and kind in ("attn_q", "attn_k"):
            return _unpermute(rows, config.num_heads if kind == "attn_q" else config.num_kv_heads)
        return rows

    def stored_blocks(self, name: str) -> StoredBlocks:
        """The tensor of Hugging Face name `name` as the file stores it: its GGML type and raw
        rows [N, bytes] (a copy), rows in the order `weights` gives them (q/k unpermuted). Only
        for 2-D tensors whose rows are the model's rows (no Mamba2 reshape)."""
        tensor = self._by_hf_name.get(name)
        if tensor is None:
            raise KeyError(f"GGUF file {self.path} has no tensor {name!r}")
        blocks = np.asarray(tensor.data)
        if blocks.ndim != 2 or blocks.dtype != np.uint8 or _layer_kind(tensor.name) in _RESHAPED:
            raise ValueError(
                f"tensor {name!r} ({tensor.tensor_type.name}, {blocks.dtype} "
                f"{tuple(blocks.shape)}) has no raw 2-D block rows to hand out"
            )
        blocks = np.array(self._unpermuted(tensor, blocks, self._config))
        return StoredBlocks(tensor.tensor_type.name, blocks)

    @functools.cached_property
    def _config(self) -> ModelConfig:
        return self.config()

    @functools.cached_property
    def _by_hf_name(self) -> dict[str, Any]:
        return {
            name: tensor
            for tensor in self.reader.tensors
            if (name := self._hf_name(tensor.name)) is not None
        }

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


def _layer_kind(gguf_name: str) -> str:
    """What a layer's tensor is ("attn_q" of "blk.3.attn_q.weight"); "" outside the layers."""
    return gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""


def _is_expert_tensor(gguf_name: str) -> bool:
    """A mixture-of-experts tensor: the router, stacked or shared experts, expert biases."""
    kind = _layer_kind(gguf_name)
    return kind in ("ffn_gate_inp", "exp_probs_b") or kind.endswith(("_exps", "_shexp"))


# The kinds of tensor `_undo_mamba2_layout` reshapes.
_RESHAPED = ("ssm_a", "ssm_d", "ssm_norm", "ssm_conv1d")


def _undo_mamba2_layout(kind: str, values: np.ndarray) -> np.ndarray:
    """A Mamba2 mixer tensor as transformers holds it, from llama.cpp's converter's layout
    (its Mamba2Model): A as -exp(A_log) and D in columns [heads, 1], the conv weight's channel
    axis of 1 squeezed out, the gated norm's weight in rows of one group."""
    if kind == "ssm_a":
        # In float64, then rounded: the float32 nearest to log(-A).
        return np.log(-values.astype(np.float64)).astype(np.float32).reshape(-1)
    if kind in ("ssm_d", "ssm_norm"):
        return values.reshape(-1)
    if kind == "ssm_conv1d" and values.ndim == 2:  # the weight, not its bias
        return np.expand_dims(values, 1)
    return values


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's rotary halves (rows of q/k, or a bias)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
