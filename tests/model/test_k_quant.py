"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) on the CPU from their stored blocks: unpacked exactly as
gguf-py dequantizes them, each kernel exact to its math against the float matmul of those
weights, rows the same bits in any batch, and a Q4_K_M-like Llama file run by "auto" close to
its float32 self."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import LAYERS, _hf_to_gguf_name, _methods, tiny_llama_writer

from inflight.model.checkpoints import gguf as gguf_checkpoint
from inflight.model.checkpoints.gguf import GGUFCheckpoint
from inflight.model.checkpoints.loader import build_model, linear_methods, open_checkpoint
from inflight.model.kernels.cpu import blocks
from inflight.model.kernels.cpu.int8 import BLOCK, QuantizedWeight, quantize_blocks
from inflight.model.kernels.cpu.q4 import Q4Weight
from inflight.model.layers.linear import Linear, process_weights_after_loading
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import (
    Int8LinearMethod,
    PackedLinearMethod,
    StoredBlocks,
    StoredBlocksLinearMethod,
)

from helpers import prefill_logits, random_blocks, torch_threads
from tiny_models import VOCAB

pytestmark = pytest.mark.usefixtures("two_threads")  # their work split, as on two cores

TYPES = ("Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
# K = 256: one superblock; 576 is no multiple of 256, so SmolLM2-like shapes use 768 / 1536.
SHAPES = [(1, 256, 9), (7, 512, 64), (33, 768, 13), (4, 1536, 130)]


def dequantized(type_name: str, raw: np.ndarray) -> torch.Tensor:
    """gguf-py's float32 dequantization: the reference."""
    return torch.from_numpy(gguf.quants.dequantize(raw, Q[type_name]).astype(np.float32))


def _dequantize_x(x: torch.Tensor) -> torch.Tensor:
    values, scales = quantize_blocks(x)
    return (values.double().unflatten(-1, (-1, BLOCK)) * scales.double()[..., None]).flatten(-2)


@pytest.mark.parametrize("type_name", TYPES)
def test_unpacked_blocks_are_gguf_dequantization_bit_for_bit(type_name):
    """The integers and scales the kernels run, put back together in float32 as GGML does,
    equal gguf-py's dequantization exactly (Q4_K: in the 4-bit kernel's own w = d * q + m)."""
    k = 768
    raw = random_blocks(type_name, 12, k, seed=1)
    ref = dequantized(type_name, raw)
    if type_name == "Q8_0":
        q, d = blocks.unpack_q8_0(raw, k)
        back = q.float().unflatten(-1, (-1, 32)) * d[..., None]
    elif type_name == "Q5_0":
        q, d = blocks.unpack_q5_0(raw, k)
        assert q.min().item() >= -16 and q.max().item() <= 15
        back = q.float().unflatten(-1, (-1, 32)) * d[..., None]
    elif type_name == "Q4_K":
        q, d, low = blocks.unpack_q4_k(raw, k)
        back = q.float().unflatten(-1, (-1, 32)) * d[..., None] + low[..., None]
    elif type_name == "Q5_K":
        q, sc, m, d, dmin = blocks.unpack_q5_k(raw, k)
        d32 = (d.repeat_interleave(8, -1) * sc.float())[..., None]
        m32 = (dmin.repeat_interleave(8, -1) * m.float())[..., None]
        back = d32 * q.float().unflatten(-1, (-1, 32)) - m32
    else:
        q, sc, d = blocks.unpack_q6_k(raw, k)
        d16 = (d.repeat_interleave(16, -1) * sc.float())[..., None]
        back = d16 * (q.float() - 32).unflatten(-1, (-1, 16))
    assert torch.equal(back.flatten(-2), ref)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_matches_the_float_matmul_of_the_dequantized_weights(type_name, m, k, n):
    raw = random_blocks(type_name, n, k, seed=m + k + n)
    weight = blocks.block_weight(type_name, raw, k)
    kinds = {"Q8_0": QuantizedWeight, "Q5_0": QuantizedWeight, "Q4_K": Q4Weight}
    assert isinstance(weight, kinds.get(type_name, blocks.K8Weight))
    assert (weight.in_features, weight.out_features) == (k, n)
    torch.manual_seed(n)
    x, bias = torch.randn(m, k), torch.randn(n)
    out = blocks.block_linear(x, weight, bias)
    w = dequantized(type_name, raw).double()
    # The block dot products are exact integers and the weights' scales exact: against the
    # same int8-rounded activations only float32 rounding is left.
    ref = _dequantize_x(x) @ w.T + bias.double()
    assert (out.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    # Against the float matmul itself, what is left is the activations' int8 rounding.
    full = x.double() @ w.T + bias.double()
    assert (out.double() - full).abs().max().item() <= 0.03 * full.abs().max().item()


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_identical_alone_or_batched_and_across_threads(type_name):
    raw = random_blocks(type_name, 77, 512, seed=5)
    weight = blocks.block_weight(type_name, raw, 512)
    torch.manual_seed(0)
    x, bias = torch.randn(33, 512), torch.randn(77)
    with torch_threads(1):
        alone = torch.cat([blocks.block_linear(row[None], weight, bias) for row in x])
        assert torch.equal(blocks.block_linear(x, weight, bias), alone)
    with torch_threads(2):
        assert torch.equal(blocks.block_linear(x, weight, bias), alone)
        for m in (7, 16):
            for start in range(0, 33 - m + 1, m):
                got = blocks.block_linear(x[start : start + m], weight, bias)
                assert torch.equal(got, alone[start : start + m])


@pytest.mark.parametrize("type_name", ["Q5_K", "Q6_K"])
def test_long_prompts_split_by_tokens_give_the_same_rows(type_name):
    """203 tokens: the threads split the tokens instead of the weight rows (work_split.h)."""
    weight = blocks.block_weight(type_name, random_blocks(type_name, 33, 256, seed=3), 256)
    x, bias = torch.randn(203, 256, generator=torch.Generator().manual_seed(3)), torch.randn(33)
    with torch_threads(2):
        whole = blocks.block_linear(x, weight, bias)
        pieces = torch.cat(
            [blocks.block_linear(x[i : i + 37], weight, bias) for i in range(0, 203, 37)]
        )
    assert torch.equal(whole, pieces)
    # The bias is added last, to the bits the matmul alone gives.
    assert torch.equal(blocks.block_linear(x, weight) + bias, whole)


def test_refuses_what_the_format_cannot_hold():
    raw = random_blocks("Q6_K", 4, 256, seed=0)
    with pytest.raises(ValueError, match="multiple of 256, got 320"):
        blocks.block_weight("Q6_K", np.zeros((4, 210), np.uint8), 320)
    with pytest.raises(ValueError, match=r"Q6_K blocks for K=512 must be uint8 \[N, 420\]"):
        blocks.block_weight("Q6_K", raw, 512)
    with pytest.raises(ValueError, match="no native kernel runs 'Q4_1' blocks"):
        blocks.block_weight("Q4_1", raw, 256)
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        blocks.block_weight("Q5_0", np.zeros((4, 33), np.uint8), 48)
    weight = blocks.block_weight("Q6_K", raw, 256)
    with pytest.raises(ValueError, match=r"k8_linear needs float32 CPU input \[\.\.\., 256\]"):
        blocks.block_linear(torch.randn(2, 128), weight)


# A tiny Llama as llama.cpp's Q4_K_M stores one: Q4_K for most matrices, Q6_K for v and down
# (in layer 0 only, so that layer 1's qkv is all Q4_K) and the head; Q5_K for layer 1's o.
HIDDEN, FFN, HEADS, KV_HEADS = 256, 512, 4, 2


def _k_quant_type(gguf_name: str, tied: bool = False) -> Q | None:
    parts = gguf_name.split(".")
    if parts[0] == "output" or (tied and parts[0] == "token_embd"):
        return Q.Q6_K
    if parts[0] != "blk" or parts[-1] != "weight" or "norm" in parts[2]:
        return None
    if parts[2] in ("attn_v", "ffn_down") and parts[1] == "0":
        return Q.Q6_K
    if parts[2] == "attn_output" and parts[1] == "1":
        return Q.Q5_K
    return Q.Q4_K


def write_k_quant_gguf(tmp_path, tied: bool = False):
    """The file; `tied`: no output tensor, the head is the (Q6_K) embedding."""
    path = tmp_path / "tiny-k.gguf"
    w = tiny_llama_writer(path, tmp_path, "llama", HIDDEN, FFN, HEADS, KV_HEADS)
    head_dim, kv = HIDDEN // HEADS, KV_HEADS * HIDDEN // HEADS
    shapes = {"embed_tokens.weight": (VOCAB, HIDDEN), "norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        for part, shape in {
            "input_layernorm": (HIDDEN,),
            "post_attention_layernorm": (HIDDEN,),
            "self_attn.q_proj": (HEADS * head_dim, HIDDEN),
            "self_attn.k_proj": (kv, HIDDEN),
            "self_attn.v_proj": (kv, HIDDEN),
            "self_attn.o_proj": (HIDDEN, HIDDEN),
            "mlp.gate_proj": (FFN, HIDDEN),
            "mlp.up_proj": (FFN, HIDDEN),
            "mlp.down_proj": (HIDDEN, FFN),
        }.items():
            shapes[f"model.layers.{i}.{part}.weight"] = shape
    rng = np.random.default_rng(0)
    for seed, (name, shape) in enumerate(shapes.items()):
        gname = _hf_to_gguf_name(name if name.startswith("model.") else f"model.{name}")
        qtype = _k_quant_type(gname, tied)
        if qtype is None:  # the embedding and norms
            scale = 0.3 if len(shape) == 2 else 0.05
            values = (1.0 if len(shape) == 1 else 0.0) + scale * rng.standard_normal(shape)
            w.add_tensor(gname, values.astype(np.float32))
        else:
            # d of 3e-4..2e-3: weights of std ~0.2; larger ones make a random model chaotic
            raw = random_blocks(qtype.name, shape[0], shape[1], seed, decades=(-3.5, -3))
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    return write_k_quant_gguf(tmp_path_factory.mktemp("blocks"))


def test_stored_blocks_are_the_loaded_weights_rows(k_quant_file):
    """The raw rows handed to the K-quant layers are in the order of the float tensors the
    loader yields: llama.cpp's q/k permutation undone on the blocks too."""
    gguf_file = GGUFCheckpoint(k_quant_file)
    weights = dict(gguf_file.weights())
    for name in (
        "layers.0.self_attn.q_proj.weight",
        "layers.1.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.1.self_attn.o_proj.weight",
        "lm_head.weight",
    ):
        type_name, blocks = gguf_file.stored_blocks(name)
        assert type_name == gguf_file.stored_types()[name]
        assert torch.equal(dequantized(type_name, blocks), weights[name]), name
    with pytest.raises(KeyError, match="absent"):
        gguf_file.stored_blocks("absent.weight")


def test_auto_runs_k_quants_from_their_blocks_close_to_float32(k_quant_file, monkeypatch):
    checkpoint = open_checkpoint(k_quant_file)
    cpu = torch.device("cpu")
    dequantized_at_load = []
    dequantize = gguf_checkpoint.dequantize

    def recording(tensor):
        dequantized_at_load.append(tensor.name)
        return dequantize(tensor)

    with monkeypatch.context() as patch:
        patch.setattr(gguf_checkpoint, "dequantize", recording)
        auto = build_model(checkpoint, torch.float32, cpu, 128, quantization="auto")
    # No K-quant tensor is dequantized to float: the embedding and norms (F32) alone are read.
    assert sorted(dequantized_at_load) == sorted(
        n
        for n in GGUFCheckpoint(k_quant_file).tensor_names
        if n == "token_embd.weight" or "norm" in n
    )
    methods = _methods(auto)
    assert methods == {name: StoredBlocksLinearMethod for name in methods}
    attn0, attn1 = auto.layers[0].self_attn, auto.layers[1].self_attn
    # Layer 0's qkv: q and k (Q4_K) in the 4-bit kernel, v (Q6_K) in k8; layer 1's all Q4_K.
    assert [type(w) for w in attn0.qkv_proj.prepared] == [Q4Weight, blocks.K8Weight]
    assert [w.out_features for w in attn0.qkv_proj.prepared] == [HIDDEN + HIDDEN // 2, HIDDEN // 2]
    assert [type(w) for w in attn1.qkv_proj.prepared] == [Q4Weight]
    assert [type(w) for w in attn1.o_proj.prepared] == [blocks.K8Weight]  # Q5_K
    assert auto.layers[0].self_attn.qkv_proj.weight is None
    none = build_model(checkpoint, torch.float32, cpu, 128, quantization="none")
    assert set(_methods(none).values()) == {PackedLinearMethod}
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, ref = prefill_logits(auto, ids), prefill_logits(none, ids)
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    # The weights are the file's in both: only the int8 rounding of activations separates them.
    # Measured: mean cosine 0.9997, worst position 0.992, argmax agreement 1.0 (the int8
    # method, re-quantizing the same weights: 0.9998, 0.9987, 1.0).
    assert cosine.mean().item() > 0.999
    assert cosine.min().item() > 0.98
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9
    # Explicit "int8" keeps its meaning: it re-quantizes the dequantized floats.
    int8 = build_model(checkpoint, torch.float32, cpu, 128, quantization="int8")
    assert set(_methods(int8).values()) == {Int8LinearMethod}


def _fused_layer(raws: dict[str, tuple[str, np.ndarray]], k: int, bias: bool) -> Linear:
    """A layer of the parts `raws` ({name: (type, raw rows)}) run from their blocks, loaded
    (a random bias where asked)."""
    method = StoredBlocksLinearMethod(
        lambda name: StoredBlocks(*raws[name]), {t for t, _ in raws.values()}
    )
    rows = sum(raw.shape[0] for _, raw in raws.values())
    layer = Linear(k, rows, bias, method, sources=tuple(raws))
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(rows, generator=torch.Generator().manual_seed(0)))
    process_weights_after_loading(layer)
    return layer


def test_mixed_parts_each_write_their_slice_bias_included():
    """A fused layer of Q4_K, Q4_K, Q6_K parts with a bias: the Q4_K parts run as one weight,
    the Q6_K part as another, each with its slice of the bias."""
    k = 512
    raws = {
        "a.weight": ("Q4_K", random_blocks("Q4_K", 24, k, seed=1)),
        "b.weight": ("Q4_K", random_blocks("Q4_K", 8, k, seed=2)),
        "c.weight": ("Q6_K", random_blocks("Q6_K", 16, k, seed=3)),
    }
    layer = _fused_layer(raws, k, bias=True)
    assert [type(w) for w in layer.prepared] == [Q4Weight, blocks.K8Weight]
    assert [w.out_features for w in layer.prepared] == [32, 16]
    torch.manual_seed(0)
    x = torch.randn(3, 5, k)
    out = layer(x)
    assert out.shape == (3, 5, 48)
    w = torch.cat([dequantized(t, raw) for t, raw in raws.values()]).double()
    ref = _dequantize_x(x) @ w.T + layer.bias.double()
    assert (out.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_parts_of_one_kernel_are_stacked_into_one_weight():
    """llama.cpp's fallbacks for rows not a multiple of 256 long (SmolLM2's 576): Q5_0 q/k
    beside a Q8_0 v run as one int8 weight, equal to the three parts run alone."""
    k = 576
    raws = {
        "q.weight": ("Q5_0", random_blocks("Q5_0", 24, k, seed=1)),
        "k.weight": ("Q5_0", random_blocks("Q5_0", 8, k, seed=2)),
        "v.weight": ("Q8_0", random_blocks("Q8_0", 8, k, seed=3)),
    }
    layer = _fused_layer(raws, k, bias=False)
    assert [type(w) for w in layer.prepared] == [QuantizedWeight]
    assert not layer.prepared[0].small  # the Q8_0 part's values are not small
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    alone = [blocks.block_linear(x, blocks.block_weight(t, raw, k)) for t, raw in raws.values()]
    assert torch.equal(layer(x), torch.cat(alone, dim=-1))


def test_tensor_parallel_shards_leave_k_quants_in_float(k_quant_file):
    """A shard's rows are no whole tensor's blocks: under tensor parallelism K-quant layers
    take the float path."""
    checkpoint = open_checkpoint(k_quant_file)
    platform = Platform.detect(torch.device("cpu"), torch.float32)
    sources = ["layers.1.self_attn.q_proj.weight"]
    assert isinstance(
        linear_methods("auto", platform, checkpoint, False).choose(HIDDEN, sources),
        StoredBlocksLinearMethod,
    )
    sharded = linear_methods("auto", platform, checkpoint, True)
    assert isinstance(sharded.choose(HIDDEN, sources), PackedLinearMethod)


def test_a_tied_k_quant_head_runs_from_the_embeddings_blocks(tmp_path):
    """No output tensor: the head computes with the Q6_K embedding's blocks, while the
    embedding itself is loaded in float."""
    checkpoint = open_checkpoint(write_k_quant_gguf(tmp_path, tied=True))
    assert checkpoint.config.tie_word_embeddings
    cpu = torch.device("cpu")
    auto = build_model(checkpoint, torch.float32, cpu, 128, quantization="auto")
    assert isinstance(auto.lm_head.method, StoredBlocksLinearMethod)
    assert [type(w) for w in auto.lm_head.prepared] == [blocks.K8Weight]
    none = build_model(checkpoint, torch.float32, cpu, 128, quantization="none")
    assert torch.equal(auto.embed_tokens.weight, none.embed_tokens.weight)
    # The head alone (the random model's own logits swing with the int8 rounding at a few
    # positions): exact to its math on the embedding's weights.
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    ref = _dequantize_x(hidden) @ none.embed_tokens.weight.double().T
    out = auto.lm_head(hidden).double()
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
