"""The CPU decoder step (kernels/cpu/decoder.c): a step runs every layer in one native call, and
gives the Python layers' results bit for bit (hidden states and the KV they store), for prefill,
decode and mixed steps, dense layers and mixtures of experts alike; a token's results do not
depend on how its prompt was split."""

import random

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from inflight.model.contract import MediaEmbeds
from inflight.model.layers.lora import LONG_RUN, LoRAMapping
from inflight.model.layers.moe import SparseMoeBlock
from inflight.model.layers.quantization import (
    Int8LinearMethod,
    Q4LinearMethod,
    StoredBlocksLinearMethod,
)
from inflight.protocol.deployment import DeploymentOptions
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.runtime import Runtime
from tests.model.test_gguf_moe import _gguf_tensors, _write
from tests.model.test_k_quant import write_k_quant_gguf

from tiny_models import COMMON, _save_random, make_tiny_moe

pytestmark = pytest.mark.usefixtures("two_threads")  # their work split, as on two cores


def _runner(model, **options):
    config = DeploymentOptions(
        device="cpu", max_model_len=256, enable_context_reuse=False, **options
    )
    return Runtime(model, config).executor.runner


def _forward(runner, rows, native: bool, slots=None, media=None) -> torch.Tensor:
    """One step of `rows`; `slots`: each row's LoRA slot (-1: none); `media`: MediaEmbeds."""
    runner.model.native_step = native
    batch = build_ragged_batch(rows, runner.block_size, torch.device("cpu")).forward
    runner.caches.backend.plan(batch.attention)
    if slots is not None:
        lengths = [len(r.token_ids) for r in rows]
        batch.lora = LoRAMapping.native(list(zip(slots, lengths, strict=True)))
    batch.media = media
    with torch.inference_mode():
        return runner.forward(batch)


