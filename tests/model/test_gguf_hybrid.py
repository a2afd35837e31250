"""GGUF files of the hybrid Mamba2/attention models (llama.cpp's `granitehybrid`, which its
converter makes of Bamba, and `nemotron_h`): tiny random checkpoints written as llama.cpp's
convert_hf_to_gguf writes them, read through the ordinary loading path and compared with
transformers (CPU, float32)."""

import copy
import json
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES
from test_gguf import _llama_cpp_permute, _methods
from test_hybrid import PROMPT, TOL, HybridSequences

from inflight.model.attention import select_backend
from inflight.model.checkpoints.gguf import GGUFCheckpoint
from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.families.hybrid import MAMBA_CHUNK_SIZES
from inflight.model.layers.quantization import PackedLinearMethod, StoredBlocksLinearMethod

from helpers import float64_reference
from tiny_models import (
    CHAT_TEMPLATE,
    NEMOTRON_H_MOE_VARIANTS,
    VOCAB,
    make_tiny_hybrid,
    make_tiny_nemotron_h_moe,
)

CPU = torch.device("cpu")
FAMILIES = ("bamba", "nemotron_h")
ARCHS = {
    "bamba": MODEL_ARCH.GRANITE_HYBRID,
    "nemotron_h": MODEL_ARCH.NEMOTRON_H,
    "nemotron_h_moe": MODEL_ARCH.NEMOTRON_H_MOE,
}
DECODE_STEPS = 8
# NemotronH's layer kinds in its configs' spellings (transformers 5's layers_block_type).
_NEMOTRON_H_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}
# Q8_0 projections into and out of every mixer and MLP, F16 for the rest of the matrices.
QUANTIZED = {
    "token_embd": Q.Q8_0,
    "ssm_in": Q.Q8_0,
    "ssm_out": Q.F16,
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q8_0,
    "attn_v": Q.Q8_0,
    "attn_output": Q.F16,
    "ffn_gate": Q.Q8_0,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.F16,
    "output": Q.Q8_0,
}


def _tokenizer_metadata(w: gguf.GGUFWriter, directory) -> None:
    """The tiny tokenizer as the converter's GPT-2 vocabulary writes it: ids without a token
    padded as [PAD{i}], special added tokens CONTROL."""
    tok = json.loads((directory / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    specials = {a["content"] for a in tok["added_tokens"] if a["special"]}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(VOCAB)]
    types = [
        gguf.TokenType.CONTROL
        if t in specials
        else gguf.TokenType.UNUSED
        if i not in by_id
        else gguf.TokenType.NORMAL
        for i, t in enumerate(tokens)
    ]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHAT_TEMPLATE)


def _roundtrip(values: np.ndarray, qtype: Q) -> np.ndarray:
    """What a tensor stored as `qtype` reads back as."""
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype).reshape(values.shape)


