"""The device executor on its own (no scheduler, output processor or session): a tiny random
Llama on the CPU, steps of hand-built rows launched, sampled and fetched. What it returns is
checked against its model runner run by hand on the same rows afterwards (which writes the
same KV again): the same logits, greedy picks their argmax, prompt scores their log-softmax."""

import numpy as np
import pytest
import torch

from inflight.model.checkpoints.loader import open_checkpoint
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.protocol.stepped import ResidentRef
from inflight.runtime.deployment import MachineFacts, model_facts, resolve
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.device.executor import Executor
from inflight.runtime.device.inputs import ForwardInput
from inflight.runtime.device.model_runner import build_model_runner
from inflight.runtime.device.sampler import Sampler
from inflight.runtime.host.decoding import PlainDecoding
from inflight.runtime.host.residents import Resident, SequenceKV
from inflight.runtime.host.rows import SamplingRow, ScheduledRow, ScheduledStep
from inflight.runtime.host.structured import Constraints, GrammarCompiler

CPU = torch.device("cpu")
BATCH = 4
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France",
    "def add(a, b):",
]


class _Fails(ForwardInput):
    """A forward input (as media that fail to encode) that cannot prepare some residents'
    rows."""

    def __init__(self, *residents: Resident) -> None:
        self.residents = residents

    def prepare(self, rows):
        return {
            row.resident: "its image did not encode"
            for row in rows
            if row.resident in self.residents
        }


@pytest.fixture(scope="module")
def checkpoint(tiny_dirs):
    return open_checkpoint(tiny_dirs["llama"])


def _executor(checkpoint, inputs=()):
    """An executor built as the runtime builds it, for a CPU float32 deployment."""
    facts = model_facts(checkpoint.config)
    options = DeploymentOptions(max_batch_size=BATCH, max_model_len=64, quantization="none")
    plan = resolve(options, facts, MachineFacts())
    runner = build_model_runner(checkpoint, plan, torch.float32, CPU)
    grammars = GrammarCompiler(checkpoint.tokenizer, checkpoint.config.vocab_size)
    return Executor(
        runner,
        Sampler(0, CPU),
        Constraints(grammars, plan.max_batch_size),
        inputs,
        max_batch_size=plan.max_batch_size,
        pick_width=PlainDecoding.pick_width,
    )


def _resident(slot: int, prompt, blocks: list[int], **params) -> Resident:
    request = GenerationRequest(prompt, SamplingParams(**params))
    kv = SequenceKV(blocks, np.asarray(blocks, dtype=np.int64))
    return Resident(ResidentRef(slot, 1), request, 0, kv, max_new_tokens=8)


def _prefill(r: Resident, samples: bool = True, scores: bool = False) -> ScheduledRow:
    return ScheduledRow(r, r.prompt, 0, samples, scores)


def _runner_logits(executor, rows) -> torch.Tensor:
    """The logits of the rows' kept positions, from the executor's model runner by hand."""
    runner = executor.runner
    inputs = [RowInput(r.token_ids, r.past_len, r.block_table, r.samples, r.scores) for r in rows]
    return runner.logits(runner.execute(build_ragged_batch(inputs, runner.block_size, CPU)))


def _run(executor, step):
    """Launch, sample and fetch a step; the sampling rows' logits, and the picks."""
    launched = executor.launch(step)
    logits = None if launched.logits is None else launched.logits.clone()
    executor.sample(launched)
    return launched, logits, executor.fetch(launched)


def _ids(checkpoint, i):
    return checkpoint.tokenizer.encode(PROMPTS[i])


def test_each_sampling_row_gets_one_pick_greedy_is_the_runners_argmax(checkpoint):
    ex = _executor(checkpoint)
    greedy = _resident(0, _ids(checkpoint, 0), [0, 1, 2], temperature=0, logprobs=3)
    seeded = _resident(2, _ids(checkpoint, 1), [3], temperature=0.8, seed=7)
    # The first chunk of a longer prompt: computed, nothing sampled.
    chunk = _resident(1, _ids(checkpoint, 2) * 3, [4, 5, 6])
    rows = [_prefill(greedy), _prefill(seeded), ScheduledRow(chunk, chunk.prompt[:8], 0, False)]
    launched, logits, picks = _run(ex, ScheduledStep(1, rows))
    assert not launched.failed and launched.step.rows == rows
    assert len(picks) == 2 and logits.shape == (2, checkpoint.config.vocab_size)
    ref = _runner_logits(ex, rows)  # the sampling rows: the chunk keeps no position
    assert torch.equal(logits, ref)
    assert picks[0].token_id == int(ref[0].argmax())
    logprobs = torch.log_softmax(ref[0].double(), dim=-1)
    assert picks[0].logprob == pytest.approx(logprobs[picks[0].token_id].item(), abs=1e-5)
    assert picks[0].top_ids == logprobs.topk(3).indices.tolist()
    # A seeded row draws what the sampler draws for its parameters at its position.
    (want,) = Sampler(123, CPU)(ref[1:2], [SamplingRow(seeded.request.params, 0)])
    assert picks[1].token_id == want.token_id and picks[1].logprob is None
    # Each sampling row's pick stays on the device, in its slot, for the next step to read.
    assert ex.picks[0, 0].item() == picks[0].token_id
    assert ex.picks[2, 0].item() == picks[1].token_id
    assert ex.picks[1, 0].item() == 0  # the chunk's slot: nothing sampled


