"""Logits and greedy continuations match HF transformers on the same weights (CPU, float32,
quantization "none")."""

import copy
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight import LLM, SamplingParams
from inflight.model.attention import select_backend
from inflight.model.checkpoints.loader import build_model, open_checkpoint

from helpers import PagedSequence
from tiny_models import FAMILIES

PROMPT = "The quick brown fox jumps over the lazy dog. In-flight batching"
TOL = 1e-4


def _float32_model(path):
    """The float32 model and the attention backend the runtime picks for it on the CPU."""
    checkpoint = open_checkpoint(path)
    cpu = torch.device("cpu")
    model = build_model(checkpoint, torch.float32, cpu, 256, quantization="none")
    return checkpoint, model, select_backend(None, cpu, torch.float32, checkpoint.config.head_dim)


def _hf_last_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]


def _check_logits(model, backend, hf, ids, decode_steps=16):
    """Prefill, then decode `decode_steps` tokens (the reference's greedy picks) through the paged
    KV cache; the last-position logits match the reference at every step.

    The reference is HF's model on the same weights computed in float64, so that the check
    measures our float32 error alone: HF's own float32 run is itself up to ~4e-5 off the float64
    logits of SmolLM2, and the two float32 errors add up."""
    hf = copy.deepcopy(hf).double()
    sequence = PagedSequence(model, backend, len(ids) + decode_steps)
    ours = sequence.extend(ids)[-1]
    ref = _hf_last_logits(hf, ids)
    assert (ours.double() - ref).abs().max().item() < TOL
    seq = list(ids)
    for _ in range(decode_steps):
        seq.append(int(ref.argmax()))
        ours = sequence.extend(seq[-1:])[-1]
        ref = _hf_last_logits(hf, seq)
        assert (ours.double() - ref).abs().max().item() < TOL


def _hf_greedy(hf, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(_hf_last_logits(hf, seq).argmax()))
    return seq[len(ids) :]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_matches_transformers(family, tiny_dirs):
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[family], dtype=torch.float32).eval()
    checkpoint, model, backend = _float32_model(tiny_dirs[family])
    ids = checkpoint.tokenizer.encode(PROMPT)
    _check_logits(model, backend, hf, ids)
    greedy = PagedSequence(model, backend, len(ids) + 48).greedy(ids, 48)
    assert greedy == _hf_greedy(hf, ids, 48)


@pytest.fixture(scope="module")
def smollm_float32():
    return _float32_model(None)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm_float32, hf_smollm):
    checkpoint, model, backend = smollm_float32
    ids = checkpoint.tokenizer.encode("The history of the Roman Empire begins")
    _check_logits(model, backend, hf_smollm, ids)
    greedy = PagedSequence(model, backend, len(ids) + 48).greedy(ids, 48)
    assert greedy == _hf_greedy(hf_smollm, ids, 48)


@pytest.mark.slow
def test_log_softmax_matches_the_reference(smollm_float32, hf_smollm):
    """What the sampler's logprobs are computed from: the log-softmax of our logits, within TOL
    of the reference's at every greedy step, with the same top 5."""
    checkpoint, model, backend = smollm_float32
    ids = checkpoint.tokenizer.encode("Water boils at a temperature of")
    sequence = PagedSequence(model, backend, len(ids) + 8)
    logits, seq = sequence.extend(ids)[-1], list(ids)
    for _ in range(8):
        ours = torch.log_softmax(logits.double(), dim=-1)
        ref = torch.log_softmax(_hf_last_logits(hf_smollm, seq), dim=-1)
        token = int(ours.argmax())
        assert token == int(ref.argmax())
        assert abs(ours[token].item() - ref[token].item()) < TOL
        assert ours.topk(5).indices.tolist() == ref.topk(5).indices.tolist()
        seq.append(token)
        logits = sequence.extend([token])[-1]


def _qwen_config(source, path, **changes):
    """A copy of the checkpoint directory `source` at `path`, its config.json changed and
    without `layer_types`, as Qwen2/Qwen3 checkpoints write it (`max_window_layers` then says
    which layers slide)."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    del config["layer_types"]
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_qwen_sliding_window_caps_the_context_at_the_window(family, tiny_dirs, tmp_path):
    """A Qwen2/Qwen3 config.json with `use_sliding_window` (a window of 40 tokens, below its
    4096 positions; layer 1 of 2 slides: max_window_layers 1) has that window, and is served
    within it, where full attention is exact: the context is capped at 40 tokens, a longer
    max_model_len is a ValueError naming the window, and greedy output up to the window is
    transformers' (the config as written, its sliding-window attention). The same config with
    `use_sliding_window: false` has no window and an uncapped context."""
    window = dict(sliding_window=40, max_window_layers=1)
    on = _qwen_config(tiny_dirs[family], tmp_path / "on", use_sliding_window=True, **window)
    off = _qwen_config(tiny_dirs[family], tmp_path / "off", use_sliding_window=False, **window)
    assert open_checkpoint(on).config.sliding_window == 40
    assert open_checkpoint(off).config.sliding_window is None
    with pytest.raises(
        ValueError,
        match=r"max_model_len \(64\) exceeds the model's context \(40: its attention window of "
        r"40 tokens, within which full attention computes it exactly\)",
    ):
        LLM(on, max_model_len=64)
    ids = list(range(5, 21))  # 16 prompt tokens, 24 generated: the whole window
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(on, quantization="none") as llm:
        assert llm.max_model_len == 40
        got = llm.generate({"prompt_token_ids": ids}, params)[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(on, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    assert list(got) == _hf_greedy(hf, ids, 24)
    with LLM(off, max_model_len=1024) as llm:
        assert llm.max_model_len == 1024
