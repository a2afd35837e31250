"""Mixture-of-experts GGUF files as llama.cpp's converter writes them (experts stacked per layer
as `ffn_{gate,up,down}_exps`, the router `ffn_gate_inp`, Qwen2-MoE's shared expert `*_shexp`;
Mixtral converted as `llama`, its q/k rows permuted), written from tiny transformers models:
the config read back, and logits within 1e-4 of transformers' (float64) with float tensors;
with quantized experts, the model equals the one loaded from their dequantized values."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import _llama_cpp_permute, tiny_llama_writer

from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.layers.quantization import Q4LinearMethod, StoredBlocksLinearMethod

from helpers import PagedSequence, assert_tracks, float32_model, prefill_logits
from tiny_models import make_tiny_moe

# family -> (GGUF architecture, the transformers checkpoint it is converted from)
FILES = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
EXPERTS, TOP_K = 8, 2

_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _gguf_tensors(hf, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names and layouts."""
    out = {}
    for name, param in hf.state_dict().items():
        value = param.detach().numpy().astype(np.float32)
        name = name.removeprefix("model.").replace("block_sparse_moe", "mlp")
        fixed = {"embed_tokens.weight": "token_embd", "norm.weight": "output_norm"}
        if name in fixed or name == "lm_head.weight":
            out[f"{fixed.get(name, 'output')}.weight"] = value
            continue
        _, layer, *rest = name.split(".")
        if rest[:2] == ["mlp", "experts"]:  # transformers 5 holds them fused: [E, 2I, H]
            if rest[2] == "gate_up_proj":
                gate, up = np.split(value, 2, axis=1)
                out[f"blk.{layer}.ffn_gate_exps.weight"] = gate
                out[f"blk.{layer}.ffn_up_exps.weight"] = up
            else:
                out[f"blk.{layer}.ffn_down_exps.weight"] = value
            continue
        kind = _NAMES[".".join(rest[:-1])]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            value = _llama_cpp_permute(value, 4 if kind == "attn_q" else 2)
        if kind == "ffn_gate_inp_shexp":
            value = value.reshape(-1)
        out[f"blk.{layer}.{kind}.{rest[-1]}"] = value
    return out


def write_moe_gguf(hf, arch: str, path, tokenizer_dir, expert_type=Q.F32, down_type=None):
    """The model as a GGUF file of `arch`, its stacked experts stored in `expert_type` (their
    down part in `down_type`, default the same), the rest in float32."""

    def qtype(name: str) -> Q:
        if "_exps" not in name:
            return Q.F32
        return (down_type or expert_type) if "down_exps" in name else expert_type

    return _write(_gguf_tensors(hf, arch), arch, path, tokenizer_dir, qtype)


def _write(tensors, arch: str, path, tokenizer_dir, qtype=lambda name: Q.F32):
    """A GGUF file of `arch` holding `tensors` (llama.cpp's names), each in `qtype(name)`."""
    w = tiny_llama_writer(path, tokenizer_dir, arch, 64, 128, 4, 2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOP_K)
    w.add_expert_feed_forward_length(32)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(48)
    for name, value in tensors.items():
        stored = qtype(name)
        if stored == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(value, stored), raw_dtype=stored)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """Each family's transformers model, its GGUF file (float32 tensors) and its Hugging Face
    directory."""
    root = tmp_path_factory.mktemp("gguf_moe")
    files = {}
    for family, arch in FILES.items():
        hf = make_tiny_moe(family, root / family)
        path = write_moe_gguf(hf, arch, root / f"{family}.gguf", root / family)
        files[family] = (hf, path, root / family)
    return files


@pytest.mark.parametrize("family", list(FILES))
def test_config_is_the_hugging_face_one(moe_files, family):
    _, path, directory = moe_files[family]
    ours = open_checkpoint(path).config
    theirs = open_checkpoint(directory).config
    assert ours.family == family
    for field in ("moe", "qkv_bias", "qk_norm", "head_dim", "num_kv_heads"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.rope.theta, ours.rope.type) == (theirs.rope.theta, theirs.rope.type)


@pytest.mark.parametrize("family", list(FILES))
def test_logits_match_transformers(moe_files, family):
    hf, path, _ = moe_files[family]
    hf = hf.double()
    hf.set_experts_implementation("eager")
    _, model, backend = float32_model(path)

    def theirs(seq):
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0]

    assert_tracks(model, backend, [1] + [(29 * i + 7) % 300 + 3 for i in range(30)], theirs)
    hf.float()


def test_quantized_experts_are_their_dequantized_values(moe_files, tmp_path):
    """Experts stored in Q8_0 and Q4_0: the model's logits are those of a float32 file holding
    the dequantized values (what was stored is what runs)."""
    hf = moe_files["qwen3_moe"][0]
    for qtype in (Q.Q8_0, Q.Q4_0):
        path = write_moe_gguf(hf, "qwen3moe", tmp_path / f"{qtype.name}.gguf", tmp_path, qtype)
        _, quantized, backend = float32_model(path)
        values = {
            name: gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
            if "_exps" in name
            else value
            for name, value in _gguf_tensors(hf, "qwen3moe").items()
        }
        assert any("_exps" in name for name in values)
        ids = list(range(3, 40))
        got = PagedSequence(quantized, backend, 64).extend(ids)
        reference = _write(values, "qwen3moe", tmp_path / f"{qtype.name}-float.gguf", tmp_path)
        _, model, backend = float32_model(reference)
        assert torch.equal(got, PagedSequence(model, backend, 64).extend(ids))


def test_auto_runs_each_expert_in_the_kernel_of_its_stored_type(moe_files, tmp_path):
    """Gate and up stored Q8_0 run from each expert's stored blocks (the file's rows, never a
    float copy), down stored Q4_1 in the 4-bit kernel: each expert computes its dequantized
    weights but for the int8 rounding of activations, and so do the logits, but where that
    rounding flips a token's choice of experts at a near-tie (the model's float weights and
    `quantization="none"` give the reference)."""
    hf = moe_files["qwen3_moe"][0]
    path = write_moe_gguf(hf, "qwen3moe", tmp_path / "auto.gguf", tmp_path, Q.Q8_0, Q.Q4_1)
    checkpoint = open_checkpoint(path)
    cpu = torch.device("cpu")
    auto = build_model(checkpoint, torch.float32, cpu, 128, quantization="auto")
    for layer in auto.layers:
        experts = layer.mlp.experts
        assert all(type(e.method) is StoredBlocksLinearMethod for e in experts.gate_up)
        assert all(e.weight is None for e in experts.gate_up)
        assert all(type(e.method) is Q4LinearMethod for e in experts.down)
    none = build_model(checkpoint, torch.float32, cpu, 128, quantization="none")
    x = torch.randn(5, 64)
    pairs = zip(auto.layers[1].mlp.experts.gate_up, none.layers[1].mlp.experts.gate_up, strict=True)
    for ours, ref in pairs:
        with torch.no_grad():
            got, want = ours(x), ref(x)
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    ids = list(range(3, 40))
    ours, ref = prefill_logits(auto, ids), prefill_logits(none, ids)
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).median().item() > 0.999