def _same_both_ways(runner, rows, slots=None, media=None) -> torch.Tensor:
    """One step of `rows` through the native step and through the layers, from the same caches:
    the same hidden states, the same stored keys and values. Returns the hidden states."""
    caches = [tuple(c.clone() for c in kv) for kv in runner.caches.kv]
    native = _forward(runner, rows, native=True, slots=slots, media=media)
    assert runner.model.ran_native_step, "the native step did not run"
    native_caches = [tuple(c.clone() for c in kv) for kv in runner.caches.kv]
    for kv, saved in zip(runner.caches.kv, caches, strict=True):
        for cache, copy in zip(kv, saved, strict=True):
            cache.copy_(copy)
    layers = _forward(runner, rows, native=False, slots=slots, media=media)
    assert torch.equal(native, layers)
    for a, b in zip(native_caches, runner.caches.kv, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return native


def _steps_match_the_layers(runner, vocab: int, lengths=(5, 40, 17, 1), windows=False) -> None:
    """A prefill step of rows of `lengths`, a decode step of them, then a mixed step: their
    decodes beside a new prompt's first chunk and the rest of another's; each both ways.
    `windows`: the sliding layers' KV is in a pool of its own, the rows' blocks there taken
    in the order they first appear."""
    rng = random.Random(0)
    size = runner.block_size
    blocks = list(range(1, 80))
    rng.shuffle(blocks)
    window_blocks: dict[int, int] = {}

    def prompt(n):
        return [rng.randrange(vocab) for _ in range(n)]

    def table(n):
        return [blocks.pop() for _ in range(-(-n // size))]

    def row(tokens, past, table, samples):
        window = [window_blocks.setdefault(b, len(window_blocks)) for b in table]
        return RowInput(tokens, past, table, samples, window_table=window if windows else None)

    tables = [table(n + 2) for n in lengths]
    prefills = [row(prompt(n), 0, t, True) for n, t in zip(lengths, tables, strict=True)]
    _same_both_ways(runner, prefills)
    decodes = [row(prompt(1), n, t, True) for n, t in zip(lengths, tables, strict=True)]
    native = _same_both_ways(runner, decodes)
    for i, decode in enumerate(decodes):  # each row alone gets the bits it got in the batch
        assert torch.equal(_forward(runner, [decode], native=True)[0], native[i])
    late = table(30)
    _same_both_ways(runner, [row(prompt(20), 0, late, False)])
    mixed = [row(prompt(1), n + 1, t, True) for n, t in zip(lengths, tables, strict=True)]
    mixed += [row(prompt(9), 0, table(9), False), row(prompt(7), 20, late, True)]
    _same_both_ways(runner, mixed)


@pytest.fixture(scope="module")
def default_runner():
    return _runner(None)  # Q4_1 decoder layers in the 4-bit kernel


def test_the_default_model_steps_as_its_layers_do(default_runner):
    _steps_match_the_layers(default_runner, default_runner.model.config.vocab_size)


def _a_token_alike_however_its_prompt_is_split(runner) -> None:
    """Every position's hidden state of a prompt, bit for bit: prefilled whole; its last 1 or
    3 tokens after the rest; in chunks beside another sequence's decode row; one token a
    step."""
    rng = random.Random(1)
    prompt = [rng.randrange(runner.model.config.vocab_size) for _ in range(45)]
    table, other = [90, 84, 97], [88, 95]

    def hidden(steps):
        """The prompt's hidden states, over steps of spans [start, end) of it (with the other
        sequence's decode row in front where a step says so)."""
        out = []
        for spans, beside in steps:
            rows = [RowInput([7], 20, other, True)] if beside else []
            rows += [RowInput(prompt[a:b], a, table, True) for a, b in spans]
            out.append(_forward(runner, rows, native=True)[int(beside) :])
        return torch.cat(out)

    _forward(runner, [RowInput(prompt[:20], 0, other, True)], native=True)
    whole = hidden([([(0, 45)], False)])
    assert runner.model.ran_native_step
    for steps in (
        [([(0, 44)], False), ([(44, 45)], False)],
        [([(0, 42)], False), ([(42, 45)], True)],
        [([(0, 16)], True), ([(16, 33), (33, 45)], True)],
        [([(t, t + 1)], t % 2 == 1) for t in range(45)],
    ):
        assert torch.equal(hidden(steps), whole), steps


def test_the_default_model_computes_a_token_alike_however_its_prompt_is_split(default_runner):
    """Every position's hidden state (so its logits), bit for bit: the prompt prefilled whole;
    its last 1 or 3 tokens after the rest, as a context-cache hit computes them; in chunks
    beside another sequence's decode row; one token a step. A cache hit's first token used to
    differ in the last bits of its attention, which its per-token int8 activations then made a
    different token of (the user's seeded chat, replied to otherwise the second time)."""
    _a_token_alike_however_its_prompt_is_split(default_runner)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_int8_layers_with_biases_and_q_k_norms(tiny_dirs, family):
    runner = _runner(tiny_dirs[family], quantization="int8")
    assert runner.model.config.qkv_bias == (family == "qwen2")
    assert runner.model.config.qk_norm == (family == "qwen3")
    _steps_match_the_layers(runner, runner.model.config.vocab_size)


def test_sliding_window_layers_each_attend_over_their_window(sliding_dirs):
    """Sliding layers (windows of 12 tokens) alternating with full ones (Qwen3's
    `layer_types`), int8: the step gives each layer its own window, and the sliding layers
    their own pool's blocks (the window group's), as the layers do; rows of up to 40 tokens
    cross it."""
    runner = _runner(sliding_dirs["qwen3"], quantization="int8")
    assert [layer.self_attn.window for layer in runner.model.layers] == [12, None, 12, None]
    _steps_match_the_layers(runner, runner.model.config.vocab_size, windows=True)
    # A step without the sliding layers' tables would write past their pool: refused.
    with pytest.raises(ValueError, match="no block tables for it"):
        _forward(runner, [RowInput([1, 2], 0, [70], True)], native=True)


def test_k_quant_layers_of_mixed_kernels(tmp_path):
    # Layer 0's q/k are Q4_K (the 4-bit kernel), its v Q6_K (k8): two parts; layer 1's o Q5_K.
    runner = _runner(str(write_k_quant_gguf(tmp_path)))
    layers = runner.model.layers
    assert [len(layer.self_attn.qkv_proj.prepared) for layer in layers] == [2, 1]
    _steps_match_the_layers(runner, runner.model.config.vocab_size)


def test_models_it_cannot_run_keep_their_layers(tiny_dirs):
    # Float weights (no native matmul), the torch attention backend.
    for model, options in (
        (tiny_dirs["llama"], {"quantization": "none"}),
        (tiny_dirs["llama"], {"quantization": "int8", "attention_backend": "torch"}),
    ):
        runner = _runner(model, **options)
        _forward(runner, [RowInput([3, 4, 5], 0, [1], True)], native=True)
        assert not runner.model.ran_native_step


def test_lora_rows_beside_base_rows(tiny_dirs):
    """Adapters in two slots; a decode step of rows of both and of the base model, then a mixed
    step with a short prompt chunk of one adapter: the layers' bits, adapters applied."""
    runner = _runner(
        tiny_dirs["llama"], quantization="int8", enable_lora=True, max_loras=2, max_lora_rank=8
    )
    torch.manual_seed(0)
    for slot, rank in ((0, 8), (1, 4)):
        for layer in runner.model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lora = linear.lora_slots
                parts = [
                    (torch.randn(rank, lora.in_features) / 8, torch.randn(size, rank) / 8)
                    for size in lora.part_sizes
                ]
                lora.write(slot, parts, rank, 2.0)
    rows = [RowInput([5 + i] * (3 + i), 0, [1 + i], True) for i in range(3)]
    _forward(runner, rows, native=False, slots=[0, 1, -1])
    decodes = [RowInput([9], 3 + i, [1 + i], True) for i in range(3)]
    with_adapters = _same_both_ways(runner, decodes, slots=[0, 1, -1])
    base = _forward(runner, decodes, native=True, slots=[-1, -1, -1])
    assert not torch.equal(with_adapters[0], base[0]) and torch.equal(with_adapters[2], base[2])
    assert LONG_RUN > 10  # the chunk's adapter runs per token, as decodes do
    mixed = [*decodes, RowInput(list(range(10, 20)), 0, [5], True)]
    _same_both_ways(runner, mixed, slots=[1, -1, 0, 1])


def test_a_step_with_media_embeddings(tiny_dirs):
    """Packed tokens whose input is an encoder's output (an image's, here random) beside a
    decode row: the layers' bits, and the media changed the result."""
    runner = _runner(tiny_dirs["llama"], quantization="int8")
    _forward(runner, [RowInput([3, 4, 5], 0, [1], True)], native=True)
    rows = [RowInput([6], 3, [1], True), RowInput([7] * 12, 0, [2], True)]
    torch.manual_seed(0)
    hidden = runner.model.config.hidden_size
    media = MediaEmbeds(torch.arange(3, 9), torch.randn(6, hidden))
    with_media = _same_both_ways(runner, rows, media=media)
    assert not torch.equal(with_media, _forward(runner, rows, native=True))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """Tiny mixture-of-experts checkpoints (8 experts of 32, 2 a token), by family: Qwen3-MoE
    (weights renormalized over the chosen two), the same with a dense first layer (weights not
    renormalized), Mixtral, and Qwen2-MoE with 4 experts a token (whose sum's order shows) and
    its gated shared expert 64 wide (the int8 kernel takes in_features in multiples of 32; the
    shared tests' is 48); and their transformers models."""
    import transformers as tf

    root = tmp_path_factory.mktemp("moe")
    models = {
        name: make_tiny_moe(name, root / name)
        for name in ("qwen3_moe", "qwen3_moe_dense_first", "mixtral")
    }
    config = tf.Qwen2MoeConfig(
        **COMMON,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )
    models["qwen2_moe"] = _save_random(tf.Qwen2MoeForCausalLM, config, root / "qwen2_moe", 0)
    return {name: (root / name, model) for name, model in models.items()}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_dense_first", "qwen2_moe", "mixtral"])
def test_int8_experts_step_as_their_layers_do(moe_dirs, family):
    """Each token's experts chosen by the layer's router, run in the int8 kernel, weighed and
    summed (a shared expert's output added, times its gate): the layers' bits, and each decode
    row's alone."""
    runner = _runner(moe_dirs[family][0], quantization="int8")
    mixtures = [layer.mlp for layer in runner.model.layers]
    assert [isinstance(m, SparseMoeBlock) for m in mixtures] == [
        family != "qwen3_moe_dense_first",
        True,
    ]
    experts = mixtures[1].experts
    assert all(type(e.method) is Int8LinearMethod for e in [*experts.gate_up, *experts.down])
    assert (mixtures[1].shared_expert_gate is not None) == (family == "qwen2_moe")
    _steps_match_the_layers(runner, runner.model.config.vocab_size)


def test_gguf_experts_run_from_their_stored_blocks(moe_dirs, tmp_path):
    """Mixtral from llama.cpp's file: attention and the experts' gate and up stored Q8_0 (run
    from their blocks), their down Q4_1 (the 4-bit kernel), the router float32."""
    path, hf = moe_dirs["mixtral"]

    def qtype(name: str) -> Q:
        if "down_exps" in name:
            return Q.Q4_1
        quantized = "_exps" in name or (".attn_" in name and "norm" not in name)
        return Q.Q8_0 if quantized else Q.F32

    gguf_path = _write(_gguf_tensors(hf, "llama"), "llama", tmp_path / "m.gguf", path, qtype)
    runner = _runner(str(gguf_path))
    experts = runner.model.layers[0].mlp.experts
    assert all(type(e.method) is StoredBlocksLinearMethod for e in experts.gate_up)
    assert all(type(e.method) is Q4LinearMethod for e in experts.down)
    _steps_match_the_layers(runner, runner.model.config.vocab_size)


def test_experts_compute_a_token_alike_however_its_prompt_is_split(moe_dirs):
    """A token's routing and experts do not depend on which tokens share its step."""
    runner = _runner(moe_dirs["qwen2_moe"][0], quantization="int8")
    _a_token_alike_however_its_prompt_is_split(runner)


def test_mixtures_it_cannot_run_keep_their_layers(moe_dirs, tmp_path):
    """Float experts (no native matmul), and Qwen2-MoE's shared expert 48 wide, whose down
    projection int8 leaves in float: the model runs its layers."""
    make_tiny_moe("qwen2_moe", tmp_path / "narrow")
    for model, quantization in ((moe_dirs["qwen3_moe"][0], "none"), (tmp_path / "narrow", "int8")):
        runner = _runner(model, quantization=quantization)
        _forward(runner, [RowInput([3, 4, 5], 0, [1], True)], native=True)
        assert not runner.model.ran_native_step


def test_a_router_that_fails_fails_the_step(moe_dirs):
    """A router's error, raised from within the native step, reaches its caller as it was; the
    next step runs."""
    runner = _runner(moe_dirs["qwen3_moe"][0], quantization="int8")
    rows = [RowInput([3, 4, 5], 0, [1], True)]
    gate = runner.model.layers[1].mlp.gate

    def fail(x):
        raise ArithmeticError("no route")

    gate.route = fail
    with pytest.raises(ArithmeticError, match="no route"):
        _forward(runner, rows, native=True)
    assert runner.model.ran_native_step
    del gate.route
    _forward(runner, rows, native=True)
    assert runner.model.ran_native_step
