"""Multi-LoRA in the model: each adapter's logits match transformers + peft on the same weights
(CPU, float32, quantization "none"), a step whose rows run different adapters gives each row its
solo logits, slots load and unload, and a model without slots runs exactly as before."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from inflight.model.attention import select_backend
from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.checkpoints.lora import load_lora_adapter
from inflight.model.contract import ForwardBatch, ModelCaches
from inflight.model.layers.lora import LoRAMapping
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch

from helpers import PagedSequence

CPU = torch.device("cpu")
TOL = 1e-4
MAX_RANK = 16
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: the peft LoraConfig of a tiny random adapter.
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=ALL_SEVEN),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp": dict(r=MAX_RANK, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
PROMPT = "The quick brown fox jumps over the lazy dog. In-flight batching"


class OnSlot:
    """A model whose every forward pass runs all its tokens with the adapter in `slot`, for the
    helpers that run a model directly."""

    def __init__(self, model, slot: int) -> None:
        self.model, self.slot, self.config = model, slot, model.config

    def __call__(self, batch, caches):
        batch.lora = self.model.lora.mapping([(self.slot, len(batch.input_ids))])
        return self.model(batch, caches)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def make_adapter(hf, path, seed: int, **config):
    """A tiny random peft adapter on `hf` written to `path`; the peft model (float64, the
    reference: so that the checks measure our float32 error alone, as in test_hf_parity)."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(
        copy.deepcopy(hf), LoraConfig(init_lora_weights=False, **config)
    ).eval()
    peft_model.save_pretrained(path)
    return peft_model.double()


def float32_model(path, max_loras: int, quantization: str = "none"):
    checkpoint = open_checkpoint(path)
    model = build_model(
        checkpoint,
        torch.float32,
        CPU,
        256,
        quantization=quantization,
        max_loras=max_loras,
        max_lora_rank=MAX_RANK,
    )
    return checkpoint, model, select_backend(None, CPU, torch.float32, checkpoint.config.head_dim)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, tiny_dirs, tmp_path_factory):
    """A tiny model of the family with every adapter of ADAPTERS in a slot (in that order), the
    adapters' peft references and paths."""
    path = tiny_dirs[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    checkpoint, model, backend = float32_model(path, max_loras=len(ADAPTERS) + 1)
    refs, dirs = {}, {}
    for slot, (name, config) in enumerate(ADAPTERS.items()):
        dirs[name] = tmp_path_factory.mktemp(f"{request.param}-{name}")
        refs[name] = make_adapter(hf, dirs[name], seed=slot, **config)
        model.lora.load(slot, load_lora_adapter(dirs[name], checkpoint.config, MAX_RANK))
    return dict(
        path=path,
        checkpoint=checkpoint,
        model=model,
        backend=backend,
        hf=copy.deepcopy(hf).double(),
        refs=refs,
        dirs=dirs,
    )


def _ref_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("name", ADAPTERS)
def test_adapter_logits_match_peft(family, name):
    """Prefill, then 8 decode steps through the paged KV cache, each adapter on its slot."""
    ids = family["checkpoint"].tokenizer.encode(PROMPT)
    ref = family["refs"][name]
    slot = list(ADAPTERS).index(name)
    sequence = PagedSequence(OnSlot(family["model"], slot), family["backend"], len(ids) + 8)
    ours, want = sequence.extend(ids)[-1], _ref_logits(ref, ids)
    # The adapter moves the logits far beyond the tolerance: the check sees it applied.
    assert (want - _ref_logits(family["hf"], ids)).abs().max().item() > 100 * TOL
    assert (ours.double() - want).abs().max().item() < TOL
    seq = list(ids)
    for _ in range(8):
        seq.append(int(want.argmax()))
        ours, want = sequence.extend(seq[-1:])[-1], _ref_logits(ref, seq)
        assert (ours.double() - want).abs().max().item() < TOL


def _solo(family, slot: int, prompt: list[int], token: int) -> list[torch.Tensor]:
    """One sequence's logits alone: its prefill, then one decode step."""
    model = family["model"] if slot < 0 else OnSlot(family["model"], slot)
    sequence = PagedSequence(model, family["backend"], len(prompt) + 1)
    return [sequence.extend(prompt), sequence.extend([token])]


@pytest.mark.parametrize("form", ["native", "masked"])
def test_rows_of_three_adapters_and_the_base_in_one_step(family, form):
    """A prefill step and a decode step over rows of three adapters and the base model, one
    adapter on two rows apart: every row gets the logits it gets alone. Base rows get the same
    bits: the base path is batch-invariant and no adapter touches them. On the native path
    (these rows are all short runs) so do adapter rows: each token's update is computed alone.
    The masked path's BLAS matmuls round according to how many rows they take: adapter rows
    agree within float32 rounding."""
    model, backend, cfg = family["model"], family["backend"], family["checkpoint"].config
    slots = [0, -1, 1, 2, 0, -1]
    lengths = [9, 5, 12, 7, 4, 16]
    prompts = [[(7 * i + 3 * j) % cfg.vocab_size for j in range(n)] for i, n in enumerate(lengths)]
    tokens = [11, 22, 33, 44, 55, 66]
    block_size, blocks = 16, 2
    shape = backend.kv_cache_shape(len(slots) * blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(slots))]

    def step(rows):
        batch = build_ragged_batch(rows, block_size, CPU)
        mapped = [(s, len(r.token_ids)) for s, r in zip(slots, rows, strict=True)]
        if form == "native":
            lora = model.lora.mapping(mapped)
        else:
            lora = LoRAMapping.masked(mapped, model.max_loras, torch.float32, CPU)
        batch.forward.lora = lora
        backend.plan(batch.forward.attention)
        with torch.no_grad():
            hidden = model(batch.forward, ModelCaches(caches, backend))
            return model.compute_logits(hidden)

    prefill = step([RowInput(p, 0, t, True, True) for p, t in zip(prompts, tables, strict=True)])
    decode = step(
        [
            RowInput([tok], len(p), t, True)
            for p, t, tok in zip(prompts, tables, tokens, strict=True)
        ]
    )
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for i, slot in enumerate(slots):
        solo_prefill, solo_decode = _solo(family, slot, prompts[i], tokens[i])
        batched = [prefill[starts[i] : starts[i] + lengths[i]], decode[i : i + 1]]
        for got, want in zip(batched, [solo_prefill, solo_decode], strict=True):
            if slot < 0 or form == "native":
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=5e-5)


