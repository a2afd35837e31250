"""The CUDA-graph bookkeeping of decode steps, checked on the CPU (no capture happens here;
`helpers.with_eager_graphs` runs each "replay" as the forward the graph would have captured)."""

import pytest
import torch

from inflight.model.contract import ForwardBatch, MediaEmbeds
from inflight.model.layers.lora import LoRAMapping
from inflight.model.layers.mamba import MambaRows
from inflight.protocol.deployment import DeploymentOptions, SpeculativeConfig
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.device.cuda_graphs import (
    UNFOLD_KEYS,
    DecodeGraphs,
    DecodeInputs,
    graph_buckets,
    is_decode_only,
    pick_bucket,
    replayable,
)
from inflight.runtime.runtime import Runtime

from helpers import (
    assert_no_leaks,
    assert_warm_up_writes_only_scratch,
    run_staggered,
    with_eager_graphs,
)

CPU = torch.device("cpu")


def test_buckets_and_their_choice():
    assert graph_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_buckets(512) == [1, 2, 4, 8, *range(16, 257, 16), 320, 384, 448, 512]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1]
    buckets = graph_buckets(64)
    assert [pick_bucket(buckets, n) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert pick_bucket(buckets, 65) is None


def test_only_steps_of_decode_rows_replay():
    def attention(rows, unfold=False):
        return build_ragged_batch(rows, 16, CPU, unfold).forward.attention

    decode = attention([RowInput([5], 9, [0], True), RowInput([6], 3, [1], True)])
    mixed_rows = [RowInput([5], 9, [0], True), RowInput([1, 2], 0, [1], True)]
    not_sampling = attention([RowInput([5], 9, [0], False)])
    assert is_decode_only(decode) and is_decode_only(not_sampling)
    assert not is_decode_only(attention(mixed_rows))
    assert is_decode_only(attention(mixed_rows, unfold=True))


def test_a_step_replays_when_its_tokens_fit_and_its_prefill_is_short():
    decode = [RowInput([5], 300, [0] * 20, True)] * 6
    assert replayable(decode, 8) and not replayable(decode, 5)
    # Drafts are read as decode rows are: only prefill chunks count against the key budget.
    verifying = [RowInput([5, 6, 7], 5000, [0] * 400, True, drafts=[6, 7])]
    assert replayable(verifying, 8)
    # A chunk of n tokens after p in KV reads n * p + n * (n + 1) / 2 keys.
    n = 64
    past = (UNFOLD_KEYS - n * (n + 1) // 2) // n
    assert replayable([RowInput([1] * n, past, [0] * 400, True)], 512)
    assert not replayable([RowInput([1] * n, past + 1, [0] * 400, True)], 512)
    assert not replayable([RowInput([1] * 600, 0, [0] * 40, True)], 512)


def test_unfolded_rows_keep_the_hidden_states_the_packed_rows_keep():
    rows = [
        RowInput([5], 9, [0], True),  # decode
        RowInput([6, 7, 8], 4, [1], True, drafts=[7, 8]),  # verifying drafts: every token
        RowInput([1, 2, 3], 0, [2], True),  # a last chunk: its last token
        RowInput([4, 5], 16, [3, 4], False),  # a chunk before the last: none
        RowInput([6, 7], 3, [5], False, scores=True),  # scoring a prompt: every token
    ]
    packed = build_ragged_batch(rows, 16, CPU)
    unfolded = build_ragged_batch(rows, 16, CPU, unfold=True)
    meta = unfolded.forward.attention
    assert meta.num_decodes == len(meta.query_lens_host) == 11
    assert torch.equal(unfolded.forward.input_ids, packed.forward.input_ids)
    assert torch.equal(unfolded.forward.positions, packed.forward.positions)
    assert torch.equal(meta.slot_mapping, packed.forward.attention.slot_mapping)
    assert meta.seq_lens.tolist() == [10, 5, 6, 7, 1, 2, 3, 17, 18, 4, 5]
    assert unfolded.logits_indices.tolist() == packed.logits_indices.tolist()
    assert unfolded.logits_indices.tolist() == [0, 1, 2, 3, 6, 9, 10]


def _decode(rows, lora=None, mamba=None) -> ForwardBatch:
    """A decode step's batch of `rows`, each with its LoRA slot in `lora`, its state slot in
    `mamba`."""
    batch = build_ragged_batch(rows, 16, CPU).forward
    if lora is not None:
        batch.lora = LoRAMapping.native([(slot, 1) for slot in lora])
    batch.recurrent = mamba
    return batch


def test_fill_copies_rows_and_parks_spare_rows_on_the_scratch_block():
    inputs = DecodeInputs(max_batch=8, max_blocks=4, block_size=16, scratch_block=99, device=CPU)
    # A previous, larger step left its rows behind.
    big = build_ragged_batch([RowInput([7], 40, [3, 4, 5], True)] * 6, 16, CPU)
    inputs.fill(big.forward, 8)
    batch = build_ragged_batch(
        [RowInput([11], 20, [5, 6], True), RowInput([12], 2, [9], True)], 16, CPU
    )
    inputs.fill(batch.forward, 4)
    assert inputs.input_ids[:4].tolist() == [11, 12, 0, 0]
    assert inputs.positions[:4].tolist() == [20, 2, 0, 0]
    assert inputs.slot_mapping[:4].tolist() == [6 * 16 + 4, 9 * 16 + 2, 99 * 16, 99 * 16]
    assert inputs.seq_lens[:4].tolist() == [21, 3, 1, 1]
    assert inputs.block_tables[:2, :2].tolist() == [[5, 6], [9, 0]]
    assert inputs.block_tables[2:4, 0].tolist() == [99, 99]
    meta = inputs.metadata(4)
    assert meta.num_decodes == 4 and meta.slot_mapping.shape == (4,)


def test_fill_copies_the_window_groups_tables_and_parks_spare_rows_on_its_scratch_block():
    """Where the sliding layers' KV is in a pool of its own, their slots and tables have
    buffers of their own, the spare rows on that pool's scratch block."""
    inputs = DecodeInputs(
        max_batch=8, max_blocks=4, block_size=16, scratch_block=99, device=CPU,
        window_scratch_block=7,
    )  # fmt: skip
    rows = [
        RowInput([11], 20, [5, 6], True, window_table=[0, 3]),
        RowInput([12], 2, [9], True, window_table=[2]),
    ]
    inputs.fill(build_ragged_batch(rows, 16, CPU).forward, 4)
    assert inputs.slot_mapping[:4].tolist() == [6 * 16 + 4, 9 * 16 + 2, 99 * 16, 99 * 16]
    assert inputs.window_slot_mapping[:4].tolist() == [3 * 16 + 4, 2 * 16 + 2, 7 * 16, 7 * 16]
    assert inputs.window_block_tables[:4, :2].tolist() == [[0, 3], [2, 0], [7, 0], [7, 0]]
    meta = inputs.metadata(4)
    assert meta.window.block_tables.data_ptr() == inputs.window_block_tables.data_ptr()
    assert meta.for_window(12) is meta.window and meta.for_window(None) is meta


def test_fill_writes_each_rows_state_slot_and_parks_spare_rows_on_the_scratch_slot():
    inputs = DecodeInputs(
        max_batch=8, max_blocks=4, block_size=16, scratch_block=99, device=CPU, scratch_state=8
    )
    rows = [RowInput([11], 20, [5, 6], True)] * 3
    inputs.fill(_decode(rows * 2, mamba=MambaRows.build([0] * 6, [0] * 6, CPU)), 8)
    inputs.fill(_decode(rows, mamba=MambaRows.build([5, 2, 7], [0] * 3, CPU)), 4)
    assert inputs.state_slots[:4].tolist() == [5, 2, 7, 8]
    captured = inputs.mamba(4)
    assert captured.slots.data_ptr() == inputs.state_slots.data_ptr()
    assert captured.fresh_host == [False] * 4


def test_a_step_that_starts_a_state_is_not_replayed():
    """A one-token prompt is a decode row whose state slot must be zeroed first: eager."""

    class Never:
        buckets = [1, 2, 4]
        inputs = None

    batch = build_ragged_batch([RowInput([11], 0, [5], True)], 16, CPU)
    batch.forward.recurrent = MambaRows.build([3], [True], CPU)
    assert DecodeGraphs.run(Never(), batch) is None


def test_fill_writes_each_rows_lora_slot_and_parks_spare_rows_on_the_base():
    inputs = DecodeInputs(
        max_batch=8, max_blocks=4, block_size=16, scratch_block=99, device=CPU, lora=True
    )
    rows = [RowInput([11], 20, [5, 6], True)] * 3
    inputs.fill(_decode(rows * 2, lora=[2, 2, 2, 2, 2, 2]), 8)
    inputs.fill(_decode(rows, lora=[1, -1, 0]), 4)
    assert inputs.lora_slots[:4].tolist() == [1, -1, 0, -1]
    mapping = inputs.lora(4)
    assert mapping.num_tokens == 4
    assert mapping.token_slots.data_ptr() == inputs.lora_slots.data_ptr()
    inputs.fill(_decode(rows), 4)  # no row on an adapter
    assert inputs.lora_slots[:4].tolist() == [-1] * 4  # the rows the graph of bucket 4 reads
    plain = DecodeInputs(max_batch=8, max_blocks=4, block_size=16, scratch_block=99, device=CPU)
    assert plain.lora(4) is None
    with pytest.raises(ValueError, match="LoRA slots for graphs captured without LoRA"):
        plain.fill(_decode(rows, lora=[0, -1, -1]), 4)


def test_the_warm_up_writes_only_the_scratch_block(tiny_dirs):
    """The eager pass a graphed runtime runs once at start (a prefill of a full step's tokens,
    so that no request pays the first compiles of that path) touches no resident's KV."""
    options = DeploymentOptions(max_batch_size=4, max_model_len=256, max_num_tokens=100)
    assert_warm_up_writes_only_scratch(with_eager_graphs(Runtime(tiny_dirs["qwen3"], options)))


@pytest.mark.parametrize("speculative", [False, True])
def test_steps_with_short_prefills_replay_a_graph_and_decode_as_eager_steps_do(
    tiny_dirs, monkeypatch, speculative
):
    """Prefill chunks, prompt scoring, verifying rows and decode rows all replayed as decode
    rows (no eager step), under IFB with joiners, overlap and chunked prefill: the same tokens
    as the eager runtime, log-probabilities equal to float32 rounding."""
    config = dict(max_batch_size=4, max_model_len=256, max_num_tokens=24, block_size=8)
    if speculative:
        spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
        config["speculative_config"] = spec
    eager = Runtime(tiny_dirs["qwen3"], DeploymentOptions(**config))
    graphed = with_eager_graphs(
        Runtime(tiny_dirs["qwen3"], DeploymentOptions(**config, overlap=True))
    )
    eager_steps = []
    plan = graphed.executor.runner.caches.backend.plan
    monkeypatch.setattr(
        graphed.executor.runner.caches.backend,
        "plan",
        lambda meta: eager_steps.append(meta) or plan(meta),
    )
    prompts = [range(3, 13), range(20, 67), range(5, 9), [4, 5, 6, 7] * 10, range(7, 30)]
    params = [
        dict(max_tokens=9, logprobs=2),
        dict(max_tokens=7, prompt_logprobs=1),
        dict(max_tokens=12, temperature=0.8, seed=5),
        dict(max_tokens=20),
        dict(max_tokens=8, logprobs=1),
    ]
    requests = [
        GenerationRequest(list(p), SamplingParams(ignore_eos=True, **{"temperature": 0, **kw}))
        for p, kw in zip(prompts, params, strict=True)
    ]
    want = run_staggered(eager, requests)
    got = run_staggered(graphed, requests)
    assert not eager_steps
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        pairs = zip(a.outputs[0].logprobs or (), b.outputs[0].logprobs or (), strict=True)
        pairs = [*pairs, *zip(a.prompt_logprobs or (), b.prompt_logprobs or (), strict=True)]
        for x, y in pairs:
            assert (x is None) == (y is None)
            if x is not None:
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    if speculative:
        assert graphed.speculator.snapshot()["verifications"] >= 3
    assert_no_leaks(graphed)


def test_fill_copies_each_rows_embedding_and_zeroes_spare_rows():
    """A model reading an embedding at every position (a speech talker): the rows' embeddings
    go to the graphs' buffer, which the captured batch reads."""
    inputs = DecodeInputs(
        max_batch=8, max_blocks=4, block_size=16, scratch_block=99, device=CPU,
        embeds=(3, torch.float32),
    )  # fmt: skip
    rows = [RowInput([0], 20, [5, 6], True), RowInput([0], 2, [9], True)]
    batch = build_ragged_batch(rows, 16, CPU).forward
    inputs.embeds.fill_(7.0)  # what a larger step left behind
    batch.media = MediaEmbeds(torch.arange(2), torch.tensor([[1.0, 2, 3], [4, 5, 6]]))
    inputs.fill(batch, 4)
    assert inputs.embeds[:4].tolist() == [[1, 2, 3], [4, 5, 6], [0, 0, 0], [0, 0, 0]]
    captured = inputs.media(4)
    assert captured.embeds.data_ptr() == inputs.embeds.data_ptr()
    assert captured.indices.tolist() == [0, 1, 2, 3]
    plain = DecodeInputs(max_batch=8, max_blocks=4, block_size=16, scratch_block=99, device=CPU)
    assert plain.media(4) is None


def test_a_step_with_media_runs_eagerly_unless_every_row_reads_an_embedding():
    class Graphs:
        buckets = [1, 2, 4]

        def __init__(self, embeds):
            self.inputs = type("Inputs", (), {"embeds": embeds})()

    rows = [RowInput([0], 20, [5, 6], True), RowInput([0], 2, [9], True)]
    batch = build_ragged_batch(rows, 16, CPU)
    batch.forward.media = MediaEmbeds(torch.arange(1), torch.zeros(1, 3))  # one row of two
    assert DecodeGraphs.run(Graphs(None), batch) is None
    assert DecodeGraphs.run(Graphs(torch.zeros(4, 3)), batch) is None