def write_hybrid_gguf(hf, family: str, source, path, qtypes=None, extra=None, tensors=()):
    """`hf`, a tiny Bamba or NemotronH (its checkpoint directory `source`, for the tokenizer),
    as a GGUF file at `path` in llama.cpp's converter's conventions (its GraniteHybridModel,
    NemotronHModel and their bases); `qtypes` maps a tensor kind ("ssm_in") to its stored type
    (default F32), `extra(writer)` adds metadata and `tensors` more (name, array) tensors.
    Returns the weights the file holds, by transformers' names and in its layout (each as its
    stored type reads back)."""
    cfg, arch = hf.config, ARCHS[family]
    layers, hidden, heads = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads
    head_dim = hidden // heads if family == "bamba" else cfg.head_dim
    if family == "bamba":
        kinds = ["attention" if i in cfg.attn_layer_indices else "mamba" for i in range(layers)]
        ssm_heads, inner = cfg.mamba_n_heads, cfg.mamba_expand * hidden
        groups, state, conv = cfg.mamba_n_groups, cfg.mamba_d_state, cfg.mamba_d_conv
        eps = cfg.rms_norm_eps
    else:
        kinds = [_NEMOTRON_H_KINDS[k] for k in cfg.layers_block_type]
        ssm_heads, inner = cfg.mamba_num_heads, cfg.mamba_num_heads * cfg.mamba_head_dim
        groups, state, conv = cfg.n_groups, cfg.ssm_state_size, cfg.conv_kernel
        eps = cfg.layer_norm_epsilon

    w = gguf.GGUFWriter(str(path), MODEL_ARCH_NAMES[arch])
    w.add_block_count(layers)
    # GraniteHybridModel: a model without RoPE (NemotronH) gets a context of 2**20.
    w.add_context_length(cfg.max_position_embeddings if family == "bamba" else 2**20)
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    # GraniteHybridModel: KV heads on attention layers only, 0 marking the recurrent ones.
    w.add_head_count_kv([cfg.num_key_value_heads if k == "attention" else 0 for k in kinds])
    if family == "bamba":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_layer_norm_rms_eps(eps)
        # GraniteHybridModel writes attn_rotary_emb as the rotary dimensions: half a head in
        # IBM's Bamba configs (transformers' BambaConfig, as here, leaves it out, and the
        # converter then writes LlamaModel's whole head).
        w.add_rope_dimension_count(head_dim // 2)
    else:
        # NemotronHModel: the FFN length on MLP layers only; the head size from head_dim; both
        # epsilons (TextModel: layer_norm_epsilon and the rms_norm_eps NVIDIA's configs carry).
        w.add_feed_forward_length([cfg.intermediate_size if k == "mlp" else 0 for k in kinds])
        if "moe" in kinds:  # NemotronHModel's mixture keys
            w.add_expert_count(cfg.n_routed_experts)
            w.add_expert_used_count(cfg.num_experts_per_tok)
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            w.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
            w.add_expert_weights_norm(cfg.norm_topk_prob)
            w.add_expert_weights_scale(cfg.routed_scaling_factor)
            w.add_expert_group_count(cfg.n_group)
            w.add_expert_group_used_count(cfg.topk_group)
            if cfg.moe_latent_size:
                w.add_uint32(f"{MODEL_ARCH_NAMES[arch]}.moe_latent_size", cfg.moe_latent_size)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_layer_norm_eps(eps)
        w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(10000.0)
    # GraniteHybridModel: RoPE for Bamba only, switched by this key.
    w.add_rope_scaling_finetuned(family == "bamba")
    w.add_vocab_size(VOCAB)
    # GraniteHybridModel: the Mamba2 mixer's shape; the head count as the time step rank.
    w.add_ssm_conv_kernel(conv)
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(ssm_heads)
    w.add_ssm_group_count(groups)
    _tokenizer_metadata(w, source)
    if extra is not None:
        extra(w)

    names = gguf.get_tensor_name_map(arch, layers)
    held = {}
    for name, param in hf.state_dict().items():
        values = param.detach().float().numpy()
        hf_name = name.replace(".dt_bias", ".dt_proj.bias")  # Mamba2Model's renaming
        if family != "bamba" and ".mixer." in name:  # NemotronHModel.filter_tensors
            hf_name = hf_name.replace("model.layers.", "backbone.layers.", 1)
        # The converter's name of the selection bias: a ".bias".
        hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        gname = names.get_name(hf_name, (".weight", ".bias"))
        if ".mixer.experts." in name:  # stacked [E, rows, cols] as transformers holds them
            part = name.rsplit(".", 1)[1].removesuffix("_proj")
            gname = f"blk.{name.split('.')[2]}.ffn_{part}_exps.weight"
        kind = gname.split(".")[2] if gname.startswith("blk.") else gname.split(".")[0]
        qtype = (qtypes or {}).get(kind, Q.F32)
        # Q8_0 blocks run along rows, which the permutation below only reorders: the file's
        # weights read back are those of the round trip in transformers' layout.
        values = held[name] = _roundtrip(values, qtype)
        if kind == "attn_q":  # LlamaModel, to which GraniteHybridModel hands attention layers
            values = _llama_cpp_permute(values, heads)
        elif kind == "attn_k":
            values = _llama_cpp_permute(values, cfg.num_key_value_heads)
        elif kind == "ssm_a":  # Mamba2Model: A itself, as a column
            values = -np.exp(values).reshape(-1, 1)
        elif kind == "ssm_d":  # Mamba2Model: a column
            values = values.reshape(-1, 1)
        elif kind == "ssm_conv1d" and values.ndim == 3:  # Mamba2Model: [conv_dim, d_conv]
            values = values.squeeze()
        elif kind == "ssm_norm":  # Mamba2Model: a row per group
            values = values.reshape(groups, inner // groups)
        if qtype == Q.F32:
            w.add_tensor(gname, values)
        elif qtype == Q.F16:
            w.add_tensor(gname, values.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    for name, values in tensors:
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """family -> (transformers model, its checkpoint directory and config, GGUF path, weights
    the file holds, our model of the file, attention backend)."""
    out = {}
    for family in FAMILIES:
        directory = tmp_path_factory.mktemp(family)
        hf = make_tiny_hybrid(family, directory / "hf")
        path = directory / "tiny.gguf"
        held = write_hybrid_gguf(hf, family, directory / "hf", path)
        config = open_checkpoint(directory / "hf").config
        model = build_model(open_checkpoint(path), torch.float32, CPU, 256, quantization="none")
        backend = select_backend(None, CPU, torch.float32, config.head_dim)
        out[family] = (hf, directory / "hf", config, path, held, model, backend)
    return out


def _logits(model, backend, steps: int) -> tuple[torch.Tensor, list[int]]:
    """Our logits of PROMPT and `steps` greedy decode steps, and the greedy picks."""
    sequences = HybridSequences(model, backend, 1, len(PROMPT) + steps)
    logits = sequences.extend(0, PROMPT)
    out, picks = [logits], []
    for _ in range(steps):
        picks.append(int(logits[-1].argmax()))
        logits = sequences.extend(0, picks[-1:])
        out.append(logits)
    return torch.cat(out), picks


def _assert_matches_transformers(model, backend, hf) -> None:
    """Within TOL of transformers (in float64, as test_hybrid.py) at every position of a
    prefill and its greedy decode steps, which pick what transformers picks."""
    ours, picks = _logits(model, backend, DECODE_STEPS)
    with torch.no_grad():
        want = float64_reference(hf)(torch.tensor([PROMPT + picks])).logits[0]
    error = (ours.double() - want).abs().max().item()
    assert error < TOL, f"max |ours - transformers| {error:.2e}"
    assert picks == want[len(PROMPT) - 1 : -1].argmax(-1).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_config_is_the_hugging_face_one(hybrids, family):
    """All of it but what GGUF does not keep: the scan's block length (the family's default),
    epsilons in float32 and NemotronH's context length (2**20: the converter's, for no RoPE)."""
    _, _, want, path, *_ = hybrids[family]
    ours = open_checkpoint(path).config
    assert ours.family == family
    assert ours.mamba.layer_types == want.mamba.layer_types
    assert ours.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    assert ours.mamba.norm_eps == pytest.approx(want.mamba.norm_eps)
    assert ours.rope.theta == want.rope.theta
    assert ours.mamba.chunk_size == MAMBA_CHUNK_SIZES[family] != want.mamba.chunk_size
    ours = replace(
        ours,
        rms_norm_eps=want.rms_norm_eps,
        max_position_embeddings=want.max_position_embeddings,
        rope=want.rope,
        mamba=replace(ours.mamba, norm_eps=want.mamba.norm_eps, chunk_size=want.mamba.chunk_size),
    )
    assert ours == want


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_are_the_hugging_face_ones(hybrids, family):
    """Every tensor comes back in transformers' layout, named as our model loads it; A_log up
    to the rounding of log(-(-exp(A_log)))."""
    _, _, _, path, held, model, _ = hybrids[family]
    ours = dict(GGUFCheckpoint(path).weights())
    assert set(ours) == {model.parameter_name(name) for name in held}
    for name, want in held.items():
        got = ours[model.parameter_name(name)]
        if name.endswith("A_log"):
            torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-6, atol=0)
        else:
            assert torch.equal(got, torch.from_numpy(want)), name
    assert set(open_checkpoint(path).stored_types) == set(ours)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(hybrids, family):
    hf, *_, model, backend = hybrids[family]
    _assert_matches_transformers(model, backend, hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_file_matches_its_dequantized_weights(hybrids, family, tmp_path):
    """Q8_0 and F16 projections: exact float32 ("none") on the dequantized weights matches
    transformers holding the same; "auto" runs each Q8_0 layer int8 (from its stored blocks)
    and stays close."""
    hf, source, config, *_, backend = hybrids[family]
    path = tmp_path / "q.gguf"
    held = write_hybrid_gguf(hf, family, source, path, qtypes=QUANTIZED)
    checkpoint = open_checkpoint(path)
    assert checkpoint.stored_types["layers.0.mixer.in_proj.weight"] == "Q8_0"
    reference = copy.deepcopy(hf)
    reference.load_state_dict({name: torch.from_numpy(v) for name, v in held.items()})
    exact = build_model(checkpoint, torch.float32, CPU, 256, quantization="none")
    _assert_matches_transformers(exact, backend, reference)

    auto = build_model(checkpoint, torch.float32, CPU, 256, quantization="auto")
    methods = _methods(auto)
    attention = config.mamba.layer_types.index("attention")
    assert methods["layers.0.mixer.in_proj"] is StoredBlocksLinearMethod
    assert methods["layers.0.mixer.out_proj"] is PackedLinearMethod  # F16
    assert methods[f"layers.{attention}.mixer.qkv_proj"] is StoredBlocksLinearMethod
    assert methods[f"layers.{attention}.mixer.o_proj"] is PackedLinearMethod  # F16
    assert methods["lm_head"] is StoredBlocksLinearMethod
    ours, _ = _logits(auto, backend, 0)
    ref, _ = _logits(exact, backend, 0)
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min().item() > 0.99


@pytest.mark.parametrize(
    "key, value",
    [
        ("embedding_scale", 12.0),
        ("residual_scale", 0.22),
        ("logit_scale", 8.0),
        ("attention.scale", 0.0078125),
    ],
)
def test_granite_multipliers_are_refused(hybrids, tmp_path, key, value):
    """Granite 4.0-H's multipliers, as the converter's GraniteModel writes them."""
    hf, source, *_ = hybrids["bamba"]
    file = tmp_path / "granite.gguf"
    write_hybrid_gguf(
        hf, "bamba", source, file, extra=lambda w: w.add_float32(f"{w.arch}.{key}", value)
    )
    with pytest.raises(ValueError, match=f"granitehybrid.{key}".replace(".", r"\.")):
        open_checkpoint(file)


def test_identity_multipliers_load(hybrids, tmp_path):
    """Multipliers of 1 (and an attention scale of 1/sqrt(head_dim)) change nothing."""
    hf, source, config, path, *_ = hybrids["bamba"]

    def identity(w):
        for key in ("embedding_scale", "residual_scale", "logit_scale"):
            w.add_float32(f"{w.arch}.{key}", 1.0)
        w.add_attention_scale(config.head_dim**-0.5)

    file = tmp_path / "identity.gguf"
    write_hybrid_gguf(hf, "bamba", source, file, extra=identity)
    assert open_checkpoint(file).config == open_checkpoint(path).config


@pytest.mark.parametrize("by", ["tensors", "expert_count"])
def test_a_granite_hybrid_with_experts_is_refused(hybrids, tmp_path, by):
    """A `granitehybrid` file with a layer of experts (Granite 4.0-H's; router and stacked
    experts in layer 1), told by its tensors or its expert count."""
    hf, source, config, *_ = hybrids["bamba"]
    hidden, experts = config.hidden_size, 4
    tensors = [
        ("blk.1.ffn_gate_inp.weight", np.zeros((experts, hidden), np.float32)),
        ("blk.1.ffn_up_exps.weight", np.zeros((experts, 32, hidden), np.float32)),
        ("blk.1.ffn_down_exps.weight", np.zeros((experts, hidden, 32), np.float32)),
    ]
    file = tmp_path / "moe.gguf"
    if by == "tensors":
        write_hybrid_gguf(hf, "bamba", source, file, tensors=tensors)
    else:
        write_hybrid_gguf(hf, "bamba", source, file, extra=lambda w: w.add_expert_count(experts))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        open_checkpoint(file)


@pytest.mark.parametrize("variant", NEMOTRON_H_MOE_VARIANTS)
def test_nemotron_h_moe_file_matches_transformers(tmp_path, variant):
    """A `nemotron_h_moe` file as llama.cpp's converter writes it (stacked experts, the
    selection bias as `exp_probs_b`, the shared expert, the latent projections): the config of
    the Hugging Face directory it came from (but what GGUF does not keep), and logits within
    TOL of transformers'."""
    hf = make_tiny_nemotron_h_moe(variant, tmp_path / "hf")
    path = tmp_path / "moe.gguf"
    write_hybrid_gguf(hf, "nemotron_h_moe", tmp_path / "hf", path)
    ours, want = open_checkpoint(path).config, open_checkpoint(tmp_path / "hf").config
    assert ours.family == "nemotron_h"
    assert ours.mamba.layer_types == want.mamba.layer_types
    assert ours.moe == want.moe
    model = build_model(open_checkpoint(path), torch.float32, CPU, 256, quantization="none")
    backend = select_backend(None, CPU, torch.float32, ours.head_dim)
    _assert_matches_transformers(model, backend, hf)


def test_unknown_tensor_is_refused(hybrids, tmp_path):
    hf, source, *_ = hybrids["bamba"]
    file = tmp_path / "unknown.gguf"
    extra = [("blk.0.ssm_x.weight", np.zeros((4, 4), np.float32))]
    write_hybrid_gguf(hf, "bamba", source, file, tensors=extra)
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.ssm_x.weight'"):
        open_checkpoint(file)