def test_load_unload_reload(family):
    """A slot takes another adapter (of larger rank), is emptied, and takes the first back: the
    same computation on the same weights, so the same bits."""
    checkpoint, model = family["checkpoint"], family["model"]
    spare = len(ADAPTERS)
    ids = checkpoint.tokenizer.encode(PROMPT)

    def logits(slot):
        return PagedSequence(OnSlot(model, slot), family["backend"], len(ids)).extend(ids)

    adapters = {
        n: load_lora_adapter(d, checkpoint.config, MAX_RANK) for n, d in family["dirs"].items()
    }
    model.lora.load(spare, adapters["qv"])
    qv = logits(spare)
    assert torch.equal(qv, logits(list(ADAPTERS).index("qv")))
    model.lora.load(spare, adapters["mlp"])
    assert torch.equal(logits(spare), logits(list(ADAPTERS).index("mlp")))
    model.lora.unload(spare)
    with pytest.raises(ValueError, match=f"LoRA slot {spare} holds no adapter"):
        logits(spare)
    model.lora.load(spare, adapters["qv"])
    assert torch.equal(logits(spare), qv)
    model.lora.unload(spare)


def test_slots_refuse_what_does_not_fit(family):
    checkpoint, model = family["checkpoint"], family["model"]
    adapter = load_lora_adapter(family["dirs"]["all"], checkpoint.config, MAX_RANK)
    with pytest.raises(ValueError, match="LoRA slot 4 does not exist: this model has 4"):
        model.lora.load(len(ADAPTERS) + 1, adapter)
    with pytest.raises(ValueError, match="LoRA slot -1 does not exist"):
        model.lora.unload(-1)
    mapping = model.lora.mapping([(0, 3)])
    with pytest.raises(ValueError, match="LoRA mapping of 3 tokens for 4"):
        model(ForwardBatch(torch.arange(4), torch.arange(4), None, lora=mapping), None)
    small = build_model(
        checkpoint, torch.float32, CPU, 64, quantization="none", max_loras=1, max_lora_rank=4
    )
    with pytest.raises(ValueError, match="rank 8 is above max_lora_rank=4"):
        small.lora.load(0, adapter)


