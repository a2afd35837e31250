"""GGUF loading: dequantization, llama.cpp's q/k permutation, metadata config and tokenizer."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from inflight.model.attention import TorchAttentionBackend
from inflight.model.checkpoints.gguf import GGUFCheckpoint, dequantize
from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.families.llama import gguf_layer_windows
from inflight.model.layers.linear import Linear
from inflight.model.layers.quantization import (
    PackedLinearMethod,
    Q4LinearMethod,
    StoredBlocksLinearMethod,
)

from helpers import PagedSequence, prefill_logits
from tiny_models import CHAT_TEMPLATE, VOCAB, write_tokenizer

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2

# Which stored type each kind of tensor gets, so that one file covers the common quantizations.
QTYPE = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q8_0,
    "attn_output": Q.BF16,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.F16,
    "ffn_down": Q.Q4_0,
    "output": Q.F16,
}


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the loader must undo it)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _hf_to_gguf_name(name: str) -> str:
    name = name.removeprefix("model.")
    fixed = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in fixed:
        return fixed[name]
    _, layer, *rest = name.split(".")
    part = ".".join(rest[:-1])
    table = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    return f"blk.{layer}.{table[part]}.{rest[-1]}"


def tiny_llama_writer(
    path, tokenizer_dir, arch: str, hidden: int, ffn: int, heads: int, kv_heads: int
) -> gguf.GGUFWriter:
    """A GGUF writer holding a tiny Llama's hyperparameters (LAYERS layers) and the test
    tokenizer (written to `tokenizer_dir`); the caller adds the tensors."""
    write_tokenizer(tokenizer_dir)
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    specials = {a["content"] for a in tok["added_tokens"]}
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    types = [3 if t in specials else 5 if t.startswith("<unused") else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    return w


def write_tiny_gguf(tmp_path, arch: str = "llama", extra_tensor=None, qtypes=None):
    """A tiny random llama GGUF file; `qtypes` maps a tensor's GGUF name to its stored type
    (default: by kind, from QTYPE)."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    path = tmp_path / "tiny.gguf"
    w = tiny_llama_writer(path, tmp_path, arch, HIDDEN, FFN, HEADS, KV_HEADS)
    for name, param in hf.state_dict().items():
        if "rotary" in name:
            continue
        arr = param.detach().numpy().astype(np.float32)
        gname = _hf_to_gguf_name(name)
        kind = gname.split(".")[-2]
        if kind == "attn_q":
            arr = _llama_cpp_permute(arr, HEADS)
        elif kind == "attn_k":
            arr = _llama_cpp_permute(arr, KV_HEADS)
        qtype = qtypes(gname) if qtypes else QTYPE.get(kind, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(gname, arr)
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_quantized_llama_gguf_matches_transformers(tmp_path):
    path = write_tiny_gguf(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    checkpoint = open_checkpoint(path)
    model = build_model(checkpoint, torch.float32, torch.device("cpu"), 128, quantization="none")
    ids = checkpoint.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    out = PagedSequence(model, TorchAttentionBackend(), len(ids) + 24).greedy(ids, 24)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(24):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out == seq[len(ids) :]
    # Same dequantized weights as transformers' own GGUF loader, permutation undone.
    ours = dict(GGUFCheckpoint(path).weights())
    ref = hf.state_dict()
    for name in (
        "layers.0.self_attn.q_proj.weight",
        "layers.1.self_attn.k_proj.weight",
        "embed_tokens.weight",
        "layers.0.self_attn.o_proj.weight",
    ):
        torch.testing.assert_close(ours[name], ref["model." + name], rtol=0, atol=0)


def test_stored_types_by_hugging_face_name(tmp_path):
    checkpoint = open_checkpoint(write_tiny_gguf(tmp_path))
    types = checkpoint.stored_types
    assert types["layers.0.self_attn.q_proj.weight"] == "Q4_0"
    assert types["layers.1.self_attn.k_proj.weight"] == "Q4_1"
    assert types["layers.0.mlp.up_proj.weight"] == "F16"
    assert types["embed_tokens.weight"] == "Q8_0"
    assert types["lm_head.weight"] == "F16"
    assert types["norm.weight"] == types["layers.0.input_layernorm.weight"] == "F32"
    assert set(types) == {name for name, _ in GGUFCheckpoint(checkpoint.path).weights()}


def _methods(model) -> dict[str, type]:
    return {
        name: type(module.method)
        for name, module in model.named_modules()
        if isinstance(module, Linear)
    }


def test_auto_runs_each_linear_in_the_kernel_of_its_stored_type(tmp_path):
    """Layer 0: q, k, v all Q4_1 -> 4-bit; gate and up both Q8_0 -> int8 from their stored
    blocks; down Q4_1 -> 4-bit; o F16 -> float. Layer 1: q, k, v Q4_1, Q4_1, Q8_0 and gate, up
    Q8_0, Q4_1 disagree -> float; down Q4_0 (no kernel of its own) -> float; o Q8_0 -> from its
    blocks. The head, output Q8_0 -> from its blocks."""
    layer0 = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.F16,
              "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1}  # fmt: skip
    layer1 = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q8_0,
              "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0}  # fmt: skip

    def qtypes(name: str) -> Q:
        parts = name.split(".")
        if parts[0] == "blk":
            return (layer0, layer1)[int(parts[1])].get(parts[2], Q.F32)
        return {"token_embd": Q.F16, "output": Q.Q8_0}.get(parts[0], Q.F32)

    checkpoint = open_checkpoint(write_tiny_gguf(tmp_path, qtypes=qtypes))
    cpu = torch.device("cpu")
    auto = build_model(checkpoint, torch.float32, cpu, 128, quantization="auto")
    assert _methods(auto) == {
        "layers.0.self_attn.qkv_proj": Q4LinearMethod,
        "layers.0.self_attn.o_proj": PackedLinearMethod,
        "layers.0.mlp.gate_up_proj": StoredBlocksLinearMethod,
        "layers.0.mlp.down_proj": Q4LinearMethod,
        "layers.1.self_attn.qkv_proj": PackedLinearMethod,
        "layers.1.self_attn.o_proj": StoredBlocksLinearMethod,
        "layers.1.mlp.gate_up_proj": PackedLinearMethod,
        "layers.1.mlp.down_proj": PackedLinearMethod,
        "lm_head": StoredBlocksLinearMethod,
    }
    # The weights are the file's in either model: what separates their logits is the int8
    # rounding of activations in the quantized layers.
    none = build_model(checkpoint, torch.float32, cpu, 128, quantization="none")
    ids = checkpoint.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    ours, ref = prefill_logits(auto, ids), prefill_logits(none, ids)
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min().item() > 0.99


def test_auto_leaves_mixed_and_kernel_less_types_in_float(tmp_path):
    """The default test file: no fused layer's parts share a type with a kernel (q Q4_0, k Q4_1,
    v Q8_0; gate Q4_1, up F16), down is Q4_0, o BF16 and the head F16: all float32."""
    checkpoint = open_checkpoint(write_tiny_gguf(tmp_path))
    model = build_model(checkpoint, torch.float32, torch.device("cpu"), 128, quantization="auto")
    assert set(_methods(model).values()) == {PackedLinearMethod}


def test_gguf_tokenizer_and_chat_template_from_metadata(tmp_path):
    path = write_tiny_gguf(tmp_path)
    ck = open_checkpoint(path)
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in ["The quick brown fox", "def add(a, b):\n    return a + b", "<|im_start|>user"]:
        assert ck.tokenizer.encode(text, add_special_tokens=False) == reference.encode(text).ids
    rendered = ck.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ck.tokenizer.eos_token_ids == [2]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.BF16])