def test_a_decode_row_reads_its_input_token_from_the_device(checkpoint):
    ex = _executor(checkpoint)
    residents = [
        _resident(1, _ids(checkpoint, 0), [0, 1, 2], temperature=0),
        _resident(3, _ids(checkpoint, 1), [3, 4], temperature=0),
    ]
    _, _, first = _run(ex, ScheduledStep(1, [_prefill(r) for r in residents]))
    assert all(p.token_id != 0 for p in first)  # 0: the placeholder a device-token row holds
    for r, pick in zip(residents, first, strict=True):
        assert ex.picks[r.ref.slot, 0].item() == pick.token_id
    # The next step's decode rows, planned before the host has seen the picks (overlap).
    rows = [
        ScheduledRow(r, (0,), r.prompt_len, True, device_token=True, position=1) for r in residents
    ]
    _, logits, second = _run(ex, ScheduledStep(2, rows))
    # As if each row had been given its picked token on the host.
    host_rows = [
        ScheduledRow(r, (pick.token_id,), r.prompt_len, True)
        for r, pick in zip(residents, first, strict=True)
    ]
    ref = _runner_logits(ex, host_rows)
    assert torch.equal(logits, ref)
    assert [p.token_id for p in second] == ref.argmax(-1).tolist()


def test_a_row_that_cannot_be_prepared_is_dropped_and_the_rest_run(checkpoint):
    ok = _resident(0, _ids(checkpoint, 0), [0, 1, 2], temperature=0)
    bad = _resident(1, _ids(checkpoint, 1), [3], temperature=0)
    ex = _executor(checkpoint, [_Fails(bad)])
    rows = [_prefill(bad), _prefill(ok)]
    launched, logits, picks = _run(ex, ScheduledStep(1, rows))
    assert launched.failed == {bad: "its image did not encode"}
    assert [row.resident for row in launched.step.rows] == [ok]
    assert len(picks) == 1 and logits.shape[0] == 1
    ref = _runner_logits(ex, launched.step.rows)
    assert torch.equal(logits, ref) and picks[0].token_id == int(ref[0].argmax())
    assert ex.picks[1, 0].item() == 0  # the dropped row sampled nothing

    # A step all of whose rows are dropped runs nothing and samples nothing.
    ex = _executor(checkpoint, [_Fails(bad)])
    launched, logits, picks = _run(ex, ScheduledStep(1, [_prefill(bad)]))
    assert launched.failed == {bad: "its image did not encode"} and not launched.step.rows
    assert logits is None and picks == []


def test_prompt_scores_are_the_log_softmax_of_the_runners_logits(checkpoint):
    ex = _executor(checkpoint)
    ids = _ids(checkpoint, 1)
    scored = _resident(0, ids, [0], temperature=0, prompt_logprobs=2)
    plain = _resident(1, _ids(checkpoint, 2), [1], temperature=0)
    rows = [_prefill(plain), _prefill(scored, scores=True)]
    launched, logits, picks = _run(ex, ScheduledStep(1, rows))
    ref = _runner_logits(ex, rows)  # the plain row's last position, then every scored one
    assert ref.shape[0] == 1 + len(ids)
    assert list(launched.scores) == [1]  # by row index: the scoring row's
    scores = launched.scores[1]
    # Each prompt token after the first, scored by the position before it.
    assert [s.token_id for s in scores] == list(ids[1:])
    logprobs = torch.log_softmax(ref[1:-1].double(), dim=-1)
    for s, row in zip(scores, logprobs, strict=True):
        assert s.logprob == pytest.approx(row[s.token_id].item(), abs=1e-5)
        assert s.top_ids == row.topk(2).indices.tolist()
    # Both rows sample from their last position (the LM head ran over other slices of the
    # hidden states than here: equal to float tolerance).
    torch.testing.assert_close(logits, ref[[0, -1]], rtol=0, atol=1e-5)
    assert [p.token_id for p in picks] == [int(ref[0].argmax()), int(ref[-1].argmax())]