def test_without_slots_or_adapters_the_logits_are_unchanged(family):
    """A model built without slots, and one with slots run with no mapping or with every row on
    the base model, give the same bits; the one without slots refuses adapters."""
    checkpoint = family["checkpoint"]
    _, plain, backend = float32_model(family["path"], max_loras=0)
    assert not any(m.lora_slots for m in plain.modules() if hasattr(m, "lora_slots"))
    ids = checkpoint.tokenizer.encode(PROMPT)
    want = PagedSequence(plain, backend, len(ids)).extend(ids)
    assert torch.equal(PagedSequence(family["model"], backend, len(ids)).extend(ids), want)
    assert torch.equal(
        PagedSequence(OnSlot(family["model"], -1), backend, len(ids)).extend(ids), want
    )
    adapter = load_lora_adapter(family["dirs"]["qv"], checkpoint.config, MAX_RANK)
    with pytest.raises(ValueError, match="LoRA slot 0 does not exist: this model has 0"):
        plain.lora.load(0, adapter)
    with pytest.raises(ValueError, match="LoRA slot 0 does not exist: this model has 0"):
        PagedSequence(OnSlot(plain, 0), backend, len(ids)).extend(ids)


def test_adapters_run_on_int8_weights(family):
    """LoRA is a side path on the activations: on an int8 model an adapter's logits are as close
    to the float32 model's with the adapter as the int8 base is to the float32 base."""
    checkpoint = family["checkpoint"]
    _, int8, backend = float32_model(family["path"], max_loras=1, quantization="int8")
    int8.lora.load(0, load_lora_adapter(family["dirs"]["all"], checkpoint.config, MAX_RANK))
    ids = torch.randint(
        0, checkpoint.config.vocab_size, (96,), generator=torch.Generator().manual_seed(0)
    ).tolist()

    def logits(model, slot):
        return PagedSequence(OnSlot(model, slot), backend, len(ids)).extend(ids)

    ours, ref = logits(int8, 0), logits(family["model"], 0)
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    # Measured: mean cosine 0.9987-0.9994, worst row 0.995, where test_int8_linear measures the
    # base alone at 0.9988-0.9995 and 0.987; against the float32 base model (the adapter not
    # applied) the mean is 0.27-0.38.
    assert cosine.mean().item() > 0.998
    assert cosine.min().item() > 0.98
    base = torch.nn.functional.cosine_similarity(ours, logits(family["model"], -1), dim=-1)
    assert base.mean().item() < 0.9


@pytest.mark.slow
def test_adapter_on_the_default_model_matches_peft(hf_smollm, tmp_path):
    """SmolLM2 (GGUF, float32 "none") with a random adapter on every projection, against peft
    on transformers' load of the same file."""
    checkpoint, model, backend = float32_model(None, max_loras=1)
    ref = make_adapter(hf_smollm, tmp_path, seed=0, **ADAPTERS["all"])
    model.lora.load(0, load_lora_adapter(tmp_path, checkpoint.config, MAX_RANK))
    ids = checkpoint.tokenizer.encode("The history of the Roman Empire begins")
    sequence = PagedSequence(OnSlot(model, 0), backend, len(ids) + 4)
    ours, want = sequence.extend(ids)[-1], _ref_logits(ref, ids)
    assert (ours.double() - want).abs().max().item() < TOL
    seq = list(ids)
    for _ in range(4):
        seq.append(int(want.argmax()))
        ours, want = sequence.extend(seq[-1:])[-1], _ref_logits(ref, seq)
        assert (ours.double() - want).abs().max().item() < TOL