def test_k_quant_tensors_dequantize_to_gguf_reference(tmp_path, qtype):
    rows, cols = 4, 256
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // block_elems * block_bytes), dtype=np.uint8)
    path = write_tiny_gguf(tmp_path, extra_tensor=("extra.weight", raw, qtype))
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "extra.weight")
    ours = dequantize(tensor)
    expected = gguf.quants.dequantize(raw, qtype)
    assert ours.shape == (rows, cols)
    # Random bytes may spell inf/NaN scales; those must come through in the same places.
    np.testing.assert_array_equal(ours, expected.astype(np.float32))


def test_unsupported_quantization_is_named(tmp_path):
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = np.zeros((2, 64 // block_elems * block_bytes), dtype=np.uint8)
    path = write_tiny_gguf(tmp_path, extra_tensor=("extra.weight", raw, Q.IQ4_NL))
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "extra.weight")
    with pytest.raises(ValueError, match="IQ4_NL"):
        dequantize(tensor)


@pytest.mark.parametrize(
    "pattern,sliding",
    [
        (None, [1, 1, 1, 1]),
        (2, [1, 0, 1, 0]),  # llama.cpp: all but every n-th layer
        ([False, True, True, False], [0, 1, 1, 0]),
    ],
)
def test_a_sliding_window_covers_the_layers_its_pattern_marks(tmp_path, pattern, sliding):
    """`{arch}.attention.sliding_window` is every layer's window, or those its
    `sliding_window_pattern` marks (a period n, or a flag per layer); none without it."""
    path = tmp_path / "windows.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(4)
    w.add_sliding_window(12)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    windows = gguf_layer_windows(GGUFCheckpoint(path))
    assert windows == tuple(12 if s else None for s in sliding)
    assert gguf_layer_windows(GGUFCheckpoint(write_tiny_gguf(tmp_path))) == ()


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path, arch="gemma")
    with pytest.raises(ValueError, match="gemma"):
        open_checkpoint(path)


def test_default_model_facts():
    ck = open_checkpoint()
    assert ck.config.family == "llama" and ck.config.tie_word_embeddings
    reader = gguf.GGUFReader(str(ck.path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == Q.Q8_0
    assert types["blk.0.attn_q.weight"] == Q.Q4_1
