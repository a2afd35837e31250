"""Logits and greedy continuations match HF transformers on the same weights (CPU, float32,
quantization "none")."""

import copy

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from inflight import LLM, SamplingParams
from inflight.model.attention import TorchAttentionBackend, select_backend
from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.registry import by_name

from helpers import PagedSequence, assert_tracks
from tiny_models import FAMILIES, SLIDING_KINDS, SLIDING_WINDOW

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


# The layers' windows of each tiny sliding-window checkpoint (tiny_models.SLIDING_KINDS).
W = SLIDING_WINDOW
WINDOWS = {"mistral": (W, W), "qwen2": (None, W), "qwen3": (W, None, W, None)}


@pytest.mark.parametrize("kind", SLIDING_KINDS)
def test_sliding_windows_are_served_past_the_window(kind, sliding_dirs):
    """Windows of 12 tokens in every layer (Mistral), from `max_window_layers` on (Qwen2), or
    alternating with full layers (Qwen3's `layer_types`), on the layers transformers makes
    slide. Past the window: a 30-token prompt and 8 decode steps through the paged KV give every
    position's logits within 1e-4 of transformers' (float64), in the CPU kernel and in the torch
    reference backend; and the engine, its context no longer capped at the window, greedy-decodes
    40 tokens as transformers does with its prompt in chunks over blocks of 4 tokens (an
    all-sliding model giving back those before its window), then again from the context cache.
    Its limit is its positions."""
    path = sliding_dirs[kind]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    checkpoint, model, backend = _float32_model(path)
    windows = checkpoint.config.layer_windows
    assert windows == WINDOWS[kind]
    types = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * len(windows)
    assert [w is not None for w in windows] == [t == "sliding_attention" for t in types]
    assert hf.config.sliding_window == W
    reference = copy.deepcopy(hf).double()

    def theirs(seq):
        with torch.no_grad():
            return reference(torch.tensor([seq])).logits[0]

    ids = list(range(5, 35))
    for attention in (backend, TorchAttentionBackend()):
        assert_tracks(model, attention, ids, theirs)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    options = dict(quantization="none", block_size=4, max_num_tokens=16, max_model_len=4096)
    with pytest.raises(ValueError, match=r"\(4096: its max_position_embeddings\)"):
        LLM(path, **{**options, "max_model_len": 4097})
    with LLM(path, **options) as llm:
        assert llm.max_model_len == 4096
        first, again = (llm.generate({"prompt_token_ids": ids}, params)[0] for _ in range(2))
    want = _hf_greedy(hf, ids, 40)
    assert list(first.token_ids) == want and list(again.token_ids) == want
    assert (first.cached_tokens, again.cached_tokens) == (0, 28)


@pytest.mark.parametrize(
    "config_cls,model_type",
    [
        (transformers.Qwen2Config, "qwen2"),
        (transformers.Qwen3Config, "qwen3"),
        (transformers.Qwen2MoeConfig, "qwen2_moe"),
        (transformers.Qwen3MoeConfig, "qwen3_moe"),
    ],
)
def test_qwen_configs_slide_the_layers_transformers_slides(config_cls, model_type):
    """A Qwen config's windows, with and without `layer_types` written out, on the layers its
    transformers model slides: from `max_window_layers` on (Qwen2, Qwen3), the even layers below
    it (Qwen2-MoE), every layer (Qwen3-MoE); none without `use_sliding_window`."""
    family = by_name(model_type)
    for use in (True, False):
        hf = config_cls(
            num_hidden_layers=6, use_sliding_window=use, sliding_window=32, max_window_layers=3
        )
        types = getattr(hf, "layer_types", None) or ["sliding_attention"] * 6
        want = tuple(32 if use and t == "sliding_attention" else None for t in types)
        cfg = hf.to_dict()
        for written in (cfg, {k: v for k, v in cfg.items() if k != "layer_types"}):
            windows = family.from_hf(written).layer_windows
            assert (windows or (None,) * 6) == want, (use, "layer_types" in written)
